"""The ``cpu`` backend for linear_scan: ctypes bindings to cpu_kernel.c.

Inputs arrive with lazy conj/neg views resolved (ops.py). Each tensor goes to the
kernel as a strided 3-d view (outer, T, inner) around the scan dim, without copying
when its strides allow it (contiguous, transposed, sliced and broadcast inputs all
do). Outputs are new contiguous tensors.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import torch

from parascan._native import kernel_library

__all__ = ["backward", "forward"]

_SUFFIX = {
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float32: "f32",
    torch.float64: "f64",
    torch.complex64: "c64",
    torch.complex128: "c128",
}

_Strides3 = ctypes.c_int64 * 3
_Strides2 = ctypes.c_int64 * 2


class _ForwardArgs(ctypes.Structure):
    _fields_ = [
        ("outer", ctypes.c_int64),
        ("steps", ctypes.c_int64),
        ("inner", ctypes.c_int64),
        ("gates", ctypes.c_void_p),
        ("gates_stride", _Strides3),
        ("tokens", ctypes.c_void_p),
        ("tokens_stride", _Strides3),
        ("initial", ctypes.c_void_p),
        ("initial_stride", _Strides2),
        ("out", ctypes.c_void_p),
        ("out_stride", _Strides3),
        ("reverse", ctypes.c_int64),
        ("nthreads", ctypes.c_int64),
    ]


class _BackwardArgs(ctypes.Structure):
    _fields_ = [
        ("outer", ctypes.c_int64),
        ("steps", ctypes.c_int64),
        ("inner", ctypes.c_int64),
        ("gates", ctypes.c_void_p),
        ("gates_stride", _Strides3),
        ("out", ctypes.c_void_p),
        ("out_stride", _Strides3),
        ("grad_out", ctypes.c_void_p),
        ("grad_out_stride", _Strides3),
        ("initial", ctypes.c_void_p),
        ("initial_stride", _Strides2),
        ("grad_gates", ctypes.c_void_p),
        ("grad_gates_stride", _Strides3),
        ("grad_tokens", ctypes.c_void_p),
        ("grad_tokens_stride", _Strides3),
        ("grad_initial", ctypes.c_void_p),
        ("grad_initial_stride", _Strides2),
        ("reverse", ctypes.c_int64),
        ("nthreads", ctypes.c_int64),
    ]


def _kernel(direction: str, dtype: torch.dtype) -> Any:
    fn = getattr(kernel_library(), f"ps_linear_scan_{direction}_{_SUFFIX[dtype]}")
    fn.restype = ctypes.c_int
    return fn


def _dims(shape: torch.Size, dim: int) -> tuple[int, int, int]:
    return math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1 :])


def _as3(
    t: torch.Tensor, dims: tuple[int, int, int]
) -> tuple[torch.Tensor, ctypes.Array[ctypes.c_int64]]:
    """A (outer, T, inner) view of ``t`` (a copy only when no view exists)."""
    t3 = t.reshape(dims)
    return t3, _Strides3(*t3.stride())


def _as2(
    t: torch.Tensor | None, outer: int, inner: int
) -> tuple[torch.Tensor | None, ctypes.Array[ctypes.c_int64]]:
    if t is None:
        return None, _Strides2(0, 0)
    t2 = t.reshape(outer, inner)
    return t2, _Strides2(*t2.stride())


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def forward(
    gates: torch.Tensor,
    tokens: torch.Tensor,
    initial: torch.Tensor | None,
    dim: int,
    reverse: bool,
) -> torch.Tensor:
    """Same contract as ``reference.forward``; CPU tensors of one dtype."""
    dim %= tokens.dim()
    dims = _dims(tokens.shape, dim)
    out = torch.empty(tokens.shape, dtype=tokens.dtype)
    a, a_s = _as3(gates, dims)
    b, b_s = _as3(tokens, dims)
    h, h_s = _as2(initial, dims[0], dims[2])
    x = out.view(dims)
    args = _ForwardArgs(
        *dims, a.data_ptr(), a_s, b.data_ptr(), b_s, _ptr(h), h_s,
        x.data_ptr(), _Strides3(*x.stride()), int(reverse), torch.get_num_threads(),
    )  # fmt: skip
    if _kernel("fwd", tokens.dtype)(ctypes.byref(args)) != 0:
        raise RuntimeError(f"parascan: linear_scan CPU kernel rejected shape {dims}")
    return out


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
    dims = _dims(out.shape, dim)
    grad_gates = torch.empty(out.shape, dtype=out.dtype)
    grad_tokens = torch.empty(out.shape, dtype=out.dtype)
    state_shape = out.shape[:dim] + out.shape[dim + 1 :]
    grad_initial = torch.empty(state_shape, dtype=out.dtype)
    a, a_s = _as3(gates, dims)
    x, x_s = _as3(out, dims)
    gx, gx_s = _as3(grad_out, dims)
    h, h_s = _as2(initial, dims[0], dims[2])
    ga, gb = grad_gates.view(dims), grad_tokens.view(dims)
    gh = grad_initial.view(dims[0], dims[2])
    args = _BackwardArgs(
        *dims, a.data_ptr(), a_s, x.data_ptr(), x_s, gx.data_ptr(), gx_s, _ptr(h), h_s,
        ga.data_ptr(), _Strides3(*ga.stride()), gb.data_ptr(), _Strides3(*gb.stride()),
        gh.data_ptr(), _Strides2(*gh.stride()), int(reverse), torch.get_num_threads(),
    )  # fmt: skip
    if _kernel("bwd", out.dtype)(ctypes.byref(args)) != 0:
        raise RuntimeError(f"parascan: linear_scan CPU kernel rejected shape {dims}")
    return grad_gates, grad_tokens, grad_initial
