"""Every op x backend x dtype on CPU: it runs and matches the float64 loop, or it
raises the contract's RuntimeError naming the op and the backend, before any kernel.

The expected support below is written from what each kernel is (facts about the
kernels, not read from parascan's backend table): the C kernels take every dtype
for the first-order scans and real dtypes for the matrix recurrence (half types
computed in float32); the Triton log-space kernel is real; there is no Triton
matrix kernel; torch and loop take everything.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

import parascan as ps
from parascan import _core

from conftest import DTYPES, assert_matches

ALL = frozenset(DTYPES)
REAL = frozenset(d for d in DTYPES if not d.is_complex)
NONE: frozenset[torch.dtype] = frozenset()
TRITON = importlib.util.find_spec("triton") is not None  # interpreted on CPU (conftest)

EXPECTED: dict[tuple[str, str], frozenset[torch.dtype]] = {
    ("linear_scan", "cpu"): ALL,
    ("linear_scan", "triton"): ALL if TRITON else NONE,
    ("linear_scan", "torch"): ALL,
    ("linear_scan", "loop"): ALL,
    ("log_linear_scan", "cpu"): ALL,
    ("log_linear_scan", "triton"): REAL if TRITON else NONE,
    ("log_linear_scan", "torch"): ALL,
    ("log_linear_scan", "loop"): ALL,
    ("matrix_linear_scan", "cpu"): REAL,
    ("matrix_linear_scan", "triton"): NONE,
    ("matrix_linear_scan", "torch"): ALL,
    ("matrix_linear_scan", "loop"): ALL,
}


def _call(op: str, dtype: torch.dtype, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the op's result, its float64 loop) on a small input."""
    gen = torch.Generator().manual_seed(5)
    wide = torch.complex128 if dtype.is_complex else torch.float64
    if op == "matrix_linear_scan":
        w = (0.3 * torch.randn(2, 5, 3, 3, generator=gen, dtype=torch.float64)).to(dtype)
        b = torch.randn(2, 5, 3, generator=gen, dtype=torch.float64).to(dtype)
        x, state = [], torch.zeros(2, 3, dtype=wide)
        for t in range(5):
            state = w[:, t].to(wide) @ state.unsqueeze(-1)
            state = state.squeeze(-1) + b[:, t].to(wide)
            x.append(state)
        return ps.matrix_linear_scan(w, b, backend=backend), torch.stack(x, 1)
    a = (0.5 + 0.5 * torch.rand(3, 7, generator=gen, dtype=torch.float64)).to(dtype)
    b = torch.rand(3, 7, generator=gen, dtype=torch.float64).to(dtype)
    if op == "log_linear_scan":
        a, b = a.log(), b.log()
        want, h = [], torch.full((3,), -torch.inf, dtype=wide)
        for t in range(7):
            h = (
                torch.logaddexp(a[:, t].to(wide) + h, b[:, t].to(wide))
                if not dtype.is_complex
                else torch.log(torch.exp(a[:, t].to(wide) + h) + torch.exp(b[:, t].to(wide)))
            )
            want.append(h)
        return ps.log_linear_scan(a, b, 1, backend=backend), torch.stack(want, 1)
    want, x0 = [], torch.zeros(3, dtype=wide)
    for t in range(7):
        x0 = a[:, t].to(wide) * x0 + b[:, t].to(wide)
        want.append(x0)
    return ps.linear_scan(a, b, 1, backend=backend), torch.stack(want, 1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("backend", _core.BACKENDS)
@pytest.mark.parametrize("op", ["linear_scan", "log_linear_scan", "matrix_linear_scan"])
def test_every_op_backend_and_dtype_runs_or_says_why(op: str, backend: str, dtype: torch.dtype):
    if dtype in EXPECTED[(op, backend)]:
        got, want = _call(op, dtype, backend)
        assert got.dtype == dtype
        assert_matches(got, want, dtype)
    else:
        with pytest.raises(RuntimeError, match=rf"^parascan\.{op}: backend '{backend}' is not"):
            _call(op, dtype, backend)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", ["linear_scan", "log_linear_scan", "matrix_linear_scan"])
def test_auto_always_finds_a_backend_on_cpu(op: str, dtype: torch.dtype):
    got, want = _call(op, dtype, "auto")
    assert_matches(got, want, dtype)


def test_the_table_has_a_row_for_every_op_with_a_backend_argument():
    assert set(_core.table()) == {
        "parascan.delta_rule_scan",
        "parascan.dplr_delta_rule_scan",
        "parascan.linear_attention_scan",
        "parascan.linear_scan",
        "parascan.log_linear_scan",
        "parascan.matrix_linear_scan",
        "parascan.selective_scan",
        "parascan.ssd_scan",
    }


def test_backends_of_a_bad_device_names_the_function():
    with pytest.raises(ValueError, match=r"parascan\.backends: expected a device .* 'foo'"):
        ps.backends("foo")
