"""The ``torch`` backend of the generalized delta rule (canonical.py's contract) on the
shared checkpointed driver (parascan._checkpointed).

A block of c steps is matrix products and one triangular solve, batched over batch
and heads. With x[t] = a[t]^T S[t-1] (a row of V: what the rank-one term reads from
the state), a step is linear attention with two writes::

    S[t] = Diag(exp(g[t])) S[t-1] + b[t] x[t]^T + k[t] v[t]^T

so, with gamma[t] = g[first] + ... + g[t] and S0 the state entering the block, every
x[t] is a sum over the block's earlier steps and S0, and the x's solve one unit lower
triangular system::

    (I - AB) X = (a * exp(gamma[t-1])) S0 + AK V
    AB[t, j] = a[t] . (b[j] exp(gamma[t-1] - gamma[j])),  AK likewise with k   (j < t)

after which the block's outputs and its last state are linear attention's with the
pairs (k, v) and (b, x)::

    o[t]  = (q[t] exp(gamma[t])) S0 + sum_{j <= t} QB[t, j] x[j] + QK[t, j] v[j]
    S_end = exp(gamma[c-1]) S0 + sum_j (b[j] exp(gamma[c-1] - gamma[j])) x[j]^T + (k[j] ...) v[j]^T

The decays between steps come from segment sums, masked before the exponential (no
exp(-gamma) alone, no difference of running sums), as in linear attention's blocks.
The solve is forward substitution through the block's transitions; with RWKV-7's
ranges (|a|, |b| up to 1) it can amplify rounding as the transitions' products do,
so blocks are short (16 steps; BENCHMARKS.md has the float32 drift at L = 16k).
"""

from __future__ import annotations

import torch
from torch import Tensor

from parascan._checkpointed import bind_heads
from parascan.dplr.canonical import CHECKPOINT_STEPS, OPERANDS
from parascan.linear_attention.chunked import _segments, blocks

__all__ = ["BLOCK", "backward_torch", "forward_torch"]

BLOCK = 16

Optional = Tensor | None


def _pairs(x: Tensor, y: Tensor, w: Tensor | None) -> Tensor:
    """(batch, H, c, c): x[t] . (y[j] w[t, j]) with the decay weights w None (ones),
    (batch, H, c, c) or (batch, H, c, c, K)."""
    if w is None:
        return x @ y.transpose(-1, -2)
    if w.dim() == 4:
        return (x @ y.transpose(-1, -2)) * w
    return torch.einsum("bhtc,bhjc,bhtjc->bhtj", x, y, w)


def _block(
    q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, g: Optional, h: Tensor
) -> tuple[Tensor, Tensor]:
    """(out, last state) of one block, from the state ``h`` (batch, H, K, V); q, k, a,
    b (batch, H, c, K), v (batch, H, c, V), g None, (batch, H, c) or (batch, H, c, K):
    the module docstring's form."""
    c = v.shape[-2]
    i = torch.arange(c, device=v.device)
    lower, strict = i[:, None] >= i, i[:, None] > i
    if g is None:
        w = w_prev = None
        q_in, a_in, b_out, k_out, through = q, a, b, k, None
    else:
        per_head = g.dim() == 3
        gk = g[..., None] if per_head else g  # (batch, H, c, 1 or K)
        seg = _segments(gk, i)  # (batch, H, c, c, 1 or K): gamma[t] - gamma[j], j <= t
        w5 = torch.exp(seg.masked_fill(~lower[..., None], -torch.inf))
        # from step j to step t - 1: row t of w_prev is row t - 1 of w (none for t = 0)
        w5_prev = torch.cat([torch.zeros_like(w5[..., :1, :, :]), w5[..., :-1, :, :]], -3)
        w, w_prev = (w5[..., 0], w5_prev[..., 0]) if per_head else (w5, w5_prev)
        total = gk.cumsum(-2)
        into = torch.exp(total)
        # the exclusive running sum (gamma[t - 1]), summed, not total - g: a -inf decay
        # (a hard reset) would give -inf - -inf
        into_prev = torch.exp(
            torch.cat([torch.zeros_like(total[..., :1, :]), total[..., :-1, :]], -2)
        )
        q_in, a_in = q * into, a * into_prev
        last = w5[..., -1, :, :]  # (batch, H, c, 1 or K): from step j to the block's end
        b_out, k_out = b * last, k * last
        through = into[..., -1, :, None]  # (batch, H, 1 or K, 1)
    # masks select, not multiply: a later NaN never reaches an earlier row
    qb = torch.where(lower, _pairs(q, b, w), 0.0)
    qk = torch.where(lower, _pairs(q, k, w), 0.0)
    ab = torch.where(strict, _pairs(a, b, w_prev), 0.0)
    ak = torch.where(strict, _pairs(a, k, w_prev), 0.0)
    # Causality under NaN and inf: v is read with its non-finite entries zeroed, and NaN
    # is added from each channel's first non-finite v on (v - v is 0, or NaN where v is
    # not finite; its running sum stays NaN); x then follows from finite v's.
    clean = torch.nan_to_num(v, 0.0, 0.0, 0.0)
    rhs = a_in @ h + ak @ clean
    eye = torch.eye(c, dtype=v.dtype, device=v.device)
    x = torch.linalg.solve_triangular(eye - ab, rhs, upper=False, unitriangular=True)
    spoilt = (v - v).cumsum(-2) + (x - x).cumsum(-2)
    out = q_in @ h + qb @ torch.nan_to_num(x, 0.0, 0.0, 0.0) + qk @ clean + spoilt
    h = (h if through is None else through * h) + b_out.transpose(-1, -2) @ x
    h = h + k_out.transpose(-1, -2) @ v
    return out, h


def _piece(
    q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, g: Optional, h: Tensor
) -> tuple[Tensor, Tensor]:
    return blocks(_block, g, h, q, k, v, a, b, size=BLOCK)


forward_torch, backward_torch = bind_heads(
    "parascan.dplr_delta_rule_scan", _piece, CHECKPOINT_STEPS["torch"], OPERANDS
)
