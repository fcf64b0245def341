"""The ``triton`` backend for log_linear_scan (real inputs): the chunked Triton
kernels of parascan._triton_scan (imported here, when the backend first runs)."""

from __future__ import annotations

import torch

from parascan._op_utils import state_shape

__all__ = ["backward", "forward"]


def forward(
    log_gates: torch.Tensor,
    log_tokens: torch.Tensor,
    initial: torch.Tensor | None,
    dim: int,
    reverse: bool,
) -> torch.Tensor:
    """Same contract as ``reference.forward``; real tensors of one shape and dtype."""
    from parascan import _triton_scan as kernels

    return kernels.forward(kernels.LOG, log_gates, log_tokens, initial, dim, reverse)


def backward(
    log_gates: torch.Tensor,
    log_tokens: torch.Tensor,
    out: torch.Tensor,
    grad_out: torch.Tensor,
    initial: torch.Tensor | None,
    dim: int,
    reverse: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused backward: g[t] = G[t] + wu[t+1] g[t+1] with the step weights
    wu[t] = exp(log a[t] + h[t-1] - h[t]), in one chunked pass the other way, writing
    dL/dlog_b = g exp(log b - h) and dL/dlog_a = g wu; dL/dinitial = g[0] wu[0]."""
    from parascan import _triton_scan as kernels

    grad_tokens, grad_gates = kernels.backward(
        kernels.LOG_BWD, log_gates, grad_out, out, log_tokens, initial, dim, not reverse
    )
    steps = out.shape[dim]
    if steps == 0 or initial is None:
        return grad_gates, grad_tokens, out.new_zeros(state_shape(out, dim))
    # d h[0] / d initial is the step weight of h[0], the same as d h[0] / d log a[0]
    first = steps - 1 if reverse else 0
    return grad_gates, grad_tokens, grad_gates.select(dim, first).clone()
