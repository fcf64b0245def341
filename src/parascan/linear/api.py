"""``parascan.linear_scan``: the public first-order linear recurrence."""

from __future__ import annotations

from typing import Any, Literal, overload

import torch
from torch import Tensor

from parascan._backends import resolve_backend
from parascan._checks import (
    FLOAT_DTYPES,
    as_operand,
    broadcast_shape,
    check_dtype,
    check_same_device,
    describe,
    normalize_dim,
    result_dtype,
)
from parascan._native import kernel_library_error
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


def _plain_eager() -> bool:
    """True when the call runs eagerly: no torch.compile, no torch.func transform, no
    dispatch mode. (Tensor subclasses, fake or functional, are ruled out by the
    caller's exact type checks.)"""
    return (
        not torch.compiler.is_compiling()
        and not torch._C._are_functorch_transforms_active()
        and torch._C._len_torch_dispatch_stack() == 0
    )


def _cpu_fast_path(
    gates: object, tokens: object, dim: object, initial: object, reverse: object, backend: object
) -> Tensor | None:
    """The cpu kernel called directly, for the common call that needs nothing of the
    op machinery: plain CPU tensors of one shape and dtype that need no gradient.
    Returns None (take the general path, which validates everything and owns every
    error message) for anything else. A small scan costs microseconds in the
    kernel, so the tens of microseconds of dispatch are what this path saves."""
    if not (
        type(gates) is torch.Tensor
        and type(tokens) is torch.Tensor
        and (initial is None or type(initial) is torch.Tensor)
        and type(dim) is int
        and type(reverse) is bool
        and backend in ("auto", "cpu")
    ):
        return None
    dtype, shape = tokens.dtype, tokens.shape
    if (
        gates.dtype != dtype
        or gates.shape != shape
        or dtype not in FLOAT_DTYPES
        or tokens.device.type != "cpu"
        or gates.device.type != "cpu"
        or not -len(shape) <= dim < len(shape)
        or gates.is_conj()
        or tokens.is_conj()
        or gates.is_neg()
        or tokens.is_neg()
        or (torch.is_grad_enabled() and (gates.requires_grad or tokens.requires_grad))
        or not _plain_eager()
        or kernel_library_error() is not None
    ):
        return None
    if initial is not None:
        d = dim % len(shape)
        if (
            initial.dtype != dtype
            or initial.device.type != "cpu"
            or initial.shape != shape[:d] + shape[d + 1 :]
            or initial.is_conj()
            or initial.is_neg()
            or (torch.is_grad_enabled() and initial.requires_grad)
        ):
            return None
    return cpu.forward(gates, tokens, initial, dim, reverse)


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
    if not return_final and not torch.compiler.is_compiling():
        fast = _cpu_fast_path(gates, tokens, dim, initial, reverse, backend)
        if fast is not None:
            return fast
    tokens = as_operand(_NAME, "tokens", tokens, allow_number=False)
    gates = as_operand(_NAME, "gates", gates, allow_number=True, like=tokens)
    check_dtype(_NAME, "gates", gates)
    check_dtype(_NAME, "tokens", tokens)
    named = [("gates", gates), ("tokens", tokens)]
    if initial is not None:
        initial = as_operand(_NAME, "initial", initial, allow_number=True, like=tokens)
        check_dtype(_NAME, "initial", initial)
        named.append(("initial", initial))
    check_same_device(_NAME, named)
    shape = broadcast_shape(_NAME, [("gates", gates.shape), ("tokens", tokens.shape)])
    scalar = len(shape) == 0
    if scalar:  # like torch.cumsum, a 0-d input is a sequence of length 1
        shape = (1,)
    d = normalize_dim(_NAME, dim, len(shape))
    dtype = result_dtype(_NAME, gates, tokens)
    state_shape = shape[:d] + shape[d + 1 :]
    if initial is not None:
        if initial.is_complex() and not dtype.is_complex:
            raise TypeError(
                f"{_NAME}: expected a real initial for a real result ({dtype}), "
                f"but got {initial.dtype}"
            )
        if len(initial.shape) > len(state_shape) or (
            broadcast_shape(
                _NAME, [("result without dim", state_shape), ("initial", initial.shape)]
            )
            != state_shape
        ):
            raise ValueError(
                f"{_NAME}: expected initial broadcastable to the result's shape without dim "
                f"{state_shape}, but got {describe(initial)}"
            )
        initial = initial.to(dtype).expand(state_shape)
    if not isinstance(reverse, bool) or not isinstance(return_final, bool):
        raise TypeError(
            f"{_NAME}: expected bool reverse and return_final, but got "
            f"{describe(reverse)} and {describe(return_final)}"
        )
    chosen = resolve_backend(_NAME, backend, tokens.device)

    a = gates.to(dtype).expand(shape)
    b = tokens.to(dtype).expand(shape)
    out = _apply(a, b, initial, d - len(shape), reverse, chosen)
    if not return_final:
        return out.reshape(()) if scalar else out
    steps = shape[d]
    if steps == 0:
        final = out.new_zeros(state_shape) if initial is None else initial.clone()
    else:
        final = out.select(d, 0 if reverse else steps - 1).clone()
    if scalar:
        return out.reshape(()), final.reshape(())
    return out, final
