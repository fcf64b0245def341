"""The sequential reference for linear_scan: the ``loop`` backend, and the oracle.

Semantics, as a plain loop (``reverse`` walks t from T-1 down to 0 and reads x[t+1]):

    x = initial                      # zeros when None
    for t in range(T):
        x = gates[t] * x + tokens[t]
        out[t] = x

Tests run this in float64/complex128 as the oracle every backend is compared with.
"""

from __future__ import annotations

import torch

from parascan._checks import accumulate_dtype

__all__ = ["forward"]


def forward(
    gates: torch.Tensor,
    tokens: torch.Tensor,
    initial: torch.Tensor | None,
    dim: int,
    reverse: bool,
) -> torch.Tensor:
    """The recurrence one step at a time. ``gates`` and ``tokens`` share one shape;
    ``initial`` has that shape without ``dim``. Half types accumulate in float32.
    Differentiable with ordinary autograd (it is plain torch), which makes it the
    gradient oracle too."""
    dtype = tokens.dtype
    acc = accumulate_dtype(dtype)
    a = gates.movedim(dim, 0).to(acc)
    b = tokens.movedim(dim, 0).to(acc)
    state = b.new_zeros(b.shape[1:]) if initial is None else initial.to(acc)
    steps = range(b.shape[0] - 1, -1, -1) if reverse else range(b.shape[0])
    out: list[torch.Tensor] = [state] * b.shape[0]
    for t in steps:
        state = a[t] * state + b[t]
        out[t] = state
    result = torch.empty(tokens.shape, dtype=dtype, device=tokens.device)
    if out:
        result.copy_(torch.stack(out).movedim(0, dim))
    return result
