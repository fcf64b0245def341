"""``parascan.distributed.linear_scan``: a linear scan whose time dim is sharded
across the ranks of a process group.

Summary of the algorithm (rank r of R, in scan order; ``reverse`` reverses it):

1. Local scan of the shard from state 0 (rank 0 from ``initial``): its final state
   F_r, and the product of its gates A_r. Together (A_r, F_r) is the affine map
   h -> A_r h + F_r that the shard applies to the state it receives.
2. One all-gather of the stacked (A_r, F_r): 2 x state elements per rank, whatever T.
3. The state entering rank r is the composition of the maps of ranks before it,
   applied to 0; the global final state composes all of them.
4. Fix-up: the shard scanned again from its entering state (a second local pass).

In step 2 the ranks also check that their calls agree in everything but the time
length (the op, shape, dtype, device type, dim, reverse, whether ``initial`` is given,
whether a backward runs): every rank's message of step 2 has one fixed size, an int64
header followed by (A_r, F_r) when they fit in _INLINE_BYTES, and every rank raises a
RuntimeError when the headers differ, or when a rank failed before it (its header says
so). A data all-gather of mismatched shards would otherwise abort inside the
collective or mix mismatched data.

The backward is the same in reverse. The total gradient reaching the first state
of rank r (lambda_r) obeys lambda_r = A_r^H lambda_{r+1} + mu_r, where mu_r is the
local backward's gradient of the entering state with nothing arriving from later
ranks; one all-gather of (mu_r, the final state's gradient) gives every rank its
lambda_{r+1}, which enters its local backward as a gradient of its last state.

With ``cu_seqlens`` (packed sequences with global offsets) the same scheme runs per
sequence boundary: packed.py.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal, overload

import torch
import torch.distributed as dist
from torch import Tensor

from parascan._core import FLOAT_DTYPES, Function, check_flag, conj
from parascan._higher_order import once_differentiable
from parascan.first_order import linear_scan as local_linear_scan
from parascan.first_order import log_linear_scan as local_log_linear_scan
from parascan.first_order.api import Prepared, prepare
from parascan.first_order.ops import backward_op
from parascan.first_order.packed import packed_initial, to_public
from parascan.first_order.semiring import LINEAR, LOG, SEMIRINGS, Semiring, log_weight

__all__ = ["linear_scan", "log_linear_scan"]


@dataclass(frozen=True)
class _Sharded:
    """A first-order scan sharded over ranks: its semiring (which composes the
    shards' maps h -> A (x) h (+) F, A the ``total`` of the shard's gates), its
    public name, and the local scan each rank runs."""

    ring: Semiring
    name: str
    scan: Callable[..., Any]

    def backward(
        self, gates: Tensor, tokens: Tensor, out: Tensor, grad: Tensor, start: Tensor | None,
        dim: int, reverse: bool, backend: str,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        """The local fused backward (one pass on CPU; not differentiable again:
        once_differentiable)."""
        return backward_op(self.ring)(  # type: ignore[no-any-return]
            gates, tokens, out, grad, start, dim, reverse, backend
        )

    def multiplier(
        self, total: Tensor, start: Tensor | None, out: Tensor, dim: int, reverse: bool
    ) -> Tensor:
        """d(last state)/d(entering state) across a non-empty shard: the product of
        the steps' derivatives in their previous state. Linear: the gates' product.
        Log: the product of exp(log a[t] + h[t-1] - h[t]) telescopes."""
        if self.ring is LINEAR:
            return total
        last = out.select(dim, 0 if reverse else out.shape[dim] - 1)
        entering = torch.full_like(last, self.ring.zero) if start is None else start
        return log_weight(total + entering, last)


_LINEAR = _Sharded(LINEAR, "parascan.distributed.linear_scan", local_linear_scan)
_LOG = _Sharded(LOG, "parascan.distributed.log_linear_scan", local_log_linear_scan)


def _all_gather_bytes(message: Tensor, group: Any) -> list[Tensor]:
    """Every rank's ``message`` (uint8, of one size on every rank), in rank order."""
    received = [torch.empty_like(message) for _ in range(dist.get_world_size(group))]
    dist.all_gather(received, message, group=group)
    return received


def _real_view(t: Tensor) -> Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


def _to_bytes(payload: Tensor) -> Tensor:
    """``payload``'s bytes, complex tensors as real pairs (not every backend reduces
    complex)."""
    return _real_view(payload).contiguous().view(-1).view(torch.uint8)


def _from_bytes(received: list[Tensor], at: int, like: Tensor) -> Tensor:
    """Every rank's tensor like ``like``, read from byte ``at`` of its message (see
    _to_bytes), stacked on ``like``'s device: (world, *like.shape)."""
    wire = _real_view(like)
    end = at + wire.numel() * wire.element_size()
    gathered = torch.stack([m[at:end].view(wire.dtype).view(wire.shape) for m in received])
    gathered = gathered.to(like.device)
    return torch.view_as_complex(gathered) if like.is_complex() else gathered


def _all_gather_stacked(parts: list[Tensor], group: Any) -> Tensor:
    """all_gather of ``parts`` (tensors of one shape) stacked: (world, len(parts), *shape)."""
    payload = torch.stack(parts)
    return _from_bytes(_all_gather_bytes(_to_bytes(payload), group), 0, payload)


_HEADER_DIMS = 16  # state dims spelled out in the header; more are folded into a hash
_HEADER_FIELDS = (
    "op", "dims", "dim", "reverse", "initial given", "backward", "dtype", "device",
    "cu_seqlens", "num_seqs", "return_final", "length",
)  # fmt: skip
_LENGTH = _HEADER_FIELDS.index("length")  # the one field the ranks need not agree on
_HEADER_BYTES = 8 * (len(_HEADER_FIELDS) + _HEADER_DIMS)  # int64 each
_OPS = {ring.code: ring.op.removeprefix("parascan.") for ring in SEMIRINGS.values()}
_DEVICE_TYPES = ("cpu", "cuda")
_REJECTED = -1  # the op field of a rank that failed before its exchange (its own error)
# The forward's first collective is one message of this fixed size on every rank,
# sent after the local scan: the header, then the shard's (A, F) when they fit in
# _INLINE_BYTES (the scan's only collective), else nothing (the states follow in a
# second all-gather). Every rank sends the same number of bytes whatever its data,
# so ranks that disagree, or one that failed, still meet, and all raise.
_INLINE_BYTES = 16384


def _header(
    sharded: _Sharded, p: Prepared, reverse: bool, cu: list[int] | None = None,
    return_final: bool = False, initial: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """What every rank must agree on, as int64 (see _HEADER_FIELDS): the op, the
    number of dims, the (non-negative) time dim, reverse, whether initial is given,
    whether a backward will run (it has collectives of its own), the dtype, the
    device type, with packed sequences (``cu``: cu_seqlens' values) a CRC of the
    offsets, their number and return_final (-1 each without), this rank's shard
    length (not compared), and the shape without the time dim."""
    shape = p.tokens.shape
    dim = p.dim % len(shape)
    state = [*shape[:dim], *shape[dim + 1 :]]
    if len(state) > _HEADER_DIMS:
        rest = ",".join(map(str, state[_HEADER_DIMS - 1 :])).encode()
        state = [*state[: _HEADER_DIMS - 1], zlib.crc32(rest)]
    device = p.tokens.device.type
    initial = p.initial if cu is None else initial
    operands = (p.gates, p.tokens, initial)
    backward = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in operands)
    packed = [-1, -1, -1]
    if cu is not None:
        packed = [zlib.crc32(",".join(map(str, cu)).encode()), len(cu) - 1, int(return_final)]
    values = [
        sharded.ring.code, len(shape), dim, int(reverse), int(initial is not None), int(backward),
        FLOAT_DTYPES.index(p.tokens.dtype),
        _DEVICE_TYPES.index(device) if device in _DEVICE_TYPES else zlib.crc32(device.encode()),
        *packed, shape[dim],
        *state, *[-1] * (_HEADER_DIMS - len(state)),
    ]  # fmt: skip
    return torch.tensor(values, dtype=torch.int64)


def _wire_device(group: Any) -> torch.device:
    """Where messages travel from: CUDA for NCCL, else CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _first_message(header: Tensor, payload: Tensor | None, group: Any) -> list[Tensor]:
    """All-gather every rank's fixed-size message (header, then ``payload`` or
    nothing); returns the messages, as bytes, in rank order."""
    device, head = _wire_device(group), header.numel() * 8
    message = torch.zeros(head + _INLINE_BYTES, dtype=torch.uint8, device=device)
    message[:head] = header.to(device).view(torch.uint8)
    if payload is not None:
        raw = _to_bytes(payload)
        message[head : head + raw.numel()] = raw.to(device)
    return _all_gather_bytes(message, group)


def _reject(group: Any) -> None:
    """This rank failed before its exchange: meet the others' first message with a
    header saying so (every rank then raises), and return to raise its own error."""
    _first_message(torch.full((_HEADER_BYTES // 8,), _REJECTED), None, group)


def _exchange(name: str, header: Tensor, parts: list[Tensor], group: Any) -> Tensor:
    """Every rank's ``parts`` stacked, (world, len(parts), *shape), once every rank's
    header agrees with ``header``; the same RuntimeError on every rank otherwise."""
    payload = torch.stack(parts)
    # the same on every rank once the headers agree
    inline = payload.numel() * payload.element_size() <= _INLINE_BYTES
    received = _first_message(header, payload if inline else None, group)
    _check_agreement(name, received, group)
    if not inline:
        return _all_gather_stacked(parts, group)
    return _from_bytes(received, _HEADER_BYTES, payload)


def _describe_header(row: list[int]) -> str:
    f = dict(zip(_HEADER_FIELDS, row, strict=False))
    state: list[int | str] = [x for x in row[len(_HEADER_FIELDS) :] if x >= 0]
    if f["dims"] - 1 > _HEADER_DIMS:  # more dims than the header spells out: a hash last
        state[-1] = f"(more dims, crc {state[-1]})"
    dtype = FLOAT_DTYPES[f["dtype"]] if 0 <= f["dtype"] < len(FLOAT_DTYPES) else "?"
    device = _DEVICE_TYPES[f["device"]] if 0 <= f["device"] < len(_DEVICE_TYPES) else "other"
    packed = "no cu_seqlens"
    if f["num_seqs"] >= 0:
        packed = (
            f"cu_seqlens of {f['num_seqs']} sequences (crc {f['cu_seqlens']}), "
            f"return_final={bool(f['return_final'])}"
        )
    return (
        f"{_OPS.get(f['op'], '?')} along dim {f['dim']} of {f['dims']}, shape without it "
        f"({', '.join(map(str, state))}), {dtype}, {device}, reverse={bool(f['reverse'])}, initial "
        f"{'given' if f['initial given'] else 'not given'}, "
        f"{'needs' if f['backward'] else 'no'} backward, {packed}"
    )


def _check_agreement(name: str, received: list[Tensor], group: Any) -> list[list[int]]:
    """The ranks' headers, read from their first messages; raise on every rank when
    they differ (every rank holds the same messages, so every rank reaches the same
    verdict)."""
    rows = [m[:_HEADER_BYTES].view(torch.int64).tolist() for m in received]
    agreed = [[x for i, x in enumerate(row) if i != _LENGTH] for row in rows]
    if all(row == agreed[0] for row in agreed[1:]) and rows[0][0] != _REJECTED:
        return rows
    ranks = dist.get_process_group_ranks(group) if group is not None else range(len(rows))
    rejected = [r for r, row in zip(ranks, rows, strict=True) if row[0] == _REJECTED]
    if rejected:
        raise RuntimeError(
            f"{name}: rank(s) {', '.join(map(str, rejected))} failed before the exchange "
            f"(their own error says why), so no rank can scan"
        )
    described = "; ".join(
        f"rank {r}: {_describe_header(row)}" for r, row in zip(ranks, rows, strict=True)
    )
    raise RuntimeError(
        f"{name}: expected every rank's shard to agree in all but the length of the time "
        f"dim (op, shape, dtype, device type, dim, reverse, whether initial is given, whether "
        f"a backward runs, cu_seqlens and return_final), but got {described}"
    )


def _order(group: Any, reverse: bool) -> tuple[int, int]:
    """(this rank's position in scan order, world size)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    return (world - 1 - rank if reverse else rank), world


def apply_map(ring: Semiring, total: Tensor, h: Tensor, leaving: Tensor) -> Tensor:
    """A shard's map h -> total (x) h (+) leaving, exactly ``leaving`` where h is the
    empty state: the scan never multiplies a zero state by the shard's gates, whose
    product may overflow (inf * 0 would make a NaN of an exact result)."""
    return torch.where(h == ring.zero, leaving, ring.step(total, h, leaving))


def carry_back(m: Tensor, carry: Tensor, mu: Tensor) -> Tensor:
    """conj(m) carry + mu, exactly mu where no gradient arrives (carry 0): the
    backward's image of apply_map."""
    return torch.where(carry == 0, mu, conj(m) * carry + mu)


def _compose(ring: Semiring, maps: Tensor, upto: int, start: Tensor) -> Tensor:
    """h = A_q (x) h (+) F_q for q in scan positions [0, upto), from ``start``."""
    h = start
    for q in range(upto):
        h = apply_map(ring, maps[q, 0], h, maps[q, 1])
    return h


class _ShardScan(Function):
    @staticmethod
    def forward(
        ctx: Any, sharded: _Sharded, gates: Tensor, tokens: Tensor, initial: Tensor | None,
        dim: int, reverse: bool, backend: str, group: Any, header: Tensor,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        position, world = _order(group, reverse)
        first = position == 0
        own_initial = initial if first else None
        # 1. the shard's map (scan positions are ranks in scan order)
        try:
            _, local_final = sharded.scan(
                gates, tokens, dim, initial=own_initial, reverse=reverse, return_final=True,
                backend=backend,
            )  # fmt: skip
            total = sharded.ring.total(gates, dim)
        except Exception:
            _reject(group)  # the other ranks wait in the exchange: all of them raise
            raise
        # 2. the checked exchange of every rank's map
        gathered = _exchange(sharded.name, header, [total, local_final], group)
        if reverse:  # ranks to scan positions
            gathered = gathered.flip(0)
        # 3. the entering state, and the global final state
        nothing = torch.full_like(local_final, sharded.ring.zero)
        entering = _compose(sharded.ring, gathered, position, nothing)
        final = _compose(sharded.ring, gathered[position:], world - position, entering)
        # 4. the shard from its entering state (the first rank: from initial)
        start = own_initial if first else entering
        out = sharded.scan(gates, tokens, dim, initial=start, reverse=reverse, backend=backend)
        ctx.save_for_backward(gates, tokens, out, start, total)
        ctx.sharded, ctx.dim, ctx.reverse, ctx.backend = sharded, dim, reverse, backend
        ctx.group, ctx.position, ctx.world = group, position, world
        ctx.had_initial = initial is not None
        return out, final

    @staticmethod
    @once_differentiable(lambda ctx: ctx.sharded.name)  # parascan's error, not zeros
    def backward(ctx: Any, grad_out: Tensor, grad_final: Tensor) -> tuple[Tensor | None, ...]:
        gates, tokens, out, start, total = ctx.saved_tensors
        sharded, dim, reverse, backend = ctx.sharded, ctx.dim, ctx.reverse, ctx.backend
        steps = out.shape[dim]
        # mu: the gradient of the entering state with nothing arriving from later
        # ranks; m: d(last state)/d(entering state) across this shard (1 if empty).
        _, _, mu = sharded.backward(gates, tokens, out, grad_out, start, dim, reverse, backend)
        m = sharded.multiplier(total, start, out, dim, reverse) if steps else torch.ones_like(mu)
        gathered = _all_gather_stacked([mu, grad_final, m], ctx.group)
        if reverse:
            gathered = gathered.flip(0)
        # The gradient arriving after this shard: the final state's total gradient,
        # carried back through the later ranks (lambda = conj(m) lambda + mu).
        carry = gathered[:, 1].sum(0)
        for q in range(ctx.world - 1, ctx.position, -1):
            carry = carry_back(gathered[q, 2], carry, gathered[q, 0])
        if steps:
            arriving = torch.zeros_like(grad_out)
            arriving.select(dim, 0 if reverse else steps - 1).copy_(carry)
            grad_gates, grad_tokens, grad_start = sharded.backward(
                gates, tokens, out, grad_out + arriving, start, dim, reverse, backend
            )
        else:
            grad_gates, grad_tokens = torch.zeros_like(gates), torch.zeros_like(tokens)
            grad_start = carry
        grad_initial = grad_start if ctx.position == 0 and ctx.had_initial else None
        return None, grad_gates, grad_tokens, grad_initial, None, None, None, None, None


def _distributed(
    sharded: _Sharded, gates: object, tokens: object, dim: object, group: Any,
    initial: object, reverse: bool, return_final: bool, backend: str, cu_seqlens: object,
) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
    from parascan.distributed.packed import _PackedShardScan, check_offsets

    name = sharded.name
    grouped = dist.is_available() and dist.is_initialized()
    packed = cu_seqlens is not None
    try:
        p = prepare(
            sharded.ring, gates, tokens, dim, None if packed else initial, reverse, True, backend,
            name=name,
        )  # fmt: skip
        if p.scalar:
            raise ValueError(f"{name}: expected tensors with a time dim, but got 0-d inputs")
        return_final = check_flag(name, "return_final", return_final)
        d = p.dim % p.tokens.dim()
        cu, h = None, None
        if packed:  # the checks a rank makes alone; the global length after the headers
            cu = check_offsets(name, cu_seqlens, p.tokens.shape[d], p.tokens.device)
            h = packed_initial(name, initial, p.tokens, d, len(cu) - 1)
        header = _header(sharded, p, reverse, cu, return_final, h)
    except Exception:
        if grouped:  # the other ranks wait in the exchange: all of them raise
            _reject(group)
        raise
    if not grouped:
        raise RuntimeError(
            f"{name}: expected an initialized torch.distributed process group "
            "(torch.distributed.init_process_group), but there is none"
        )
    dtype = p.tokens.dtype
    if dtype in (torch.float16, torch.bfloat16):
        # computed in float32 and rounded once, as the local scans do: the shards'
        # maps, the states crossing ranks and their compositions in float32 (in the
        # half type, a sum of 700 log gates came out 1.5 off, a factor e^1.5)
        wide = torch.float32
        p = replace(
            p, gates=p.gates.to(wide), tokens=p.tokens.to(wide),
            initial=None if p.initial is None else p.initial.to(wide),
        )  # fmt: skip
        h = None if h is None else h.to(wide)
    if cu is not None:
        out, final = _PackedShardScan.apply(
            sharded, p.gates, p.tokens, h, d, cu, reverse, return_final, p.backend, group, header,
        )  # type: ignore[no-untyped-call]  # fmt: skip
        final = to_public(final, d) if return_final else final
    else:
        out, final = _ShardScan.apply(
            sharded, p.gates, p.tokens, p.initial, d, reverse, p.backend, group, header,
        )  # type: ignore[no-untyped-call]  # fmt: skip
    out, final = out.to(dtype), final.to(dtype)
    return (out, final) if return_final else out


@overload
def linear_scan(
    gates: Tensor | float, tokens: Tensor, dim: int, *, group: Any = ...,
    initial: Tensor | float | None = ..., reverse: bool = ...,
    return_final: Literal[False] = ..., backend: str = ..., cu_seqlens: Tensor | None = ...,
) -> Tensor: ...  # fmt: skip
@overload
def linear_scan(
    gates: Tensor | float, tokens: Tensor, dim: int, *, group: Any = ...,
    initial: Tensor | float | None = ..., reverse: bool = ...,
    return_final: Literal[True], backend: str = ..., cu_seqlens: Tensor | None = ...,
) -> tuple[Tensor, Tensor]: ...  # fmt: skip


def linear_scan(
    gates: Tensor | float, tokens: Tensor, dim: int, *, group: Any = None,
    initial: Tensor | float | None = None, reverse: bool = False,
    return_final: bool = False, backend: str = "auto", cu_seqlens: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
    r""":func:`parascan.linear_scan` over a time dim sharded across ranks.

    Rank r of the process group ``group`` (default: the world) holds the r-th
    contiguous shard of the time dim, in rank order; shards may have different
    lengths, including 0. Every rank calls this function with its shards of
    ``gates`` and ``tokens`` (the other dims agree across ranks) and gets its shard of
    the result, as if the whole sequence had been scanned on one process:

    .. math:: x_t = a_t \, x_{t-1} + b_t

    Args:
        gates, tokens, dim, reverse, backend: as in :func:`parascan.linear_scan`, for
            the local shard.
        group: the process group (``None``: the default group).
        initial: the state before the first step, read on the first rank (the last
            when ``reverse``). Every rank passes one or none does (the ranks check
            that they agree); the others' values are not read.
        return_final: also return the global final state (the last state of the last
            rank, or the first of the first when reversed), on every rank.
        cu_seqlens: packed variable-length sequences, as in
            :func:`parascan.linear_scan`, with GLOBAL offsets: an int32/int64 tensor
            (num_seqs + 1,) of offsets along the whole (concatenated) time dim, 0
            first, the sum of the ranks' shard lengths last, non-decreasing, the same
            on every rank (the ranks check it: a CRC of the values rides in their
            first message, and every rank raises when they differ). Each sequence is
            scanned alone (``reverse`` within it) and may span ranks, be empty, or
            start or end on a shard boundary. The result's leading dim must be 1 (or
            ``dim`` 0); ``initial`` is then (num_seqs, state...), given on every rank
            (each rank reads the rows of the sequences whose first step it holds),
            and the final states (num_seqs, state...) are returned on every rank.

    Returns:
        This rank's shard of ``x`` (and the global final state). Differentiable in
        gates, tokens and initial across ranks: as with DistributedDataParallel,
        every rank must run the backward (it exchanges one all-gather). Each call
        sends one all-gather of 2 states per rank forward and one backward,
        whatever the length: O(state) bytes, not O(T). With ``cu_seqlens``: a
        fixed-size header message, then one all-gather of 2 states per rank (plus,
        with ``return_final``, the finals of the sequences ending in each shard,
        padded to the most any shard holds) forward, and one of 2 states per rank
        (plus, with ``return_final``, each rank's num_seqs gradients of the finals)
        backward. The gradient of ``initial`` is then split over the ranks, whose
        sum is the gradient: a sequence's row on the rank holding its first step,
        an empty sequence's (its final is its initial state) on every rank from
        that rank's own use of the final.
    """
    return _distributed(
        _LINEAR, gates, tokens, dim, group, initial, reverse, return_final, backend, cu_seqlens
    )


@overload
def log_linear_scan(
    log_gates: Tensor | float, log_tokens: Tensor, dim: int, *, group: Any = ...,
    initial: Tensor | float | None = ..., reverse: bool = ...,
    return_final: Literal[False] = ..., backend: str = ..., cu_seqlens: Tensor | None = ...,
) -> Tensor: ...  # fmt: skip
@overload
def log_linear_scan(
    log_gates: Tensor | float, log_tokens: Tensor, dim: int, *, group: Any = ...,
    initial: Tensor | float | None = ..., reverse: bool = ...,
    return_final: Literal[True], backend: str = ..., cu_seqlens: Tensor | None = ...,
) -> tuple[Tensor, Tensor]: ...  # fmt: skip


def log_linear_scan(
    log_gates: Tensor | float, log_tokens: Tensor, dim: int, *, group: Any = None,
    initial: Tensor | float | None = None, reverse: bool = False,
    return_final: bool = False, backend: str = "auto", cu_seqlens: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
    r""":func:`parascan.log_linear_scan` over a time dim sharded across ranks.

    The same contract as :func:`linear_scan` of this module, in log space:
    ``h[t] = logaddexp(log_gates[t] + h[t-1], log_tokens[t])``, ``initial`` (log of
    the state before the first step, default ``-inf``) read on the first rank. A
    shard's map is ``h -> logaddexp(sum(log_gates) + h, F)``; the all-gathers carry
    O(state) elements per rank, forward and backward. ``cu_seqlens``: packed
    sequences with global offsets, as in :func:`linear_scan` of this module (an empty
    sequence's final is its ``initial`` row, ``-inf`` without one).
    """
    return _distributed(
        _LOG, log_gates, log_tokens, dim, group, initial, reverse, return_final, backend, cu_seqlens
    )
