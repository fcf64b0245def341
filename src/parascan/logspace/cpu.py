"""The ``cpu`` backend for log_linear_scan: ctypes bindings to cpu_kernel.c (the
shared machinery is parascan._ckernels)."""

from __future__ import annotations

import torch

from parascan import _ckernels
from parascan._ckernels import ARG_STRUCTS, dims3, kernel, state2, view3

__all__ = ["backward", "forward"]


def forward(
    log_gates: torch.Tensor,
    log_tokens: torch.Tensor,
    initial: torch.Tensor | None,
    dim: int,
    reverse: bool,
) -> torch.Tensor:
    """Same contract as ``reference.forward``; CPU tensors of one dtype."""
    return _ckernels.forward("log_scan", log_gates, log_tokens, initial, dim, reverse)


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
    dim %= out.dim()
    dims = dims3(out.shape, dim)
    grad_gates = torch.empty(out.shape, dtype=out.dtype)
    grad_tokens = torch.empty(out.shape, dtype=out.dtype)
    grad_initial = torch.empty((*out.shape[:dim], *out.shape[dim + 1 :]), dtype=out.dtype)
    (a, a_s), (b, b_s), (x, x_s), (gx, gx_s) = (
        view3(t, dims) for t in (log_gates, log_tokens, out, grad_out)
    )
    (ga, ga_s), (gb, gb_s) = view3(grad_gates, dims), view3(grad_tokens, dims)
    h_keep, h = state2(initial, dims[0], dims[2])
    args = ARG_STRUCTS["log_bwd"](
        *dims, a.data_ptr(), *a_s, b.data_ptr(), *b_s, x.data_ptr(), *x_s,
        gx.data_ptr(), *gx_s, *h, ga.data_ptr(), *ga_s, gb.data_ptr(), *gb_s,
        grad_initial.data_ptr(), dims[2], 1, reverse, torch.get_num_threads(),
    )  # fmt: skip
    if kernel("log_scan_bwd", out.dtype)(args) != 0:
        raise RuntimeError(f"parascan: log_linear_scan CPU kernel rejected shape {dims}")
    del h_keep
    return grad_gates, grad_tokens, grad_initial
