"""parascan's native layer: the C kernels, built into one shared library and loaded
with ctypes. This module loads the library, fills its argument structs by field name
(abi.h), looks its entries up and guards them; each family's cpu.py calls them. The C
sources shared by the kernels are beside it.

The argument structs of abi.h are passed as flat int64 arrays, in the structs' member
order (every member is 64 bits wide): building one is a single call, which keeps a small
scan's Python overhead to a few microseconds.

Nothing is compiled here: the library is built by ``pip install`` (setup.py). When it
is missing or stale the ``cpu`` backend is unavailable and says why.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import os
import re
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "ARG_FIELDS",
    "ARG_STRUCTS",
    "ChunkedOperands",
    "arg_struct",
    "check_operands",
    "dense",
    "kernel",
    "kernel_constants",
    "kernel_library",
    "kernel_library_error",
    "kernel_library_path",
    "pointer",
    "run_kernel",
    "simd",
]

_STEM = "_kernels"


def simd() -> bool:
    """Whether the C kernels that have a portable path besides their vector one (the SSD
    scan and layer, the generic block products) take the vector one where the CPU has
    it: yes, unless the environment sets ``PARASCAN_SIMD=0`` (the tests run both)."""
    return os.environ.get("PARASCAN_SIMD", "1") != "0"


ABI_VERSION = 15  # abi.h: PS_ABI_VERSION


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    here = Path(__file__).resolve().parent.parent  # setup.py builds parascan._kernels
    candidates = [here / (_STEM + suffix) for suffix in importlib.machinery.EXTENSION_SUFFIXES]
    # Another build of the same sources (tools/sanitize.sh: with AddressSanitizer and
    # UBSan), for testing; never needed otherwise.
    override = os.environ.get("PARASCAN_KERNEL_LIBRARY")
    if override:
        candidates = [Path(override)]
    path = next((p for p in candidates if p.is_file()), None)
    if path is None:
        return None, (
            f"the compiled kernels ({_STEM}.*.so) are not in {here}; reinstall parascan "
            "with a C compiler available (pip install -e .)"
        )
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        return None, f"loading {path} failed: {exc}"
    lib.ps_abi_version.restype = ctypes.c_int64
    found = lib.ps_abi_version()
    if found != ABI_VERSION:
        return None, (
            f"{path} has kernel ABI {found} but this parascan expects {ABI_VERSION}; "
            "rebuild it (pip install -e .)"
        )
    global _loaded_path
    _loaded_path = str(path)
    return lib, None


_loaded_path: str | None = None


def kernel_library_path() -> str | None:
    """The file the kernels were loaded from (None until they are, or if they fail)."""
    _load()
    return _loaded_path


def kernel_library() -> ctypes.CDLL:
    """The loaded kernel library; RuntimeError saying why when it cannot be used."""
    lib, error = _load()
    if lib is None:
        raise RuntimeError(error)
    return lib


def kernel_library_error() -> str | None:
    """None when the kernel library loads, else the reason it does not."""
    return _load()[1]


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
    "delta": (
        "batch", "length", "kheads", "heads", "dk", "dv", "gate", "chunk", "qk_form",
        "scale_bits", "cu_seqlens", "nseq",
        "q", "k", "v", "beta", "g", "initial", "out", "final", "checkpoints", "grad_out",
        "grad_final", "grad_q", "grad_k", "grad_v", "grad_beta", "grad_g", "grad_initial",
        "nthreads", "simd", "failed",
    ),
    "linear_attention": (
        "batch", "length", "kheads", "heads", "dk", "dv", "gate", "chunk", "scale_bits",
        "cu_seqlens", "nseq", "q", "k", "v", "g", "initial", "out", "final", "checkpoints",
        "grad_out", "grad_final", "grad_q", "grad_k", "grad_v", "grad_g", "grad_initial",
        "nthreads", "simd", "failed",
    ),
    "dplr": (
        "batch", "length", "kheads", "heads", "dk", "dv", "gate", "chunk", "scale_bits",
        "cu_seqlens", "nseq", "q", "k", "v", "a", "b", "g", "initial", "out", "final",
        "checkpoints", "grad_out", "grad_final", "grad_q", "grad_k", "grad_v", "grad_a",
        "grad_b", "grad_g", "grad_initial", "nthreads", "simd", "failed",
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


def dense(t: torch.Tensor) -> torch.Tensor:
    """An operand as the kernels read it: contiguous, with any lazy conjugate or negative
    bit applied."""
    return t.resolve_conj().resolve_neg().contiguous()


def pointer(t: torch.Tensor | None) -> int:
    """A kernel's pointer member for ``t``: NULL (0) for no tensor or an empty one."""
    return 0 if t is None or t.numel() == 0 else t.data_ptr()


def run_kernel(
    entry: str, dtype: torch.dtype, args: object, *named: tuple[str, torch.Tensor]
) -> None:
    """Call ``ps_<entry>_<dtype>`` on ``args``; its failure (operands it rejects, such as
    bad cu_seqlens offsets, or out of memory) raises, naming the shapes of ``named``
    (described only then: a decoding step's call is a few tens of microseconds)."""
    if kernel(entry, dtype)(args) != 0:
        operands = ", ".join(f"{name} {tuple(t.shape)}" for name, t in named)
        raise RuntimeError(
            f"parascan: the {entry} CPU kernel failed (operands it rejects, such as bad "
            f"cu_seqlens offsets, or out of memory) on {operands}"
        )


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
            or not t.is_cpu
            or t.is_neg()
            or t.is_conj()
        ):
            raise RuntimeError(
                f"parascan: internal error: the {entry} CPU kernel indexes a strided CPU "
                f"tensor of shape {shape} and dtype {dtype} with no lazy neg/conj bit, but was "
                f"handed Tensor(shape={tuple(t.shape)}, dtype={t.dtype}, layout={t.layout}, "
                f"device={t.device}, neg={t.is_neg()}, conj={t.is_conj()})"
            )


class ChunkedOperands:
    """What the operands of the chunked kernels with checkpoints (ssd, delta) share:
    ``cu_seqlens`` as the kernel reads it, the struct's packing and pointer members,
    and the backward's checks. A family's cpu.py subclasses it, with ``kind`` its
    struct (abi.h) and ``entry`` the kernel whose operands these are; it sets
    ``dtype``, ``state_shape`` and ``checkpoint_shape``."""

    kind: str
    dtype: torch.dtype
    state_shape: tuple[int, ...]
    checkpoint_shape: tuple[int, ...]

    def __init__(self, entry: str, cu_seqlens: torch.Tensor | None, batch: int) -> None:
        # cu_seqlens as the kernel reads it, a contiguous int64 CPU vector. Its values were
        # checked by the public function (parascan._core.check_cu_seqlens); the kernel
        # checks them again and fails the call rather than read out of bounds.
        self.entry = entry
        self.cu = None if cu_seqlens is None else cu_seqlens.to("cpu", torch.int64).contiguous()
        self.states = batch if self.cu is None else self.cu.numel() - 1
        self.misfit = self.cu is not None and (batch != 1 or self.cu.dim() != 1)

    def struct(self, plain: dict[str, int], operands: dict[str, torch.Tensor | None]) -> object:
        """The argument struct: ``plain`` members, the packing and threading ones, and a
        pointer for each of ``operands`` (NULL for None or an empty tensor)."""
        pointers = {name: pointer(t) for name, t in operands.items()}
        if self.cu is not None:  # the kernel tells packed from not by a non-NULL pointer
            pointers["cu_seqlens"] = self.cu.data_ptr()
        return arg_struct(
            self.kind, **plain, nseq=0 if self.cu is None else self.cu.numel() - 1,
            nthreads=torch.get_num_threads(), simd=int(simd()), **pointers,
        )  # fmt: skip

    def backward_inputs(
        self, checkpoints: torch.Tensor, grad_out: torch.Tensor, grad_final: torch.Tensor,
        out_shape: tuple[int, ...],
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
        """The backward's own operands, dense and guarded: ``grad_final`` may have no
        rows (zeros, which the kernel then never reads)."""
        checkpoints, grad_out, grad_final = (dense(t) for t in (checkpoints, grad_out, grad_final))
        finals = self.state_shape if grad_final.shape[:1] != (0,) else (0, *self.state_shape[1:])
        check_operands(
            self.entry, self.dtype, (checkpoints, self.checkpoint_shape), (grad_out, out_shape),
            (grad_final, finals),
        )  # fmt: skip
        return checkpoints, grad_out, grad_final

    def final_rows(self, want_final: bool) -> torch.Tensor:
        """The forward's final state; without ``want_final``, one with no rows (the kernel
        then stores none)."""
        rows = self.state_shape if want_final else (0, *self.state_shape[1:])
        return torch.empty(rows, dtype=self.dtype)

    def grad_initial(self, initial: torch.Tensor | None) -> torch.Tensor | None:
        return None if initial is None else torch.empty(self.state_shape, dtype=self.dtype)
