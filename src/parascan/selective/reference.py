"""The ``loop`` backend of the selective scan: the recurrence one step at a time, a
few torch ops on the (batch, dim, N) state per step, run a chunk at a time by the
checkpointed driver it shares with the ``torch`` backend (chunked.py)."""

from __future__ import annotations

import torch
from torch import Tensor

from parascan.selective import chunked

__all__ = ["backward_loop", "forward_loop"]


def _loop_states(
    dt: Tensor, dtu: Tensor, A: Tensor, b_full: Tensor, c_full: Tensor, h0: Tensor
) -> tuple[Tensor, Tensor]:
    """One chunk's outputs (before the skip and the gate) and last state, a step at a
    time."""
    h, ys = h0, []
    for t in range(dt.shape[2]):
        decay = torch.exp(dt[:, :, t, None] * A)
        b_t = b_full[:, :, min(t, b_full.shape[2] - 1)]
        c_t = c_full[:, :, min(t, c_full.shape[2] - 1)]
        h = decay * h + dtu[:, :, t, None] * b_t
        ys.append((c_t * h).sum(-1))
    y = torch.stack(ys, dim=-1) if ys else dtu.new_zeros(dtu.shape).to(h.dtype)
    return y, h


forward_loop, backward_loop = chunked.bind("loop", _loop_states)
