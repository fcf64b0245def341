"""``associative_reduce(torch.matmul, x, dim)`` on the CPU by the C kernel of
generic/cpu.c: each sequence of square matrices multiplied left to right in
cache, on torch's threads, with one call instead of one per tree level.

It is a fast path for the plain eager call only: float32 or float64 CPU tensors
that need no gradient, outside torch.compile, torch.func transforms, forward-mode AD
and dispatch modes. Everything else (and every error) is the generic tree's, which gives the
same product up to rounding.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from parascan._core import plain_eager
from parascan._native import arg_struct, check_operands, kernel, kernel_library_error, simd

__all__ = ["matrix_product_fast_path"]

_MATMULS = (torch.matmul, operator.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__)

# Up to this size the kernel beats the tree of batched torch.matmul calls at every d
# measured, float32 and float64 (BENCHMARKS.md); at 512 torch's blocked matmul is
# ahead, and a few calls more cost nothing next to the products.
_MAX_D = 256
_DTYPES = (torch.float32, torch.float64)


def matrix_product_fast_path(
    combine_fn: Callable[[Any, Any], Any], elems: Tensor, dim: int
) -> Tensor | None:
    """The product along ``dim`` of the square matrices in the last two dims of
    ``elems``, when ``combine_fn`` is torch's matmul and the call qualifies (see the
    module's doc); None otherwise. ``dim`` is already validated and non-negative
    (the generic path's own argument handling): the kernel takes exactly the calls
    in which the tree would multiply the same matrices, i.e. ``dim`` before them."""
    if not any(combine_fn is f for f in _MATMULS) or type(elems) is not torch.Tensor:
        return None
    if not 0 <= dim < elems.dim() - 2:
        return None
    d, dtype = elems.shape[-1], elems.dtype
    steps = elems.shape[dim]
    if (
        dtype not in _DTYPES
        or elems.shape[-2] != d
        or d > _MAX_D
        or steps < 2
        or elems.numel() == 0
        or elems.device.type != "cpu"
        or elems.layout != torch.strided
        or (torch.is_grad_enabled() and elems.requires_grad)
        or not plain_eager()
        or kernel_library_error() is not None
    ):
        return None
    # The kernel reads raw memory: a lazy negative view (e.g. the .imag of a conj
    # view) would lose its sign, so it is materialized first.
    x = elems.resolve_neg().movedim(dim, -3)
    batch = x.shape[:-3]
    x = x.reshape(-1, steps, d, d)  # a view unless the batch dims cannot merge
    # The shapes the kernel indexes, from elems and dim alone (not from x: a guard
    # that read x's own shape could not see a reshape gone wrong).
    sequences = elems.numel() // (steps * d * d)
    check_operands("matmul_reduce", dtype, (x, (sequences, steps, d, d)))
    out = torch.empty((sequences, d, d), dtype=dtype)  # written contiguously
    x_batch, x_step, x_row, x_col = x.stride()
    args = arg_struct(
        "matmul", batch=sequences, steps=steps, d=d, x=x.data_ptr(), x_batch=x_batch,
        x_step=x_step, x_row=x_row, x_col=x_col, out=out.data_ptr(),
        nthreads=torch.get_num_threads(), simd=int(simd()),
    )  # fmt: skip
    status = kernel("matmul_reduce", dtype)(args)
    if status == 2:  # no memory for the kernel's scratch: the tree needs none
        return None
    if status != 0:
        raise RuntimeError(f"parascan: the matrix product kernel rejected {tuple(x.shape)}")
    return out.view(*batch, d, d)
