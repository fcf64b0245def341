"""The ``cpu`` backend of the first-order scans: the C kernels of this folder (one
forward and one fused backward template, cpu_forward.h and cpu_backward.h,
instantiated per semiring and dtype in cpu.c), through parascan._native.bindings."""

from __future__ import annotations

import torch

from parascan._native import bindings
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
    see parascan._native.bindings.scan_forward)."""
    return bindings.scan_forward(ring.name, gates, tokens, initial, dim, reverse, verified)


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
    """Fused backward: reads gates (and tokens, when the semiring's partials need
    them), out and grad_out once; writes the gradients of gates, tokens and initial
    once (the equations: _native/abi.h)."""
    if not ring.backward_reads_tokens:
        tokens = None
    return bindings.scan_backward(ring.name, gates, tokens, out, grad_out, initial, dim, reverse)
