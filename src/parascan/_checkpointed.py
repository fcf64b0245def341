"""The checkpointed driver of the ``loop`` and ``torch`` backends of the scans with a
state per head (ssd_scan, delta_rule_scan): the backend's forward and backward from
one function that computes a piece of a sequence.

The driver walks L one checkpoint interval (a "chunk" of K steps) at a time, holding
the state entering each chunk and never a state per step over all of L. A family
gives it its operands in two kinds: ``timed`` ones, (batch, L, ...) with time at dim
1, cut with the chunks (None for an absent one; the first has the output's shape),
and ``fixed`` ones, passed whole to every piece; and a ``piece(timed, fixed, h) ->
(out, h)``: the output of a few consecutive steps of one sequence and the state after
them, from the state ``h`` before them, in differentiable torch ops.

Packed sequences: each chunk is cut into pieces at the sequence boundaries inside
it; a piece that starts a sequence starts from that sequence's initial state, and
the state at the end of a piece that ends a sequence is that sequence's final
state. The chunks stay aligned to L, so the checkpoints' shape follows from the
operands' shapes (the fake kernels need that).

The backward is exact activation checkpointing: for each chunk from the last, the
chunk's forward runs again from its checkpoint under ``torch.func.vjp`` (inside a
custom op the autograd keys are excluded, and functorch brings its own), carrying
the output's, the final states' and the carried state's gradients back to the
chunk's operands and to the state entering it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch
from torch import Tensor

from parascan import _core
from parascan._core import short_repr

__all__ = ["EMPTY", "Piece", "backward", "drops_final", "forward", "states", "zero_rows_as_zeros"]

Opt = Tensor | None
Operands = tuple[Opt, ...]
Piece = Callable[[Operands, Operands, Tensor], tuple[Tensor, Tensor]]


def EMPTY(like: Tensor) -> Tensor:
    """The placeholder gradient of an absent operand."""
    return like.new_empty(0)


def states(first: Tensor, cu_seqlens: Opt) -> int:
    """The number of final states: the batch, or the packed sequences."""
    return first.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


def drops_final(forward: Callable[..., Any], operands: _core.Operands) -> Callable[..., Any]:
    """A backend's ``forward`` of the family's ``operands`` that also takes
    ``want_final`` (after them, True when not given): without it the final state it
    computed is dropped (no rows)."""
    count = operands.count

    @functools.wraps(forward)
    def wrapped(*args: Any, want_final: bool = True, **kwargs: Any) -> Any:
        if len(args) == count + 1:
            *args, want_final = args  # type: ignore[assignment]
        out, final, checkpoints = forward(*args, **kwargs)
        return out, final if want_final else final.new_empty(0, *final.shape[1:]), checkpoints

    return wrapped


def zero_rows_as_zeros(
    backward: Callable[..., Any], operands: _core.Operands
) -> Callable[..., Any]:
    """A backend's ``backward`` that also takes a ``grad_final`` with no rows, for
    zeros (its last argument; the family's ``operands`` first, cu_seqlens among them)."""
    cu_at = operands.cu_at

    @functools.wraps(backward)
    def wrapped(*args: Any) -> Any:
        *head, grad_final = args
        count = states(args[0], args[cu_at])
        if grad_final.shape[0] != count:
            grad_final = grad_final.new_zeros(count, *grad_final.shape[1:])
        return backward(*head, grad_final)

    return wrapped


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


def _plan(name: str, cu_seqlens: Opt, length: int, k: int) -> tuple[list[int], list[_Chunk]]:
    """The sequences' offsets: cu_seqlens's values (checked again here: a compiled
    graph skips the public function's check), or the one sequence [0, L); and the
    chunks of K steps of L, each cut at the sequence boundaries inside it."""
    cu = [0, length] if cu_seqlens is None else [int(v) for v in cu_seqlens.tolist()]
    if not cu or cu[0] != 0 or cu[-1] != length or any(b < a for a, b in pairwise(cu)):
        raise ValueError(
            f"{name}: expected cu_seqlens to be non-decreasing offsets from 0 to L = {length}, "
            f"but got {short_repr(cu)}"
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


def _cut(timed: Sequence[Opt], s: slice) -> Operands:
    return tuple(None if t is None else t[:, s] for t in timed)


def _chunk_forward(
    piece: Piece, pieces: tuple[_Piece, ...], timed: Operands, fixed: Operands, h0: Tensor,
    fresh: Opt,
) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:  # fmt: skip
    """One chunk's (out, last state, final states of the sequences ending in it): the
    first piece starts from ``h0``, each later one from its row of ``fresh`` (the
    initial states of the sequences starting inside the chunk, in order; zeros when
    None)."""
    ys, ends, h, k = [], [], h0, 0
    for p in pieces:
        if p.fresh:
            h = torch.zeros_like(h0) if fresh is None else fresh[k : k + 1]
            k += 1
        y, h = piece(_cut(timed, slice(p.lo, p.hi)), fixed, h)
        ys.append(y)
        if p.ends:
            ends.append(h)
    return (ys[0] if len(ys) == 1 else torch.cat(ys, 1)), h, tuple(ends)


def _rows(s: int, packed: bool) -> slice:
    """The rows of a state tensor holding sequence ``s``'s: its own row when packed,
    every batch row (one sequence each) when not."""
    return slice(s, s + 1) if packed else slice(None)


def forward(
    name: str, piece: Piece, k: int, timed: Operands, fixed: Operands, initial: Opt,
    cu_seqlens: Opt, zero: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """(out, final, checkpoints): ``zero`` is a zero state of the batch, (batch, ...);
    checkpoints[:, c] is the state entering chunk c (a sequence's initial state where
    the chunk's first step starts one)."""
    first = timed[0]
    assert first is not None
    packed = cu_seqlens is not None
    bounds, plan = _plan(name, cu_seqlens, first.shape[1], k)

    def start_state(s: int) -> Tensor:
        return zero if initial is None else initial[_rows(s, packed)]

    # no in-place writes (lists, then one cat) and no torch.no_grad: the forward mode
    # of the scans runs this under torch.func.jvp and jacfwd, where tangents are
    # batched, and under reverse mode (jacrev of jacfwd); inside the op autograd does
    # not record anyway
    outs, entering = [], []
    finals: list[Tensor | None] = [None] * (len(bounds) - 1)
    h = zero
    for chunk in plan:
        h0 = h if chunk.entry is None else start_state(chunk.entry)
        entering.append(h0)
        fresh = None if initial is None or not chunk.fresh else initial[chunk.fresh]
        y, h, ends = _chunk_forward(
            piece, chunk.pieces, _cut(timed, slice(chunk.start, chunk.stop)), fixed, h0, fresh
        )
        outs.append(y)
        for seq, state in zip(chunk.ending, ends, strict=True):
            finals[seq] = state
    out = torch.cat(outs, 1) if outs else first.new_zeros(first.shape)
    rest = zero.shape[1:]
    checkpoints = torch.stack(entering, 1) if entering else zero.new_zeros(zero.shape[0], 0, *rest)
    finished = [start_state(s) if f is None else f for s, f in enumerate(finals)]
    final = torch.cat(finished) if finished else zero.new_zeros(0, *rest)
    return out, final, checkpoints


def backward(
    name: str, piece: Piece, k: int, timed: Operands, fixed: Operands, initial: Opt,
    cu_seqlens: Opt, checkpoints: Tensor, grad_out: Tensor, grad_final: Tensor, zero: Tensor,
) -> tuple[Operands, Operands, Opt]:  # fmt: skip
    """The gradients of the timed operands, of the fixed ones (summed over the
    chunks) and of ``initial``, None for an absent one."""
    first = timed[0]
    assert first is not None
    packed = cu_seqlens is not None
    bounds, plan = _plan(name, cu_seqlens, first.shape[1], k)
    grad_timed = [None if t is None else torch.zeros_like(t) for t in timed]
    grad_fixed = [None if f is None else torch.zeros_like(f) for f in fixed]
    grad_initial = None if initial is None else torch.zeros_like(initial)
    carry = zero  # the gradient of the state leaving the chunk into the next
    for c in reversed(range(len(plan))):
        chunk = plan[c]
        s = slice(chunk.start, chunk.stop)
        primals = {f"t{i}": t[:, s] for i, t in enumerate(timed) if t is not None}
        primals.update({f"f{i}": f for i, f in enumerate(fixed) if f is not None})
        primals["h0"] = checkpoints[:, c]
        if initial is not None and chunk.fresh:
            primals["fresh"] = initial[chunk.fresh]

        def run(p: dict[str, Tensor], pieces: tuple[_Piece, ...] = chunk.pieces) -> object:
            return _chunk_forward(
                piece, pieces, tuple(p.get(f"t{i}") for i in range(len(timed))),
                tuple(p.get(f"f{i}") for i in range(len(fixed))), p["h0"], p.get("fresh"),
            )  # fmt: skip

        ends = tuple(grad_final[_rows(seq, packed)] for seq in chunk.ending)
        (found,) = torch.func.vjp(run, primals)[1]((grad_out[:, s], carry, ends))
        for i, g in enumerate(grad_timed):
            if g is not None:
                g[:, s] = found[f"t{i}"]
        for i, g in enumerate(grad_fixed):
            if g is not None:
                g += found[f"f{i}"]
        if grad_initial is not None and "fresh" in found:
            grad_initial[chunk.fresh] = found["fresh"]
        if chunk.entry is None:
            carry = found["h0"]
        else:  # step ``start`` starts a sequence: h0 was its initial state
            if grad_initial is not None:
                grad_initial[_rows(chunk.entry, packed)] = found["h0"]
            carry = zero
    if grad_initial is not None:  # an empty sequence's final state is its initial state
        for seq, (lo, hi) in enumerate(pairwise(bounds)):
            if lo == hi:
                grad_initial[_rows(seq, packed)] = grad_final[_rows(seq, packed)]
    return tuple(grad_timed), tuple(grad_fixed), grad_initial
