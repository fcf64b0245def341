"""The SSD scan's raw ops (torch.library) and the autograd.Function around them.

``parascan::ssd_scan`` and ``parascan::ssd_scan_backward`` take the canonical
operands of ssd_canonical.py (``cu_seqlens`` among them, as a tensor: its values are
read inside the op, where torch.compile does not trace) and a concrete backend; they
carry fake kernels (torch.compile) and vmap rules, and ``_SSDScan`` (an
autograd.Function with ``generate_vmap_rule``, as in ops.py) gives them gradients.
Every op takes its tensors first and the backend's name last.
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
from parascan.ssm import ssd_cpu, ssd_triton
from parascan.ssm import ssd_reference as reference
from parascan.ssm.ssd_canonical import n_chunks

__all__ = ["ROW", "apply"]

_STATE_DTYPES = (torch.float32, torch.float64)

# The backend table's row: the dtypes are the state's (float32, or float64).
ROW = register(
    OpBackends(
        op="parascan.ssd_scan",
        backends={
            # the first usable one is "auto"'s choice: the C kernel on CPU tensors
            "cpu": Backend(ssd_cpu.forward, ssd_cpu.backward, _STATE_DTYPES),
            # "auto" picks it for CUDA tensors only (the interpreter is a testing aid)
            "triton": Backend(ssd_triton.forward, ssd_triton.backward, _STATE_DTYPES),
            "torch": Backend(reference.forward_torch, reference.backward_torch, _STATE_DTYPES),
            "loop": Backend(reference.forward_loop, reference.backward_loop, _STATE_DTYPES),
        },
    )
)

Opt = Tensor | None


def _resolved_all(*ts: Opt) -> list[Opt]:
    return [resolved_optional(t) for t in ts]


@torch.library.custom_op("parascan::ssd_scan", mutates_args=())
def _forward_op(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Opt, z: Opt, initial: Opt,
    cu_seqlens: Opt, want_final: bool, backend: str,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """(out, final, checkpoints) of canonical operands; see ssd_canonical.py. Without
    ``want_final``, ``final`` has no rows (the C kernel then stores none: with many
    packed sequences that was a state's write per sequence nobody read)."""
    args = _resolved_all(x, dt, A, B, C, D, z, initial)
    if backend == "cpu":
        out, final, checkpoints = ssd_cpu.forward(*args, cu_seqlens, want_final=want_final)
    else:
        out, final, checkpoints = ROW.backends[backend].forward(*args, cu_seqlens)
        final = final if want_final else final.new_empty(0, *final.shape[1:])
    # contiguous whatever the backend returns, as the fake kernel says (torch.compile's
    # graphs assert the strides it reports)
    return out.contiguous(), final.contiguous(), checkpoints.contiguous()


def _states(x: Tensor, cu_seqlens: Opt) -> int:
    """The number of final states: the batch, or the packed sequences."""
    return x.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1


@_forward_op.register_fake
def _(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Opt, z: Opt, initial: Opt,
    cu_seqlens: Opt, want_final: bool, backend: str,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    batch, length, heads, headdim = x.shape
    n = B.shape[-1]
    return (
        x.new_empty(batch, length, heads, headdim),
        x.new_empty(_states(x, cu_seqlens) if want_final else 0, heads, headdim, n),
        x.new_empty(batch, n_chunks(length, backend), heads, headdim, n),
    )


@torch.library.custom_op("parascan::ssd_scan_backward", mutates_args=())
def _backward_op(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Opt, z: Opt, initial: Opt,
    cu_seqlens: Opt, checkpoints: Tensor, grad_out: Tensor, grad_final: Tensor, backend: str,
) -> list[Tensor]:  # fmt: skip
    """The 8 gradients of ssd_canonical.py's backward (empty for absent operands).
    ``grad_final`` with no rows stands for zeros (the C kernel then reads none)."""
    args = _resolved_all(x, dt, A, B, C, D, z, initial)
    backward = ROW.backends[backend].backward
    assert backward is not None
    grad_final = resolved(grad_final)
    if backend != "cpu" and grad_final.shape[0] != _states(x, cu_seqlens):
        grad_final = grad_final.new_zeros(_states(x, cu_seqlens), *grad_final.shape[1:])
    grads = backward(*args, cu_seqlens, checkpoints, resolved(grad_out), grad_final)
    return [g.contiguous() for g in grads]  # not in the operands' layouts: as the fake


@_backward_op.register_fake
def _(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Opt, z: Opt, initial: Opt,
    cu_seqlens: Opt, checkpoints: Tensor, grad_out: Tensor, grad_final: Tensor, backend: str,
) -> list[Tensor]:  # fmt: skip
    return [
        t.new_empty(t.shape) if t is not None else x.new_empty(0)
        for t in (x, dt, A, B, C, D, z, initial)
    ]


torch.library.register_vmap("parascan::ssd_scan", loop_vmap(_forward_op))
torch.library.register_vmap("parascan::ssd_scan_backward", loop_vmap(_backward_op))


class _SSDScanBackward(torch.autograd.Function):
    """The backward op as a function of its own, so that torch.func transforms can
    run it (they track the backward's operations); differentiating it again raises."""

    generate_vmap_rule = True

    @staticmethod
    def forward(
        x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Opt, z: Opt, initial: Opt,
        cu_seqlens: Opt, checkpoints: Tensor, grad_out: Tensor, grad_final: Tensor, backend: str,
    ) -> tuple[Tensor, ...]:  # fmt: skip
        # spelled out: torch.compile tells forward(ctx, ...) from forward(...) by name
        return tuple(
            _backward_op(
                x,
                dt,
                A,
                B,
                C,
                D,
                z,
                initial,
                cu_seqlens,
                checkpoints,
                grad_out,
                grad_final,
                backend,
            )
        )

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        refuse_second_derivatives("parascan.ssd_scan")


class _SSDScanBackwardForwardMode(_SSDScanBackward):
    """Forward mode over the backward (jacfwd of jacrev: hessians) raises the same error
    as differentiating the backward; apart, as dynamo cannot trace a Function with jvp."""

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        refuse_second_derivatives("parascan.ssd_scan")


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    *tensors, want_final, backend = inputs
    # The same tensors for backward and forward mode: under vmap (generate_vmap_rule)
    # torch keeps the vmapped dims of the last call's tensors only (see ops.py).
    ctx.save_for_backward(*tensors, output[2])
    ctx.save_for_forward(*tensors, output[2])
    ctx.backend, ctx.want_final = backend, want_final
    # an unused output's gradient arrives as None, not as a tensor of zeros to fill
    # (the checkpoints': 3 MiB at (1, 512, 24, 64, 64)); backward makes what it needs
    ctx.set_materialize_grads(False)


class _SSDScan(torch.autograd.Function):
    generate_vmap_rule = True

    @staticmethod
    def forward(
        x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Opt, z: Opt, initial: Opt,
        cu_seqlens: Opt, want_final: bool, backend: str,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        result: tuple[Tensor, Tensor, Tensor] = _forward_op(
            x, dt, A, B, C, D, z, initial, cu_seqlens, want_final, backend
        )
        return result

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
        _setup_context(ctx, inputs, output)
        ctx.mark_non_differentiable(output[2])

    @staticmethod
    def backward(ctx: Any, grad_out: Opt, grad_final: Opt, _: Opt) -> tuple[Opt, ...]:
        *tensors, checkpoints = ctx.saved_tensors
        x, B = tensors[0], tensors[3]
        _batch, _length, heads, headdim = x.shape
        if grad_out is None:
            grad_out = torch.zeros_like(x)
        if grad_final is None:  # no rows: zeros (_backward_op)
            grad_final = x.new_empty(0, heads, headdim, B.shape[-1])
        fn = _SSDScanBackward if torch.compiler.is_compiling() else _SSDScanBackwardForwardMode
        grads = fn.apply(  # type: ignore[no-untyped-call]
            *tensors, checkpoints, grad_out, grad_final, ctx.backend
        )
        need = ctx.needs_input_grad
        return (
            *(g if need[i] and tensors[i] is not None else None for i, g in enumerate(grads)),
            None,  # cu_seqlens
            None,  # want_final
            None,  # backend
        )


class _SSDScanForwardMode(_SSDScan):
    """_SSDScan with forward-mode AD (torch.func.jvp, jacfwd). Kept apart because
    dynamo cannot trace an autograd.Function that defines ``jvp``."""

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
        # The checkpoints stay differentiable here, with a zero tangent (jvp): see ops.py.
        _setup_context(ctx, inputs, output)

    @staticmethod
    def jvp(ctx: Any, *tangents: Opt) -> tuple[Opt, ...]:
        # The kernels have no forward mode: the tangents come from forward-mode AD
        # through the torch backend's forward (the dual form a chunk at a time), at the
        # primal point the scan ran at.
        def forward(*ops: Opt) -> tuple[Tensor, Tensor]:
            out, final, _ = reference.forward_torch(*ops)
            return out, final

        if nested_forward_mode():  # forward over forward: see nested_forward_mode
            refuse_second_derivatives("parascan.ssd_scan")
        *operands, checkpoints = ctx.saved_tensors
        t_out, t_final = jvp_through(forward, tuple(operands), tangents[:9])
        return t_out, t_final if ctx.want_final else t_final[:0], torch.zeros_like(checkpoints)


def apply(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Opt, z: Opt, initial: Opt,
    cu_seqlens: Opt, backend: str, want_final: bool = True,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """(out, final) of canonical operands on a concrete backend, differentiable;
    ``final`` has no rows without ``want_final``."""
    fn = _SSDScan if torch.compiler.is_compiling() else _SSDScanForwardMode
    out, final, _ = fn.apply(  # type: ignore[no-untyped-call]
        x, dt, A, B, C, D, z, initial, cu_seqlens, want_final, backend
    )
    return out, final
