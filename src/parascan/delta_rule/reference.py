"""The ``loop`` backend of the delta-rule scan: the recurrence one step at a time, a
few torch ops on the (batch, Hv, K, V) state per step, run a chunk at a time (cut at
packed sequences' boundaries) by the shared checkpointed driver."""

from __future__ import annotations

import torch
from torch import Tensor

from parascan._checkpointed import bind_heads
from parascan.delta_rule.canonical import CHECKPOINT_STEPS, OPERANDS

__all__ = ["backward_loop", "forward_loop"]


def _loop_piece(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor | None, h: Tensor
) -> tuple[Tensor, Tensor]:
    """(out, last state) of a few steps from the state ``h``, one step at a time (q and
    k already per value head)."""
    outs = []
    for t in range(v.shape[1]):
        if g is not None:
            decay = torch.exp(g[:, t])
            h = h * (decay[..., None, None] if decay.dim() == 2 else decay[..., None])
        kt = k[:, t, :, None, :]  # (batch, Hv, 1, K)
        u = beta[:, t, :, None] * (v[:, t] - (kt @ h).squeeze(-2))
        h = h + kt.transpose(-1, -2) * u[..., None, :]
        outs.append((q[:, t, :, None, :] @ h).squeeze(-2))
    return torch.stack(outs, 1), h


forward_loop, backward_loop = bind_heads(
    "parascan.delta_rule_scan", _loop_piece, CHECKPOINT_STEPS["loop"], OPERANDS
)
