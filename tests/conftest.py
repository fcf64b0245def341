"""Shared test setup.

- Uninitialized memory is filled with NaN (torch's deterministic mode does this for
  every torch.empty), so an output element a kernel forgets to write fails a test.
- The tolerance table (parascan.cli.tolerance, shared with ``parascan check``) for
  comparisons against the float64 oracles (oracles.py), in ``assert_matches``.
- Seeded random inputs (``gen``, ``random_gates``, ``random_tokens``).
- The one backend/device fixture, ``target``: every test that takes a ``target``
  argument runs once per entry of ``targets()``: each backend ``ps.backends("cpu")``
  lists, the Triton kernels in Triton's interpreter on CPU tensors (where a test asks
  for them: the interpreter is slow), and, on a machine with CUDA, every backend
  ``ps.backends("cuda")`` lists, on CUDA tensors. Narrow it with
  ``@pytest.mark.targets(backends=..., interpreter=True)``; ``slow_interpreter=True``
  moves the interpreter's cases to the slow tests (``pytest -m slow``), and
  ``slow_interpreter=predicate`` those for which ``predicate(**params)`` holds (the
  case's other parameters, by name); ``slow_backends=(...)`` moves those backends' cases.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

# Triton kernels (the ``triton`` backend, when triton is installed) run in Triton's
# interpreter on CPU tensors in these tests. The flag must be set before torch imports
# triton (torch._dynamo does), so it is set here, first; it changes nothing else.
os.environ.setdefault("TRITON_INTERPRET", "1")
# OpenMP's threads sleep while they wait (libgomp reads this when torch loads it): with
# its default, a thread spins for its partner instead, and on a machine as busy as its
# cores each of torch's parallel regions (thousands a test, in the loops) then waits for a
# time slice: a 9x9 batched matmul took 7 ms instead of 30 us, the suite twice as long.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest
import torch

import parascan as ps
from parascan.cli.tolerance import TOLERANCE

# A skipped test of installed code fails the run (skip_policy.py).
pytest_plugins = ["skip_policy"]

# On CUDA, cuBLAS is deterministic only with a fixed workspace (torch raises without
# one), and a few torch ops have no deterministic CUDA kernel: those warn there instead of
# raising (the tests compare results with the oracles; the warnings show in the report).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
torch.use_deterministic_algorithms(True, warn_only=torch.cuda.is_available())
torch.utils.deterministic.fill_uninitialized_memory = True  # type: ignore[attr-defined]

DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
]


def oracle_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.complex128 if dtype.is_complex else torch.float64


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """``actual`` (any dtype, any device) against a float64 ``expected``, with the
    tolerance of ``dtype``; the absolute part scales with the largest expected
    magnitude, since errors accumulate relative to the running state rather than to
    each element."""
    rtol, atol = TOLERANCE[dtype]
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    actual = actual.detach().to(device=expected.device, dtype=expected.dtype)
    torch.testing.assert_close(actual, expected.detach(), rtol=rtol, atol=atol * scale)


# --- seeded inputs --------------------------------------------------------------------


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


def random_gates(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Gates with magnitude in [0.5, 1): long memory, bounded states."""
    mag = 0.5 + 0.5 * torch.rand(shape, generator=gen, dtype=torch.float64)
    if dtype.is_complex:
        phase = torch.rand(shape, generator=gen, dtype=torch.float64) * 6.283185307179586
        return torch.polar(mag, phase).to(dtype)
    return mag.to(dtype)


def random_tokens(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    real = torch.randn(shape, generator=gen, dtype=torch.float64)
    if dtype.is_complex:
        return torch.complex(real, torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype)
    return real.to(dtype)


# --- the backend/device fixture ---------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """One backend on one device type: what a test's ``target`` argument holds."""

    backend: str
    device: str  # "cpu" or "cuda"

    @property
    def interpreted(self) -> bool:
        """The Triton kernels run step by step in Python: keep shapes tiny."""
        return self.backend == "triton" and self.device == "cpu"

    def __str__(self) -> str:
        if self.interpreted:
            return "triton-interpreter"
        return self.backend if self.device == "cpu" else f"{self.device}-{self.backend}"


def triton_interpreter_available() -> bool:
    return (
        importlib.util.find_spec("triton") is not None and os.environ.get("TRITON_INTERPRET") == "1"
    )


def targets(*, backends: Iterable[str] | None = None, interpreter: bool = False) -> list[Target]:
    """The targets a test runs on: the CPU backends, the Triton interpreter when
    ``interpreter`` (and triton is installed), the CUDA backends when CUDA is
    available; only those named in ``backends`` when given."""
    found = [Target(b, "cpu") for b in ps.backends("cpu")]
    if interpreter and triton_interpreter_available():
        found.append(Target("triton", "cpu"))
    if torch.cuda.is_available():
        found += [Target(b, "cuda") for b in ps.backends("cuda")]
    return [t for t in found if backends is None or t.backend in backends]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "target" in metafunc.fixturenames:
        marker = metafunc.definition.get_closest_marker("targets")
        options = dict(marker.kwargs) if marker else {}
        slow_interpreter = options.pop("slow_interpreter", False)
        every = slow_interpreter is True  # a predicate: pytest_collection_modifyitems
        slow_backends = options.pop("slow_backends", ())
        chosen = targets(**options)
        params = [
            pytest.param(t, marks=pytest.mark.slow)
            if (every and t.interpreted) or t.backend in slow_backends
            else t
            for t in chosen
        ]
        metafunc.parametrize("target", params, ids=[str(t) for t in chosen])


@pytest.hookimpl(tryfirst=True)  # before ``-m 'not slow'`` deselects
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``@pytest.mark.targets(slow_interpreter=predicate)``: the interpreter's cases whose
    other parameters satisfy the predicate are marked slow."""
    for item in items:
        marker = item.get_closest_marker("targets")
        predicate = marker.kwargs.get("slow_interpreter") if marker else None
        callspec = getattr(item, "callspec", None)
        if not callable(predicate) or callspec is None:
            continue
        params = dict(callspec.params)
        target = params.pop("target", None)
        if isinstance(target, Target) and target.interpreted and predicate(**params):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _cuda_cases_run_on_the_gpu(request: pytest.FixtureRequest) -> Iterator[None]:
    """A case of a CUDA target that allocates nothing on the GPU ran on the CPU under a
    CUDA name (the first GPU run found whole modules doing so): it fails."""
    callspec = getattr(request.node, "callspec", None)
    params = callspec.params.values() if callspec is not None else ()
    if not any(isinstance(v, Target) and v.device == "cuda" for v in params):
        yield
        return
    before = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
    yield
    after = torch.cuda.memory_stats().get("allocation.all.allocated", 0)
    report = getattr(request.node, "call_report", None)
    if report is not None and report.skipped:  # e.g. importorskip of an optional peer
        return
    assert after > before, f"{request.node.nodeid}: a CUDA case put no tensor on the GPU"


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
    """Keeps the call phase's report on the item (the fixture above reads it)."""
    report = yield
    if report.when == "call":
        item.call_report = report  # type: ignore[attr-defined]
    return report


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With PARASCAN_TEST_LOG set, each failed or skipped phase is appended to that file as
    it happens, traceback included: a run cut off at its time limit (the GPU check's CUDA
    leg) keeps what it found, where pytest's own summary comes only at the end. Under
    pytest-xdist the controller sees every worker's reports."""
    path = os.environ.get("PARASCAN_TEST_LOG")
    if not path or report.passed or "PYTEST_XDIST_WORKER" in os.environ:
        return
    outcome = "FAILED" if report.failed else "XFAIL" if hasattr(report, "wasxfail") else "SKIPPED"
    with open(path, "a", encoding="utf-8") as log:
        log.write(f"== {outcome} {report.nodeid} ({report.when})\n{report.longreprtext}\n")


@contextmanager
def simd_path(on: bool) -> Iterator[None]:
    """The C kernels' vector paths (``on``) or their portable ones (PARASCAN_SIMD=0),
    within the block."""
    saved = os.environ.get("PARASCAN_SIMD")
    os.environ["PARASCAN_SIMD"] = "1" if on else "0"
    try:
        yield
    finally:
        if saved is None:
            del os.environ["PARASCAN_SIMD"]
        else:
            os.environ["PARASCAN_SIMD"] = saved


@contextmanager
def threads(n: int) -> Iterator[None]:
    """torch's (and the C kernels') thread count ``n`` within the block."""
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def oracle_threads() -> AbstractContextManager[None]:
    """torch on one thread within the block: for the float64 oracles (oracles.py) and
    their gradients, never for the code under test. A loop of thousands of tiny ops (a
    batched matmul a step) makes as many parallel regions on 2 threads, and on a busy
    machine each waits for the other thread's time slice: the suite's oracles ran 3 to
    10 times slower for it, to the same results."""
    return threads(1)
