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

__all__ = [
    "EMPTY",
    "Piece",
    "backward",
    "bind_heads",
    "drops_final",
    "forward",
    "head_state_op",
    "states",
    "zero_rows_as_zeros",
]

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


# --- the scans with a (K, V) state per value head -------------------------------------

# Operands read per query/key head (batch, L, Hk, ...): each serves Hv / Hk value heads.
_KEYED = ("q", "k", "a", "b")
HeadPiece = Callable[..., tuple[Tensor, Tensor]]


def bind_heads(
    name: str, inner: HeadPiece, steps: int, operands: _core.Operands
) -> tuple[Callable[..., tuple[Tensor, Tensor, Tensor]], Callable[..., tuple[Tensor, ...]]]:
    """A backend's forward and backward, on the driver above, for a family with a
    (K, V) state per value head (the delta rule, linear attention, DPLR): ``operands``
    are the family's (``v``, the keyed ones, time-major ones, then ``initial`` and
    ``cu_seqlens``), and ``inner(*timed, h)`` computes the steps of a piece from the
    state ``h`` (batch, Hv, K, V), ``timed`` the operands but initial and cu_seqlens in
    their order, q and k (a and b) already repeated to the value heads. The forward
    takes the operands and ``want_final``, the backward a ``grad_final`` with no rows
    for zeros (``drops_final``, ``zero_rows_as_zeros``)."""
    names = operands.names
    timed_names = [n for n in names if n not in ("initial", "cu_seqlens")]
    order = ["v", *(n for n in timed_names if n != "v")]  # v first: the output's shape
    keyed = [i for i, n in enumerate(timed_names) if n in _KEYED]

    def piece(timed: Operands, fixed: Operands, h: Tensor) -> tuple[Tensor, Tensor]:
        by_name = dict(zip(order, timed, strict=True))
        args = [by_name[n] for n in timed_names]
        v, q = by_name["v"], by_name["q"]
        assert v is not None and q is not None
        r = v.shape[2] // q.shape[2]
        if r > 1:
            for i in keyed:
                t = args[i]
                args[i] = None if t is None else t.repeat_interleave(r, 2)
        return inner(*args, h)

    def zero(k: Tensor, v: Tensor) -> Tensor:
        # torch.zeros, not v.new_zeros: under torch.compile, in a jvp of a jvp (the
        # scan's forward mode run by a compiled vmap of jvp), FakeTensor makes new_zeros
        # of a wrapped tensor a meta tensor (torch 2.13), which no later op takes
        return torch.zeros(
            v.shape[0], v.shape[2], k.shape[-1], v.shape[-1], dtype=v.dtype, device=v.device
        )

    def run_forward(*args: Opt) -> tuple[Tensor, Tensor, Tensor]:
        ops = dict(zip(names, args, strict=True))
        k, v = ops["k"], ops["v"]
        assert k is not None and v is not None
        timed = tuple(ops[n] for n in order)
        return forward(name, piece, steps, timed, (), ops["initial"], ops["cu_seqlens"], zero(k, v))

    def run_backward(*args: Opt) -> tuple[Tensor, ...]:
        *given, checkpoints, grad_out, grad_final = args
        assert checkpoints is not None and grad_out is not None and grad_final is not None
        ops = dict(zip(names, given, strict=True))
        k, v = ops["k"], ops["v"]
        assert k is not None and v is not None
        grads, _, grad_initial = backward(
            name, piece, steps, tuple(ops[n] for n in order), (), ops["initial"],
            ops["cu_seqlens"], checkpoints, grad_out, grad_final, zero(k, v),
        )  # fmt: skip
        found = {**dict(zip(order, grads, strict=True)), "initial": grad_initial}
        # a new empty tensor per absent operand: a custom op's returns may not alias
        # one another (one shared placeholder for g's and initial's made the delta
        # rule's backward fail whenever both were absent)
        return tuple(
            EMPTY(v) if found[n] is None else found[n]  # type: ignore[misc]
            for n in names
            if n != "cu_seqlens"
        )

    return drops_final(run_forward, operands), zero_rows_as_zeros(run_backward, operands)


def head_state_op(
    op: str, operands: _core.Operands, n_chunks: Callable[[int, str], int],
    backends: dict[str, tuple[Callable[..., Any], Callable[..., Any]]],
    missing: dict[str, str],
) -> tuple[Any, Callable[..., tuple[Tensor, Tensor]]]:  # fmt: skip
    """The backend-table row and the differentiable op of a (K, V)-state family
    (``bind_heads``): ``op`` its public name (``"parascan.delta_rule_scan"``),
    ``backends`` name -> (forward, backward) in "auto"'s order, ``missing`` name -> why
    it has none. Returns (ROW, apply): ``apply(*operands, want_final, backend) -> (out,
    final)``, ``final`` with no rows without ``want_final``. The state, and so every
    backend's dtypes, is float32 or float64."""
    dtypes = (torch.float32, torch.float64)
    row = _core.register(
        _core.OpBackends(
            op=op,
            backends={n: _core.Backend(f, b, dtypes) for n, (f, b) in backends.items()},
            missing=missing,
        )
    )
    names = operands.names
    at_k, at_v, at_cu = names.index("k"), names.index("v"), names.index("cu_seqlens")

    def shapes(*args: Any) -> tuple[Tensor, Tensor, Tensor]:
        k, v, cu_seqlens = args[at_k], args[at_v], args[at_cu]
        want_final, backend = args[len(names) :]
        batch, length, heads, dv = v.shape
        dk = k.shape[-1]
        return (
            v.new_empty(batch, length, heads, dv),
            v.new_empty(states(v, cu_seqlens) if want_final else 0, heads, dk, dv),
            v.new_empty(batch, n_chunks(length, backend), heads, dk, dv),
        )

    def zero_final(tensors: list[Tensor], consts: tuple[object, ...]) -> Tensor:
        k, v = tensors[at_k], tensors[at_v]
        return v.new_empty(0, v.shape[2], k.shape[-1], v.shape[-1])  # no rows: zeros

    apply = _core.checkpointed_scan(
        _core.CheckpointedScan(
            row=row,
            name=op.removeprefix("parascan."),
            operands=operands,
            consts="bool want_final",
            forward_shapes=shapes,
            zero_final=zero_final,
            backward_consts=False,  # a grad_final with no rows stands for zeros
            out_like=at_v,
        )
    )
    return row, apply
