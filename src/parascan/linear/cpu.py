"""The ``cpu`` backend for linear_scan: the C kernels of first_order/scan.c in the
linear semiring, through parascan._native.bindings."""

from __future__ import annotations

import torch

from parascan._native import bindings

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
    (``verified``: see parascan._native.bindings.scan_forward)."""
    return bindings.scan_forward("linear", gates, tokens, initial, dim, reverse, verified)


def backward(
    gates: torch.Tensor,
    out: torch.Tensor,
    grad_out: torch.Tensor,
    initial: torch.Tensor | None,
    dim: int,
    reverse: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused backward: reads gates, out and grad_out once; writes the gradients of
    gates, tokens and initial once (see _native/abi.h for the equations)."""
    return bindings.scan_backward("linear", gates, None, out, grad_out, initial, dim, reverse)
