"""The raw log_linear_scan ops, registered with torch.library.

``parascan::log_linear_scan`` and ``parascan::log_linear_scan_backward`` take
validated, broadcast inputs (log_gates and log_tokens of one shape and dtype,
initial of that shape without ``dim``, or None) and a concrete backend name, like
linear_scan's ops (parascan.linear.ops), with fake kernels and vmap rules.
"""

from __future__ import annotations

import math

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
from parascan.linear.ops import _FORWARD as _LINEAR_FORWARD
from parascan.linear.ops import ScanFn, gradient_chain, previous_states
from parascan.logspace import chunked, cpu, reference, triton

__all__ = ["backward_from_weights", "log_linear_scan_backward_op", "log_linear_scan_op"]

_FORWARD: dict[str, ScanFn] = {
    "cpu": cpu.forward,
    "triton": triton.forward,
    "torch": chunked.forward,
    "loop": reference.forward,
}


def step_weights(
    log_gates: Tensor, log_tokens: Tensor, out: Tensor, initial: Tensor | None, dim: int,
    reverse: bool,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The derivatives of each step h[t] = logaddexp(u, v), u = log_gates[t] + h[t-1],
    v = log_tokens[t]: (exp(u - h[t]), exp(v - h[t])), 0 where h[t] is log 0."""
    h_prev = previous_states(out, initial, dim, reverse, empty=-math.inf)
    return reference.log_weight(log_gates + h_prev, out), reference.log_weight(log_tokens, out)


def backward_from_weights(
    scan: ScanFn,
    log_gates: Tensor,
    log_tokens: Tensor,
    out: Tensor,
    grad_out: Tensor,
    initial: Tensor | None,
    dim: int,
    reverse: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of log_linear_scan. With the step weights wu, wb (step_weights), the
    gradient reaching h[t] is g[t] = grad_out[t] + conj(wu[t+1]) g[t+1]: a linear
    scan (``scan``, linear_scan's) run the other way. Then dL/dlog_gates = g conj(wu),
    dL/dlog_tokens = g conj(wb), dL/dinitial = g[0] conj(wu[0]). Torch ops only, so
    it is differentiable whenever ``scan`` is."""
    steps = out.shape[dim]
    if steps == 0:
        return torch.zeros_like(out), torch.zeros_like(out), out.new_zeros(state_shape(out, dim))
    wu, wb = step_weights(log_gates, log_tokens, out, initial, dim, reverse)
    g = gradient_chain(scan, wu, grad_out, dim, reverse)
    first = steps - 1 if reverse else 0
    grad_initial = g.select(dim, first) * conj(wu.select(dim, first))
    return g * conj(wu), g * conj(wb), grad_initial


@torch.library.custom_op("parascan::log_linear_scan", mutates_args=())
def log_linear_scan_op(
    log_gates: Tensor,
    log_tokens: Tensor,
    initial: Tensor | None,
    dim: int,
    reverse: bool,
    backend: str,
) -> Tensor:
    """h[t] = logaddexp(log_gates[t] + h[t-1], log_tokens[t]) along ``dim``; a new
    contiguous tensor."""
    return _FORWARD[backend](
        resolved(log_gates), resolved(log_tokens), resolved_optional(initial), dim, reverse
    )


@log_linear_scan_op.register_fake
def _(
    log_gates: Tensor,
    log_tokens: Tensor,
    initial: Tensor | None,
    dim: int,
    reverse: bool,
    backend: str,
) -> Tensor:
    torch._check(log_gates.shape == log_tokens.shape, lambda: "parascan::log_linear_scan: shapes")
    torch._check(log_gates.dtype == log_tokens.dtype, lambda: "parascan::log_linear_scan: dtypes")
    return torch.empty(log_tokens.shape, dtype=log_tokens.dtype, device=log_tokens.device)


@torch.library.custom_op("parascan::log_linear_scan_backward", mutates_args=())
def log_linear_scan_backward_op(
    log_gates: Tensor,
    log_tokens: Tensor,
    out: Tensor,
    grad_out: Tensor,
    initial: Tensor | None,
    dim: int,
    reverse: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_log_gates, grad_log_tokens, grad_initial), given the forward's output."""
    la, lb, out, grad_out = (resolved(t) for t in (log_gates, log_tokens, out, grad_out))
    initial = resolved_optional(initial)
    if backend == "cpu":
        return cpu.backward(la, lb, out, grad_out, initial, dim, reverse)
    if backend == "triton":
        return triton.backward(la, lb, out, grad_out, initial, dim, reverse)
    acc = accumulate_dtype(out.dtype)
    grads = backward_from_weights(
        _LINEAR_FORWARD[backend],
        la.to(acc),
        lb.to(acc),
        out.to(acc),
        grad_out.to(acc),
        None if initial is None else initial.to(acc),
        dim,
        reverse,
    )
    return tuple(g.to(out.dtype) for g in grads)  # type: ignore[return-value]


@log_linear_scan_backward_op.register_fake
def _(
    log_gates: Tensor,
    log_tokens: Tensor,
    out: Tensor,
    grad_out: Tensor,
    initial: Tensor | None,
    dim: int,
    reverse: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    torch._check(log_gates.shape == out.shape, lambda: "parascan::log_linear_scan_backward")
    torch._check(grad_out.shape == out.shape, lambda: "parascan::log_linear_scan_backward")
    return (
        torch.empty(out.shape, dtype=out.dtype, device=out.device),
        torch.empty(out.shape, dtype=out.dtype, device=out.device),
        torch.empty(state_shape(out, dim), dtype=out.dtype, device=out.device),
    )


register_batch_first_vmap("parascan::log_linear_scan", log_linear_scan_op, tensors=3, outputs=1)
register_batch_first_vmap(
    "parascan::log_linear_scan_backward", log_linear_scan_backward_op, tensors=5, outputs=3
)
