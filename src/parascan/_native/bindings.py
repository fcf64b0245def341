"""ctypes bindings of the C kernels (linear_scan, log_linear_scan,
matrix_linear_scan, the matrix products of associative_reduce, and the selective
scan, whose wrapper is selective/cpu.py).

Each tensor goes to a kernel as a strided 3-d view (outer, T, inner) around the
scan dim, without copying when its strides allow it (contiguous, transposed,
sliced and broadcast inputs all do). Outputs are new contiguous tensors. Inputs
arrive with lazy conj/neg views resolved (each family's autograd.py or ops.py).

The argument structs of abi.h are passed as flat int64 arrays, in the structs'
member order (every member is 64 bits wide): building one array is a single call,
which keeps a small scan's Python overhead to a few microseconds.
"""

from __future__ import annotations

import ctypes
import functools
import math
import re
from typing import Any

import torch

from parascan._native import kernel_library

__all__ = [
    "ARG_FIELDS",
    "ARG_STRUCTS",
    "arg_struct",
    "check_operands",
    "dims3",
    "kernel",
    "kernel_constants",
    "scan_backward",
    "scan_forward",
    "state2",
    "view3",
]

_SUFFIX = {
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float32: "f32",
    torch.float64: "f64",
    torch.complex64: "c64",
    torch.complex128: "c128",
}


def _tensor(name: str, dims: int) -> tuple[str, ...]:
    """A tensor's members: its data pointer, then its strides (``name_stride[i]``)."""
    return (name, *(f"{name}_stride[{i}]" for i in range(dims)))


# ps_selective_operands, the first member of both selective scan structs.
_SELECTIVE_OPERANDS = (
    "batch", "dim", "length", "nstate", "chunk", *_tensor("u", 3), *_tensor("delta", 3),
    *_tensor("A", 2), *_tensor("B", 4), "B_groups", "B_complex", *_tensor("C", 4),
    "C_groups", "C_complex", "D", "D_stride", *_tensor("z", 3),
    "delta_bias", "delta_bias_stride", *_tensor("initial", 3), "softplus", "nthreads",
)  # fmt: skip

# The argument structs of abi.h (ps_<name>_args), member by member: the one Python
# copy of their layouts. Each is passed as a flat int64 array of that many members,
# its size checked against the library's ps_<name>_args_size() once.
ARG_FIELDS: dict[str, tuple[str, ...]] = {
    "scan_fwd": (
        "outer", "steps", "inner", *_tensor("gates", 3), *_tensor("tokens", 3),
        *_tensor("initial", 2), *_tensor("out", 3), "reverse", "nthreads",
    ),
    "scan_bwd": (
        "outer", "steps", "inner", *_tensor("gates", 3), *_tensor("tokens", 3),
        *_tensor("out", 3), *_tensor("grad_out", 3), *_tensor("initial", 2),
        *_tensor("grad_gates", 3), *_tensor("grad_tokens", 3), *_tensor("grad_initial", 2),
        "reverse", "nthreads",
    ),
    "varlen": ("cu_seqlens", "nseq", "initial_seq_stride", "grad_initial_seq_stride"),
    "matrix_linear_scan": (
        "batch", "steps", "d", "weights", "w_batch", "w_step", "w_row", "w_col",
        "biases", "b_batch", "b_step", "initial", "i_batch", "out", "reverse", "nthreads",
    ),
    "matmul": (
        "batch", "steps", "d", "x", "x_batch", "x_step", "x_row", "x_col", "out",
        "nthreads", "simd",
    ),
    "selective_fwd": (
        *_SELECTIVE_OPERANDS, *_tensor("out", 3), *_tensor("final", 3),
        *_tensor("checkpoints", 4),
    ),
    "selective_bwd": (
        *_SELECTIVE_OPERANDS, *_tensor("checkpoints", 4), *_tensor("grad_out", 3),
        *_tensor("grad_final", 3), *_tensor("grad_u", 3), *_tensor("grad_delta", 3),
        *_tensor("grad_A", 2), *_tensor("grad_B", 4), *_tensor("grad_C", 4),
        "grad_D", "grad_D_stride", *_tensor("grad_z", 3),
        "grad_delta_bias", "grad_delta_bias_stride", *_tensor("grad_initial", 3),
    ),
    "selective_step": (
        "batch", "heads", "headdim", "nstate", "B_groups", "C_groups", *_tensor("state", 4),
        *_tensor("x", 3), *_tensor("dt", 3), *_tensor("A", 3), *_tensor("B", 3), *_tensor("C", 3),
        *_tensor("D", 2), *_tensor("z", 3), *_tensor("dt_bias", 2), *_tensor("out", 3),
        "softplus", "nthreads",
    ),
    "ssd": (
        "batch", "length", "heads", "headdim", "groups", "nstate", "chunk", "cu_seqlens",
        "nseq", "x", "dt", "A", "B", "C", "D", "z", "initial", "out", "final", "checkpoints",
        "grad_out", "grad_final", "grad_x", "grad_dt", "grad_A", "grad_B", "grad_C", "grad_D",
        "grad_z", "grad_initial", "nthreads", "simd", "failed",
    ),
    "ssd_conv": (
        "batch", "length", "channels", "width", *_tensor("x", 2), "weight", "bias", "silu",
        "split[0]", "split[1]", "split[2]", "out[0]", "out[1]", "out[2]", "grad_out[0]",
        "grad_out[1]", "grad_out[2]", *_tensor("grad_x", 2), "grad_weight", "grad_bias",
        "nthreads", "simd", "failed",
    ),
    "ssd_norm": (
        "batch", "length", "dim", "groups", "y", *_tensor("z", 2), "weight", "eps_bits",
        "before_gate", "out", "rstd", "grad_out", "grad_y", *_tensor("grad_z", 2), "grad_weight",
        "nthreads", "simd", "failed",
    ),
}  # fmt: skip
ARG_STRUCTS: dict[str, type[ctypes.Array[ctypes.c_int64]]] = {
    name: ctypes.c_int64 * len(fields) for name, fields in ARG_FIELDS.items()
}


def _groups(fields: tuple[str, ...]) -> dict[str, tuple[int, int]]:
    """A struct's members by name, as (first index, count): a tensor's pointer and its
    strides (``x``, ``x_stride[0]``, ...) and an array's elements (``split[0]``, ...)
    are one name, filled from a sequence."""
    groups: dict[str, tuple[int, int]] = {}
    last = ""
    for i, field in enumerate(fields):
        stride = re.fullmatch(r"(\w+)_stride(\[\d+\])?", field)
        name = last if stride and stride[1] == last else re.sub(r"\[\d+\]$", "", field)
        first, count = groups.get(name, (i, 0))
        groups[name] = (first, count + 1)
        last = name
    return groups


_GROUPS = {kind: _groups(fields) for kind, fields in ARG_FIELDS.items()}


def _builder(kind: str) -> Any:
    """The constructor of ps_<kind>_args that takes its members by field name
    (keyword-only; see arg_struct), generated once: Python binds the names, so
    filling a struct by name costs no more than filling it by position."""
    groups, size = _GROUPS[kind], len(ARG_FIELDS[kind])
    params = ", ".join(
        f"{name}=0" if count == 1 else f"{name}=({'0, ' * count})"
        for name, (_, count) in groups.items()
    )
    row = ", ".join(name if count == 1 else f"*{name}" for name, (_, count) in groups.items())
    source = (
        f"def build(*, {params}):\n"
        f"    row = ({row},)\n"
        f"    if len(row) != {size}:\n"
        f"        raise TypeError(f'parascan: internal error: ps_{kind}_args takes {size} '\n"
        f"                        f'members, not {{len(row)}}')\n"
        f"    return struct(*row)\n"
    )
    scope: dict[str, Any] = {"struct": ARG_STRUCTS[kind]}
    exec(source, scope)  # the source is built from ARG_FIELDS alone
    return scope["build"]


_BUILDERS: dict[str, Any] = {kind: _builder(kind) for kind in ARG_FIELDS}


def arg_struct(kind: str, **members: int | tuple[int, ...]) -> Any:
    """The struct ps_<kind>_args with its members filled by field name (ARG_FIELDS):
    a scalar by its value; a tensor by its (data pointer, *strides) and an array by
    its elements, each a sequence of the member's length. Members not named are 0."""
    return _BUILDERS[kind](**members)


# The first-order scans' C entry points per semiring (first_order/cpu.c).
_SCAN_OP = {"linear": "linear_scan", "log": "log_linear_scan"}
_SCAN_FWD = {s: f"{op}_fwd" for s, op in _SCAN_OP.items()}
_SCAN_BWD = {s: f"{op}_bwd" for s, op in _SCAN_OP.items()}


@functools.cache
def _checked_library() -> ctypes.CDLL:
    """The kernel library, once its argument structs are checked against ours."""
    lib = kernel_library()
    for name, args in ARG_STRUCTS.items():
        size = getattr(lib, f"ps_{name}_args_size")
        size.restype = ctypes.c_int64
        if size() != ctypes.sizeof(args):
            raise RuntimeError(
                f"parascan: the kernel library's ps_{name}_args has {size()} bytes, "
                f"these bindings expect {ctypes.sizeof(args)}; rebuild it (pip install -e .)"
            )
    return lib


@functools.cache
def kernel(name: str, dtype: torch.dtype) -> Any:
    """The C entry ``ps_<name>_<dtype suffix>``, e.g. ``kernel("linear_scan_fwd", f32)``
    for ``ps_linear_scan_fwd_f32``."""
    fn = getattr(_checked_library(), f"ps_{name}_{_SUFFIX[dtype]}")
    fn.restype = ctypes.c_int
    # the packed-sequence entries take a ps_varlen_args after the scan's struct
    fn.argtypes = [ctypes.c_void_p] * (2 if name.endswith("_varlen") else 1)
    return fn


_CONSTANT_NAMES = {
    "scan": ("BLOCK", "ROWS", "TILE", "LONG_STEPS", "LONG_ROWS", "LONG_CHUNKS", "LONG_MIN_LEN",
             "LONG_CHUNK_BYTES"),
    "matmul": ("PRODUCT_ITEMS", "PRODUCT_MIN_SEGMENT"),
}  # fmt: skip


@functools.cache
def kernel_constants() -> dict[str, int]:
    """The C kernels' block and chunk constants, as the library was built with them
    (for tests and the fuzzer, which place lengths around each one)."""
    lib = _checked_library()
    constants: dict[str, int] = {}
    for family, names in _CONSTANT_NAMES.items():
        fn = getattr(lib, f"ps_{family}_constants")
        fn.restype = ctypes.c_int64
        fn.argtypes = [ctypes.POINTER(ctypes.c_int64), ctypes.c_int64]
        values = (ctypes.c_int64 * len(names))()
        if fn(values, len(names)) != len(names):
            raise RuntimeError(f"parascan: ps_{family}_constants disagrees with {names}")
        constants.update(zip(names, values, strict=True))
    return constants


Operand = tuple["torch.Tensor | None", tuple[int, ...]]


def check_operands(entry: str, dtype: torch.dtype, *operands: Operand) -> None:
    """The guard in front of every C entry: each tensor handed to ``entry`` (None is
    no tensor) must be a strided CPU tensor of ``dtype`` with exactly the shape the
    kernel indexes it by, and no lazy negative or conjugate bit (the kernel reads raw
    memory). torch keeps every tensor's own view inside its storage, so a kernel
    that walks a tensor of the right shape by that tensor's strides (or, for a
    contiguous one, by the strides of that shape) never leaves it. Raises
    RuntimeError instead of letting the kernel read or write out of bounds; the
    public functions validate first, so this fires only on a bug in parascan."""
    for t, shape in operands:
        if t is not None and (
            t.shape != shape
            or t.dtype != dtype
            or t.layout != torch.strided
            or t.device.type != "cpu"
            or t.is_neg()
            or t.is_conj()
        ):
            raise RuntimeError(
                f"parascan: internal error: the {entry} CPU kernel indexes a strided CPU "
                f"tensor of shape {shape} and dtype {dtype} with no lazy neg/conj bit, but was "
                f"handed Tensor(shape={tuple(t.shape)}, dtype={t.dtype}, layout={t.layout}, "
                f"device={t.device}, neg={t.is_neg()}, conj={t.is_conj()})"
            )


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
    fast path, first_order.api.cpu_fast_path) has checked exactly what check_operands
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
