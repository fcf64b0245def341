"""The ``cpu`` backend of matrix_linear_scan: ctypes bindings to cpu.c."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from parascan._native import arg_struct, check_operands, kernel

__all__ = ["DTYPES", "forward"]

DTYPES = (torch.float32, torch.float64)


def _flat_batch(t: Tensor, batch: tuple[int, ...], own: int) -> Tensor:
    """``t`` expanded to ``batch`` and its batch dims flattened to one: a view when
    the expanded strides allow it (shared or contiguous batches), else a copy."""
    t = t.expand(*batch, *t.shape[len(t.shape) - own :])
    return t.reshape(math.prod(batch), *t.shape[len(batch) :])


def forward(weights: Tensor, biases: Tensor, initial: Tensor | None, reverse: bool) -> Tensor:
    """x[t] = W[t] @ x[t-1] + b[t] over ``(*batch, T, d, d)`` weights, ``(*batch, T, d)``
    biases and ``(*batch, d)`` initial (batch dims broadcast; None is zeros), one
    dtype of ``DTYPES``, CPU tensors."""
    steps, d = biases.shape[-2], biases.shape[-1]
    if initial is None:
        initial = biases.new_zeros(d)
    batch = torch.broadcast_shapes(weights.shape[:-3], biases.shape[:-2], initial.shape[:-1])
    w = _flat_batch(weights, batch, 3)
    b = _flat_batch(biases, batch, 2)
    h = _flat_batch(initial, batch, 1)
    b = b if b.stride(-1) == 1 else b.contiguous()
    h = h if h.stride(-1) == 1 else h.contiguous()
    nbatch = w.shape[0]
    out = torch.empty((nbatch, steps, d), dtype=biases.dtype)  # written contiguously
    check_operands(
        "matrix_linear_scan_fwd", biases.dtype, (w, (nbatch, steps, d, d)),
        (b, (nbatch, steps, d)), (h, (nbatch, d)),
    )  # fmt: skip
    w_batch, w_step, w_row, w_col = w.stride()
    args = arg_struct(
        "matrix_linear_scan", batch=nbatch, steps=steps, d=d, weights=w.data_ptr(),
        w_batch=w_batch, w_step=w_step, w_row=w_row, w_col=w_col, biases=b.data_ptr(),
        b_batch=b.stride(0), b_step=b.stride(1), initial=h.data_ptr(), i_batch=h.stride(0),
        out=out.data_ptr(), reverse=int(reverse), nthreads=torch.get_num_threads(),
    )  # fmt: skip
    if kernel("matrix_linear_scan_fwd", biases.dtype)(args) != 0:
        raise RuntimeError(f"parascan: matrix_linear_scan CPU kernel rejected {tuple(w.shape)}")
    return out.view(*batch, steps, d)
