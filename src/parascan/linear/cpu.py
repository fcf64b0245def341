"""The ``cpu`` backend for linear_scan: ctypes bindings to cpu_kernel.c.

Inputs arrive with lazy conj/neg views resolved (ops.py). Each tensor goes to the
kernel as a strided 3-d view (outer, T, inner) around the scan dim, without copying
when its strides allow it (contiguous, transposed, sliced and broadcast inputs all
do). Outputs are new contiguous tensors.

The argument structs of cpu_kernel.h are passed as flat int64 arrays, in the
structs' member order (every member is 64 bits wide): building one array is a
single call, which keeps a small scan's Python overhead to a few microseconds.
"""

from __future__ import annotations

import ctypes
import functools
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

# ps_scan_fwd_args: outer, steps, inner, gates, gates_stride[3], tokens,
# tokens_stride[3], initial, initial_stride[2], out, out_stride[3], reverse, nthreads
_ForwardArgs = ctypes.c_int64 * 20
# ps_linear_bwd_args: outer, steps, inner, gates, stride[3], out, stride[3], grad_out,
# stride[3], initial, stride[2], grad_gates, stride[3], grad_tokens, stride[3],
# grad_initial, stride[2], reverse, nthreads
_BackwardArgs = ctypes.c_int64 * 31


@functools.cache
def _checked_library() -> ctypes.CDLL:
    """The kernel library, once its argument structs are checked against ours."""
    lib = kernel_library()
    for name, args in (("scan_fwd", _ForwardArgs), ("linear_bwd", _BackwardArgs)):
        size = getattr(lib, f"ps_{name}_args_size")
        size.restype = ctypes.c_int64
        if size() != ctypes.sizeof(args):
            raise RuntimeError(
                f"parascan: the kernel library's ps_{name}_args has {size()} bytes, "
                f"these bindings expect {ctypes.sizeof(args)}; rebuild it (pip install -e .)"
            )
    return lib


@functools.cache
def _kernel(direction: str, dtype: torch.dtype) -> Any:
    fn = getattr(_checked_library(), f"ps_linear_scan_{direction}_{_SUFFIX[dtype]}")
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p]
    return fn


def _dims(shape: torch.Size, dim: int) -> tuple[int, int, int]:
    return math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1 :])


def _view3(
    t: torch.Tensor, dims: tuple[int, int, int]
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``t`` seen as (outer, T, inner): the tensor to read (a copy only when no view
    exists; the caller holds it while the kernel runs) and its three strides.
    Contiguous tensors, the common case, need no view object at all."""
    if t.is_contiguous():
        return t, (dims[1] * dims[2], dims[2], 1)
    v = t.reshape(dims)
    return v, v.stride()  # type: ignore[return-value]


def _state(
    t: torch.Tensor | None, outer: int, inner: int
) -> tuple[torch.Tensor | None, tuple[int, int, int]]:
    """A state tensor as (outer, inner), and its (data pointer, strides) for the
    kernel (NULL for None). The caller holds the tensor while the kernel runs: it
    may be a copy that nothing else references."""
    if t is None:
        return None, (0, 0, 0)
    t2 = t.reshape(outer, inner)
    return t2, (t2.data_ptr(), t2.stride(0), t2.stride(1))


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
    (a, a_s), (b, b_s), (x, x_s) = _view3(gates, dims), _view3(tokens, dims), _view3(out, dims)
    h_keep, h = _state(initial, dims[0], dims[2])
    args = _ForwardArgs(
        *dims, a.data_ptr(), *a_s, b.data_ptr(), *b_s, *h,
        x.data_ptr(), *x_s, reverse, torch.get_num_threads(),
    )  # fmt: skip
    if _kernel("fwd", tokens.dtype)(args) != 0:
        raise RuntimeError(f"parascan: linear_scan CPU kernel rejected shape {dims}")
    del h_keep
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
    grad_initial = torch.empty((*out.shape[:dim], *out.shape[dim + 1 :]), dtype=out.dtype)
    (a, a_s), (x, x_s), (gx, gx_s) = (_view3(t, dims) for t in (gates, out, grad_out))
    (ga, ga_s), (gb, gb_s) = _view3(grad_gates, dims), _view3(grad_tokens, dims)
    h_keep, h = _state(initial, dims[0], dims[2])
    args = _BackwardArgs(
        *dims, a.data_ptr(), *a_s, x.data_ptr(), *x_s, gx.data_ptr(), *gx_s,
        *h, ga.data_ptr(), *ga_s, gb.data_ptr(), *gb_s, grad_initial.data_ptr(), dims[2], 1,
        reverse, torch.get_num_threads(),
    )  # fmt: skip
    if _kernel("bwd", out.dtype)(args) != 0:
        raise RuntimeError(f"parascan: linear_scan CPU kernel rejected shape {dims}")
    del h_keep
    return grad_gates, grad_tokens, grad_initial
