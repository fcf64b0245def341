"""The ``cpu`` backend for log_linear_scan: ctypes bindings to cpu_kernel.c (the
shared machinery is parascan._ckernels)."""

from __future__ import annotations

import torch

from parascan import _ckernels

__all__ = ["backward", "forward"]


def forward(
    log_gates: torch.Tensor,
    log_tokens: torch.Tensor,
    initial: torch.Tensor | None,
    dim: int,
    reverse: bool,
    verified: bool = False,
) -> torch.Tensor:
    """Same contract as ``reference.forward``; CPU tensors of one dtype
    (``verified``: see parascan._ckernels.forward)."""
    return _ckernels.forward("log_scan", log_gates, log_tokens, initial, dim, reverse, verified)


def backward(
    log_gates: torch.Tensor,
    log_tokens: torch.Tensor,
    out: torch.Tensor,
    grad_out: torch.Tensor,
    initial: torch.Tensor | None,
    dim: int,
    reverse: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused backward: reads both inputs, out and grad_out once; writes the
    gradients of both inputs and of initial once (equations in cpu_kernel.h)."""
    return _ckernels.backward(
        "log_scan", "log_bwd", (log_gates, log_tokens, out, grad_out), initial, dim, reverse
    )
