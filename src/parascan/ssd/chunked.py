"""The ``torch`` backend of the SSD scan (canonical.py's contract), and the
checkpointed driver it shares with the ``loop`` backend (reference.py).

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

Packed sequences: each chunk is cut into pieces at the sequence boundaries inside
it; a piece that starts a sequence starts from that sequence's initial state, and
the state at the end of a piece that ends a sequence is that sequence's final
state. The chunks stay aligned to L (see the checkpoints in canonical.py).

The backward is exact activation checkpointing: for each chunk from the last, the
chunk's forward runs again from its checkpoint under ``torch.func.vjp`` (inside a
custom op the autograd keys are excluded, and functorch brings its own), carrying
the output's, the final states' and the carried state's gradients back to the
chunk's inputs and to the state entering it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import Tensor

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


# --- the plan: chunks, and the pieces of sequences inside them ------------------------


@dataclass(frozen=True)
class _Piece:
    lo: int  # steps lo .. hi - 1 of the chunk
    hi: int
    seq: int  # the sequence the piece belongs to
    fresh: bool  # the sequence starts inside the chunk (lo > 0): from its initial state
    ends: bool  # the sequence ends with this piece


@dataclass(frozen=True)
class _Chunk:
    start: int  # steps start .. stop - 1 of L
    stop: int
    entry: int | None  # the sequence that step ``start`` starts, if it starts one
    pieces: tuple[_Piece, ...]

    @property
    def fresh(self) -> list[int]:
        return [p.seq for p in self.pieces if p.fresh]

    @property
    def ending(self) -> list[int]:
        return [p.seq for p in self.pieces if p.ends]


def _plan(cu_seqlens: Optional, length: int, k: int) -> tuple[list[int], list[_Chunk]]:
    """The sequences' offsets: cu_seqlens's values (checked again here: a compiled
    graph skips the public function's check), or the one sequence [0, L); and the
    chunks of K steps of L, each cut at the sequence boundaries inside it."""
    cu = [0, length] if cu_seqlens is None else [int(v) for v in cu_seqlens.tolist()]
    if not cu or cu[0] != 0 or cu[-1] != length or any(b < a for a, b in pairwise(cu)):
        raise ValueError(
            f"{_FN}: expected cu_seqlens to be non-decreasing offsets from 0 to L = {length}, "
            f"but got {cu}"
        )
    seqs = [(s, lo, hi) for s, (lo, hi) in enumerate(pairwise(cu)) if hi > lo]
    chunks, first = [], 0
    for start in range(0, length, k):
        stop = min(start + k, length)
        while seqs[first][2] <= start:
            first += 1
        pieces, i = [], first
        while i < len(seqs) and seqs[i][1] < stop:
            s, lo, hi = seqs[i]
            pieces.append(
                _Piece(max(lo, start) - start, min(hi, stop) - start, s, lo > start, hi <= stop)
            )
            i += 1
        entry = seqs[first][0] if seqs[first][1] == start else None
        chunks.append(_Chunk(start, stop, entry, tuple(pieces)))
    return cu, chunks


# --- one piece of a sequence: the loop, and the dual form -----------------------------


def per_head(m: Tensor, heads: int) -> Tensor:
    """(batch, ..., groups, N) -> (batch, ..., heads, N): head h reads group
    h // (heads // groups)."""
    return m.repeat_interleave(heads // m.shape[-2], dim=-2)


def _floor(t: Tensor) -> float:
    """The log decay below which exp(.) is clamped: exp of it is still a normal number
    of the dtype (below it the result is subnormal or zero, and the vectorized exp
    takes a slow path, about 25 times slower on CPU). The clamp turns a weight below
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
    backward), from every batch element under vmap."""
    growth = float(_values(dt * A).clamp(min=0).amax()) if dt.numel() else 0.0
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
    cb = (c_g @ b_g.transpose(-1, -2)) * (i[:, None] >= i).to(x.dtype)
    y = (decay.view(m, groups, r, size, size) * cb[:, :, None]) @ x_dt  # (m, G, r, size, P)
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


# --- a chunk, and the two drivers -----------------------------------------------------


def _chunk_forward(
    piece: Piece, pieces: tuple[_Piece, ...], x: Tensor, dt: Tensor, A: Tensor, B: Tensor,
    C: Tensor, D: Optional, z: Optional, h0: Tensor, fresh: Optional,
) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:  # fmt: skip
    """One chunk's (out, last state, final states of the sequences ending in it), in
    differentiable torch ops: the first piece starts from ``h0``, each later one from
    its row of ``fresh`` (the initial states of the sequences starting inside the
    chunk, in order; zeros when None)."""
    ys, ends, h, k = [], [], h0, 0
    for p in pieces:
        if p.fresh:
            h = torch.zeros_like(h0) if fresh is None else fresh[k : k + 1]
            k += 1
        s = slice(p.lo, p.hi)
        y, h = piece(x[:, s], dt[:, s], A, B[:, s], C[:, s], h)
        ys.append(y)
        if p.ends:
            ends.append(h)
    out = ys[0] if len(ys) == 1 else torch.cat(ys, 1)
    if D is not None:
        out = out + D * x
    if z is not None:
        out = out * F.silu(z)
    return out, h, tuple(ends)


def _rows(s: int, packed: bool) -> slice:
    """The rows of a state tensor holding sequence ``s``'s: its own row when packed,
    every batch row (one sequence each) when not."""
    return slice(s, s + 1) if packed else slice(None)


Forward = tuple[Tensor, Tensor, Tensor]


def _forward(
    piece: Piece, k: int, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
    D: Optional, z: Optional, initial: Optional, cu_seqlens: Optional,
) -> Forward:  # fmt: skip
    batch, length, heads, headdim = x.shape
    n = B.shape[-1]
    packed = cu_seqlens is not None
    bounds, plan = _plan(cu_seqlens, length, k)

    def start_state(s: int) -> Tensor:
        if initial is None:
            return x.new_zeros(batch, heads, headdim, n)
        return initial[_rows(s, packed)]

    # no in-place writes (lists, then one cat) and no torch.no_grad: the forward mode
    # of the scans runs this under torch.func.jvp and jacfwd (ssd/autograd.py), where
    # tangents are batched, and under reverse mode (jacrev of jacfwd); inside the op
    # autograd does not record anyway
    outs, entering = [], []
    finals: list[Tensor | None] = [None] * (len(bounds) - 1)
    h = x.new_zeros(batch, heads, headdim, n)
    for chunk in plan:
        h0 = h if chunk.entry is None else start_state(chunk.entry)
        entering.append(h0)
        fresh = None if initial is None or not chunk.fresh else initial[chunk.fresh]
        s = slice(chunk.start, chunk.stop)
        y, h, ends = _chunk_forward(
            piece, chunk.pieces, x[:, s], dt[:, s], A, B[:, s], C[:, s], D,
            None if z is None else z[:, s], h0, fresh,
        )  # fmt: skip
        outs.append(y)
        for seq, state in zip(chunk.ending, ends, strict=True):
            finals[seq] = state
    out = torch.cat(outs, 1) if outs else x.new_zeros(x.shape)
    checkpoints = torch.stack(entering, 1) if entering else x.new_zeros(batch, 0, heads, headdim, n)
    states = [start_state(s) if f is None else f for s, f in enumerate(finals)]
    final = torch.cat(states) if states else x.new_zeros(0, heads, headdim, n)
    return out, final, checkpoints


def _backward(
    piece: Piece, k: int, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
    D: Optional, z: Optional, initial: Optional, cu_seqlens: Optional, checkpoints: Tensor,
    grad_out: Tensor, grad_final: Tensor,
) -> tuple[Tensor, ...]:  # fmt: skip
    batch, length, heads, headdim = x.shape
    packed = cu_seqlens is not None
    bounds, plan = _plan(cu_seqlens, length, k)
    grad_x, grad_dt = torch.zeros_like(x), torch.zeros_like(dt)
    grad_b, grad_c = torch.zeros_like(B), torch.zeros_like(C)
    grad_z = EMPTY(x) if z is None else torch.zeros_like(z)
    grad_a = torch.zeros_like(A)
    grad_d = EMPTY(x) if D is None else torch.zeros_like(D)
    grad_initial = EMPTY(x) if initial is None else torch.zeros_like(initial)
    zero_state = x.new_zeros(batch, heads, headdim, B.shape[-1])
    carry = zero_state  # the gradient of the state leaving the chunk into the next
    for c in reversed(range(len(plan))):
        chunk = plan[c]
        s = slice(chunk.start, chunk.stop)
        primals = {"x": x[:, s], "dt": dt[:, s], "A": A, "B": B[:, s], "C": C[:, s],
                   "h0": checkpoints[:, c]}  # fmt: skip
        if D is not None:
            primals["D"] = D
        if z is not None:
            primals["z"] = z[:, s]
        if initial is not None and chunk.fresh:
            primals["fresh"] = initial[chunk.fresh]

        def run(p: dict[str, Tensor], pieces: tuple[_Piece, ...] = chunk.pieces) -> object:
            return _chunk_forward(
                piece, pieces, p["x"], p["dt"], p["A"], p["B"], p["C"], p.get("D"),
                p.get("z"), p["h0"], p.get("fresh"),
            )  # fmt: skip

        ends = tuple(grad_final[_rows(seq, packed)] for seq in chunk.ending)
        (found,) = torch.func.vjp(run, primals)[1]((grad_out[:, s], carry, ends))
        grad_x[:, s], grad_dt[:, s] = found["x"], found["dt"]
        grad_b[:, s], grad_c[:, s] = found["B"], found["C"]
        grad_a += found["A"]
        if D is not None:
            grad_d += found["D"]
        if z is not None:
            grad_z[:, s] = found["z"]
        if "fresh" in found:
            grad_initial[chunk.fresh] = found["fresh"]
        if chunk.entry is None:
            carry = found["h0"]
        else:  # step ``start`` starts a sequence: h0 was its initial state
            if initial is not None:
                grad_initial[_rows(chunk.entry, packed)] = found["h0"]
            carry = zero_state
    if initial is not None:  # an empty sequence's final state is its initial state
        for seq, (lo, hi) in enumerate(pairwise(bounds)):
            if lo == hi:
                grad_initial[_rows(seq, packed)] = grad_final[_rows(seq, packed)]
    return grad_x, grad_dt, grad_a, grad_b, grad_c, grad_d, grad_z, grad_initial


def bind(
    piece_for: Callable[[Tensor, Tensor], Piece], backend: str
) -> tuple[Callable[..., Forward], Callable[..., tuple[Tensor, ...]]]:
    """The backend's forward and backward, with the piece ``piece_for(dt, A)`` picks
    for the call's steps."""
    k = CHECKPOINT_STEPS[backend]

    @drops_final
    def forward(x: Tensor, dt: Tensor, A: Tensor, *args: Optional) -> Forward:
        return _forward(piece_for(dt, A), k, x, dt, A, *args)  # type: ignore[arg-type]

    @zero_rows_as_zeros
    def backward(x: Tensor, dt: Tensor, A: Tensor, *args: Optional) -> tuple[Tensor, ...]:
        return _backward(piece_for(dt, A), k, x, dt, A, *args)  # type: ignore[arg-type]

    return forward, backward


def _dual_for(dt: Tensor, A: Tensor) -> Piece:
    block = dual_form_steps(dt, A, BLOCK)
    return _dual_piece if block == BLOCK else partial(_dual_piece, block=block)


forward_torch, backward_torch = bind(_dual_for, "torch")
