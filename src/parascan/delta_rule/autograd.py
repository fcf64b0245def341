"""The delta-rule scan's op: its row of the backend table, and its torch.library ops
and autograd.Functions, made by the core's builder (parascan._core.checkpointed_scan)
from the canonical operands of canonical.py."""

from __future__ import annotations

import torch
from torch import Tensor

from parascan._checkpointed import states
from parascan._core import Backend, CheckpointedScan, OpBackends, checkpointed_scan, register
from parascan.delta_rule import chunked, cpu, reference
from parascan.delta_rule.canonical import OPERANDS, n_chunks

__all__ = ["ROW", "apply"]

_STATE_DTYPES = (torch.float32, torch.float64)

# The backend table's row: the dtypes are the state's (float32, or float64).
ROW = register(
    OpBackends(
        op="parascan.delta_rule_scan",
        backends={
            # the first usable one is "auto"'s choice: the C kernel on CPU tensors, the
            # chunked torch form elsewhere (on GPUs flash-linear-attention is the anchor)
            "cpu": Backend(cpu.forward, cpu.backward, _STATE_DTYPES),
            "torch": Backend(chunked.forward_torch, chunked.backward_torch, _STATE_DTYPES),
            "loop": Backend(reference.forward_loop, reference.backward_loop, _STATE_DTYPES),
        },
        missing={
            "triton": "delta_rule_scan has no Triton kernel (on GPUs flash-linear-attention's "
            "kernels are the reference); use 'torch' (or 'auto', which picks it)",
        },
    )
)

Opt = Tensor | None


def _shapes(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Opt, initial: Opt, cu_seqlens: Opt,
    want_final: bool, backend: str,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    batch, length, heads, dv = v.shape
    dk = k.shape[-1]
    return (
        v.new_empty(batch, length, heads, dv),
        v.new_empty(states(v, cu_seqlens) if want_final else 0, heads, dk, dv),
        v.new_empty(batch, n_chunks(length, backend), heads, dk, dv),
    )


def _zero_final(tensors: list[Tensor], consts: tuple[object, ...]) -> Tensor:
    k, v = tensors[1], tensors[2]
    return v.new_empty(0, v.shape[2], k.shape[-1], v.shape[-1])  # no rows: zeros


# apply(q, k, v, beta, g, initial, cu_seqlens, want_final, backend) -> (out, final):
# canonical operands on a concrete backend, differentiable; ``final`` has no rows
# without ``want_final``.
apply = checkpointed_scan(
    CheckpointedScan(
        row=ROW,
        name="delta_rule_scan",
        operands=OPERANDS,
        consts="bool want_final",
        forward_shapes=_shapes,
        zero_final=_zero_final,
        backward_consts=False,  # a grad_final with no rows stands for zeros
        out_like=2,  # v
    )
)
