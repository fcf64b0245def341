"""The ``torch`` backend of matrix_linear_scan: a parallel scan of affine maps.

Step t maps a state x to ``W[t] x + b[t]``; two steps compose to the affine map
``(W2 W1, W2 b1 + b2)``. associative_scan over these pairs gives every prefix
``(A[t], c[t])`` in O(log T) batched calls, then ``x[t] = A[t] x[-1] + c[t]``.
It costs d^3 per step (matrix products) instead of d^2, so it pays only where the
sequential loop is bound by per-step overhead: short states, long sequences,
devices with slow launches.
"""

from __future__ import annotations

import torch
from torch import Tensor

from parascan.generic import associative_scan

__all__ = ["forward"]


def _compose(first: tuple[Tensor, Tensor], then: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
    (w1, b1), (w2, b2) = first, then
    return w2 @ w1, (w2 @ b1.unsqueeze(-1)).squeeze(-1) + b2


def forward(weights: Tensor, biases: Tensor, initial: Tensor | None, reverse: bool) -> Tensor:
    """Same contract as reference.forward."""
    pairs = torch.broadcast_shapes(weights.shape[:-3], biases.shape[:-2])
    w = weights.expand(*pairs, *weights.shape[-3:])
    b = biases.expand(*pairs, *biases.shape[-2:])
    maps, shifts = associative_scan(_compose, (w, b), len(pairs), reverse=reverse)
    out: Tensor = shifts
    if initial is not None:
        start = initial.unsqueeze(-2).unsqueeze(-1)  # one state for every step
        out = (maps @ start).squeeze(-1) + shifts
    return out.contiguous()
