"""The one autograd.Function of the first-order scans, parametrized by the semiring,
for whole rows and for packed sequences (``cu_seqlens``) alike.

Forward and backward are torch.library ops with vmap rules (ops.py, packed.py), so
``generate_vmap_rule`` gives vmap, vmap(grad) and jacrev for free, eager and compiled:
``apply`` is opaque to dynamo (``_core.opaque_to_dynamo``). The semiring travels by
name (a string is a constant to torch.compile).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from parascan._core import Function, opaque_to_dynamo
from parascan._higher_order import tangent_mode
from parascan.first_order import packed
from parascan.first_order.ops import ScanFn, backward_from_partials, backward_op, forward_op
from parascan.first_order.semiring import LINEAR, SEMIRINGS

__all__ = ["apply", "linear_scan_fn"]


class _FirstOrderScan(Function):
    """x[t] = a[t] (x) x[t-1] (+) b[t] in the semiring named ``ring``; each packed
    sequence of ``cu_seqlens`` (when not None) scanned alone. With forward-mode AD
    (torch.func.jvp, jacfwd)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(
        gates: Tensor, tokens: Tensor, initial: Tensor | None, dim: int, reverse: bool,
        backend: str, ring: str, cu_seqlens: Tensor | None,
    ) -> Tensor:  # fmt: skip
        out: Tensor
        if cu_seqlens is None:
            out = forward_op(SEMIRINGS[ring])(gates, tokens, initial, dim, reverse, backend)
        else:
            out = packed.ops(ring)[0](gates, tokens, initial, dim, cu_seqlens, reverse, backend)
        return out

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        gates, tokens, initial, dim, reverse, backend, ring, cu_seqlens = inputs
        # only what the semiring's backward reads is kept alive
        if not SEMIRINGS[ring].backward_reads_tokens:
            tokens = None
        ctx.save_for_backward(gates, tokens, output, initial, cu_seqlens)
        ctx.save_for_forward(gates, tokens, output, initial, cu_seqlens)
        ctx.dim, ctx.reverse, ctx.backend, ctx.ring = dim, reverse, backend, ring

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        gates, tokens, out, initial, cu_seqlens = ctx.saved_tensors
        ring, dim, reverse, backend = SEMIRINGS[ctx.ring], ctx.dim, ctx.reverse, ctx.backend
        if cu_seqlens is not None:
            if torch.is_grad_enabled():
                # create_graph: each sequence's gradients through differentiable torch ops
                grads = packed.differentiable_backward(
                    ring, backend, gates, tokens, out, grad_out, initial, cu_seqlens, dim,
                    reverse,
                )  # fmt: skip
            else:
                grads = packed.ops(ctx.ring)[1](
                    gates, tokens, out, grad_out, initial, dim, cu_seqlens, reverse, backend
                )
        elif torch.is_grad_enabled():
            # create_graph (double backward, torch.func): the same equations through
            # differentiable torch ops and the linear scan's Function.
            partials = ring.partials(gates, tokens, out, initial, dim, reverse)
            grads = backward_from_partials(
                linear_scan_fn(backend), partials, grad_out, dim, reverse
            )
        else:
            grads = backward_op(ring)(gates, tokens, out, grad_out, initial, dim, reverse, backend)
        need = ctx.needs_input_grad
        return (
            grads[0] if need[0] else None,
            grads[1] if need[1] else None,
            grads[2] if initial is not None and need[2] else None,
            None, None, None, None, None,
        )  # fmt: skip

    @staticmethod
    def jvp(
        ctx: Any, gates_t: Tensor | None, tokens_t: Tensor | None, initial_t: Tensor | None,
        *_: Any,
    ) -> Tensor:  # fmt: skip
        # The tangent obeys a linear recurrence with the steps' partials (w, d_a, d_b),
        # within each packed sequence from its own d initial:
        # dx[t] = w[t] dx[t-1] + (d_a[t] da[t] + d_b[t] db[t]),  dx[-1] = d initial.
        # Torch ops and this Function: differentiable by an outer forward-mode
        # transform too (jacfwd of jacfwd), in tangent_mode.
        ring = SEMIRINGS[ctx.ring]
        with tangent_mode(ctx.saved_tensors, ring.op) as saved:
            gates, tokens, out, initial, cu_seqlens = saved
            w, d_gates, d_tokens = ring.partials(
                gates, tokens, out, initial, ctx.dim, ctx.reverse, cu_seqlens
            )
            drive = torch.zeros_like(out)
            if tokens_t is not None:
                drive = tokens_t if d_tokens is None else d_tokens * tokens_t
            if gates_t is not None:
                drive = drive + d_gates * gates_t
            return apply(
                LINEAR.name, w, drive, initial_t, ctx.dim, ctx.reverse, ctx.backend, cu_seqlens
            )


def linear_scan_fn(backend: str) -> ScanFn:
    """The differentiable linear scan on ``backend``, as backward_from_partials takes it."""

    def scan(a: Tensor, b: Tensor, h: Tensor | None, dim: int, reverse: bool) -> Tensor:
        return apply(LINEAR.name, a, b, h, dim, reverse, backend)

    return scan


@opaque_to_dynamo
def apply(
    ring: str, gates: Tensor, tokens: Tensor, initial: Tensor | None, dim: int, reverse: bool,
    backend: str, cu_seqlens: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """The differentiable scan in the semiring named ``ring`` of validated operands."""
    scan = _FirstOrderScan.apply
    out: Tensor = scan(gates, tokens, initial, dim, reverse, backend, ring, cu_seqlens)  # type: ignore[no-untyped-call]
    return out
