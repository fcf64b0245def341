"""The selective scan's op: its row of the backend table, and its torch.library ops and
autograd.Functions, made by the core's builder (parascan._core.checkpointed_scan) from
the canonical operands of canonical.py."""

from __future__ import annotations

import torch
from torch import Tensor

from parascan._core import Backend, CheckpointedScan, OpBackends, checkpointed_scan, register
from parascan.selective import chunked, cpu, reference, triton
from parascan.selective.canonical import OPERANDS, n_chunks, state_dtype

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
            "torch": Backend(chunked.forward_torch, chunked.backward_torch, _STATE_DTYPES),
            "loop": Backend(reference.forward_loop, reference.backward_loop, _STATE_DTYPES),
        },
    )
)

Opt = Tensor | None


def _shapes(
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


def _zero_final(tensors: list[Tensor], consts: tuple[object, ...]) -> Tensor:
    u, A = tensors[0], tensors[2]
    return u.new_zeros(u.shape[0], u.shape[1], A.shape[-1], dtype=state_dtype(A, u))


# apply(u, delta, A, B, C, D, z, delta_bias, initial, softplus, backend) -> (out, final):
# canonical operands on a concrete backend, differentiable.
apply = checkpointed_scan(
    CheckpointedScan(
        row=ROW,
        name="selective_scan",
        operands=OPERANDS,
        consts="bool softplus",
        forward_shapes=_shapes,
        zero_final=_zero_final,
    )
)
