"""Packed variable-length sequences (``cu_seqlens=``) in parascan.distributed's scans.

``cu_seqlens`` holds the GLOBAL offsets along the sharded time dim, the same on every
rank; a sequence may start and end on any rank, span several, or be empty. Rank r of
R holds the steps [S_r, S_r + n_r). "First", "last", "left" and "right" below are in
scan order (ranks and steps reversed when ``reverse``).

Summary of the algorithm (forward):

1. One fixed-size message: every rank's header (api._header, with a CRC of the
   offsets and its shard length), checked as the unpacked scans check theirs; every
   rank then knows every shard's place, so it plans every shard (_plan): the
   sequence that enters it from the left (``first``; ``carried`` when it started on an
   earlier rank, ``prefix`` its steps here), the one that leaves on the right
   (``last``), and the sequences whose final step lies in it (``ending``).
2. The local packed scan (first_order/packed.py's op) of the shard, the local offsets
   being the global ones clamped to the shard, every sequence from its initial state
   and the carried one from the empty state.
3. One all-gather of, per rank: X, the product of the prefix's gates; Y, the state
   leaving on the right; and, with ``return_final``, the local final states of the
   sequences ending in the shard (padded to the most any shard holds). The carry
   entering rank r is then the composition over the earlier non-empty ranks q of
   ``h -> Y_q`` (a sequence starts on q: its state does not depend on h) or ``h -> X_q
   (x) h (+) Y_q`` (one sequence covers q); a carried sequence ending on q has final
   ``X_q (x) carry_q (+) R``. Every rank gets every final.
4. The prefix scanned again from its carry (the rest of the shard does not depend on
   it).

The backward is the same in reverse: mu_q, the gradient of the carry entering q
from q's own prefix (a local backward of the prefix alone), and the multiplier m_q
of the prefix, all-gathered with each rank's gradient of the finals (summed: every
rank holds the finals); the gradient leaving rank r on the right follows from the
later ranks by lambda_q = mu_q + conj(m_q) lambda_{q+1} through the ranks one
sequence covers, and the shard's packed backward runs once with it and the finals'
gradients added at the sequences' last steps. Nothing crosses a sequence boundary:
only the carried sequence's steps see the carry, only the leaving one's the gradient
from the right.

Gradient of ``initial``: a sequence's row goes to the rank holding its first step (in
scan order); an empty sequence's final is its initial state, on every rank, so each
rank gets its own final's gradient for that row. Summed over the ranks (as for a
replicated parameter), the rows are the exact gradient.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from parascan._core import Function, check_cu_seqlens, short_repr, state_shape
from parascan._higher_order import once_differentiable
from parascan.distributed.api import (
    _LENGTH,
    _all_gather_bytes,
    _all_gather_stacked,
    _check_agreement,
    _first_message,
    _from_bytes,
    _Sharded,
    _to_bytes,
    _wire_device,
    apply_map,
    carry_back,
)
from parascan.first_order.packed import _OPS, _finals

__all__ = ["check_offsets"]


def check_offsets(name: str, cu_seqlens: object, steps: int, device: torch.device) -> list[int]:
    """The checks a rank can make alone: a 1-d int32/int64 tensor of non-decreasing
    offsets from 0, on the CPU or ``device``, ending at least at this rank's shard
    length ``steps`` (the global length is checked once the ranks' lengths are known)."""
    last = 0
    if (
        isinstance(cu_seqlens, Tensor)
        and cu_seqlens.dim() == 1
        and cu_seqlens.numel() > 0
        and cu_seqlens.dtype in (torch.int32, torch.int64)
    ):
        last = int(cu_seqlens[-1])
    cu: list[int] = check_cu_seqlens(name, cu_seqlens, last, device).tolist()
    if last < steps:
        raise ValueError(
            f"{name}: expected cu_seqlens to end at the global length along dim (the sum "
            f"of the ranks' shard lengths), at least this rank's {steps}, but got {short_repr(cu)}"
        )
    return cu


@dataclass(frozen=True)
class _Shard:
    """One rank's shard, as every rank sees it (sequences by their index in cu_seqlens;
    "first" and "last" in scan order)."""

    start: int  # the shard's first step along dim (not in scan order)
    length: int
    first: int  # the sequence holding the shard's first step in scan order (-1: empty)
    carried: bool  # it started on an earlier rank: its state enters from the left
    prefix: int  # its steps in the shard
    last: int  # the sequence holding the shard's last step in scan order
    ending: tuple[int, ...]  # non-empty sequences whose last step is here
    starting: tuple[int, ...]  # non-empty sequences whose first step is here

    @property
    def covered(self) -> bool:
        """One sequence, entering from the left, covers the shard: the state leaving
        it depends on the carry."""
        return self.carried and self.prefix == self.length


def _plan(cu: list[int], lengths: list[int], reverse: bool) -> list[_Shard]:
    """Every rank's _Shard, in rank order."""
    total = cu[-1]
    nseq = len(cu) - 1
    order = list(range(nseq - 1, -1, -1)) if reverse else list(range(nseq))
    # scan coordinates: step t is at total - 1 - t when reversed
    begins = [total - cu[s + 1] if reverse else cu[s] for s in order]
    ends = [total - cu[s] if reverse else cu[s + 1] for s in order]
    shards, start = [], 0
    for n in lengths:
        lo = total - start - n if reverse else start  # the shard in scan coordinates
        hi = lo + n
        if n == 0:
            shards.append(_Shard(start, 0, -1, False, 0, -1, (), ()))
        else:
            i = bisect_right(ends, lo)  # the first sequence ending after lo holds lo
            j = bisect_right(ends, hi - 1)
            ending = range(i, bisect_right(ends, hi))
            starting = range(bisect_left(begins, lo), bisect_left(begins, hi))
            shards.append(
                _Shard(
                    start, n, order[i], begins[i] < lo, min(ends[i], hi) - lo, order[j],
                    tuple(order[k] for k in ending if begins[k] < ends[k]),
                    tuple(order[k] for k in starting if begins[k] < ends[k]),
                )
            )  # fmt: skip
        start += n
    return shards


def _local_offsets(cu: list[int], shard: _Shard) -> list[int]:
    return [min(max(c - shard.start, 0), shard.length) for c in cu]


def _last_step(local: list[int], s: int, reverse: bool) -> int:
    """The local index of sequence s's last step in scan order."""
    return local[s] if reverse else local[s + 1] - 1


def _prefix_at(shard: _Shard, reverse: bool) -> int:
    """The local index where the carried sequence's steps begin along dim."""
    return shard.length - shard.prefix if reverse else 0


def _gather_or_fail(
    name: str, parts: list[Tensor] | None, count: int, like: Tensor, group: Any
) -> Tensor:
    """All-gather ``count`` state tensors shaped like ``like`` from every rank, each
    message led by a status word: ``parts`` is None on a rank whose local work
    failed (it sends zeros, then raises its own error). Returns the stacked parts
    (world, count, *state); when a rank failed, every other rank raises instead of
    waiting forever."""
    device = _wire_device(group)
    payload = like.new_zeros((count, *like.shape)) if parts is None else torch.stack(parts)
    status = torch.tensor([0 if parts is not None else 1], dtype=torch.int64, device=device)
    message = torch.cat([status.view(torch.uint8), _to_bytes(payload).to(device)])
    received = _all_gather_bytes(message, group)
    ranks = dist.get_process_group_ranks(group) if group is not None else range(len(received))
    failed = [r for r, m in zip(ranks, received, strict=True) if int(m[:8].view(torch.int64)) != 0]
    if failed and parts is not None:
        raise RuntimeError(
            f"{name}: rank(s) {', '.join(map(str, failed))} failed in their local scan "
            f"(their own error says why), so no rank can finish"
        )
    return _from_bytes(received, 8, payload)


def _scan_order(shards: list[_Shard], reverse: bool) -> list[int]:
    ranks = range(len(shards))
    return [r for r in (reversed(ranks) if reverse else ranks) if shards[r].length]


class _PackedShardScan(Function):
    """This rank's shard of the packed scan, and the finals in the internal layout
    (every sequence's, on every rank; an empty tensor without ``return_final``)."""

    @staticmethod
    def forward(
        ctx: Any, sharded: _Sharded, gates: Tensor, tokens: Tensor, initial: Tensor | None,
        dim: int, cu: list[int], reverse: bool, return_final: bool, backend: str, group: Any,
        header: Tensor,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        name, ring = sharded.name, sharded.ring
        # 1. the checked headers, and every shard's plan
        headers = _check_agreement(name, _first_message(header, None, group), group)
        lengths = [h[_LENGTH] for h in headers]
        if sum(lengths) != cu[-1]:  # every rank reaches the same verdict
            raise ValueError(
                f"{name}: expected cu_seqlens to end at the global length along dim, the sum "
                f"of the ranks' shard lengths {' + '.join(map(str, lengths))} = {sum(lengths)}, "
                f"but got {short_repr(cu)}"
            )
        shards = _plan(cu, lengths, reverse)
        rank = dist.get_rank(group)
        mine = shards[rank]
        nseq = len(cu) - 1
        rows = max(len(s.ending) for s in shards) if return_final else 0
        local = _local_offsets(cu, mine)
        local_cu = torch.tensor(local, dtype=torch.int64)
        zero = tokens.new_full(state_shape(tokens, dim), ring.zero)
        # 2. the local packed scan, the carried sequence from the empty state
        try:
            start = initial
            if mine.carried and initial is not None:
                start = initial.clone(memory_format=torch.contiguous_format)
                start.select(dim, mine.first).fill_(ring.zero)
            if mine.length:
                out = _OPS[ring.name][0](gates, tokens, start, dim, local_cu, reverse, backend)
            else:
                out = torch.empty(tokens.shape, dtype=tokens.dtype, device=tokens.device)
            total, leaving, ends = torch.full_like(zero, ring.one), zero, []
            if mine.length:
                finals = _finals(ring, out, start, local_cu, dim, reverse)
                leaving = finals.select(dim, mine.last)
                ends = [finals.select(dim, s) for s in mine.ending] if return_final else []
            if mine.carried:
                total = ring.total(gates.narrow(dim, _prefix_at(mine, reverse), mine.prefix), dim)
            parts = [total, leaving, *ends, *[zero] * (rows - len(ends))]
        except Exception:
            _gather_or_fail(name, None, 2 + rows, zero, group)  # every other rank raises
            raise
        # 3. the exchange; the carries entering every shard, every final
        gathered = _gather_or_fail(name, parts, 2 + rows, zero, group)
        carries: dict[int, Tensor] = {}
        h = zero
        for q in _scan_order(shards, reverse):
            carries[q] = h
            x, y = gathered[q, 0], gathered[q, 1]
            h = apply_map(ring, x, h, y) if shards[q].covered else y
        final = zero.new_zeros(0)
        if return_final:
            base = initial
            if base is None:
                base = zero.unsqueeze(dim).expand(*zero.shape[:dim], nseq, *zero.shape[dim:])
            each = list(base.unbind(dim))
            for q, shard in enumerate(shards):
                for i, s in enumerate(shard.ending):
                    row = gathered[q, 2 + i]
                    if shard.carried and s == shard.first:
                        row = apply_map(ring, gathered[q, 0], carries[q], row)
                    each[s] = row
            final = torch.stack(each, dim) if each else base.clone()
        # 4. the carried sequence's steps from its carry
        carry = carries.get(rank, zero)
        if mine.carried:
            at = _prefix_at(mine, reverse)
            fixed = sharded.scan(
                gates.narrow(dim, at, mine.prefix), tokens.narrow(dim, at, mine.prefix), dim,
                initial=carry, reverse=reverse, backend=backend,
            )  # fmt: skip
            out.narrow(dim, at, mine.prefix).copy_(fixed)
            if start is None:
                start = zero.unsqueeze(dim).repeat_interleave(nseq, dim)
            start.select(dim, mine.first).copy_(carry)
        ctx.save_for_backward(gates, tokens, out, start, carry, gathered[rank, 0])
        ctx.sharded, ctx.dim, ctx.reverse, ctx.backend, ctx.group = (
            sharded, dim, reverse, backend, group
        )  # fmt: skip
        ctx.shards, ctx.local, ctx.cu, ctx.return_final = shards, local, cu, return_final
        ctx.had_initial = initial is not None
        return out, final

    @staticmethod
    @once_differentiable(lambda ctx: ctx.sharded.name)  # parascan's error, not zeros
    def backward(ctx: Any, grad_out: Tensor, grad_final: Tensor) -> tuple[Tensor | None, ...]:
        gates, tokens, out, start, carry, total = ctx.saved_tensors
        sharded, dim, reverse, backend = ctx.sharded, ctx.dim, ctx.reverse, ctx.backend
        ring, shards, local = sharded.ring, ctx.shards, ctx.local
        rank = dist.get_rank(ctx.group)
        mine = shards[rank]
        own: list[Tensor] = list(grad_final.unbind(dim)) if ctx.return_final else []
        # mu: the carry's gradient from the prefix alone (with this rank's gradient of
        # its final when it ends here); m: d(state leaving the prefix)/d(carry)
        mu, m = torch.zeros_like(carry), torch.ones_like(carry)
        if mine.carried:
            at = _prefix_at(mine, reverse)
            piece = [t.narrow(dim, at, mine.prefix) for t in (gates, tokens, out, grad_out)]
            if ctx.return_final and mine.first in mine.ending:
                piece[3] = piece[3].clone()
                piece[3].select(dim, 0 if reverse else mine.prefix - 1).add_(own[mine.first])
            _, _, mu = sharded.backward(*piece, carry, dim, reverse, backend)
            m = sharded.multiplier(total, carry, piece[2], dim, reverse)
        gathered = _all_gather_stacked([mu, m, *own], ctx.group)
        # the finals' gradients summed over the ranks, and the gradient leaving each
        # shard on the right (lambda of the next shard when it carries the sequence on)
        summed = gathered[:, 2:].sum(0)
        leaving: dict[int, Tensor] = {}
        nxt = torch.zeros_like(carry)
        for q in reversed(_scan_order(shards, reverse)):
            shard = shards[q]
            leaving[q] = nxt
            lam = gathered[q, 0]
            mq = gathered[q, 1]
            if ctx.return_final and shard.carried and shard.first in shard.ending:
                lam = carry_back(mq, summed[shard.first] - gathered[q, 2 + shard.first], lam)
            if shard.covered:
                lam = carry_back(mq, nxt, lam)
            nxt = lam if shard.carried else torch.zeros_like(carry)
        grad_gates, grad_tokens = torch.zeros_like(gates), torch.zeros_like(tokens)
        grad_start = None
        if mine.length:
            arriving = grad_out.clone(memory_format=torch.contiguous_format)
            for s in mine.ending if ctx.return_final else ():
                arriving.select(dim, _last_step(local, s, reverse)).add_(summed[s])
            arriving.select(dim, 0 if reverse else mine.length - 1).add_(leaving[rank])
            local_cu = torch.tensor(local, dtype=torch.int64)
            grad_gates, grad_tokens, grad_start = _OPS[ring.name][1](
                gates, tokens, out, arriving, start, dim, local_cu, reverse, backend
            )
        grad_initial = None
        if ctx.had_initial:
            nseq = len(local) - 1
            each = [torch.zeros_like(carry) for _ in range(nseq)]
            for s in mine.starting:
                assert grad_start is not None  # a rank with a starting sequence has steps
                each[s] = grad_start.select(dim, s)
            if ctx.return_final:  # an empty sequence's final is its initial state
                for s, (lo, hi) in enumerate(pairwise(ctx.cu)):
                    if lo == hi:
                        each[s] = own[s]
            grad_initial = (
                torch.stack(each, dim) if each else carry.unsqueeze(dim).narrow(dim, 0, 0)
            )
        return (
            None, grad_gates, grad_tokens, grad_initial,
            None, None, None, None, None, None, None,
        )  # fmt: skip
