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

The backward is the same in reverse. The total gradient reaching the first state
of rank r (lambda_r) obeys lambda_r = A_r^H lambda_{r+1} + mu_r, where mu_r is the
local backward's gradient of the entering state with nothing arriving from later
ranks; one all-gather of (mu_r, the final state's gradient) gives every rank its
lambda_{r+1}, which enters its local backward as a gradient of its last state.
"""

from __future__ import annotations

from typing import Any, Literal, overload

import torch
import torch.distributed as dist
from torch import Tensor

from parascan._op_utils import conj
from parascan._scan_api import prepare
from parascan.linear import linear_scan as local_scan
from parascan.linear.ops import backward_via_scan

__all__ = ["linear_scan"]

_NAME = "parascan.distributed.linear_scan"


def _all_gather_stacked(parts: list[Tensor], group: Any) -> Tensor:
    """all_gather of ``parts`` (tensors of one shape) stacked: (world, len(parts), *shape).
    Complex tensors travel as real pairs (not every backend reduces complex)."""
    payload = torch.stack(parts)
    wire = torch.view_as_real(payload) if payload.is_complex() else payload
    wire = wire.contiguous()
    world = dist.get_world_size(group)
    received = [torch.empty_like(wire) for _ in range(world)]
    dist.all_gather(received, wire, group=group)
    gathered = torch.stack(received)
    return torch.view_as_complex(gathered) if payload.is_complex() else gathered


def _order(group: Any, reverse: bool) -> tuple[int, int]:
    """(this rank's position in scan order, world size)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    return (world - 1 - rank if reverse else rank), world


def _compose(maps: Tensor, upto: int, start: Tensor) -> Tensor:
    """h = A_q h + F_q for q in scan positions [0, upto), from ``start``."""
    h = start
    for q in range(upto):
        h = maps[q, 0] * h + maps[q, 1]
    return h


class _ShardScan(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, gates: Tensor, tokens: Tensor, initial: Tensor | None, dim: int,
        reverse: bool, backend: str, group: Any,
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        position, world = _order(group, reverse)
        first = position == 0
        own_initial = initial if first else None
        # 1. the shard's map h -> A h + F (scan positions are ranks in scan order)
        _, local_final = local_scan(
            gates, tokens, dim, initial=own_initial, reverse=reverse, return_final=True,
            backend=backend,
        )  # fmt: skip
        product = torch.prod(gates, dim)
        gathered = _all_gather_stacked([product, local_final], group)
        if reverse:  # ranks to scan positions
            gathered = gathered.flip(0)
        # 3. the entering state, and the global final state
        zero = torch.zeros_like(local_final)
        entering = _compose(gathered, position, zero)
        final = _compose(gathered[position:], world - position, entering)
        # 4. the shard from its entering state (rank 0: from initial)
        start = own_initial if first else entering
        out = local_scan(gates, tokens, dim, initial=start, reverse=reverse, backend=backend)
        ctx.save_for_backward(gates, out, start)
        ctx.products = gathered[:, 0]
        ctx.dim, ctx.reverse, ctx.backend, ctx.group = dim, reverse, backend, group
        ctx.position, ctx.world, ctx.had_initial = position, world, initial is not None
        return out, final

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor, grad_final: Tensor) -> tuple[Tensor | None, ...]:
        gates, out, start = ctx.saved_tensors
        dim, reverse, backend = ctx.dim, ctx.reverse, ctx.backend

        def scan(a: Tensor, b: Tensor, h: Tensor | None, d: int, rev: bool) -> Tensor:
            return local_scan(a, b, d, initial=h, reverse=rev, backend=backend)

        # mu: the gradient of the entering state with nothing arriving from later ranks
        _, _, mu = backward_via_scan(scan, gates, out, grad_out, start, dim, reverse)
        gathered = _all_gather_stacked([mu, grad_final], ctx.group)
        if reverse:
            gathered = gathered.flip(0)
        # lambda after this shard: the final state's total gradient, carried back
        # through the maps of the later ranks (their A^H, their mu).
        carry = gathered[:, 1].sum(0)
        for q in range(ctx.world - 1, ctx.position, -1):
            carry = conj(ctx.products[q]) * carry + gathered[q, 0]
        steps = out.shape[dim]
        if steps:
            last = 0 if reverse else steps - 1
            arriving = torch.zeros_like(grad_out)
            arriving.select(dim, last).copy_(carry)
            grad_gates, grad_tokens, grad_start = backward_via_scan(
                scan, gates, out, grad_out + arriving, start, dim, reverse
            )
        else:
            grad_gates, grad_tokens, grad_start = (
                torch.zeros_like(gates),
                torch.zeros_like(out),
                carry,
            )
        grad_initial = grad_start if ctx.position == 0 and ctx.had_initial else None
        return grad_gates, grad_tokens, grad_initial, None, None, None, None


@overload
def linear_scan(
    gates: Tensor | float, tokens: Tensor, dim: int, *, group: Any = ...,
    initial: Tensor | float | None = ..., reverse: bool = ...,
    return_final: Literal[False] = ..., backend: str = ...,
) -> Tensor: ...  # fmt: skip
@overload
def linear_scan(
    gates: Tensor | float, tokens: Tensor, dim: int, *, group: Any = ...,
    initial: Tensor | float | None = ..., reverse: bool = ...,
    return_final: Literal[True], backend: str = ...,
) -> tuple[Tensor, Tensor]: ...  # fmt: skip


def linear_scan(
    gates: Tensor | float,
    tokens: Tensor,
    dim: int,
    *,
    group: Any = None,
    initial: Tensor | float | None = None,
    reverse: bool = False,
    return_final: bool = False,
    backend: str = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
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
            when ``reverse``); ignored on the others.
        return_final: also return the global final state (the last state of the last
            rank, or the first of the first when reversed), on every rank.

    Returns:
        This rank's shard of ``x`` (and the global final state). Differentiable in
        gates, tokens and initial across ranks: as with DistributedDataParallel,
        every rank must run the backward (it exchanges one all-gather). Each call
        sends one all-gather of 2 states per rank forward and one backward,
        whatever the length: O(state) bytes, not O(T).
    """
    p = prepare(_NAME, gates, tokens, dim, initial, reverse, True, backend)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"{_NAME}: expected an initialized torch.distributed process group "
            "(torch.distributed.init_process_group), but there is none"
        )
    if p.scalar:
        raise ValueError(f"{_NAME}: expected tensors with a time dim, but got 0-d inputs")
    out, final = _ShardScan.apply(
        p.gates, p.tokens, p.initial, p.dim % p.tokens.dim(), reverse, p.backend, group
    )  # type: ignore[no-untyped-call]
    if not return_final:
        return out  # type: ignore[no-any-return]
    return out, final
