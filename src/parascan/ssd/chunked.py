"""The ``torch`` backend of the SSD scan (canonical.py's contract), and how it and the
``loop`` backend (reference.py) run on the shared checkpointed driver.

Both walk L one checkpoint interval (a "chunk" of K steps) at a time, holding the
state entering each chunk and never a state per step over all of L; they differ in
how a piece of a chunk is computed (``bind``'s ``piece_for``):

- ``loop`` (the semantics in one loop, reference.py): each step is a few torch ops
  on the (batch, heads, headdim, N) state.
- ``torch`` (any device): the state-space dual form in blocks of ``BLOCK`` steps,
  the within-block terms of all the blocks of a chunk computed together and only the
  states entering the blocks chained one after another. Within a block of q steps,
  with a[t] = dt[t] * A (the log decays) and seg[i, j] = a[j+1] + ... + a[i] (i >= j),

      y[i]    = sum_{j <= i} exp(seg[i, j]) dt[j] (C[i] . B[j]) x[j]   (a masked,
                decay-weighted attention: one (q, q) product per head)
              + exp(a[0] + ... + a[i]) h0 @ C[i]                       (entering state)
      h_end   = exp(a[0] + ... + a[q-1]) h0
              + sum_j exp(seg[q-1, j]) dt[j] x[j] (outer) B[j]        (one product)

  seg is summed over each segment directly (a masked cumulative sum, not as a
  difference of running sums, which would cancel catastrophically); the entries
  above the diagonal are empty sums, 0, and the causal mask is applied to ``C . B``
  (computed once per group and shared by the group's heads), so no exponent there
  can overflow and no 0 * inf appears in the gradient.

  A growing state (dt * A > 0: the contract allows A > 0) makes the weights exp(seg)
  and exp(a[0] + ... + a[i]) as large as exp(q * max(dt * A)): they overflow long
  before the state does where the state or the early inputs are zero (a scan from
  no initial state), and inf * 0 is NaN. So q is cut, for a whole call, to keep every
  weight below exp(half the dtype's exponent range) (``dual_form_steps``): each
  product is then a term of the loop's own states or bounded by one, finite wherever
  the loop is. A decaying state (dt * A <= 0, the normal regime) keeps BLOCK steps.

The driver (chunks, packed sequences' pieces, checkpoints, the backward's
recomputation under ``torch.func.vjp``) is parascan._checkpointed's, shared with the
delta-rule scan; ``D`` and ``z`` are applied to each piece's output.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from parascan import _checkpointed
from parascan.ssd.canonical import CHECKPOINT_STEPS, EMPTY, drops_final, zero_rows_as_zeros

__all__ = [
    "BLOCK",
    "Piece",
    "backward_torch",
    "bind",
    "dual_form_steps",
    "forward_torch",
    "per_head",
]

_FN = "parascan.ssd_scan"
# Steps of one block of the dual form (the ``torch`` backend's within-chunk unit):
# per step it costs about BLOCK * (N + headdim) multiply-adds for the masked product
# against 2 * headdim * N for the state's, so a block of 64 balances them at
# headdim = N = 64.
BLOCK = 64

Optional = Tensor | None
Piece = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]
Forward = tuple[Tensor, Tensor, Tensor]


# --- one piece of a sequence: the loop, and the dual form -----------------------------


def per_head(m: Tensor, heads: int) -> Tensor:
    """(batch, ..., groups, N) -> (batch, ..., heads, N): head h reads group
    h // (heads // groups)."""
    return m.repeat_interleave(heads // m.shape[-2], dim=-2)


def _floor(t: Tensor) -> float:
    """The log decay below which exp(.) is clamped: exp of it is still a normal number
    of the dtype (below it the result is subnormal or zero, and the vectorized exp
    takes a slow path on CPU, many times slower: BENCHMARKS.md, "Figures the source
    cites"). The clamp turns a weight below
    1.8e-35 (float32; 1e-304 in float64) into that value: invisible next to terms of
    ordinary size, and its gradient, already below that, into 0."""
    return -80.0 if t.dtype != torch.float64 else -700.0


def _decays(a: Tensor) -> Tensor:
    """exp(a[..., j+1] + ... + a[..., i]) for i >= j, and exactly 1 above the diagonal
    (an empty sum: the caller masks it), from the log decays a (..., q).

    Each segment is summed directly (a masked cumulative sum, not a difference of
    running sums, which would cancel catastrophically), so the entries above the
    diagonal reach the exponential as 0: nothing there can overflow or put 0 * inf
    into the gradient. (The mask multiplies: masked_fill is several times slower.)"""
    q = a.shape[-1]
    i = torch.arange(q, device=a.device)
    # a[k] enters seg[i, j] for j < k <= i: row k of the terms keeps columns j < k;
    # the cumulative sum over rows is then 0 on and above the diagonal
    seg = (a[..., :, None] * (i[:, None] > i).to(a.dtype)).cumsum(-2)
    return torch.exp(seg.clamp(min=_floor(a)))


def _values(t: Tensor) -> Tensor:
    """``t``'s values as a plain tensor, under any torch.func transform too (the
    forward mode runs the torch backend's forward under jvp, jacfwd and vmap): a
    batched tensor gives all of its batch's values."""
    t = t.detach()
    while torch._C._functorch.is_functorch_wrapped_tensor(t):
        t = torch._C._functorch.get_unwrapped(t)
    return t


def dual_form_steps(dt: Tensor, A: Tensor, most: int) -> int:
    """The dual form's block length for a call: ``most`` steps, or fewer where the
    state grows so fast (a = dt * A > 0) that a block's weights would leave the
    dtype's range (see the module's docstring). The torch backend's blocks and the
    Triton chunked forward's (which walks step by step when its blocks do not fit)
    both follow it.

    The weights of a block of q steps are at most exp(q * max(a, 0)); q keeps that
    below exp(half the exponent range): exp(44) in float32, exp(354) in float64. The
    other half is left to what they multiply (C . B, the inputs, the state), so that
    a product overflows only where the loop's state does. One step growing by more
    than that is a block of its own: its one weight exp(a) is the loop's own decay.
    One number for the call (a host sync on an accelerator, once per forward and
    backward), from every batch element under vmap.

    Traced without values (torch.compile's fake tensors: the forward mode of a compiled
    ``jvp``), the block length cannot follow them: one step, the loop's own form,
    finite wherever the loop is."""
    values = _values(dt * A)
    if is_fake(values):
        return 1
    growth = float(values.clamp(min=0).amax()) if dt.numel() else 0.0
    limit = 0.5 * math.log(torch.finfo(dt.dtype).max)
    if not growth * most > limit:  # also the normal regime, and NaN: it propagates
        return most
    return max(1, int(limit // growth))


def _dual_piece(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, h: Tensor, block: int = BLOCK
) -> tuple[Tensor, Tensor]:
    """(y, last state) of q steps from the state ``h`` by the dual form (see the
    module's docstring), its blocks of ``block`` steps computed together.

    The steps are padded to whole blocks with dt = 0 (a decay of 1 and no input: the
    state passes through unchanged) and the blocks folded into the batch: every
    within-block term of every block comes from one batch of products, only the
    states entering the blocks are chained, one block after another."""
    batch, q, heads, headdim = x.shape
    groups, n = B.shape[-2], B.shape[-1]
    r = heads // groups
    size = min(q, block)
    blocks = -(-q // size)
    pad = blocks * size - q
    if pad:
        x, dt, B, C = (F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) for t in (x, dt, B, C))
    m = batch * blocks  # (batch, blocks) folded
    dt_h = dt.reshape(m, size, heads).transpose(1, 2).contiguous()  # (m, heads, size)
    a = dt_h * A[:, None]  # the log decays
    decay = _decays(a)  # (m, heads, size, size), 1 above the diagonal
    into = torch.exp(a.cumsum(-1).clamp(min=_floor(a)))  # (m, heads, size): entry to step i
    b_g = B.reshape(m, size, groups, n).transpose(1, 2)  # (m, groups, size, N)
    c_g = C.reshape(m, size, groups, n).transpose(1, 2)
    x_h = x.reshape(m, size, groups, r, headdim).permute(0, 2, 3, 1, 4)  # (m, G, r, size, P)
    x_dt = x_h * dt_h.view(m, groups, r, size, 1)
    # within each block: C B^T (shared by the group, masked to j <= i) * decay, times dt x
    i = torch.arange(size, device=x.device)
    # Causality under NaN and inf: a later step's non-finite input must not reach an
    # earlier row through the products over the block's steps (0 * NaN = NaN). The
    # mask of C B^T selects (a later B's NaN times 0 would be NaN; per group, cheap);
    # the decays above the diagonal are non-finite only in rows from a non-finite
    # dt on. A non-finite dt x[j, p] makes the loop's state row p, and channel p of
    # every output from step j on, non-finite: the product reads dt x with its
    # non-finite entries zeroed, and NaN is added from each channel's first one on
    # (dt x - dt x is 0, or NaN where it is not finite; its running sum stays NaN).
    cb = torch.where(i[:, None] >= i, c_g @ b_g.transpose(-1, -2), 0.0)
    spoilt = (x_dt - x_dt).cumsum(-2)
    xs = torch.nan_to_num(x_dt, 0.0, 0.0, 0.0)
    y = (decay.view(m, groups, r, size, size) * cb[:, :, None]) @ xs + spoilt  # (m, G, r, size, P)
    # each block's own input to the state at its end (from a zero state); the last
    # row of the decays has no entry above the diagonal
    w = decay[..., -1, :].reshape(m, groups, r, size, 1)
    own = (x_dt * w).transpose(-1, -2).reshape(m, groups, r * headdim, size) @ b_g
    own = own.view(batch, blocks, heads, headdim, n)
    # the states entering the blocks, chained
    through = into[..., -1].view(batch, blocks, heads, 1, 1)  # a whole block's decay
    entering = []
    for k in range(blocks):
        entering.append(h)
        h = through[:, k] * h + own[:, k]
    h_in = torch.stack(entering, 1).view(m, groups, r * headdim, n)
    # the entering states, read by every step's C and decayed to it
    y_in = (c_g @ h_in.transpose(-1, -2)).view(m, groups, size, r, headdim).transpose(2, 3)
    y = y + y_in * into.view(m, groups, r, size, 1)
    y = y.reshape(batch, blocks, heads, size, headdim).transpose(2, 3)
    return y.reshape(batch, blocks * size, heads, headdim)[:, :q], h


# --- the backends on the shared driver -------------------------------------------------


def _with_d_z(inner: Piece) -> _checkpointed.Piece:
    """The driver's piece: ``inner``'s steps, then ``D`` and ``z`` on their output."""

    def piece(
        timed: tuple[Optional, ...], fixed: tuple[Optional, ...], h: Tensor
    ) -> tuple[Tensor, Tensor]:
        x, dt, B, C, z = timed
        A, D = fixed
        assert x is not None and dt is not None and A is not None
        assert B is not None and C is not None
        y, h = inner(x, dt, A, B, C, h)
        if D is not None:
            y = y + D * x
        if z is not None:
            y = y * F.silu(z)
        return y, h

    return piece


def bind(
    piece_for: Callable[[Tensor, Tensor], Piece], backend: str
) -> tuple[Callable[..., Forward], Callable[..., tuple[Tensor, ...]]]:
    """The backend's forward and backward, with the piece ``piece_for(dt, A)`` picks
    for the call's steps."""
    k = CHECKPOINT_STEPS[backend]

    def forward(
        x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional, z: Optional,
        initial: Optional, cu_seqlens: Optional,
    ) -> Forward:  # fmt: skip
        zero = x.new_zeros(x.shape[0], x.shape[2], x.shape[3], B.shape[-1])
        piece = _with_d_z(piece_for(dt, A))
        return _checkpointed.forward(
            _FN, piece, k, (x, dt, B, C, z), (A, D), initial, cu_seqlens, zero
        )

    def backward(
        x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional, z: Optional,
        initial: Optional, cu_seqlens: Optional, checkpoints: Tensor, grad_out: Tensor,
        grad_final: Tensor,
    ) -> tuple[Tensor, ...]:  # fmt: skip
        zero = x.new_zeros(x.shape[0], x.shape[2], x.shape[3], B.shape[-1])
        piece = _with_d_z(piece_for(dt, A))
        (gx, gdt, gb, gc, gz), (ga, gd), gi = _checkpointed.backward(
            _FN, piece, k, (x, dt, B, C, z), (A, D), initial, cu_seqlens, checkpoints,
            grad_out, grad_final, zero,
        )  # fmt: skip
        return tuple(EMPTY(x) if g is None else g for g in (gx, gdt, ga, gb, gc, gd, gz, gi))

    return drops_final(forward), zero_rows_as_zeros(backward)


def _dual_for(dt: Tensor, A: Tensor) -> Piece:
    block = dual_form_steps(dt, A, BLOCK)
    return _dual_piece if block == BLOCK else partial(_dual_piece, block=block)


forward_torch, backward_torch = bind(_dual_for, "torch")
