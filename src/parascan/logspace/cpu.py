"""The ``cpu`` backend for log_linear_scan: the C kernels of first_order/scan.c in
the log semiring, through parascan._native.bindings."""

from __future__ import annotations

import torch

from parascan._native import bindings

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
    (``verified``: see parascan._native.bindings.scan_forward)."""
    return bindings.scan_forward("log", log_gates, log_tokens, initial, dim, reverse, verified)


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
    gradients of both inputs and of initial once (equations in _native/abi.h)."""
    return bindings.scan_backward(
        "log", log_gates, log_tokens, out, grad_out, initial, dim, reverse
    )
