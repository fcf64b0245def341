"""The ``triton`` backend for linear_scan: the chunked Triton kernels of
parascan._triton_scan (imported here, when the backend first runs)."""

from __future__ import annotations

import torch

from parascan._op_utils import conj, state_shape

__all__ = ["backward", "forward"]


def forward(
    gates: torch.Tensor,
    tokens: torch.Tensor,
    initial: torch.Tensor | None,
    dim: int,
    reverse: bool,
) -> torch.Tensor:
    """Same contract as ``reference.forward``; tensors of one shape and dtype."""
    from parascan import _triton_scan as kernels

    return kernels.forward(kernels.LINEAR, gates, tokens, initial, dim, reverse)


def backward(
    gates: torch.Tensor,
    out: torch.Tensor,
    grad_out: torch.Tensor,
    initial: torch.Tensor | None,
    dim: int,
    reverse: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused backward: one chunked pass the other way, g[t] = G[t] + conj(a[t+1]) g[t+1],
    writing dL/db = g and dL/da = g conj(x[t-1]); then dL/dinitial = conj(a[0]) g[0]."""
    from parascan import _triton_scan as kernels

    grad_tokens, grad_gates = kernels.backward(
        kernels.LINEAR_BWD, gates, grad_out, out, None, initial, dim, not reverse
    )
    steps = out.shape[dim]
    if steps == 0:
        return grad_gates, grad_tokens, out.new_zeros(state_shape(out, dim))
    first = steps - 1 if reverse else 0
    grad_initial = conj(gates.select(dim, first)) * grad_tokens.select(dim, first)
    return grad_gates, grad_tokens, grad_initial
