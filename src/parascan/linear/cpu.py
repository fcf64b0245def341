"""The ``cpu`` backend for linear_scan: ctypes bindings to cpu_kernel.c (the
shared machinery is parascan._ckernels)."""

from __future__ import annotations

import torch

from parascan import _ckernels

__all__ = ["backward", "forward"]


def forward(
    gates: torch.Tensor,
    tokens: torch.Tensor,
    initial: torch.Tensor | None,
    dim: int,
    reverse: bool,
    verified: bool = False,
) -> torch.Tensor:
    """Same contract as ``reference.forward``; CPU tensors of one dtype
    (``verified``: see parascan._ckernels.forward)."""
    return _ckernels.forward("linear_scan", gates, tokens, initial, dim, reverse, verified)


def backward(
    gates: torch.Tensor,
    out: torch.Tensor,
    grad_out: torch.Tensor,
    initial: torch.Tensor | None,
    dim: int,
    reverse: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused backward: reads gates, out and grad_out once; writes the gradients of
    gates, tokens and initial once (see cpu_kernel.h for the equations)."""
    return _ckernels.backward(
        "linear_scan", "linear_bwd", (gates, out, grad_out), initial, dim, reverse
    )
