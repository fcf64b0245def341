"""The ``torch`` backend of the delta-rule scan (canonical.py's contract), and how it
and the ``loop`` backend (reference.py) run on the shared checkpointed driver
(parascan._checkpointed: chunks of CHECKPOINT_STEPS, packed sequences' pieces, the
backward's recomputation under ``torch.func.vjp``).

The torch backend computes a block of c steps at once by the WY (UT transform) form
(arXiv 2412.06464), batched over batch and heads, and chains the blocks. Within a
block, with gamma[t] = g[first] + ... + g[t] (the log decay from the block's entry to
step t, per head or per key channel) and S0 the state entering the block, the
recurrence's corrections u[t] = beta[t] (v[t] - S~[t]^T k[t]) (S~[t]: the state
decayed to step t, before step t's update) solve one unit lower-triangular system::

    (I + A) U = beta * (V - (k * exp(gamma)) S0),
    A[t, j] = beta[t] sum_c k[t, c] k[j, c] exp(gamma[t, c] - gamma[j, c])   (j < t)

and then, for every step and for the state leaving the block::

    o[t]  = (q[t] * exp(gamma[t])) S0 + sum_{j <= t} (q[t] . (k[j] exp(gamma[t] - gamma[j]))) u[j]
    S_end = exp(gamma[c-1]) S0 + sum_j (k[j] exp(gamma[c-1] - gamma[j])) u[j]^T

The work is matrix products and one triangular solve per block. The decays between
steps, exp(gamma[t] - gamma[j]), are taken from the differences directly, masked
above the diagonal before the exponential (-inf there), so no weight overflows
(a difference of the running sums over the block, never exp(-gamma) alone, which
strong decays (g down to -50 a step) would overflow). With a gate per key channel
the decays are a (c, c, K) tensor per head: blocks are shorter there.
"""

from __future__ import annotations

import torch
from torch import Tensor

from parascan._checkpointed import bind_heads
from parascan.delta_rule.canonical import CHECKPOINT_STEPS, OPERANDS
from parascan.linear_attention.chunked import blocks, finish, gated

__all__ = ["backward_torch", "forward_torch"]

Optional = Tensor | None


def _block(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Optional, h: Tensor
) -> tuple[Tensor, Tensor]:
    """(out, last state) of one block, from the state ``h`` (batch, H, K, V); q, k
    (batch, H, c, K), v (batch, H, c, V), beta (batch, H, c), g None, (batch, H, c)
    or (batch, H, c, K): the module docstring's form, on linear attention's gated
    products (linear_attention/chunked.py), which also finish the block: a NaN or
    inf in u stays in its own and later rows (causality)."""
    c = v.shape[-2]
    p = gated(q, k, g, with_kk=True)
    assert p.kk is not None
    i = torch.arange(c, device=v.device)
    strict = (i[:, None] > i).to(v.dtype)
    # (a's entries on and above the diagonal are never read: the solve takes the
    # strictly lower triangle, a unit diagonal)
    a = beta[..., None] * p.kk * strict
    rhs = beta[..., None] * (v - p.k_in @ h)
    eye = torch.eye(c, dtype=v.dtype, device=v.device)
    u = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
    return finish(p, h, u)


def _wy_piece(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Optional, h: Tensor
) -> tuple[Tensor, Tensor]:
    """(out, last state) of a few steps from the state ``h``, a block at a time."""
    return blocks(_block, g, h, q, k, v, beta)


forward_torch, backward_torch = bind_heads(
    "parascan.delta_rule_scan", _wy_piece, CHECKPOINT_STEPS["torch"], OPERANDS
)
