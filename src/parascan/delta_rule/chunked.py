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

from collections.abc import Callable

import torch
from torch import Tensor

from parascan import _checkpointed
from parascan.delta_rule.canonical import CHECKPOINT_STEPS, drops_final, zero_rows_as_zeros

__all__ = ["backward_torch", "bind", "forward_torch"]

_FN = "parascan.delta_rule_scan"
# Steps of one block of the WY form: with a gate per head a block costs about
# c * (K + V) multiply-adds a step for its (c, c) products against 2 K V for the
# state's; with a gate per key channel the decays are a (c, c, K) tensor per head.
BLOCK = 64
CHANNEL_BLOCK = 32

Optional = Tensor | None
Piece = Callable[[Tensor, Tensor, Tensor, Tensor, Optional, Tensor], tuple[Tensor, Tensor]]
Forward = tuple[Tensor, Tensor, Tensor]


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


def _block(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Optional, h: Tensor
) -> tuple[Tensor, Tensor]:
    """(out, last state) of one block, from the state ``h`` (batch, H, K, V); q, k
    (batch, H, c, K), v (batch, H, c, V), beta (batch, H, c), g None, (batch, H, c)
    or (batch, H, c, K): the module docstring's form."""
    c = v.shape[-2]
    i = torch.arange(c, device=v.device)
    lower = i[:, None] >= i  # j <= t
    strict = (i[:, None] > i).to(v.dtype)
    kt = k.transpose(-1, -2)
    if g is None:
        kk, qk = k @ kt, q @ kt
        k_in, q_in, k_out, through = k, q, k, None
    elif g.dim() == 3:  # a log decay per head
        seg = _segments(g[..., :, None], i)[..., 0]  # (batch, H, c, c)
        w = torch.exp(seg.masked_fill(~lower, -torch.inf))
        kk, qk = (k @ kt) * w, (q @ kt) * w
        into = torch.exp(g.cumsum(-1))[..., None]
        k_in, q_in = k * into, q * into
        k_out = k * w[..., -1, :, None]
        through = into[..., -1:, :]
    else:  # a log decay per key channel
        seg = _segments(g, i)  # (batch, H, c, c, K)
        w = torch.exp(seg.masked_fill(~lower[..., None], -torch.inf))
        kk = torch.einsum("bhtc,bhjc,bhtjc->bhtj", k, k, w)
        qk = torch.einsum("bhtc,bhjc,bhtjc->bhtj", q, k, w)
        into = torch.exp(g.cumsum(-2))
        k_in, q_in = k * into, q * into
        k_out = k * w[..., -1, :, :]
        through = into[..., -1, :, None]
    # (a's entries on and above the diagonal are never read: the solve takes the
    # strictly lower triangle, a unit diagonal)
    a = beta[..., None] * kk * strict
    rhs = beta[..., None] * (v - k_in @ h)
    eye = torch.eye(c, dtype=v.dtype, device=v.device)
    u = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
    # Causality under NaN and inf. A non-finite input at step t makes u[t] non-finite
    # and, through the solve, every later u in its value channels: the loop's state
    # from t on. The products over the block's steps must not carry it into earlier
    # rows (0 * NaN = NaN): qk's mask selects (a later k's NaN above the diagonal), u
    # is read with its non-finite entries zeroed, and NaN is added from each channel's
    # first non-finite u on (u - u is 0, or NaN where u is not finite; its running sum
    # stays NaN). On and below the diagonal qk keeps every value, an overflow of finite
    # inputs included (the loop's output there is as large).
    spoilt = (u - u).cumsum(-2)
    qk = torch.where(lower, qk, 0.0)
    out = q_in @ h + qk @ torch.nan_to_num(u, 0.0, 0.0, 0.0) + spoilt
    h = (h if through is None else through * h) + k_out.transpose(-1, -2) @ u
    return out, h


def _wy_piece(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Optional, h: Tensor
) -> tuple[Tensor, Tensor]:
    """(out, last state) of a few steps from the state ``h``, a block at a time."""
    size = CHANNEL_BLOCK if g is not None and g.dim() == 4 else BLOCK
    outs = []
    for lo in range(0, v.shape[1], size):
        s = slice(lo, lo + size)
        y, h = _block(
            q[:, s].transpose(1, 2), k[:, s].transpose(1, 2), v[:, s].transpose(1, 2),
            beta[:, s].transpose(1, 2), None if g is None else g[:, s].transpose(1, 2), h,
        )  # fmt: skip
        outs.append(y.transpose(1, 2))
    return (outs[0] if len(outs) == 1 else torch.cat(outs, 1)), h


def _per_value_head(inner: Piece) -> _checkpointed.Piece:
    """The driver's piece: q and k repeated to the value heads, then ``inner``."""

    def piece(timed: tuple[Optional, ...], fixed: tuple[Optional, ...], h: Tensor) -> Forward:
        v, q, k, beta, g = timed
        assert v is not None and q is not None and k is not None and beta is not None
        r = v.shape[2] // q.shape[2]
        if r > 1:
            q, k = q.repeat_interleave(r, 2), k.repeat_interleave(r, 2)
        return inner(q, k, v, beta, g, h)  # type: ignore[return-value]

    return piece  # type: ignore[return-value]


def bind(
    inner: Piece, backend: str
) -> tuple[Callable[..., Forward], Callable[..., tuple[Tensor, ...]]]:
    """The backend's forward and backward on the shared driver, with ``inner``
    computing the steps of a piece."""
    k_steps = CHECKPOINT_STEPS[backend]
    piece = _per_value_head(inner)

    def zero(k: Tensor, v: Tensor) -> Tensor:
        # torch.zeros, not v.new_zeros: under torch.compile, in a jvp of a jvp (the
        # scan's forward mode run by a compiled vmap of jvp), FakeTensor makes new_zeros
        # of a wrapped tensor a meta tensor (torch 2.13), which no later op takes
        return torch.zeros(
            v.shape[0], v.shape[2], k.shape[-1], v.shape[-1], dtype=v.dtype, device=v.device
        )

    def forward(
        q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Optional, initial: Optional,
        cu_seqlens: Optional,
    ) -> Forward:  # fmt: skip
        return _checkpointed.forward(
            _FN, piece, k_steps, (v, q, k, beta, g), (), initial, cu_seqlens, zero(k, v)
        )

    def backward(
        q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Optional, initial: Optional,
        cu_seqlens: Optional, checkpoints: Tensor, grad_out: Tensor, grad_final: Tensor,
    ) -> tuple[Tensor, ...]:  # fmt: skip
        (gv, gq, gk, gb, gg), _, gi = _checkpointed.backward(
            _FN, piece, k_steps, (v, q, k, beta, g), (), initial, cu_seqlens, checkpoints,
            grad_out, grad_final, zero(k, v),
        )  # fmt: skip
        # a new empty tensor per absent operand: a custom op's returns may not alias
        # one another (one shared placeholder for g's and initial's made the backward
        # fail whenever both were absent)
        return tuple(_checkpointed.EMPTY(v) if t is None else t for t in (gq, gk, gv, gb, gg, gi))

    return drops_final(forward), zero_rows_as_zeros(backward)


forward_torch, backward_torch = bind(_wy_piece, "torch")
