"""``parascan.linear_scan``: the public first-order linear recurrence."""

from __future__ import annotations

from typing import Any, Literal, overload

import torch
from torch import Tensor

from parascan._scan_api import cpu_fast_path, prepare, with_final
from parascan.linear import cpu
from parascan.linear.ops import (
    backward_via_scan,
    linear_scan_backward_op,
    linear_scan_op,
    previous_states,
)

__all__ = ["linear_scan"]

_NAME = "parascan.linear_scan"


class _LinearScan(torch.autograd.Function):
    """Autograd around the raw ops. Forward and backward are ops with vmap rules,
    so ``generate_vmap_rule`` gives vmap, vmap(grad) and jacrev for free."""

    generate_vmap_rule = True

    @staticmethod
    def forward(
        gates: Tensor, tokens: Tensor, initial: Tensor | None, dim: int, reverse: bool, backend: str
    ) -> Tensor:
        out: Tensor = linear_scan_op(gates, tokens, initial, dim, reverse, backend)
        return out

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        gates, _, initial, dim, reverse, backend = inputs
        ctx.save_for_backward(gates, output, initial)
        ctx.save_for_forward(gates, output, initial)
        ctx.dim, ctx.reverse, ctx.backend = dim, reverse, backend

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        gates, out, initial = ctx.saved_tensors
        if torch.is_grad_enabled():
            # create_graph (double backward, torch.func): the same reverse scan,
            # but through this Function so that it is differentiable again.
            def scan(a: Tensor, b: Tensor, h: Tensor | None, dim: int, reverse: bool) -> Tensor:
                return _apply(a, b, h, dim, reverse, ctx.backend)

            grads = backward_via_scan(scan, gates, out, grad_out, initial, ctx.dim, ctx.reverse)
        else:
            grads = linear_scan_backward_op(
                gates, out, grad_out, initial, ctx.dim, ctx.reverse, ctx.backend
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


class _LinearScanForwardMode(_LinearScan):
    """_LinearScan with forward-mode AD (torch.func.jvp, jacfwd). Kept apart because
    dynamo cannot trace an autograd.Function that defines ``jvp``."""

    @staticmethod
    def jvp(
        ctx: Any, gates_t: Tensor | None, tokens_t: Tensor | None, initial_t: Tensor | None, *_: Any
    ) -> Tensor:
        # Forward mode: the tangent obeys the same recurrence,
        # dx[t] = a[t] dx[t-1] + (da[t] x[t-1] + db[t]),  dx[-1] = d initial.
        gates, out, initial = ctx.saved_tensors
        drive = torch.zeros_like(out) if tokens_t is None else tokens_t
        if gates_t is not None:
            drive = drive + gates_t * previous_states(out, initial, ctx.dim, ctx.reverse)
        return _apply(gates, drive, initial_t, ctx.dim, ctx.reverse, ctx.backend)


def _apply(
    gates: Tensor, tokens: Tensor, initial: Tensor | None, dim: int, reverse: bool, backend: str
) -> Tensor:
    fn = _LinearScan if torch.compiler.is_compiling() else _LinearScanForwardMode
    out: Tensor = fn.apply(gates, tokens, initial, dim, reverse, backend)  # type: ignore[no-untyped-call]
    return out


@overload
def linear_scan(
    gates: Tensor | float,
    tokens: Tensor,
    dim: int,
    *,
    initial: Tensor | float | None = ...,
    reverse: bool = ...,
    return_final: Literal[False] = ...,
    backend: str = ...,
) -> Tensor: ...
@overload
def linear_scan(
    gates: Tensor | float,
    tokens: Tensor,
    dim: int,
    *,
    initial: Tensor | float | None = ...,
    reverse: bool = ...,
    return_final: Literal[True],
    backend: str = ...,
) -> tuple[Tensor, Tensor]: ...


def linear_scan(
    gates: Tensor | float,
    tokens: Tensor,
    dim: int,
    *,
    initial: Tensor | float | None = None,
    reverse: bool = False,
    return_final: bool = False,
    backend: str = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    r"""First-order linear recurrence along ``dim``.

    .. math:: x_t = a_t \, x_{t-1} + b_t, \qquad x_{-1} = \text{initial} \ (\text{default } 0)

    Semantics given by this loop (``reverse=True`` walks ``t`` from T-1 down to 0 and
    reads ``x[t+1]``, with ``x[T] = initial``)::

        x = initial
        for t in range(T):
            x = gates[t] * x + tokens[t]
            out[t] = x

    Args:
        gates: the multipliers ``a``; a tensor or a Python number, broadcast with
            ``tokens``.
        tokens: the inputs ``b``.
        dim: the time dimension of the broadcast result (negative counts from the end).
        initial: the state before the first step, broadcastable to the result's shape
            without ``dim``.
        reverse: run time backwards.
        return_final: also return the last state (``out[T-1]``, or ``out[0]`` when
            reversed; ``initial`` or zeros when T == 0).
        backend: ``"auto"``, ``"cpu"``, ``"triton"``, ``"torch"`` or ``"loop"``; see
            :func:`parascan.backends`.

    Returns:
        ``out``, contiguous, with the broadcast shape and dtype
        ``torch.result_type(gates, tokens)``; or ``(out, final)``. float16 and bfloat16
        accumulate in float32. Differentiable in gates, tokens and initial (gradients
        are reduced to each input's shape), under vmap, torch.func and torch.compile.

    Example:
        >>> import torch, parascan as ps
        >>> ps.linear_scan(torch.tensor([1.0, 0.5, 2.0]), torch.tensor([1.0, 1.0, 1.0]), 0)
        tensor([1.0000, 1.5000, 4.0000])
        >>> ps.linear_scan(0.5, torch.ones(3), 0, reverse=True)
        tensor([1.7500, 1.5000, 1.0000])
        >>> out, final = ps.linear_scan(0.5, torch.ones(2, 3), 1, initial=torch.tensor([0.0, 4.0]),
        ...                             return_final=True)
        >>> out
        tensor([[1.0000, 1.5000, 1.7500],
                [3.0000, 2.5000, 2.2500]])
        >>> final
        tensor([1.7500, 2.2500])
    """
    if not torch.compiler.is_compiling():
        fast = cpu_fast_path(
            cpu.forward, gates, tokens, dim, initial, reverse, return_final, backend
        )
        if fast is not None:
            return fast
    p = prepare(_NAME, gates, tokens, dim, initial, reverse, return_final, backend)
    out = _apply(p.gates, p.tokens, p.initial, p.dim, reverse, p.backend)
    return with_final(out, p, reverse, return_final, 0.0)
