"""``parascan.log_linear_scan``: the first-order recurrence in log space."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Literal, overload

import torch
from torch import Tensor

from parascan._scan_api import cpu_fast_path, prepare, with_final
from parascan.linear.api import _apply as _linear_apply
from parascan.logspace import cpu
from parascan.logspace.ops import (
    backward_from_weights,
    log_linear_scan_backward_op,
    log_linear_scan_op,
    step_weights,
)

__all__ = ["log_linear_scan"]

_NAME = "parascan.log_linear_scan"


class _LogLinearScan(torch.autograd.Function):
    """Autograd around the raw ops, as for linear_scan (see parascan.linear.api)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(
        log_gates: Tensor,
        log_tokens: Tensor,
        initial: Tensor | None,
        dim: int,
        reverse: bool,
        backend: str,
    ) -> Tensor:
        out: Tensor = log_linear_scan_op(log_gates, log_tokens, initial, dim, reverse, backend)
        return out

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        log_gates, log_tokens, initial, dim, reverse, backend = inputs
        ctx.save_for_backward(log_gates, log_tokens, output, initial)
        ctx.save_for_forward(log_gates, log_tokens, output, initial)
        ctx.dim, ctx.reverse, ctx.backend = dim, reverse, backend

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        la, lb, out, initial = ctx.saved_tensors
        if torch.is_grad_enabled():
            # create_graph: the same equations through differentiable torch ops and
            # linear_scan's autograd Function.
            def scan(a: Tensor, b: Tensor, h: Tensor | None, dim: int, reverse: bool) -> Tensor:
                return _linear_apply(a, b, h, dim, reverse, ctx.backend)

            grads = backward_from_weights(
                scan, la, lb, out, grad_out, initial, ctx.dim, ctx.reverse
            )
        else:
            grads = log_linear_scan_backward_op(
                la, lb, out, grad_out, initial, ctx.dim, ctx.reverse, ctx.backend
            )
        need = ctx.needs_input_grad
        return (
            grads[0] if need[0] else None,
            grads[1] if need[1] else None,
            grads[2] if initial is not None and need[2] else None,
            None,
            None,
            None,
        )


class _LogLinearScanForwardMode(_LogLinearScan):
    """With forward-mode AD; apart because dynamo cannot trace a Function with jvp."""

    @staticmethod
    def jvp(
        ctx: Any, la_t: Tensor | None, lb_t: Tensor | None, initial_t: Tensor | None, *_: Any
    ) -> Tensor:
        # dh[t] = wu[t] (d log_gates[t] + dh[t-1]) + wb[t] d log_tokens[t]: a linear
        # scan with the step weights as gates.
        la, lb, out, initial = ctx.saved_tensors
        wu, wb = step_weights(la, lb, out, initial, ctx.dim, ctx.reverse)
        drive = torch.zeros_like(out)
        if la_t is not None:
            drive = drive + wu * la_t
        if lb_t is not None:
            drive = drive + wb * lb_t
        return _linear_apply(wu, drive, initial_t, ctx.dim, ctx.reverse, ctx.backend)


def _apply(
    log_gates: Tensor,
    log_tokens: Tensor,
    initial: Tensor | None,
    dim: int,
    reverse: bool,
    backend: str,
) -> Tensor:
    fn = _LogLinearScan if torch.compiler.is_compiling() else _LogLinearScanForwardMode
    out: Tensor = fn.apply(log_gates, log_tokens, initial, dim, reverse, backend)  # type: ignore[no-untyped-call]
    return out


@overload
def log_linear_scan(
    log_gates: Tensor | float,
    log_tokens: Tensor,
    dim: int,
    *,
    initial: Tensor | float | None = ...,
    reverse: bool = ...,
    return_final: Literal[False] = ...,
    backend: str = ...,
) -> Tensor: ...
@overload
def log_linear_scan(
    log_gates: Tensor | float,
    log_tokens: Tensor,
    dim: int,
    *,
    initial: Tensor | float | None = ...,
    reverse: bool = ...,
    return_final: Literal[True],
    backend: str = ...,
) -> tuple[Tensor, Tensor]: ...


def log_linear_scan(
    log_gates: Tensor | float,
    log_tokens: Tensor,
    dim: int,
    *,
    initial: Tensor | float | None = None,
    reverse: bool = False,
    return_final: bool = False,
    backend: str = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    r"""First-order linear recurrence computed in log space, returning ``log x``.

    .. math:: h_t = \operatorname{logaddexp}(\log a_t + h_{t-1}, \log b_t), \qquad
              h_{-1} = \text{initial} \ (\text{default } -\infty)

    so ``h = log x`` for ``x[t] = a[t] x[t-1] + b[t]``, without ever leaving log
    space: no overflow for huge values, no cancellation of a running cumsum (it
    stays accurate at any length), and exact, finite gradients where a gate or a
    token is zero (``-inf``). ``reverse=True`` walks time backwards.

    Args:
        log_gates: ``log a``; a tensor or a Python number, broadcast with
            ``log_tokens``.
        log_tokens: ``log b``.
        dim: the time dimension of the broadcast result (negative counts from the end).
        initial: ``log x[-1]``, broadcastable to the result's shape without ``dim``.
        reverse: run time backwards.
        return_final: also return the last state (``-inf`` or ``initial`` when T == 0).
        backend: ``"auto"``, ``"cpu"``, ``"torch"`` or ``"loop"``; see
            :func:`parascan.backends`.

    Returns:
        ``h`` (contiguous, broadcast shape, dtype ``torch.result_type``), or
        ``(h, final)``. Real inputs give a real result. Complex inputs give the
        principal complex log (imaginary part in [-pi, pi)): for real recurrences
        with negative numbers pass ``torch.log(v.to(torch.complex64))`` and read
        ``torch.exp(h).real``. Half types compute in float32. Differentiable in
        every input (where the result is log 0 the gradient is 0), under vmap,
        torch.func and torch.compile.

    Example:
        >>> import torch, parascan as ps
        >>> a, b = torch.tensor([0.5, 0.5, 0.5]), torch.tensor([1.0, 2.0, 0.0])
        >>> ps.log_linear_scan(a.log(), b.log(), 0).exp()
        tensor([1.0000, 2.5000, 1.2500])
        >>> neg = torch.tensor([1.0, -3.0]).to(torch.complex64).log()
        >>> ps.log_linear_scan(torch.zeros(2), neg, 0).exp().real
        tensor([ 1., -2.])
    """
    if not torch.compiler.is_compiling():
        fast = cpu_fast_path(
            cpu.forward, log_gates, log_tokens, dim, initial, reverse, return_final, backend
        )
        if fast is not None:
            return fast
    p = prepare(
        _NAME,
        log_gates,
        log_tokens,
        dim,
        initial,
        reverse,
        return_final,
        backend,
        names=("log_gates", "log_tokens"),
    )
    if p.backend == "triton" and p.tokens.is_complex():
        # The Triton log kernel is real; "auto" takes the torch backend instead.
        if backend != "auto":
            raise RuntimeError(
                f"{_NAME}: backend 'triton' is not available for complex inputs "
                f"({p.tokens.dtype}); use 'torch' or 'loop' (or 'auto')"
            )
        p = dataclasses.replace(p, backend="torch")
    out = _apply(p.gates, p.tokens, p.initial, p.dim, reverse, p.backend)
    return with_final(out, p, reverse, return_final, -math.inf)
