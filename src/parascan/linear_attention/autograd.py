"""Linear attention's op: its row of the backend table, and its torch.library ops and
autograd.Functions, made by the core's builder (parascan._core.checkpointed_scan)
from the canonical operands of canonical.py."""

from __future__ import annotations

import torch

from parascan._checkpointed import head_state_shapes
from parascan._core import Backend, CheckpointedScan, OpBackends, checkpointed_scan, register
from parascan.linear_attention import chunked, cpu, reference
from parascan.linear_attention.canonical import OPERANDS, n_chunks

__all__ = ["ROW", "apply"]

_STATE_DTYPES = (torch.float32, torch.float64)

# The backend table's row: the dtypes are the state's (float32, or float64).
ROW = register(
    OpBackends(
        op="parascan.linear_attention_scan",
        backends={
            # the first usable one is "auto"'s choice: the C kernel on CPU tensors, the
            # chunked torch form elsewhere
            "cpu": Backend(cpu.forward, cpu.backward, _STATE_DTYPES),
            "torch": Backend(chunked.forward_torch, chunked.backward_torch, _STATE_DTYPES),
            "loop": Backend(reference.forward_loop, reference.backward_loop, _STATE_DTYPES),
        },
        missing={
            "triton": "linear_attention_scan has no Triton kernel (on GPUs flash-linear-"
            "attention's kernels are the reference); use 'torch' (or 'auto', which picks it)",
        },
    )
)

_shapes, _zero_final = head_state_shapes(OPERANDS, n_chunks)

# apply(q, k, v, g, initial, cu_seqlens, want_final, backend) -> (out, final): canonical
# operands on a concrete backend, differentiable; ``final`` has no rows without
# ``want_final``.
apply = checkpointed_scan(
    CheckpointedScan(
        row=ROW,
        name="linear_attention_scan",
        operands=OPERANDS,
        consts="bool want_final",
        forward_shapes=_shapes,
        zero_final=_zero_final,
        backward_consts=False,  # a grad_final with no rows stands for zeros
        out_like=2,  # v
    )
)
