"""Input validation shared by the public functions.

Every check raises before any kernel runs, with a message that starts with the
public name (``parascan.linear_scan: ...``) and states what was expected and what
was received. These run under torch.compile too, so they use no try/except on the
happy path and only Python-level shape arithmetic.

The backend argument is checked here too, against the one backend table. The
backends, and the devices they take:

cpu     compiled C kernels (CPU tensors)
triton  Triton kernels (CUDA tensors; also CPU tensors under TRITON_INTERPRET=1, for
        testing, when asked for by name)
torch   pure PyTorch, parallel (chunked) algorithm, any device
loop    the sequential reference, any device, slow

Each op declares, in its family, an ``OpBackends`` row (``register``): its backends,
fastest first, with the dtypes each takes, its forward and its fused backward (or
None), and for each backend it lacks, why. ``resolve`` reads that row for every call,
``"auto"`` included: ``"auto"`` takes the first backend that runs on the device and
takes the dtype (or lets the op choose among those), and a named backend that cannot
run raises RuntimeError naming the op, the backend and the reason.
"""

from __future__ import annotations

import importlib.util
import numbers
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import torch

from parascan._native import kernel_library_error

__all__ = [
    "BACKENDS",
    "FLOAT_DTYPES",
    "Backend",
    "DimensionError",
    "OpBackends",
    "accumulate_dtype",
    "as_operand",
    "backends",
    "broadcast_shape",
    "check_cu_seqlens",
    "check_dtype",
    "check_flag",
    "check_in_place",
    "check_layout",
    "check_offsets",
    "check_same_device",
    "check_shape",
    "check_tensor",
    "describe",
    "normalize_dim",
    "register",
    "resolve",
    "result_dtype",
    "table",
    "unavailable_reason",
]

FLOAT_DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
)


_COMPLEX_OF = {
    torch.float16: torch.complex32,
    torch.bfloat16: torch.complex64,
    torch.float32: torch.complex64,
    torch.float64: torch.complex128,
}


def result_dtype(fn: str, a: torch.Tensor, b: torch.Tensor) -> torch.dtype:
    """``torch.result_type(a, b)`` for floating/complex tensors, written with
    ``torch.promote_types`` because dynamo cannot trace ``result_type``: a 0-d
    tensor (a Python number) never widens a dimensioned tensor of its own kind;
    a complex 0-d tensor makes a real dimensioned tensor complex."""
    if (a.dim() == 0) == (b.dim() == 0):
        dtype = torch.promote_types(a.dtype, b.dtype)
    else:
        zero_dim, dimensioned = (a, b) if a.dim() == 0 else (b, a)
        dtype = dimensioned.dtype
        if zero_dim.dtype.is_complex and not dtype.is_complex:
            dtype = _COMPLEX_OF[dtype]
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"{fn}: the inputs promote to {dtype}, which parascan does not support")
    return dtype


def accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    """Half types accumulate in float32; every other dtype in itself."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def describe(value: object) -> str:
    """A short description of a received value for error messages."""
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        return f"numpy.{type(value).__name__} {value!r}"
    if isinstance(value, torch.Tensor):
        if value.is_nested:  # no single shape
            return f"nested Tensor(dtype={value.dtype}, device={value.device})"
        layout = "" if value.layout == torch.strided else f", layout={value.layout}"
        return (
            f"Tensor(shape={tuple(value.shape)}, dtype={value.dtype}, device={value.device}"
            f"{layout})"
        )
    return f"{type(value).__name__} {value!r}"


def check_layout(fn: str, name: str, tensor: torch.Tensor) -> None:
    """Only strided (dense) tensors: sparse (COO, CSR, CSC, BSR, BSC), mkldnn and
    nested tensors have no strides to scan along."""
    if tensor.layout != torch.strided or tensor.is_nested:
        raise TypeError(
            f"{fn}: expected {name} to be a strided (dense) tensor, but got {describe(tensor)}"
        )


def as_operand(
    fn: str, name: str, value: object, *, allow_number: bool, like: torch.Tensor | None = None
) -> torch.Tensor:
    """``value`` as a tensor: tensors pass through; Python numbers become 0-d tensors
    on ``like``'s device when ``allow_number``. Anything else is a TypeError."""
    if isinstance(value, torch.Tensor):
        check_layout(fn, name, value)
        return value
    if allow_number and isinstance(value, numbers.Number) and not isinstance(value, bool):
        # A 0-d floating tensor promotes like the Python scalar it came from: it
        # never widens the dtype of a dimensioned tensor of the same kind. It is
        # made in the dtype of ``like`` (complex when the number is), so that
        # 0.1 next to float64 tokens is float64's 0.1, not float32's.
        if like is not None and (like.is_floating_point() or like.is_complex()):
            dtype = like.dtype
            if isinstance(value, complex) and not dtype.is_complex:
                dtype = _COMPLEX_OF[dtype]
            if dtype in FLOAT_DTYPES:  # else (complex32) result_dtype reports it
                return torch.tensor(value, dtype=dtype, device=like.device)
        number = torch.tensor(value, device=like.device if like is not None else None)
        if not (number.is_floating_point() or number.is_complex()):
            number = number.to(torch.get_default_dtype())
        return number
    expected = "a Tensor or a Python number" if allow_number else "a Tensor"
    raise TypeError(f"{fn}: expected {name} to be {expected}, but got {describe(value)}")


REAL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
COMPLEX_DTYPES = (torch.complex64, torch.complex128)


def check_tensor(fn: str, name: str, value: object, *, complex_ok: bool = False) -> torch.Tensor:
    """``value`` if it is a strided tensor of a real floating dtype (or a complex one,
    with ``complex_ok``), else a TypeError naming ``fn``."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{fn}: expected {name} to be a Tensor, but got {describe(value)}")
    check_layout(fn, name, value)
    allowed = REAL_DTYPES + COMPLEX_DTYPES if complex_ok else REAL_DTYPES
    if value.dtype not in allowed:
        kinds = "a floating or complex" if complex_ok else "a real floating"
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise TypeError(
            f"{fn}: expected {name} to have {kinds} dtype ({names}), but got {value.dtype}"
        )
    return value


def check_shape(fn: str, name: str, t: torch.Tensor, expected: tuple[int, ...], what: str) -> None:
    """A ValueError naming ``fn`` unless ``t`` has the shape ``expected`` (``what``
    names its dimensions, e.g. "(batch, dim, L)")."""
    if tuple(t.shape) != expected:
        raise ValueError(
            f"{fn}: expected {name} of shape {what} = {expected}, but got {describe(t)}"
        )


def check_dtype(fn: str, name: str, tensor: torch.Tensor) -> None:
    if tensor.dtype not in FLOAT_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in FLOAT_DTYPES)
        raise TypeError(
            f"{fn}: expected {name} to have a floating or complex dtype ({names}), "
            f"but got {tensor.dtype}"
        )


def check_flag(fn: str, name: str, value: object) -> bool:
    """``value`` as a Python bool when it is a bool (or a numpy bool), else a TypeError
    naming ``fn``. Flags are never coerced: ``bool("0")`` is True where ``int("0")`` is
    0, so a string (or None, or a number) would mean one thing on one path and the
    opposite on another; a bool tensor is data, not a flag."""
    if isinstance(value, bool):
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        return bool(value)  # numpy's bool scalar (numpy is not imported for this)
    raise TypeError(f"{fn}: expected {name} to be a bool, but got {describe(value)}")


def has_internal_overlap(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory: False when, its dimensions
    sorted by stride, each steps past everything the smaller ones span (then no two
    elements meet). Every tensor made by indexing, slicing, transposing or reshaping a
    fresh one passes; an expanded (zero-stride) tensor, or one ``as_strided`` onto
    itself, does not. Shape and strides only, so torch.compile traces it."""
    if t.numel() == 0:  # no element, nothing shared
        return False
    dims: list[tuple[int, int]] = []
    for size, stride in zip(t.shape, t.stride(), strict=True):
        if size == 1:
            continue
        # an insertion sort by stride (torch.compile traces comparisons of symbolic
        # strides, not sorted() with a key)
        i = len(dims)
        while i and dims[i - 1][1] > stride:
            i -= 1
        dims.insert(i, (size, stride))
    span = 0
    for size, stride in dims:
        if stride <= span:
            return True
        span += (size - 1) * stride
    return False


def check_in_place(fn: str, name: str, tensor: torch.Tensor) -> None:
    """A ValueError naming ``fn`` unless ``tensor``, which ``fn`` writes in place, has
    no two elements sharing memory: each write must land in an element of its own
    (torch's own in-place ops let such aliased writes through unless a stride is 0)."""
    if has_internal_overlap(tensor):
        raise ValueError(
            f"{fn}: expected {name} whose elements do not share memory (it is updated in "
            f"place), but got {describe(tensor)} with strides {tuple(tensor.stride())}: more "
            "than one element refers to a single memory location (an expanded or "
            "as_strided tensor); clone() it"
        )


def check_same_device(fn: str, named: Sequence[tuple[str, torch.Tensor]]) -> None:
    first_name, first = named[0]
    for name, tensor in named[1:]:
        if tensor.device != first.device:
            raise ValueError(
                f"{fn}: expected all tensors on one device, but {first_name} is on "
                f"{first.device} and {name} is on {tensor.device}"
            )


def broadcast_shape(fn: str, named: Sequence[tuple[str, Sequence[int]]]) -> tuple[int, ...]:
    """The broadcast of the named shapes (numpy rules), or ValueError naming them."""
    ndim = max(len(shape) for _, shape in named)
    out = [1] * ndim
    for _, shape in named:
        for i, size in enumerate(shape, start=ndim - len(shape)):
            if size != 1:
                if out[i] != 1 and out[i] != size:
                    received = ", ".join(f"{n} {tuple(s)}" for n, s in named)
                    raise ValueError(f"{fn}: expected shapes that broadcast, but got {received}")
                out[i] = size
    return tuple(out)


class DimensionError(IndexError, ValueError):
    """A dim out of range: an IndexError like torch's own, and a ValueError."""


def normalize_dim(fn: str, dim: object, ndim: int) -> int:
    """``dim`` as a non-negative index into ``ndim`` dims, as torch.cumsum wraps it."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{fn}: expected dim to be an int, but got {describe(dim)}")
    if not -ndim <= dim < ndim:
        raise DimensionError(
            f"{fn}: expected dim in the range [{-ndim}, {ndim - 1}] for a result with "
            f"{ndim} dimensions, but got {dim}"
        )
    return dim % ndim


def check_cu_seqlens(
    name: str, cu_seqlens: object, steps: int, device: torch.device
) -> torch.Tensor:
    """``cu_seqlens`` validated: a 1-d integer tensor (num_seqs + 1,) of offsets
    along the scanned dim, 0 first, ``steps`` last, non-decreasing, on the CPU or on
    ``device`` (the operands'). Its values are
    read (a device sync for a CUDA tensor) unless torch.compile is tracing; the
    kernels check them again."""
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(
            f"{name}: expected cu_seqlens to be an integer tensor of offsets, but got "
            f"{describe(cu_seqlens)}"
        )
    if cu_seqlens.dtype not in (torch.int32, torch.int64) or cu_seqlens.dim() != 1:
        raise TypeError(
            f"{name}: expected cu_seqlens to be a 1-d int32 or int64 tensor "
            f"(num_seqs + 1 offsets), but got {describe(cu_seqlens)}"
        )
    if cu_seqlens.numel() == 0:
        raise ValueError(f"{name}: expected cu_seqlens to hold at least one offset (0), got none")
    if cu_seqlens.device != device and cu_seqlens.device.type != "cpu":
        raise ValueError(
            f"{name}: expected cu_seqlens on the CPU or on {device}, but got it on "
            f"{cu_seqlens.device}"
        )
    if not torch.compiler.is_compiling():
        check_offsets(name, cu_seqlens.tolist(), steps)
    return cu_seqlens


def check_offsets(name: str, cu: list[int], steps: int) -> None:
    """A ValueError naming ``name`` unless ``cu`` are non-decreasing offsets from 0 to
    ``steps``: also the raw ops' own check (a compiled graph skips the public one)."""
    if cu[0] != 0 or cu[-1] != steps or any(b < a for a, b in pairwise(cu)):
        raise ValueError(
            f"{name}: expected cu_seqlens to be non-decreasing offsets from 0 to the length "
            f"along dim ({steps}), but got {cu}"
        )


# --- the backend table -------------------------------------------------------------

BACKENDS = ("cpu", "triton", "torch", "loop")


def _kernel_library_status() -> str:
    return kernel_library_error() or ""


# Constant for the process: torch.compile evaluates it once instead of tracing into
# the file system. "" means the library loads.
_kernel_library_error: Callable[[], str] = torch.compiler.assume_constant_result(
    _kernel_library_status
)


def _triton_status() -> bool:
    return importlib.util.find_spec("triton") is not None


# Constant for the process, as above: whether triton can be imported (not importing it).
_triton_importable: Callable[[], bool] = torch.compiler.assume_constant_result(_triton_status)


def _triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _device(device: str | torch.device) -> torch.device:
    return device if isinstance(device, torch.device) else torch.device(device)


def unavailable_reason(backend: str, device: str | torch.device) -> str | None:
    """None when ``backend`` can run on ``device``, else why it cannot."""
    dev = _device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        return "this machine has no CUDA device"
    if backend == "cpu":
        if dev.type != "cpu":
            return f"it runs on CPU tensors only, and the inputs are on {dev}"
        return _kernel_library_error() or None
    if backend == "triton":
        if not _triton_importable():
            return "triton is not installed (pip install 'parascan[triton]')"
        if dev.type == "cuda" or (dev.type == "cpu" and _triton_interpreted()):
            return None
        return (
            f"it runs on CUDA tensors (or on CPU tensors under TRITON_INTERPRET=1), and the "
            f"inputs are on {dev}"
        )
    if backend in ("torch", "loop"):
        return None
    raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")


def backends(device: str | torch.device = "cpu") -> list[str]:
    """Names of the backends that can run on ``device``, fastest first. (``triton``
    is listed for CUDA devices only: the interpreter is a testing aid.)

    >>> backends("cpu")[-2:]
    ['torch', 'loop']
    """
    try:
        dev = _device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(
            f"parascan.backends: expected a device (a string such as 'cpu' or 'cuda:0', or a "
            f"torch.device), but got {device!r} ({err})"
        ) from None
    return [
        b
        for b in BACKENDS
        if unavailable_reason(b, dev) is None and (b != "triton" or dev.type == "cuda")
    ]


@dataclass(frozen=True)
class Backend:
    """One backend of one op: the dtypes it takes (``unsupported`` completes "is not
    available for ..." for the others, formatted with ``dtype``), its forward and
    its fused backward (None: the op's backward runs through its forward)."""

    forward: Callable[..., Any]
    backward: Callable[..., Any] | None = None
    dtypes: tuple[torch.dtype, ...] = FLOAT_DTYPES
    unsupported: str = "{dtype}"


@dataclass(frozen=True)
class OpBackends:
    """An op's row of the backend table: its public name, its backends fastest first
    (names from BACKENDS), and for each backend it lacks, why (with what to use)."""

    op: str
    backends: dict[str, Backend]
    missing: dict[str, str] = field(default_factory=dict)


_TABLE: dict[str, OpBackends] = {}


def register(row: OpBackends) -> OpBackends:
    """Add an op's row to the table (once per op, at import of its family)."""
    unknown = set(row.backends) | set(row.missing)
    if not unknown <= set(BACKENDS) or set(row.backends) & set(row.missing):
        raise ValueError(f"parascan: bad backend table row for {row.op}: {sorted(unknown)}")
    _TABLE[row.op] = row
    return row


def table() -> dict[str, OpBackends]:
    """The backend table: op name -> its row."""
    return dict(_TABLE)


def _runs_here(name: str, device: torch.device) -> bool:
    # "auto" never picks the Triton interpreter (a testing aid) for CPU tensors
    return unavailable_reason(name, device) is None and (name != "triton" or device.type == "cuda")


def resolve(
    row: OpBackends,
    backend: object,
    device: torch.device,
    dtype: torch.dtype,
    choose: Callable[[Sequence[str]], str] | None = None,
    name: str | None = None,
) -> str:
    """The backend of ``row`` that computes a call on ``device`` in ``dtype``:
    ``backend`` itself when it can, else RuntimeError naming the op (or ``name``, the
    public function that called it), the backend and why; for ``"auto"`` the first
    that can (or ``choose`` among those that can)."""
    fn = row.op if name is None else name
    if not isinstance(backend, str) or backend not in ("auto", *BACKENDS):
        raise ValueError(
            f"{fn}: expected backend to be one of {('auto', *BACKENDS)}, but got {backend!r}"
        )
    if backend == "auto":
        usable = [
            name
            for name, entry in row.backends.items()
            if dtype in entry.dtypes and _runs_here(name, device)
        ]
        if not usable:
            raise RuntimeError(f"{fn}: no backend can run on device {device}")
        return usable[0] if choose is None else choose(usable)
    if backend in row.missing:
        raise RuntimeError(f"{fn}: backend {backend!r} is not available: {row.missing[backend]}")
    reason = unavailable_reason(backend, device)
    if reason is not None:
        raise RuntimeError(f"{fn}: backend {backend!r} is not available: {reason}")
    entry = row.backends[backend]
    if dtype not in entry.dtypes:
        raise RuntimeError(
            f"{fn}: backend {backend!r} is not available for "
            + entry.unsupported.format(dtype=dtype)
        )
    return backend
