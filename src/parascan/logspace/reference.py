"""The sequential reference for log_linear_scan: the ``loop`` backend.

    h = initial                      # -inf (log 0) when None
    for t in range(T):               # T-1 down to 0 when reverse
        h = logaddexp(log_gates[t] + h, log_tokens[t])
        out[t] = h

``logaddexp`` is the exact function with its special values (see logaddexp
below); complex results have their imaginary part in [-pi, pi).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from parascan._checks import accumulate_dtype

__all__ = ["forward", "log_weight", "logaddexp"]


def logaddexp(u: Tensor, v: Tensor) -> Tensor:
    """log(exp(u) + exp(v)), real or complex. For complex tensors: the principal
    value (imaginary part in [-pi, pi)), -inf + 0j for log 0, computed from the
    argument with the larger real part so that exp never overflows."""
    if not u.is_complex():
        return torch.logaddexp(u, v)
    first = u.real >= v.real
    hi, lo = torch.where(first, u, v), torch.where(first, v, u)
    usable = hi.real.isfinite() & (lo.real != -math.inf)
    w = torch.exp(torch.where(usable, lo - hi, torch.zeros_like(hi)))
    out = hi + torch.where(usable, _log1p_unit_disk(w), torch.zeros_like(hi))
    phase = torch.remainder(out.imag + math.pi, 2 * math.pi) - math.pi
    phase = torch.where(out.real == -math.inf, torch.zeros_like(phase), phase)
    return torch.complex(out.real, phase)


def _log1p_unit_disk(w: Tensor) -> Tensor:
    """log(1 + w) for complex |w| <= 1, from real functions: torch's vectorized
    complex log1p returns NaN for subnormal inputs (torch 2.13, CPU)."""
    re, im = w.real, w.imag
    return torch.complex(0.5 * torch.log1p(re * (2 + re) + im * im), torch.atan2(im, 1 + re))


def log_weight(x: Tensor, h: Tensor) -> Tensor:
    """exp(x - h), the derivative of h = logaddexp(x, y) in x; 0 where h is log 0
    (x and y both -inf: no gradient flows through log(0 + 0)). Differentiable
    without NaN (the -inf case is masked before the exp)."""
    dead = (h.real if h.is_complex() else h) == -math.inf
    return torch.exp(torch.where(dead, torch.full_like(h, -math.inf), x - h))


def forward(
    log_gates: Tensor,
    log_tokens: Tensor,
    initial: Tensor | None,
    dim: int,
    reverse: bool,
) -> Tensor:
    """The recurrence one step at a time. Operands share one shape (``initial``:
    without ``dim``); half types compute in float32."""
    dtype = log_tokens.dtype
    acc = accumulate_dtype(dtype)
    a = log_gates.movedim(dim, 0).to(acc)
    b = log_tokens.movedim(dim, 0).to(acc)
    state = b.new_full(b.shape[1:], -math.inf) if initial is None else initial.to(acc)
    steps = range(b.shape[0] - 1, -1, -1) if reverse else range(b.shape[0])
    out: list[Tensor] = [state] * b.shape[0]
    for t in steps:
        state = logaddexp(a[t] + state, b[t])
        out[t] = state
    result = torch.empty(log_tokens.shape, dtype=dtype, device=log_tokens.device)
    if out:
        result.copy_(torch.stack(out).movedim(0, dim))
    return result
