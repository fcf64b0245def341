"""The ``triton`` backend of the first-order scans: the chunked Triton kernels of
triton_kernels.py (imported here, when the backend first runs), whose ``MODE`` is
the semiring's code."""

from __future__ import annotations

import torch

from parascan._op_utils import conj, state_shape
from parascan.first_order.semiring import LOG, Semiring

__all__ = ["backward", "forward"]


def forward(
    ring: Semiring,
    gates: torch.Tensor,
    tokens: torch.Tensor,
    initial: torch.Tensor | None,
    dim: int,
    reverse: bool,
) -> torch.Tensor:
    """Same contract as ``reference.loop``; tensors of one shape and dtype (real
    ones in the log semiring)."""
    from parascan.first_order import triton_kernels as kernels

    return kernels.forward(ring.code, gates, tokens, initial, dim, reverse)


def backward(
    ring: Semiring,
    gates: torch.Tensor,
    tokens: torch.Tensor | None,
    out: torch.Tensor,
    grad_out: torch.Tensor,
    initial: torch.Tensor | None,
    dim: int,
    reverse: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused backward: one chunked pass the other way, g[t] = G[t] + conj(w[t+1]) g[t+1]
    with w the step's derivative in its previous state (a[t]; in log space
    wu[t] = exp(log a[t] + h[t-1] - h[t])), writing the gradients of tokens and
    gates; then dL/dinitial = conj(w[0]) g[0]."""
    from parascan.first_order import triton_kernels as kernels

    grad_tokens, grad_gates = kernels.backward(
        kernels.BACKWARD + ring.code, gates, grad_out, out,
        tokens if ring.backward_reads_tokens else None, initial, dim, not reverse,
    )  # fmt: skip
    steps = out.shape[dim]
    if steps == 0 or (ring is LOG and initial is None):
        return grad_gates, grad_tokens, out.new_zeros(state_shape(out, dim))
    first = steps - 1 if reverse else 0
    if ring is LOG:
        # the gates' gradient g wu already holds conj(w[0]) g[0] (real)
        return grad_gates, grad_tokens, grad_gates.select(dim, first).clone()
    grad_initial = conj(gates.select(dim, first)) * grad_tokens.select(dim, first)
    return grad_gates, grad_tokens, grad_initial
