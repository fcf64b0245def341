"""The selective scan's raw ops (torch.library) and the autograd.Function around them.

``parascan::selective_scan`` and ``parascan::selective_scan_backward`` take the
canonical operands of canonical.py and a concrete backend; they carry fake kernels
(torch.compile) and vmap rules, and ``_SelectiveScan`` (an autograd.Function with
``generate_vmap_rule``: see first_order/ops.py for why not register_autograd) gives
them gradients.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from parascan._backends import Backend, OpBackends, register
from parascan._op_utils import (
    jvp_through,
    loop_vmap,
    nested_forward_mode,
    refuse_second_derivatives,
    resolved,
    resolved_optional,
)
from parascan.ssm import cpu, reference, triton
from parascan.ssm.canonical import n_chunks, state_dtype

__all__ = ["ROW", "apply"]

_STATE_DTYPES = (torch.float32, torch.float64, torch.complex64, torch.complex128)

# The backend table's row: the dtypes are the state's (complex when A is).
ROW = register(
    OpBackends(
        op="parascan.selective_scan",
        backends={
            "cpu": Backend(cpu.forward, cpu.backward, _STATE_DTYPES),
            "triton": Backend(
                triton.forward,
                triton.backward,
                (torch.float32, torch.float64),
                unsupported="{dtype} states (a complex A): its kernels take a real A; use "
                "'torch' (or 'auto')",
            ),
            "torch": Backend(reference.forward_torch, reference.backward_torch, _STATE_DTYPES),
            "loop": Backend(reference.forward_loop, reference.backward_loop, _STATE_DTYPES),
        },
    )
)

Opt = Tensor | None


def _resolved_all(*ts: Opt) -> list[Opt]:
    return [resolved_optional(t) for t in ts]


@torch.library.custom_op("parascan::selective_scan", mutates_args=())
def _forward_op(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Opt, z: Opt,
    delta_bias: Opt, initial: Opt, softplus: bool, backend: str,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """(out, final, checkpoints) of canonical operands; see canonical.py. Contiguous
    whatever the backend returns, as the fake kernel says (torch.compile's graphs
    assert the strides it reports)."""
    args = _resolved_all(u, delta, A, B, C, D, z, delta_bias, initial)
    out, final, checkpoints = ROW.backends[backend].forward(*args, softplus)
    return out.contiguous(), final.contiguous(), checkpoints.contiguous()


@_forward_op.register_fake
def _(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Opt, z: Opt,
    delta_bias: Opt, initial: Opt, softplus: bool, backend: str,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    batch, dim, length = u.shape
    n = A.shape[-1]
    sd = state_dtype(A, u)
    return (
        u.new_empty(batch, dim, length),
        u.new_empty(batch, dim, n, dtype=sd),
        u.new_empty(batch, dim, n_chunks(length, backend), n, dtype=sd),
    )


@torch.library.custom_op("parascan::selective_scan_backward", mutates_args=())
def _backward_op(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Opt, z: Opt,
    delta_bias: Opt, initial: Opt, softplus: bool, backend: str, checkpoints: Tensor,
    grad_out: Tensor, grad_final: Tensor,
) -> list[Tensor]:  # fmt: skip
    """The 9 gradients of canonical.py's backward (empty for absent operands), each
    contiguous (not in its operand's layout: the fake kernel says so)."""
    args = _resolved_all(u, delta, A, B, C, D, z, delta_bias, initial)
    backward = ROW.backends[backend].backward
    assert backward is not None
    grads = backward(*args, softplus, checkpoints, resolved(grad_out), resolved(grad_final))
    return [g.contiguous() for g in grads]


@_backward_op.register_fake
def _(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Opt, z: Opt,
    delta_bias: Opt, initial: Opt, softplus: bool, backend: str, checkpoints: Tensor,
    grad_out: Tensor, grad_final: Tensor,
) -> list[Tensor]:  # fmt: skip
    return [
        t.new_empty(t.shape) if t is not None else u.new_empty(0)
        for t in (u, delta, A, B, C, D, z, delta_bias, initial)
    ]


torch.library.register_vmap("parascan::selective_scan", loop_vmap(_forward_op))
torch.library.register_vmap("parascan::selective_scan_backward", loop_vmap(_backward_op))


class _SelectiveScanBackward(torch.autograd.Function):
    """The backward op as a function of its own, so that torch.func transforms can
    run it (they track the backward's operations); differentiating it again raises."""

    generate_vmap_rule = True

    @staticmethod
    def forward(
        u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Opt, z: Opt,
        delta_bias: Opt, initial: Opt, softplus: bool, backend: str, checkpoints: Tensor,
        grad_out: Tensor, grad_final: Tensor,
    ) -> tuple[Tensor, ...]:  # fmt: skip
        # spelled out: torch.compile tells forward(ctx, ...) from forward(...) by name
        return tuple(
            _backward_op(
                u,
                delta,
                A,
                B,
                C,
                D,
                z,
                delta_bias,
                initial,
                softplus,
                backend,
                checkpoints,
                grad_out,
                grad_final,
            )
        )

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        refuse_second_derivatives("parascan.selective_scan")


class _SelectiveScanBackwardForwardMode(_SelectiveScanBackward):
    """Forward mode over the backward (jacfwd of jacrev: hessians) raises the same error
    as differentiating the backward; apart, as dynamo cannot trace a Function with jvp."""

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        refuse_second_derivatives("parascan.selective_scan")


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    *tensors, softplus, backend = inputs
    # The same tensors for backward and forward mode: under vmap (generate_vmap_rule)
    # torch keeps the vmapped dims of the last call's tensors only and reads them for
    # both; a shorter save_for_forward broke every backward through a vmapped scan (grad
    # of vmap; jacrev of jacfwd, whose jvp vmaps the primals too, of a non-linear f)
    # with torch's internal "flat_bdims must not be None".
    ctx.save_for_backward(*tensors, output[2])
    ctx.save_for_forward(*tensors, output[2])
    ctx.softplus, ctx.backend = softplus, backend
    # an unused output's gradient arrives as None, not as a tensor of zeros to fill
    # (the checkpoints': (batch, dim, chunks, N)); backward makes what it needs
    ctx.set_materialize_grads(False)


class _SelectiveScan(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(
        u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Opt, z: Opt,
        delta_bias: Opt, initial: Opt, softplus: bool, backend: str,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        result: tuple[Tensor, Tensor, Tensor] = _forward_op(
            u, delta, A, B, C, D, z, delta_bias, initial, softplus, backend
        )
        return result

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
        _setup_context(ctx, inputs, output)
        ctx.mark_non_differentiable(output[2])

    @staticmethod
    def backward(ctx: Any, grad_out: Opt, grad_final: Opt, _: Opt) -> tuple[Opt, ...]:
        *tensors, checkpoints = ctx.saved_tensors
        u, A = tensors[0], tensors[2]
        batch, dim, _length = u.shape
        if grad_out is None:
            grad_out = torch.zeros_like(u)
        if grad_final is None:
            grad_final = u.new_zeros(batch, dim, A.shape[-1], dtype=state_dtype(A, u))
        fn = (
            _SelectiveScanBackward
            if torch.compiler.is_compiling()
            else _SelectiveScanBackwardForwardMode
        )
        grads = fn.apply(  # type: ignore[no-untyped-call]
            *tensors, ctx.softplus, ctx.backend, checkpoints, grad_out, grad_final
        )
        need = ctx.needs_input_grad
        return (
            *(g if need[i] and tensors[i] is not None else None for i, g in enumerate(grads)),
            None,
            None,
        )


class _SelectiveScanForwardMode(_SelectiveScan):
    """_SelectiveScan with forward-mode AD (torch.func.jvp, jacfwd). Kept apart because
    dynamo cannot trace an autograd.Function that defines ``jvp``."""

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
        # The checkpoints stay differentiable here, with a zero tangent (jvp): under vmap,
        # torch's generated rule passes mark_non_differentiable the batched output, which
        # marks nothing, and then fails on a None tangent (jvp, jacfwd of a vmapped scan).
        # Nothing reads them outside the op; backward gets None for them.
        _setup_context(ctx, inputs, output)

    @staticmethod
    def jvp(ctx: Any, *tangents: Opt) -> tuple[Opt, ...]:
        # The kernels have no forward mode: the tangents come from forward-mode AD
        # through the torch backend's chunked forward (one chunk's states at a time),
        # at the primal point the scan ran at.
        def forward(*ops: Opt) -> tuple[Tensor, Tensor]:
            out, final, _ = reference.forward_torch(*ops, ctx.softplus)
            return out, final

        if nested_forward_mode():  # forward over forward: see nested_forward_mode
            refuse_second_derivatives("parascan.selective_scan")
        *operands, checkpoints = ctx.saved_tensors
        t_out, t_final = jvp_through(forward, tuple(operands), tangents[:9])
        return t_out, t_final, torch.zeros_like(checkpoints)


def apply(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Opt, z: Opt,
    delta_bias: Opt, initial: Opt, softplus: bool, backend: str,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(out, final) of canonical operands on a concrete backend, differentiable."""
    fn = _SelectiveScan if torch.compiler.is_compiling() else _SelectiveScanForwardMode
    out, final, _ = fn.apply(  # type: ignore[no-untyped-call]
        u, delta, A, B, C, D, z, delta_bias, initial, softplus, backend
    )
    return out, final
