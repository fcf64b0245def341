"""ps.selective_scan (Mamba-1's scan) against the float64 loop (oracles.selective_loop),
on every backend of its row. The cases every checkpointed scan owes (lengths around
the checkpoints, dtypes, gradients, gradcheck, forward mode, vmap, compile, decoding,
inputs untouched, optional arguments) are tests/checkpointed.py's; here: the forms of
B and C (invariant, shared, grouped), complex states (and their refusal by the Triton
kernels), non-contiguous inputs, the decoding step of ps.selective_state_update,
errors, memory, and the Triton kernels through the public function."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch

import parascan as ps
from checkpointed import (
    ScanSpec,
    cast,
    check_forward,
    draw,
    gradients,
    loss_weights,
    shared_tests,
    to,
)
from checkpointed import run as run_scan
from parascan.selective import autograd as ops
from parascan.selective.canonical import CHECKPOINT_STEPS

from conftest import Target, assert_matches, targets
from oracles import selective_loop

FORMS = ("invariant", "shared", "grouped")
K = min(CHECKPOINT_STEPS.values())


def _bc(form: str, batch: int, dim: int, n: int, length: int, gen: torch.Generator,
        complex_: bool = False) -> torch.Tensor:  # fmt: skip
    shape = {
        "invariant": (dim, n), "shared": (batch, n, length), "grouped": (batch, 3, n, length)
    }[form]  # fmt: skip
    m = torch.randn(shape, generator=gen, dtype=torch.float64)
    if complex_:
        m = torch.complex(m, torch.randn(shape, generator=gen, dtype=torch.float64))
    return m


def _draw(
    gen: torch.Generator, *, batch: int, length: int, states: int | None = None, dim: int = 6,
    n: int = 3, b_form: str = "shared", c_form: str = "shared", extras: bool = True,
    complex_a: bool = False, complex_bc: bool = False,
) -> dict[str, torch.Tensor | bool | None]:  # fmt: skip
    """A float64 problem; dim is a multiple of 3 (the grouped form's G). ``extras``: D,
    z, delta_bias, the softplus and an initial state. (No packed sequences: ``states``
    is always None.)"""
    assert states is None
    f64 = torch.float64
    a = -0.5 - torch.rand(dim, n, generator=gen, dtype=f64)
    if complex_a:
        a = torch.complex(a, torch.randn(dim, n, generator=gen, dtype=f64))
    p: dict[str, torch.Tensor | bool | None] = {
        "u": torch.randn(batch, dim, length, generator=gen, dtype=f64),
        "delta": torch.rand(batch, dim, length, generator=gen, dtype=f64) - 0.5,
        "A": a,
        "B": _bc(b_form, batch, dim, n, length, gen, complex_bc),
        "C": _bc(c_form, batch, dim, n, length, gen, complex_bc),
        "D": None, "z": None, "delta_bias": None, "delta_softplus": False, "initial": None,
    }  # fmt: skip
    if extras:
        p["D"] = torch.randn(dim, generator=gen, dtype=f64)
        p["z"] = torch.randn(batch, dim, length, generator=gen, dtype=f64)
        p["delta_bias"] = torch.randn(dim, generator=gen, dtype=f64) * 0.5
        p["delta_softplus"] = True
        p["initial"] = torch.randn(batch, dim, n, generator=gen, dtype=a.dtype)
    return p


def _timed(name: str, tensor: torch.Tensor) -> int | None:
    """u, delta and z have their steps along the last dim, and so have B and C but in
    their invariant form (dim, N)."""
    if name in ("u", "delta", "z") or (name in ("B", "C") and tensor.dim() >= 3):
        return tensor.dim() - 1
    return None


def _takes_complex_a(backend: str) -> bool:
    """Whether ``backend`` computes complex states (a complex A): the Triton kernels take
    a real A only (the backend table's row), and must refuse one."""
    return torch.complex64 in ops.ROW.backends[backend].dtypes


COMPLEX_A = {"complex_a": True}
SELECTIVE = ScanSpec(
    name="selective_scan",
    function=ps.selective_scan,
    oracle=selective_loop,
    draw=_draw,
    positional=("u", "delta", "A", "B", "C"),
    timed=_timed,
    optional=("D", "z", "delta_bias", "initial"),
    checkpoints={b: CHECKPOINT_STEPS[b] for b in ops.ROW.backends},
    backends=tuple(ops.ROW.backends),
    packs=False,
    wide=("A", "initial"),
    lengths=(17, 1031),
    forms={"": {"b_form": "grouped", "c_form": "shared"}},
    tiny={"batch": 1, "dim": 3, "n": 2},
    vmapped=("u", "A"),
    gradient_cases={
        "grouped-shared": {},
        "invariant-grouped": {"b_form": "invariant", "c_form": "grouped"},
        "shared-invariant-complex-A": {"b_form": "shared", "c_form": "invariant", **COMPLEX_A},
        "grouped-shared-complex": {**COMPLEX_A, "complex_bc": True},
    },
    jvp_cases={"": {}, "complex-A": COMPLEX_A},
    overrides={"dtypes": {"length": 33}, "gradients": {"length": K + 5}},
    refuses=lambda target, options: (
        bool(options.get("complex_a")) and not _takes_complex_a(target.backend)
    ),
)
TestShared = shared_tests(SELECTIVE)

# The backends of the selective scan's row that run here (the Triton interpreter on
# tiny shapes only: see test_selective_triton.py for its own cases).
TARGETS = SELECTIVE.targets()
IDS = [str(t) for t in TARGETS]


def _problem(gen: torch.Generator, **options: object) -> dict:
    """SELECTIVE's problem of ``options`` (checkpointed.draw; length 20 and batch 2 by
    default)."""
    return draw(SELECTIVE, gen, {"length": 20, **options})


def _cast(p: dict, dtype: torch.dtype, device: str) -> dict:
    """The problem's inputs in ``dtype`` on ``device``; A and the initial state (and
    complex operands) in the state's precision: float32 for the half types."""
    return to(cast(SELECTIVE, p, dtype), device)


def _run(p: dict, backend: str, device: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, final) of the problem ``p`` on ``backend``, its tensors moved to ``device``
    (None: where they are), the outputs handed back on the device of ``p``'s u."""
    return run_scan(SELECTIVE, p, backend, device)


def _grads(
    p: dict, fn: Callable[[dict], tuple[torch.Tensor, torch.Tensor]],
    use: tuple[str, ...] = ("out", "final"),
) -> dict[str, torch.Tensor]:  # fmt: skip
    """The gradients of a weighted sum of the outputs named in ``use``."""
    return gradients(SELECTIVE, p, fn, lambda outputs: loss_weights(outputs, use))


def _assert_refuses_complex_a(p: dict, where: Target) -> None:
    """The contract's RuntimeError, naming the op and the backend, for the complex-A
    problem ``p`` on a backend without complex states."""
    pattern = (
        rf"^parascan\.selective_scan: backend '{where.backend}' is not available for .*complex"
    )
    with pytest.raises(RuntimeError, match=pattern):
        _run(_cast(p, torch.float32, where.device), where.backend, where.device)


@pytest.mark.parametrize("where", TARGETS, ids=IDS)
@pytest.mark.parametrize(("b_form", "c_form"), list(itertools.product(FORMS, FORMS)))
@pytest.mark.parametrize("extras", [False, True])
def test_forms_against_loop(where, gen, b_form, c_form, extras):
    p = _problem(gen, length=K + 3, b_form=b_form, c_form=c_form, extras=extras)
    check_forward(SELECTIVE, p, where)


@pytest.mark.parametrize("where", TARGETS, ids=IDS)
@pytest.mark.parametrize("complex_bc", [False, True])
def test_complex_a_against_loop(where, gen, complex_bc):
    p = _problem(gen, length=K + 1, b_form="invariant", c_form="grouped",
                 complex_a=True, complex_bc=complex_bc)  # fmt: skip
    if not _takes_complex_a(where.backend):
        _assert_refuses_complex_a(p, where)
        return
    check_forward(SELECTIVE, p, where)


@pytest.mark.parametrize("where", TARGETS, ids=IDS)
def test_non_contiguous_inputs(where, gen):
    p = _cast(_problem(gen, length=40, b_form="grouped", c_form="invariant"), torch.float32,
              where.device)  # fmt: skip
    q = dict(p)
    for k in ("u", "delta", "z"):
        q[k] = p[k].transpose(0, 2).contiguous().transpose(0, 2)  # batch-innermost strides
    q["B"] = p["B"].transpose(-1, -2).contiguous().transpose(-1, -2)
    q["C"] = p["C"].t().contiguous().t()
    q["A"] = p["A"].t().contiguous().t()
    q["D"] = torch.stack([p["D"], p["D"]], 1)[:, 0]
    assert not q["u"].is_contiguous() and not q["B"].is_contiguous()
    want_out, want_final = selective_loop(**_cast(p, torch.float64, "cpu"))
    out, final = _run(q, where.backend, where.device)
    assert_matches(out, want_out, torch.float32)
    assert_matches(final, want_final, torch.float32)


@pytest.mark.parametrize("where", TARGETS, ids=IDS)
def test_gradients_of_an_empty_scan_with_a_complex_state(where, gen):
    """L = 0 with a complex initial state (the real one: checkpointed.py): the final
    state is the initial one, so d(initial) is the final state's gradient and every
    other gradient is zero. Before, the loop and torch backends handed that gradient
    back as d(initial) itself, an output aliasing an input, which torch.library
    refuses: backward raised."""
    p = _problem(gen, length=0, b_form="grouped", c_form="shared", **COMPLEX_A)
    if not _takes_complex_a(where.backend):
        _assert_refuses_complex_a(p, where)
        return
    q = _cast(p, torch.float32, where.device)
    leaves = {k: v.requires_grad_() for k, v in q.items() if isinstance(v, torch.Tensor)}
    out, final = _run(q, where.backend, where.device)
    assert out.shape == q["u"].shape
    torch.testing.assert_close(final, q["initial"].detach())
    seed = torch.randn(final.shape, generator=gen, dtype=torch.float64).to(
        final.device, final.dtype
    )
    grads = torch.autograd.grad(final, list(leaves.values()), seed, allow_unused=True)
    for (k, v), g in zip(leaves.items(), grads, strict=True):
        want = seed if k == "initial" else torch.zeros_like(v)
        torch.testing.assert_close(torch.zeros_like(v) if g is None else g, want.to(v.device))


@pytest.mark.parametrize("where", TARGETS, ids=IDS)
def test_selective_state_update_steps_equal_the_scan(where, gen):
    """selective_state_update over L steps, one at a time, equals the scan (both
    layouts: the multi-head one is the scan over heads * headdim channels)."""
    p = _cast(_problem(gen, length=9, b_form="grouped", c_form="grouped"), torch.float32,
              where.device)  # fmt: skip
    out, final = _run(p, where.backend, where.device)
    state = p["initial"].clone()
    steps = [
        ps.selective_state_update(
            state, p["u"][..., t], p["delta"][..., t], p["A"], p["B"][..., t], p["C"][..., t],
            p["D"], p["z"][..., t], p["delta_bias"], dt_softplus=True,
        )
        for t in range(9)
    ]  # fmt: skip
    torch.testing.assert_close(torch.stack(steps, -1), out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, final, rtol=1e-5, atol=1e-5)
    # heads layout: dim 6 = 3 heads x 2 headdim, B/C in 3 groups
    state4 = p["initial"].clone().view(2, 3, 2, -1)
    for t in range(9):
        y = ps.selective_state_update(
            state4, p["u"][..., t].view(2, 3, 2), p["delta"][..., t].view(2, 3, 2),
            p["A"].view(3, 2, -1), p["B"][..., t], p["C"][..., t], p["D"].view(3, 2),
            p["z"][..., t].view(2, 3, 2), p["delta_bias"].view(3, 2), dt_softplus=True,
        )  # fmt: skip
        torch.testing.assert_close(y.view(2, 6), out[..., t], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state4.view(2, 6, -1), final, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (lambda p: p.update(u=p["u"][:, :, :-1]), ValueError, "delta of shape"),
        (lambda p: p.update(B=torch.randn(2, 4, 3, 20)), ValueError, "group count"),
        (lambda p: p.update(u=p["u"].to(torch.int64)), TypeError, "expected u to have"),
        (lambda p: p.update(B=p["B"].to(torch.complex64)), TypeError, "complex B needs"),
        (lambda p: p.update(A=p["A"][:-1]), ValueError, "expected A of shape"),
        (lambda p: p.update(D=torch.randn(5)), ValueError, "expected D of shape"),
        (lambda p: p.update(initial=torch.randn(2, 6, 4)), ValueError, "expected initial"),
        (lambda p: p.update(C=torch.randn(2, 3, 21)), ValueError, "expected C of shape"),
        (lambda p: p.update(u=[1.0]), TypeError, "expected u to be a Tensor"),
    ],
)  # fmt: skip
def test_errors(gen, change, error, match):
    p = _cast(_problem(gen), torch.float32, "cpu")
    change(p)
    with pytest.raises(error, match="parascan.selective_scan: .*" + match):
        _run(p, "auto")


# the torch backend's case takes 10-30 s on 2 cores: in the slow suite
_FAST = [
    pytest.param(t, id=str(t), marks=[pytest.mark.slow] if t.backend == "torch" else [])
    for t in TARGETS
    if t.backend != "loop"
]


def _peak_growth_mib(run, device: str) -> float | None:  # type: ignore[no-untyped-def]
    """How much the peak memory grows during ``run()``, in MiB: on the CPU the process's
    resident set (Linux VmHWM, reset before the call, malloc made to return freed
    blocks; None where that cannot be read), on CUDA the GPU memory torch allocates
    (its peak reset before the call, the work synchronized on both sides)."""
    where = torch.device(device)
    if where.type == "cpu":
        from parascan.cli.bench_selective import _peak_extra_mib

        return _peak_extra_mib(run)
    torch.cuda.synchronize(where)
    torch.cuda.reset_peak_memory_stats(where)
    base = torch.cuda.memory_allocated(where)
    run()
    torch.cuda.synchronize(where)
    return (torch.cuda.max_memory_allocated(where) - base) / 2**20


@pytest.mark.parametrize("where", _FAST)
def test_never_materializes_the_state_over_time(where):
    """Memory grows with L by the inputs, outputs and checkpoints only: doubling L from
    2048 to 4096 grows the peak memory of forward + backward (on the CPU the resident
    set, on CUDA the GPU's allocated memory: _peak_growth_mib) by well under the 64 MiB
    that one more (batch, dim, L, N) float32 tensor's worth of steps would take. (The
    loop backend, a Python loop over the steps, holds one step's state at a time and is
    too slow at these lengths.)"""
    gen = torch.Generator().manual_seed(3)
    batch, dim, n = 1, 128, 64
    on = where.device
    peaks = []
    for length in (2048, 4096):
        u = torch.randn(batch, dim, length, generator=gen).to(on).requires_grad_()
        delta = torch.rand(batch, dim, length, generator=gen).to(on).requires_grad_()
        A = (-torch.rand(dim, n, generator=gen)).to(on).requires_grad_()
        B = torch.randn(batch, n, length, generator=gen).to(on).requires_grad_()
        C = torch.randn(batch, n, length, generator=gen).to(on).requires_grad_()

        def run(u=u, delta=delta, A=A, B=B, C=C) -> None:
            total = ps.selective_scan(u, delta, A, B, C, backend=where.backend).sum()
            assert total.device == u.device, (total.device, u.device)
            total.backward()

        run()  # warm up (lazy imports, thread pools, kernel compilation)
        peaks.append(_peak_growth_mib(run, on))
    assert None not in peaks
    step_mib = batch * dim * 2048 * n * 4 / 2**20
    # The Triton backward sums the shared B and C gradients from per-program partials,
    # (batch x dim / 8 programs, N, L) each: two eighths of a state's worth by design
    # (selective/triton.py), so its bound is half a state's worth, not a quarter.
    share = 2 if where.backend == "triton" else 4
    assert peaks[1] - peaks[0] < step_mib / share, (peaks, step_mib)


_INTERPRETED = [t for t in targets(interpreter=True) if t.interpreted]


@pytest.mark.parametrize("where", _INTERPRETED, ids=[str(t) for t in _INTERPRETED])
def test_triton_through_the_public_function(where, gen):
    """The op, its autograd and the backend table route to the Triton kernels (tiny,
    interpreted); the kernels' own cases are in test_selective_triton.py."""
    p = _problem(gen, batch=1, dim=3, n=2, length=K + 2, b_form="grouped")
    p["B"] = p["B"][:, :3]
    want = _grads(p, lambda q: selective_loop(**q))
    got = _grads(
        _cast(p, torch.float32, where.device), lambda q: _run(q, where.backend, where.device)
    )
    for k in want:
        assert_matches(got[k], want[k], torch.float32)
    with pytest.raises(RuntimeError, match=r"backend 'triton' is not available for .*complex A"):
        q = _problem(gen, complex_a=True)
        _run(_cast(q, torch.float32, where.device), where.backend, where.device)
