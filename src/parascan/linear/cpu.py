"""The ``cpu`` backend for linear_scan: ctypes bindings to cpu_kernel.c (the
shared machinery is parascan._ckernels)."""

from __future__ import annotations

import torch

from parascan import _ckernels
from parascan._ckernels import ARG_STRUCTS, dims3, kernel, state2, view3

__all__ = ["backward", "forward"]


def forward(
    gates: torch.Tensor,
    tokens: torch.Tensor,
    initial: torch.Tensor | None,
    dim: int,
    reverse: bool,
) -> torch.Tensor:
    """Same contract as ``reference.forward``; CPU tensors of one dtype."""
    return _ckernels.forward("linear_scan", gates, tokens, initial, dim, reverse)


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
    dim %= out.dim()
    dims = dims3(out.shape, dim)
    grad_gates = torch.empty(out.shape, dtype=out.dtype)
    grad_tokens = torch.empty(out.shape, dtype=out.dtype)
    grad_initial = torch.empty((*out.shape[:dim], *out.shape[dim + 1 :]), dtype=out.dtype)
    (a, a_s), (x, x_s), (gx, gx_s) = (view3(t, dims) for t in (gates, out, grad_out))
    (ga, ga_s), (gb, gb_s) = view3(grad_gates, dims), view3(grad_tokens, dims)
    h_keep, h = state2(initial, dims[0], dims[2])
    args = ARG_STRUCTS["linear_bwd"](
        *dims, a.data_ptr(), *a_s, x.data_ptr(), *x_s, gx.data_ptr(), *gx_s,
        *h, ga.data_ptr(), *ga_s, gb.data_ptr(), *gb_s, grad_initial.data_ptr(), dims[2], 1,
        reverse, torch.get_num_threads(),
    )  # fmt: skip
    if kernel("linear_scan_bwd", out.dtype)(args) != 0:
        raise RuntimeError(f"parascan: linear_scan CPU kernel rejected shape {dims}")
    del h_keep
    return grad_gates, grad_tokens, grad_initial
