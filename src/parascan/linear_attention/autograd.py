"""Linear attention's op: its row of the backend table, and its torch.library ops and
autograd.Functions (parascan._checkpointed.head_state_op)."""

from __future__ import annotations

from parascan._checkpointed import head_state_op
from parascan.linear_attention import chunked, cpu, reference
from parascan.linear_attention.canonical import OPERANDS, n_chunks

__all__ = ["ROW", "apply"]

# The backend table's row (the first usable backend is "auto"'s choice) and
# apply(*operands, want_final, backend) -> (out, final): canonical operands on a
# concrete backend, differentiable; ``final`` has no rows without ``want_final``.
ROW, apply = head_state_op(
    "parascan.linear_attention_scan",
    OPERANDS,
    n_chunks,
    {
        "cpu": (cpu.forward, cpu.backward),
        "torch": (chunked.forward_torch, chunked.backward_torch),
        "loop": (reference.forward_loop, reference.backward_loop),
    },
    {
        "triton": "linear_attention_scan has no Triton kernel (on GPUs flash-linear-attention's "
        "kernels are the reference); use 'auto' (the C kernel on CPUs, 'torch' elsewhere)",
    },
)
