"""The SSD scan's op: its row of the backend table, and its torch.library ops and
autograd.Functions, made by the core's builder (parascan._core.checkpointed_scan) from
the canonical operands of canonical.py (``cu_seqlens`` among them, as a tensor: its
values are read inside the op, where torch.compile does not trace)."""

from __future__ import annotations

import torch
from torch import Tensor

from parascan._core import Backend, CheckpointedScan, OpBackends, checkpointed_scan, register
from parascan.ssd import chunked, cpu, reference, triton
from parascan.ssd.canonical import OPERANDS, n_chunks, states

__all__ = ["ROW", "apply"]

_STATE_DTYPES = (torch.float32, torch.float64)

# The backend table's row: the dtypes are the state's (float32, or float64).
ROW = register(
    OpBackends(
        op="parascan.ssd_scan",
        backends={
            # the first usable one is "auto"'s choice: the C kernel on CPU tensors
            "cpu": Backend(cpu.forward, cpu.backward, _STATE_DTYPES),
            # "auto" picks it for CUDA tensors only (the interpreter is a testing aid)
            "triton": Backend(triton.forward, triton.backward, _STATE_DTYPES),
            "torch": Backend(chunked.forward_torch, chunked.backward_torch, _STATE_DTYPES),
            "loop": Backend(reference.forward_loop, reference.backward_loop, _STATE_DTYPES),
        },
    )
)

Opt = Tensor | None


def _shapes(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Opt, z: Opt, initial: Opt,
    cu_seqlens: Opt, want_final: bool, backend: str,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    batch, length, heads, headdim = x.shape
    n = B.shape[-1]
    return (
        x.new_empty(batch, length, heads, headdim),
        x.new_empty(states(x, cu_seqlens) if want_final else 0, heads, headdim, n),
        x.new_empty(batch, n_chunks(length, backend), heads, headdim, n),
    )


def _zero_final(tensors: list[Tensor], consts: tuple[object, ...]) -> Tensor:
    x, B = tensors[0], tensors[3]
    return x.new_empty(0, x.shape[2], x.shape[3], B.shape[-1])  # no rows: zeros


# apply(x, dt, A, B, C, D, z, initial, cu_seqlens, want_final, backend) -> (out, final):
# canonical operands on a concrete backend, differentiable; ``final`` has no rows
# without ``want_final``.
apply = checkpointed_scan(
    CheckpointedScan(
        row=ROW,
        name="ssd_scan",
        operands=OPERANDS,
        consts="bool want_final",
        forward_shapes=_shapes,
        zero_final=_zero_final,
        backward_consts=False,  # a grad_final with no rows stands for zeros
    )
)
