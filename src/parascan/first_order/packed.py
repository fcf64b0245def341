"""Packed variable-length sequences for the first-order scans (``cu_seqlens=``).

The steps along ``dim`` are ``num_seqs`` sequences, sequence s holding the steps
``cu_seqlens[s] .. cu_seqlens[s + 1] - 1``, each scanned as if alone: from its own
initial state, ``reverse`` within it, its own final state. Semantics, as a loop::

    for s in range(num_seqs):
        lo, hi = cu_seqlens[s], cu_seqlens[s + 1]
        out[lo:hi], final[s] = scan(gates[lo:hi], tokens[lo:hi], initial=initial[s],
                                    return_final=True)

Layout. Inside, a per-sequence state has the shape of the result with ``dim`` of size
num_seqs (sequence s at index s), so that vmap's new leading dims and negative dims
need no special case. The public functions take and return the states with a leading
num_seqs dim in place of the batch (``to_internal``/``to_public``): a result of shape
(1, T, D) along dim 1 has states (num_seqs, D); along dim 0, (T, D) has (num_seqs, D).

Backends. ``cpu``: the C kernels' packed entries (cpu_packed.h), every input read
once, each channel block walking every sequence in one parallel region. ``triton``:
the Triton kernels in their usual launches, restarting the state where a sequence
starts inside their tiles and chunks (triton.py, ``cu_seqlens``). ``torch`` and ``loop``:
the backend's own scan on each sequence in turn (a view of its steps), the results
written into one output.
"""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import torch
from torch import Tensor

from parascan._core import (
    accumulate_dtype,
    as_operand,
    check_cu_seqlens,
    check_dtype,
    check_offsets,
    describe,
    resolved,
    resolved_optional,
)
from parascan.first_order import api, autograd, cpu, triton
from parascan.first_order.ops import (
    ROWS,
    backward_from_partials,
    backward_op,
    backward_tokens,
    define_ops,
    empty_gradients,
)
from parascan.first_order.semiring import SEMIRINGS, Semiring

__all__ = [
    "packed_initial",
    "scan",
    "to_internal",
    "to_public",
]


def to_internal(state: Tensor, dim: int) -> Tensor:
    """A public per-sequence state (num_seqs leading, in place of the batch) in the
    internal layout (the result's shape with ``dim``, non-negative, of size num_seqs)."""
    return state if dim == 0 else state.unsqueeze(0).movedim(1, dim)


def to_public(state: Tensor, dim: int) -> Tensor:
    """The inverse of ``to_internal``."""
    return state if dim == 0 else state.movedim(dim, 1).select(0, 0)


# ---- the raw ops and their backends ------------------------------------------------


def _segments(cu_seqlens: Tensor, op: str, steps: int) -> list[tuple[int, int]]:
    cu = cu_seqlens.tolist()
    check_offsets(op, cu, steps)
    return list(pairwise(cu))


def _piece(t: Tensor, dim: int, lo: int, hi: int) -> Tensor:
    return t.narrow(dim, lo, hi - lo)


def _by_segments_forward(
    ring: Semiring, backend: str, gates: Tensor, tokens: Tensor, initial: Tensor | None,
    cu_seqlens: Tensor, dim: int, reverse: bool,
) -> Tensor:  # fmt: skip
    """Any backend: its scan on each sequence's view, written into one output."""
    out = torch.empty(tokens.shape, dtype=tokens.dtype, device=tokens.device)
    scan = ROWS[ring.name].backends[backend].forward
    for s, (lo, hi) in enumerate(_segments(cu_seqlens, ring.op, tokens.shape[dim])):
        if hi > lo:
            h = None if initial is None else initial.select(dim, s)
            part = scan(ring, _piece(gates, dim, lo, hi), _piece(tokens, dim, lo, hi), h, dim,
                        reverse)  # fmt: skip
            _piece(out, dim, lo, hi).copy_(part)
    return out


def _by_segments_backward(
    ring: Semiring, backend: str, gates: Tensor, tokens: Tensor | None, out: Tensor,
    grad_out: Tensor, initial: Tensor | None, cu_seqlens: Tensor, dim: int, reverse: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Any backend: its backward op on each sequence's view."""
    grad_gates = torch.zeros_like(out)
    grad_tokens = torch.zeros_like(out)
    nseq = cu_seqlens.numel() - 1
    seq_shape = (*out.shape[:dim], nseq, *out.shape[dim + 1 :])
    grad_initial = out.new_zeros(seq_shape)
    for s, (lo, hi) in enumerate(_segments(cu_seqlens, ring.op, out.shape[dim])):
        if hi == lo:
            continue
        h = None if initial is None else initial.select(dim, s)
        ga, gb, gh = backward_op(ring)(
            _piece(gates, dim, lo, hi), None if tokens is None else _piece(tokens, dim, lo, hi),
            _piece(out, dim, lo, hi), _piece(grad_out, dim, lo, hi), h, dim, reverse, backend,
        )  # fmt: skip
        _piece(grad_gates, dim, lo, hi).copy_(ga)
        _piece(grad_tokens, dim, lo, hi).copy_(gb)
        if initial is not None:
            grad_initial.select(dim, s).copy_(gh)
    return grad_gates, grad_tokens, grad_initial


def _cpu_offsets(op: str, cu_seqlens: Tensor, steps: int) -> Tensor:
    """``cu_seqlens`` checked, as the C kernels take it: int64, on the CPU."""
    cu = cu_seqlens.to(device="cpu", dtype=torch.int64).contiguous()
    check_offsets(op, cu.tolist(), steps)
    return cu


def _define(ring: Semiring) -> tuple[Any, Any]:
    """``parascan::<op>_varlen`` and its backward, with fake kernels and vmap rules.
    The tensors come first, then ``dim`` (the layout batch_first_vmap
    batches); ``cu_seqlens`` is never batched."""
    name = ring.op.removeprefix("parascan.") + "_varlen"  # the op parascan::<name>

    def forward(
        gates: Tensor, tokens: Tensor, initial: Tensor | None, dim: int, cu_seqlens: Tensor,
        reverse: bool, backend: str,
    ) -> Tensor:  # fmt: skip
        gates, tokens, initial = resolved(gates), resolved(tokens), resolved_optional(initial)
        dim %= tokens.dim()
        steps = tokens.shape[dim]
        if backend == "cpu":
            cu = _cpu_offsets(ring.op, cu_seqlens, steps)
            return cpu.forward(ring, gates, tokens, initial, dim, reverse, cu_seqlens=cu)
        if backend == "triton":
            check_offsets(ring.op, cu_seqlens.tolist(), steps)
            return triton.forward(ring, gates, tokens, initial, dim, reverse, cu_seqlens)
        return _by_segments_forward(ring, backend, gates, tokens, initial, cu_seqlens, dim,
                                    reverse)  # fmt: skip

    def forward_fake(gates: Tensor, tokens: Tensor, *_: object) -> Tensor:
        torch._check(gates.shape == tokens.shape, lambda: f"parascan::{name}: shape mismatch")
        return torch.empty(tokens.shape, dtype=tokens.dtype, device=tokens.device)

    def backward(
        gates: Tensor, tokens: Tensor | None, out: Tensor, grad_out: Tensor,
        initial: Tensor | None, dim: int, cu_seqlens: Tensor, reverse: bool, backend: str,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        gates, out, grad_out = resolved(gates), resolved(out), resolved(grad_out)
        tokens, initial = backward_tokens(ring, tokens), resolved_optional(initial)
        dim %= out.dim()
        steps = out.shape[dim]
        if backend == "cpu":
            cu = _cpu_offsets(ring.op, cu_seqlens, steps)
            return cpu.backward(
                ring, gates, tokens, out, grad_out, initial, dim, reverse, cu_seqlens=cu
            )
        if backend == "triton":
            check_offsets(ring.op, cu_seqlens.tolist(), steps)
            return triton.backward(
                ring, gates, tokens, out, grad_out, initial, dim, reverse, cu_seqlens
            )
        return _by_segments_backward(ring, backend, gates, tokens, out, grad_out, initial,
                                     cu_seqlens, dim, reverse)  # fmt: skip

    def backward_fake(
        gates: Tensor, tokens: Tensor | None, out: Tensor, grad_out: Tensor,
        initial: Tensor | None, dim: int, cu_seqlens: Tensor, *_: object,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        d = dim % out.dim()
        return empty_gradients(out, (*out.shape[:d], cu_seqlens.shape[0] - 1, *out.shape[d + 1 :]))

    return define_ops(
        name, "Tensor cu_seqlens, bool reverse", forward, forward_fake, backward, backward_fake
    )


_OPS = {name: _define(ring) for name, ring in SEMIRINGS.items()}


# ---- autograd ---------------------------------------------------------------------


def ops(ring: str) -> tuple[Any, Any]:
    """``parascan::<op>_varlen`` and its backward, of the semiring named ``ring``."""
    return _OPS[ring]


def differentiable_backward(
    ring: Semiring, backend: str, gates: Tensor, tokens: Tensor | None, out: Tensor,
    grad_out: Tensor, initial: Tensor | None, cu_seqlens: Tensor, dim: int, reverse: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The gradients of every sequence (ops.backward_from_partials on its steps, the
    chain a linear scan through the differentiable public path), side by side."""
    linear = autograd.linear_scan_fn(backend)
    acc = accumulate_dtype(out.dtype)
    nseq = cu_seqlens.numel() - 1
    ga, gb, gh = [], [], []
    for s, (lo, hi) in enumerate(_segments(cu_seqlens, ring.op, out.shape[dim])):

        def part(t: Tensor, lo: int = lo, hi: int = hi) -> Tensor:
            return _piece(t, dim, lo, hi).to(acc)

        h = None if initial is None else initial.select(dim, s).to(acc)
        partials = ring.partials(part(gates), None if tokens is None else part(tokens), part(out),
                                 h, dim, reverse)  # fmt: skip
        a, b, i = backward_from_partials(linear, partials, part(grad_out), dim, reverse)
        ga.append(a)
        gb.append(b)
        gh.append(i)
    if nseq == 0:
        zeros = torch.zeros_like(out)
        return zeros, zeros.clone(), out.new_zeros((*out.shape[:dim], 0, *out.shape[dim + 1 :]))
    return (
        torch.cat(ga, dim).to(out.dtype),
        torch.cat(gb, dim).to(out.dtype),
        torch.stack(gh, dim).to(out.dtype),
    )


# ---- the public path ----------------------------------------------------------------


def scan(
    ring: Semiring, p: api.Prepared, initial: object, reverse: bool, return_final: bool,
    cu_seqlens: object,
) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
    """The public scan of ``ring`` over packed sequences, from its operands as
    ``api.prepare`` validated them (``initial`` aside): the packed checks, then the op."""
    name = ring.op
    d = p.dim % p.tokens.dim()
    cu = check_cu_seqlens(name, cu_seqlens, p.tokens.shape[d], p.tokens.device)
    h = packed_initial(name, initial, p.tokens, d, cu.numel() - 1)
    out = autograd.apply(ring.name, p.gates, p.tokens, h, d, reverse, p.backend, cu)
    result = out.reshape(()) if p.scalar else out
    if not return_final:
        return result
    return result, to_public(_finals(ring, out, h, cu, d, reverse), d)


def packed_initial(name: str, initial: object, like: Tensor, dim: int, nseq: int) -> Tensor | None:
    """For ``nseq`` packed sequences along ``dim`` (non-negative) of a result like
    ``like``: its layout checked (a batch of one, or ``dim`` 0), and ``initial``
    (None stays None) validated: broadcast to the public per-sequence shape (num_seqs
    leading, in place of the batch), converted to ``like``'s dtype, returned in the
    internal layout (to_internal)."""
    shape = tuple(like.shape)
    if dim != 0 and shape[0] != 1:
        raise ValueError(
            f"{name}: with cu_seqlens the sequences are packed along dim {dim} of a batch of one: "
            f"expected the leading dim to be 1 (or dim to be 0), but got shape {shape}"
        )
    public_shape = (nseq, *shape[1:dim], *shape[dim + 1 :])
    if initial is None:
        return None
    h = as_operand(name, "initial", initial, allow_number=True, like=like)
    check_dtype(name, "initial", h)
    if h.device != like.device:
        raise ValueError(f"{name}: expected initial on {like.device}, but got it on {h.device}")
    if h.is_complex() and not like.is_complex():
        raise TypeError(
            f"{name}: expected a real initial for a real result ({like.dtype}), but got {h.dtype}"
        )
    try:
        h = h.to(like.dtype).expand(public_shape)
    except RuntimeError:
        raise ValueError(
            f"{name}: expected initial broadcastable to (num_seqs, state...) = "
            f"{public_shape} with cu_seqlens, but got {describe(initial)}"
        ) from None
    return to_internal(h, dim)


def _finals(
    ring: Semiring, out: Tensor, initial: Tensor | None, cu_seqlens: Tensor, dim: int,
    reverse: bool,
) -> Tensor:  # fmt: skip
    """Each sequence's last state in the internal layout, with tensor ops (traceable
    by torch.compile, differentiable): out at its last step in the scan's order, its
    initial state (or the empty state) when it is empty."""
    nseq = cu_seqlens.numel() - 1
    shape = (*out.shape[:dim], nseq, *out.shape[dim + 1 :])
    empty = out.new_full(shape, ring.zero) if initial is None else initial
    if out.shape[dim] == 0 or nseq == 0:
        return empty.clone()
    cu = cu_seqlens.to(device=out.device, dtype=torch.int64)
    starts, ends = cu[:-1], cu[1:]
    last = starts if reverse else ends - 1
    nonempty = ends > starts
    picked = out.index_select(dim, torch.where(nonempty, last, torch.zeros_like(last)))
    view = [1] * out.dim()
    view[dim] = nseq
    return torch.where(nonempty.view(view), picked, empty)
