"""Shared test setup.

- Uninitialized memory is filled with NaN (torch's deterministic mode does this for
  every torch.empty), so an output element a kernel forgets to write fails a test.
- The tolerance table (parascan.tools.tolerance, shared with `parascan check`) for
  comparisons against the float64 oracle.
- The oracle: a float64 sequential loop written here, independently of parascan.
"""

from __future__ import annotations

import os

# Triton kernels (the ``triton`` backend, when triton is installed) run in Triton's
# interpreter on CPU tensors in these tests. The flag must be set before torch imports
# triton (torch._dynamo does), so it is set here, first; it changes nothing else.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from parascan.tools.tolerance import TOLERANCE

# A skipped test of installed code fails the run (skip_policy.py).
pytest_plugins = ["skip_policy"]

torch.use_deterministic_algorithms(True)
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
    """``actual`` (any dtype) against a float64 ``expected``, with the tolerance of
    ``dtype``; the absolute part scales with the largest expected magnitude, since
    errors accumulate relative to the running state rather than to each element."""
    rtol, atol = TOLERANCE[dtype]
    scale = max(1.0, expected.abs().max().item()) if expected.numel() else 1.0
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    torch.testing.assert_close(actual.to(expected.dtype), expected, rtol=rtol, atol=atol * scale)


def loop_oracle(
    gates: torch.Tensor | float,
    tokens: torch.Tensor,
    dim: int,
    initial: torch.Tensor | None = None,
    reverse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x[t] = gates[t] x[t-1] + tokens[t], one step at a time; returns (x, final).
    Differentiable by ordinary autograd, so it is the gradient oracle too."""
    if not isinstance(gates, torch.Tensor):
        gates = torch.tensor(gates, dtype=tokens.dtype)
    a, b = torch.broadcast_tensors(gates, tokens)
    a, b = a.movedim(dim, 0), b.movedim(dim, 0)
    steps = b.shape[0]
    state = torch.zeros_like(b.sum(0)) if initial is None else initial.expand(b.shape[1:])
    state = state + torch.zeros_like(b.sum(0))  # result dtype
    out: list[torch.Tensor] = [state] * steps
    for t in reversed(range(steps)) if reverse else range(steps):
        state = a[t] * state + b[t]
        out[t] = state
    x = torch.stack(out).movedim(0, dim) if steps else (a * b).movedim(0, dim)
    return x, state


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


@pytest.fixture
def gen() -> torch.Generator:
    return torch.Generator().manual_seed(1234)


def log_loop_oracle(
    log_gates: torch.Tensor,
    log_tokens: torch.Tensor,
    dim: int,
    initial: torch.Tensor | None = None,
    reverse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h[t] = logaddexp(log_gates[t] + h[t-1], log_tokens[t]) one step at a time with
    torch.logaddexp (real inputs; use it in float64); returns (h, final).
    Differentiable where no step adds -inf to -inf."""
    a, b = torch.broadcast_tensors(log_gates, log_tokens)
    a, b = a.movedim(dim, 0), b.movedim(dim, 0)
    steps = b.shape[0]
    state = torch.full_like(b.sum(0), -float("inf")) if initial is None else initial
    state = state.expand(b.shape[1:])
    out: list[torch.Tensor] = [state] * steps
    for t in reversed(range(steps)) if reverse else range(steps):
        state = torch.logaddexp(a[t] + state, b[t])
        out[t] = state
    h = torch.stack(out).movedim(0, dim) if steps else (a + b).movedim(0, dim)
    return h, state
