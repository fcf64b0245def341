"""ctypes bindings of the first-order scans' C kernels (linear_scan and
log_linear_scan, dense and packed; first_order/cpu.c).

Each tensor goes to a kernel as a strided 3-d view (outer, T, inner) around the
scan dim, without copying when its strides allow it (contiguous, transposed,
sliced and broadcast inputs all do). Outputs are new contiguous tensors. Inputs
arrive with lazy conj/neg views resolved (first_order/ops.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from parascan._native import arg_struct, check_operands, kernel

__all__ = [
    "dims3",
    "scan_backward",
    "scan_forward",
    "state2",
    "view3",
]

# The first-order scans' C entry points per semiring (first_order/cpu.c).
_SCAN_OP = {"linear": "linear_scan", "log": "log_linear_scan"}
_SCAN_FWD = {s: f"{op}_fwd" for s, op in _SCAN_OP.items()}
_SCAN_BWD = {s: f"{op}_bwd" for s, op in _SCAN_OP.items()}


def _time_dim(name: str, dim: int, ndim: int) -> int:
    """``dim`` made non-negative; out of range is a bug upstream, never a wrap."""
    if not -ndim <= dim < ndim:
        raise RuntimeError(
            f"parascan: internal error: the {name} CPU kernel got dim {dim} for {ndim} dims"
        )
    return dim % ndim


def dims3(shape: torch.Size, dim: int) -> tuple[int, int, int]:
    return math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1 :])


def view3(t: torch.Tensor, dims: tuple[int, int, int]) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``t`` seen as (outer, T, inner): the tensor to read (a copy only when no view
    exists; the caller holds it while the kernel runs) and its three strides.
    Contiguous tensors, the common case, need no view object at all."""
    if t.is_contiguous():
        return t, (dims[1] * dims[2], dims[2], 1)
    v = t.reshape(dims)
    return v, v.stride()  # type: ignore[return-value]


def state2(
    t: torch.Tensor | None, outer: int, inner: int
) -> tuple[torch.Tensor | None, tuple[int, int, int]]:
    """A state tensor as (outer, inner), and its (data pointer, strides) for the
    kernel (NULL for None). The caller holds the tensor while the kernel runs: it
    may be a copy that nothing else references."""
    if t is None:
        return None, (0, 0, 0)
    t2 = t.reshape(outer, inner)
    return t2, (t2.data_ptr(), t2.stride(0), t2.stride(1))


def _varlen_states(
    entry: str, cu_seqlens: torch.Tensor, dims: tuple[int, int, int],
    initial: torch.Tensor | None, grad_initial: torch.Tensor | None = None,
) -> tuple[Any, tuple[int, int, int], tuple[int, int, int], list[torch.Tensor]]:  # fmt: skip
    """For packed sequences: the ps_varlen_args; sequence 0 of ``initial`` and of
    ``grad_initial`` as the scan's struct takes them ((data pointer, strides) of the
    state seen as (outer, nseq, inner); NULL for None); and the views those pointers
    belong to (a copy of ``initial`` where no view exists; ``grad_initial`` is fresh
    and contiguous, so its view writes into it), held by the caller while the kernel
    runs."""
    nseq = cu_seqlens.numel() - 1
    if (
        cu_seqlens.dtype != torch.int64
        or cu_seqlens.device.type != "cpu"
        or cu_seqlens.dim() != 1
        or not cu_seqlens.is_contiguous()
        or nseq < 0
    ):
        raise RuntimeError(
            f"parascan: internal error: the {entry} CPU kernel takes cu_seqlens as a contiguous "
            f"non-empty int64 CPU vector, but was handed {cu_seqlens.dtype} "
            f"{tuple(cu_seqlens.shape)} on {cu_seqlens.device}"
        )
    keep = [cu_seqlens]
    found: list[tuple[tuple[int, int, int], int]] = []
    for t in (initial, grad_initial):
        if t is None:
            found.append(((0, 0, 0), 0))
        else:
            v = t.reshape(dims[0], nseq, dims[2])
            keep.append(v)
            found.append(((v.data_ptr(), v.stride(0), v.stride(2)), v.stride(1)))
    (h, h_seq), (gh, gh_seq) = found
    varlen = arg_struct(
        "varlen", cu_seqlens=cu_seqlens.data_ptr(), nseq=nseq, initial_seq_stride=h_seq,
        grad_initial_seq_stride=gh_seq,
    )  # fmt: skip
    return varlen, h, gh, keep


def _state_shape(shape: torch.Size, dim: int, cu_seqlens: torch.Tensor | None) -> tuple[int, ...]:
    """A state's shape: ``dim`` removed, or of size num_seqs for packed sequences."""
    if cu_seqlens is None:
        return (*shape[:dim], *shape[dim + 1 :])
    return (*shape[:dim], max(cu_seqlens.numel() - 1, 0), *shape[dim + 1 :])


def _call(entry: str, dtype: torch.dtype, args: Any, varlen: Any, op: str, dims: Any) -> None:
    fn = kernel(entry if varlen is None else f"{entry}_varlen", dtype)
    if (fn(args) if varlen is None else fn(args, varlen)) != 0:
        raise RuntimeError(f"parascan: {op} CPU kernel rejected shape {dims}")


def scan_forward(
    semiring: str,
    gates: torch.Tensor,
    tokens: torch.Tensor,
    initial: torch.Tensor | None,
    dim: int,
    reverse: bool,
    verified: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """The first-order scan of ``semiring`` (``"linear"``: linear_scan, ``"log"``:
    log_linear_scan) by its C forward: CPU tensors of one shape and dtype,
    ``initial`` of that shape without ``dim``. ``verified``: the caller (the eager
    fast path, first_order.api.fast_path) has checked exactly what check_operands
    checks, a few microseconds not spent twice. ``cu_seqlens`` (an int64 CPU vector of
    offsets along ``dim``, 0 first, the length last, non-decreasing): packed sequences,
    each scanned from its own state; ``initial`` then has ``dim`` of size num_seqs."""
    entry = _SCAN_FWD[semiring]
    shape = tokens.shape
    if not verified:
        dim = _time_dim(_SCAN_OP[semiring], dim, tokens.dim())
        state = _state_shape(shape, dim, cu_seqlens)
        check_operands(entry, tokens.dtype, (gates, shape), (tokens, shape), (initial, state))
    dim %= len(shape)
    dims = dims3(shape, dim)
    out = torch.empty(shape, dtype=tokens.dtype)
    (a, a_s), (b, b_s), (x, x_s) = view3(gates, dims), view3(tokens, dims), view3(out, dims)
    keep: object  # what the pointers belong to, held while the kernel runs
    if cu_seqlens is None:
        varlen, (keep, h) = None, state2(initial, dims[0], dims[2])
    else:
        varlen, h, _, keep = _varlen_states(entry, cu_seqlens, dims, initial)
    args = arg_struct(
        "scan_fwd", outer=dims[0], steps=dims[1], inner=dims[2], gates=(a.data_ptr(), *a_s),
        tokens=(b.data_ptr(), *b_s), initial=h, out=(x.data_ptr(), *x_s), reverse=int(reverse),
        nthreads=torch.get_num_threads(),
    )  # fmt: skip
    _call(entry, tokens.dtype, args, varlen, _SCAN_OP[semiring], dims)
    del keep
    return out


def scan_backward(
    semiring: str,
    gates: torch.Tensor,
    tokens: torch.Tensor | None,
    out: torch.Tensor,
    grad_out: torch.Tensor,
    initial: torch.Tensor | None,
    dim: int,
    reverse: bool,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused backward of ``semiring``'s scan (see scan_forward): reads gates,
    tokens (log only: the linear backward never reads them, and takes None), the
    forward's ``out`` and ``grad_out`` once, and returns the gradients of gates,
    tokens and initial as new tensors, each written once (equations in abi.h); for
    packed sequences the gradient of ``initial`` has its shape, 0 for an empty one."""
    entry = _SCAN_BWD[semiring]
    dim = _time_dim(_SCAN_OP[semiring], dim, gates.dim())
    shape = gates.shape  # every tensor has the shape and dtype of the gradients
    state = _state_shape(shape, dim, cu_seqlens)
    check_operands(
        entry, gates.dtype, (gates, shape), (tokens, shape), (out, shape), (grad_out, shape),
        (initial, state),
    )  # fmt: skip
    dims = dims3(shape, dim)
    grad_gates = torch.empty(shape, dtype=gates.dtype)
    grad_tokens = torch.empty(shape, dtype=gates.dtype)
    grad_initial = torch.empty(state, dtype=gates.dtype)
    (a, a_s), (x, x_s), (gx, gx_s) = view3(gates, dims), view3(out, dims), view3(grad_out, dims)
    (ga, ga_s), (gb, gb_s) = view3(grad_gates, dims), view3(grad_tokens, dims)
    b, b_s = view3(tokens, dims) if tokens is not None else (None, (0, 0, 0))
    keep: object  # what the pointers belong to, held while the kernel runs
    if cu_seqlens is None:
        varlen, (keep, h) = None, state2(initial, dims[0], dims[2])
        gh = (grad_initial.data_ptr(), dims[2], 1)
    else:
        varlen, h, gh, keep = _varlen_states(entry, cu_seqlens, dims, initial, grad_initial)
    args = arg_struct(
        "scan_bwd", outer=dims[0], steps=dims[1], inner=dims[2], gates=(a.data_ptr(), *a_s),
        tokens=(0 if b is None else b.data_ptr(), *b_s), out=(x.data_ptr(), *x_s),
        grad_out=(gx.data_ptr(), *gx_s), initial=h, grad_gates=(ga.data_ptr(), *ga_s),
        grad_tokens=(gb.data_ptr(), *gb_s), grad_initial=gh, reverse=int(reverse),
        nthreads=torch.get_num_threads(),
    )  # fmt: skip
    _call(entry, gates.dtype, args, varlen, _SCAN_OP[semiring], dims)
    del keep
    return grad_gates, grad_tokens, grad_initial
