"""The raw linear_scan ops, registered with torch.library.

``parascan::linear_scan`` and ``parascan::linear_scan_backward`` take already
validated, broadcast inputs (gates and tokens of one shape and dtype, initial of
that shape without ``dim``, or None) and a concrete backend name. They carry fake
kernels (torch.compile) and vmap rules; they are not differentiable themselves:
``api.py`` puts an autograd.Function around them, because
``torch.library.register_autograd`` breaks torch.func on torch 2.13.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from parascan._checks import accumulate_dtype
from parascan._op_utils import (
    conj,
    register_batch_first_vmap,
    resolved,
    resolved_optional,
    state_shape,
)
from parascan.linear import chunked, cpu, reference, triton

__all__ = [
    "backward_via_scan",
    "gradient_chain",
    "linear_scan_backward_op",
    "linear_scan_op",
    "previous_states",
]

ScanFn = Callable[[Tensor, Tensor, "Tensor | None", int, bool], Tensor]

_FORWARD: dict[str, ScanFn] = {
    "cpu": cpu.forward,
    "triton": triton.forward,
    "torch": chunked.forward,
    "loop": reference.forward,
}


def backward_via_scan(
    scan: ScanFn,
    gates: Tensor,
    out: Tensor,
    grad_out: Tensor,
    initial: Tensor | None,
    dim: int,
    reverse: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of linear_scan from one reverse scan (Martin & Cundy, arXiv 1709.04057).

    With x[t] = a[t] x[t-1] + b[t] and G = dL/dx, the total gradient reaching x[t] is
    g[t] = G[t] + conj(a[t+1]) g[t+1], itself a linear scan run the other way over
    the gates shifted by one step. Then dL/db = g, dL/da[t] = g[t] conj(x[t-1]) and
    dL/dinitial = conj(a[0]) g[0]. Written with torch ops only, so it is
    differentiable whenever ``scan`` is.
    """
    steps = out.shape[dim]
    if steps == 0:
        return torch.zeros_like(out), torch.zeros_like(out), out.new_zeros(state_shape(out, dim))
    g = gradient_chain(scan, gates, grad_out, dim, reverse)
    first = steps - 1 if reverse else 0
    grad_initial = conj(gates.select(dim, first)) * g.select(dim, first)
    return g * conj(previous_states(out, initial, dim, reverse)), g, grad_initial


def gradient_chain(
    scan: ScanFn, gates: Tensor, grad_out: Tensor, dim: int, reverse: bool
) -> Tensor:
    """g[t] = grad_out[t] + conj(gates[t+1]) g[t+1] (t-1 when reversed), g past the
    end 0: the total gradient reaching each state of a recurrence whose step
    multiplies the previous state by ``gates``. One scan run the other way."""
    steps = grad_out.shape[dim]
    if steps == 0:
        return torch.zeros_like(grad_out)
    no_gate = torch.zeros_like(gates.narrow(dim, 0, 1))
    if reverse:
        a_next = torch.cat([no_gate, gates.narrow(dim, 0, steps - 1)], dim)
    else:
        a_next = torch.cat([gates.narrow(dim, 1, steps - 1), no_gate], dim)
    return scan(conj(a_next), grad_out, None, dim, not reverse)


def previous_states(
    out: Tensor, initial: Tensor | None, dim: int, reverse: bool, empty: float = 0.0
) -> Tensor:
    """x[t-1] for every t (x[t+1] when reversed), the initial state (or ``empty``,
    the state before any step) at the start: the states each step's gate acts on."""
    steps = out.shape[dim]
    if steps == 0:
        return out
    if initial is None:
        x0 = torch.full_like(out.narrow(dim, 0, 1), empty)
    else:
        x0 = initial.unsqueeze(dim)
    if reverse:
        return torch.cat([out.narrow(dim, 1, steps - 1), x0], dim)
    return torch.cat([x0, out.narrow(dim, 0, steps - 1)], dim)


@torch.library.custom_op("parascan::linear_scan", mutates_args=())
def linear_scan_op(
    gates: Tensor, tokens: Tensor, initial: Tensor | None, dim: int, reverse: bool, backend: str
) -> Tensor:
    """x[t] = gates[t] * x[t-1] + tokens[t] along ``dim``; a new contiguous tensor."""
    return _FORWARD[backend](
        resolved(gates), resolved(tokens), resolved_optional(initial), dim, reverse
    )


@linear_scan_op.register_fake
def _(
    gates: Tensor, tokens: Tensor, initial: Tensor | None, dim: int, reverse: bool, backend: str
) -> Tensor:
    torch._check(gates.shape == tokens.shape, lambda: "parascan::linear_scan: shape mismatch")
    torch._check(gates.dtype == tokens.dtype, lambda: "parascan::linear_scan: dtype mismatch")
    return torch.empty(tokens.shape, dtype=tokens.dtype, device=tokens.device)


@torch.library.custom_op("parascan::linear_scan_backward", mutates_args=())
def linear_scan_backward_op(
    gates: Tensor,
    out: Tensor,
    grad_out: Tensor,
    initial: Tensor | None,
    dim: int,
    reverse: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_gates, grad_tokens, grad_initial) of linear_scan, given its output."""
    gates, out, grad_out = resolved(gates), resolved(out), resolved(grad_out)
    initial = resolved_optional(initial)
    if backend == "cpu":
        return cpu.backward(gates, out, grad_out, initial, dim, reverse)
    if backend == "triton":
        return triton.backward(gates, out, grad_out, initial, dim, reverse)
    # Backends without a fused backward: one reverse scan, accumulating half types
    # in float32 like the forward does.
    acc = accumulate_dtype(out.dtype)
    grads = backward_via_scan(
        _FORWARD[backend],
        gates.to(acc),
        out.to(acc),
        grad_out.to(acc),
        None if initial is None else initial.to(acc),
        dim,
        reverse,
    )
    return tuple(g.to(out.dtype) for g in grads)  # type: ignore[return-value]


@linear_scan_backward_op.register_fake
def _(
    gates: Tensor,
    out: Tensor,
    grad_out: Tensor,
    initial: Tensor | None,
    dim: int,
    reverse: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    torch._check(gates.shape == out.shape, lambda: "parascan::linear_scan_backward: shapes")
    torch._check(grad_out.shape == out.shape, lambda: "parascan::linear_scan_backward: shapes")
    return (
        torch.empty(out.shape, dtype=out.dtype, device=out.device),
        torch.empty(out.shape, dtype=out.dtype, device=out.device),
        torch.empty(state_shape(out, dim), dtype=out.dtype, device=out.device),
    )


register_batch_first_vmap("parascan::linear_scan", linear_scan_op, tensors=3, outputs=1)
register_batch_first_vmap(
    "parascan::linear_scan_backward", linear_scan_backward_op, tensors=4, outputs=3
)
