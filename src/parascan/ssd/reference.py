"""The ``loop`` backend of the SSD scan: the recurrence one step at a time, a few
torch ops on the (batch, heads, headdim, N) state per step, run a chunk at a time (cut
at packed sequences' boundaries) by the checkpointed driver it shares with the
``torch`` backend (chunked.py)."""

from __future__ import annotations

import torch
from torch import Tensor

from parascan.ssd import chunked

__all__ = ["backward_loop", "forward_loop"]


def _loop_piece(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, h: Tensor
) -> tuple[Tensor, Tensor]:
    """(y, last state) of q steps from the state ``h``, one step at a time."""
    b_heads = chunked.per_head(B, x.shape[2])  # (batch, q, heads, N)
    c_heads = chunked.per_head(C, x.shape[2])
    ys = []
    for t in range(x.shape[1]):
        decay = torch.exp(dt[:, t] * A)[..., None, None]
        inp = (dt[:, t, :, None] * x[:, t])[..., None] * b_heads[:, t, :, None, :]
        h = decay * h + inp
        ys.append((h @ c_heads[:, t, :, :, None]).squeeze(-1))
    return torch.stack(ys, 1), h


forward_loop, backward_loop = chunked.bind(lambda dt, A: _loop_piece, "loop")
