"""The ``cpu`` backend of the first-order scans: the C kernels (one forward and one
fused backward template, instantiated per semiring and dtype), called through
parascan._native.bindings."""

from __future__ import annotations

import torch

from parascan import _ckernels
from parascan.first_order.semiring import Semiring

__all__ = ["backward", "forward"]


def forward(
    ring: Semiring,
    gates: torch.Tensor,
    tokens: torch.Tensor,
    initial: torch.Tensor | None,
    dim: int,
    reverse: bool,
    verified: bool = False,
) -> torch.Tensor:
    """Same contract as ``reference.loop``; CPU tensors of one dtype (``verified``:
    the caller checked the operands, see parascan._native.bindings.scan_forward)."""
    name = "linear_scan" if ring.name == "linear" else "log_scan"
    return _ckernels.forward(name, gates, tokens, initial, dim, reverse, verified)


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
    """Fused backward: reads gates (and tokens when the semiring's partials need
    them), out and grad_out once; writes the gradients of gates, tokens and initial
    once."""
    if ring.name == "linear":
        inputs: tuple[torch.Tensor, ...] = (gates, out, grad_out)
        return _ckernels.backward("linear_scan", "linear_bwd", inputs, initial, dim, reverse)
    assert tokens is not None
    inputs = (gates, tokens, out, grad_out)
    return _ckernels.backward("log_scan", "log_bwd", inputs, initial, dim, reverse)
