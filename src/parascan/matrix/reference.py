"""The sequential loop of matrix_linear_scan: the ``loop`` backend, one batched
matrix-vector product per step, differentiable by ordinary autograd."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["forward"]


def forward(weights: Tensor, biases: Tensor, initial: Tensor | None, reverse: bool) -> Tensor:
    """x[t] = W[t] @ x[t-1] + b[t] (x[t+1] when reversed); shapes as in cpu.forward."""
    steps = biases.shape[-2]
    batch = torch.broadcast_shapes(
        weights.shape[:-3], biases.shape[:-2], () if initial is None else initial.shape[:-1]
    )
    state = biases.new_zeros((*batch, biases.shape[-1])) if initial is None else initial
    out: list[Tensor] = [state] * steps
    for t in range(steps - 1, -1, -1) if reverse else range(steps):
        w, b = weights[..., t, :, :], biases[..., t, :]
        state = (w @ state.unsqueeze(-1)).squeeze(-1) + b
        out[t] = state
    if not out:
        return biases.new_empty((*batch, 0, biases.shape[-1]))
    return torch.stack(out, -2).expand(*batch, steps, biases.shape[-1]).contiguous()
