"""The ``loop`` backend of the generalized delta rule: the recurrence one step at a
time, a few torch ops on the (batch, Hv, K, V) state per step, run a chunk at a time
(cut at packed sequences' boundaries) by the shared checkpointed driver."""

from __future__ import annotations

import torch
from torch import Tensor

from parascan._checkpointed import bind_heads
from parascan.dplr.canonical import CHECKPOINT_STEPS, OPERANDS

__all__ = ["backward_loop", "forward_loop"]


def _loop_piece(
    q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, g: Tensor | None, h: Tensor
) -> tuple[Tensor, Tensor]:
    """(out, last state) of a few steps from the state ``h`` (q, k, a and b already per
    value head)."""
    outs = []
    for t in range(v.shape[1]):
        x = (a[:, t, :, None, :] @ h).squeeze(-2)  # a^T S[t-1]: (batch, Hv, V)
        if g is not None:
            decay = torch.exp(g[:, t])
            h = h * (decay[..., None, None] if decay.dim() == 2 else decay[..., None])
        h = h + b[:, t, :, :, None] * x[..., None, :] + k[:, t, :, :, None] * v[:, t, :, None, :]
        outs.append((q[:, t, :, None, :] @ h).squeeze(-2))
    return torch.stack(outs, 1), h


forward_loop, backward_loop = bind_heads(
    "parascan.dplr_delta_rule_scan", _loop_piece, CHECKPOINT_STEPS["loop"], OPERANDS
)
