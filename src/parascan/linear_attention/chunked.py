"""The ``torch`` backend of linear attention (canonical.py's contract) on the shared
checkpointed driver (parascan._checkpointed), and the gated products of a block that
it shares with the delta rule's torch backend.

A block of c steps is matrix products, batched over batch and heads. With gamma[t] =
g[first] + ... + g[t] (the log decay from the block's entry to step t, per head or per
key channel) and S0 the state entering the block::

    o[t]  = (q[t] * exp(gamma[t])) S0 + sum_{j <= t} (q[t] . (k[j] exp(gamma[t] - gamma[j]))) v[j]
    S_end = exp(gamma[c-1]) S0 + sum_j (k[j] exp(gamma[c-1] - gamma[j])) v[j]^T

The decays between steps, exp(gamma[t] - gamma[j]), are taken from segment sums
directly, masked above the diagonal before the exponential (-inf there), so no weight
overflows (never exp(-gamma) alone, which strong decays would overflow). With a gate
per key channel the decays are a (c, c, K) tensor per head: blocks are shorter there.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from parascan._checkpointed import bind_heads
from parascan.linear_attention.canonical import CHECKPOINT_STEPS, OPERANDS

__all__ = ["BLOCK", "CHANNEL_BLOCK", "Gated", "backward_torch", "blocks", "forward_torch", "gated"]

# Steps of one block: with a gate per head a block costs about c (K + V) multiply-adds
# a step for its (c, c) products against 2 K V for the state's; with a gate per key
# channel the decays are a (c, c, K) tensor per head.
BLOCK = 64
CHANNEL_BLOCK = 32

Optional = Tensor | None


def _segments(g: Tensor, i: Tensor) -> Tensor:
    """seg[..., t, j, :] = g[..., j+1, :] + ... + g[..., t, :] for t >= j (0 on the
    diagonal), from the log decays g (..., c, K): each segment summed directly (a
    masked cumulative sum, not a difference of running sums, whose rounding grows
    with the running sum: after strong decays it would swamp the weak ones after
    them), so a -inf decay (a hard reset) gives -inf, never -inf - -inf. Above the
    diagonal: 0 (the caller masks it)."""
    # g[k] enters seg[t, j] for j < k <= t: row k of the terms keeps columns j < k
    keep = (i[:, None] > i)[..., None]
    terms = g[..., :, None, :].expand(*g.shape[:-2], g.shape[-2], g.shape[-2], g.shape[-1])
    return terms.masked_fill(~keep, 0.0).cumsum(-3)


class Gated(NamedTuple):
    """A block's products with the decays applied (q, k (batch, H, c, K)):
    ``qk[t, j] = q[t] . (k[j] exp(gamma[t] - gamma[j]))`` for j <= t, 0 above the
    diagonal (selected, not multiplied: a later NaN never reaches an earlier row);
    ``kk`` the same of k against k (None unless asked); ``q_in``, ``k_in`` q and k
    decayed from the block's entry (q[t] exp(gamma[t])); ``k_out`` k decayed to the
    block's end (k[j] exp(gamma[c-1] - gamma[j])); ``through`` the decay over the
    whole block, to multiply the entering state by (None: no gate)."""

    qk: Tensor
    kk: Tensor | None
    q_in: Tensor
    k_in: Tensor
    k_out: Tensor
    through: Tensor | None


def gated(q: Tensor, k: Tensor, g: Optional, with_kk: bool = False) -> Gated:
    """The products of a block of q, k (batch, H, c, K) under the log decays g: None,
    (batch, H, c) or (batch, H, c, K)."""
    c = q.shape[-2]
    i = torch.arange(c, device=q.device)
    lower = i[:, None] >= i  # j <= t
    kt = k.transpose(-1, -2)
    if g is None:
        qk, kk = q @ kt, (k @ kt if with_kk else None)
        q_in, k_in, k_out, through = q, k, k, None
    elif g.dim() == 3:  # a log decay per head
        seg = _segments(g[..., :, None], i)[..., 0]  # (batch, H, c, c)
        w = torch.exp(seg.masked_fill(~lower, -torch.inf))
        qk, kk = (q @ kt) * w, ((k @ kt) * w if with_kk else None)
        into = torch.exp(g.cumsum(-1))[..., None]
        q_in, k_in = q * into, k * into
        k_out = k * w[..., -1, :, None]
        through = into[..., -1:, :]
    else:  # a log decay per key channel
        seg = _segments(g, i)  # (batch, H, c, c, K)
        w = torch.exp(seg.masked_fill(~lower[..., None], -torch.inf))
        qk = torch.einsum("bhtc,bhjc,bhtjc->bhtj", q, k, w)
        kk = torch.einsum("bhtc,bhjc,bhtjc->bhtj", k, k, w) if with_kk else None
        into = torch.exp(g.cumsum(-2))
        q_in, k_in = q * into, k * into
        k_out = k * w[..., -1, :, :]
        through = into[..., -1, :, None]
    # on and below the diagonal qk keeps every value, an overflow of finite inputs
    # included (the loop's output there is as large)
    return Gated(torch.where(lower, qk, 0.0), kk, q_in, k_in, k_out, through)


def finish(p: Gated, h: Tensor, u: Tensor) -> tuple[Tensor, Tensor]:
    """(out, state leaving the block) of a block whose steps add k[j] u[j]^T to the
    state (u = v here, the delta rule's corrections there), from the state ``h``.

    Causality under NaN and inf: a non-finite u[j] makes the loop's state non-finite
    in its value channels from step j on. The product over the block's steps must not
    carry it into earlier rows (0 * NaN = NaN): u is read with its non-finite entries
    zeroed, and NaN is added from each channel's first non-finite u on (u - u is 0, or
    NaN where u is not finite; its running sum stays NaN)."""
    spoilt = (u - u).cumsum(-2)
    out = p.q_in @ h + p.qk @ torch.nan_to_num(u, 0.0, 0.0, 0.0) + spoilt
    h = (h if p.through is None else p.through * h) + p.k_out.transpose(-1, -2) @ u
    return out, h


def blocks(
    block: object, g: Optional, h: Tensor, *timed: Optional, size: int | None = None
) -> tuple[Tensor, Tensor]:
    """(out, last state) of a piece, a block at a time: ``block(*operands, g, h)`` on
    each block of ``size`` steps (default BLOCK, or CHANNEL_BLOCK with a gate per key
    channel) of the (batch, c, H, ...) ``timed`` operands, moved to (batch, H, c, ...)."""
    assert callable(block)
    if size is None:
        size = CHANNEL_BLOCK if g is not None and g.dim() == 4 else BLOCK
    length = next(t for t in timed if t is not None).shape[1]
    outs = []
    for lo in range(0, length, size):
        s = slice(lo, lo + size)
        cut = [None if t is None else t[:, s].transpose(1, 2) for t in (*timed, g)]
        y, h = block(*cut, h)
        outs.append(y.transpose(1, 2))
    return (outs[0] if len(outs) == 1 else torch.cat(outs, 1)), h


def _block(q: Tensor, k: Tensor, v: Tensor, g: Optional, h: Tensor) -> tuple[Tensor, Tensor]:
    return finish(gated(q, k, g), h, v)


def _piece(q: Tensor, k: Tensor, v: Tensor, g: Optional, h: Tensor) -> tuple[Tensor, Tensor]:
    return blocks(_block, g, h, q, k, v)


forward_torch, backward_torch = bind_heads(
    "parascan.linear_attention_scan", _piece, CHECKPOINT_STEPS["torch"], OPERANDS
)
