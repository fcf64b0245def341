"""The core every public function and op goes through: input validation, the backend
table, and the op builder with the helpers every family's ops share.

**Validation.** Every check raises before any kernel runs, with a message that starts
with the public name (``parascan.linear_scan: ...``) and states what was expected and
what was received. These run under torch.compile too, so they use no try/except on the
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

**Ops.**

- ``custom_op``: a torch.library op from its schema, body, fake kernel and vmap rule;
- ``checkpointed_scan``: the ops and autograd.Functions of a scan that keeps states
  every K steps for its backward (the state-space scans), from a family's declaration
  (``CheckpointedScan``);
- ``opaque_to_dynamo``: the call that applies a family's Functions, one call in
  torch.compile's graph, so that the Functions' own vmap rules and ``jvp`` run under
  the transforms around it;
- helpers: lazy views resolved before a kernel reads them, vmap rules, the eager
  check, forward mode through a ``torch`` backend, the second-derivative error.

autograd.Functions and not ``torch.library.register_autograd``: on torch 2.13 the latter
breaks ``torch.func.grad`` and makes ``torch.func.jvp`` return zeros silently.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import math
import numbers
import os
import reprlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any, NoReturn, TypeVar, cast

import torch
from torch import Tensor
from torch.autograd import forward_ad

from parascan._native import kernel_library_error

Opt = Tensor | None

__all__ = [
    "BACKENDS",
    "FLOAT_DTYPES",
    "Backend",
    "CheckpointedScan",
    "DimensionError",
    "Function",
    "OpBackends",
    "Operands",
    "accumulate_dtype",
    "as_operand",
    "backends",
    "batch_first",
    "batch_first_vmap",
    "broadcast_shape",
    "check_cu_seqlens",
    "check_dtype",
    "check_flag",
    "check_in_place",
    "check_layout",
    "check_offsets",
    "check_packed_state",
    "check_same_device",
    "check_shape",
    "check_tensor",
    "checkpointed_scan",
    "conj",
    "custom_op",
    "describe",
    "eager_no_grad",
    "loop_vmap",
    "nested_forward_mode",
    "normalize_dim",
    "on_their_device",
    "opaque_to_dynamo",
    "plain_eager",
    "refuse_second_derivatives",
    "register",
    "resolve",
    "resolved",
    "resolved_optional",
    "result_dtype",
    "short_repr",
    "state_shape",
    "table",
    "tensor_hint",
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


class _ShortRepr(reprlib.Repr):
    """reprlib's repr, bounded in every dimension, with tensors and arrays inside a
    container described by type, shape and dtype rather than printed."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel = 3
        self.maxlist = self.maxtuple = self.maxset = self.maxfrozenset = 6
        self.maxdeque = self.maxarray = self.maxdict = 6
        self.maxstring = 60
        self.maxlong = 40
        self.maxother = 60

    def repr1(self, x: object, level: int) -> str:
        array = _describe_array(x)
        return array if array is not None else super().repr1(x, level)


_SHORT_REPR = _ShortRepr()
_DESCRIBE_LIMIT = 200  # characters of a received value in a message, at most


def _is_numpy_array(value: object) -> bool:
    """Whether ``value`` is a numpy ndarray (or a subclass's instance), without importing
    numpy (parascan does not use it)."""
    return any(c.__name__ == "ndarray" and c.__module__ == "numpy" for c in type(value).__mro__)


def _describe_array(value: object) -> str | None:
    """``value`` described by type, shape and dtype when it is a tensor or an array
    (numpy's, or any object with a shape and a dtype that converts to one: jax, cupy):
    never its elements. None for anything else, and for numpy's scalars and 0-d arrays,
    whose value is short and worth showing."""
    if isinstance(value, torch.Tensor):
        if value.is_nested:  # no single shape
            return f"nested Tensor(dtype={value.dtype}, device={value.device})"
        layout = "" if value.layout == torch.strided else f", layout={value.layout}"
        return (
            f"Tensor(shape={tuple(value.shape)}, dtype={value.dtype}, device={value.device}"
            f"{layout})"
        )
    kind = type(value)
    if not any(
        hasattr(kind, a) for a in ("__array__", "__array_interface__", "__dlpack__")
    ) or not (hasattr(value, "shape") and hasattr(value, "dtype")):
        return None
    if kind.__module__.split(".")[0] == "numpy" and getattr(value, "ndim", None) == 0:
        return None
    try:
        shape = tuple(int(size) for size in value.shape)
    except (TypeError, ValueError):
        return None
    return f"{kind.__module__}.{kind.__qualname__}(shape={shape}, dtype={value.dtype})"


def describe(value: object) -> str:
    """A short description of a received value for error messages: a tensor's or an
    array's type, shape and dtype (never its elements), anything else's type and repr,
    bounded (a list of 10000 numbers shows six and its length)."""
    array = _describe_array(value)
    if array is not None:
        return array
    if type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0:
        return f"numpy.{type(value).__name__} {short_repr(value)}"  # a scalar: its value
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"int of {value.bit_length()} bits"  # not its hundreds of digits
    return f"{type(value).__name__} {short_repr(value)}"


def short_repr(value: object) -> str:
    """``repr(value)`` bounded for an error message: at most six items of a container
    (then its length), 60 characters of a string, tensors and arrays described (not
    printed), 200 characters in all. ``[0, 2, 5]`` stays ``[0, 2, 5]``."""
    text = _clip(_SHORT_REPR.repr(value), _DESCRIBE_LIMIT)
    if isinstance(value, (list, tuple, set, frozenset, dict)) and len(value) > 6:
        text += f" ({len(value)} items)"
    return text


def _clip(text: str, limit: int) -> str:
    """``text``, cut to ``limit`` characters (ending "...") when longer."""
    return text if len(text) <= limit else text[: limit - 3] + "..."


def tensor_hint(value: object) -> str:
    """For ``value``, received where a tensor is expected, how to make one of it
    (appended to the message that describes it): ``torch.from_numpy`` for a numpy
    array, ``torch.as_tensor`` for another array or a numpy scalar, ``torch.tensor``
    for a list or tuple of numbers, ``torch.stack`` for one of tensors; "" for anything
    else."""
    if isinstance(value, torch.Tensor):
        return ""
    if _is_numpy_array(value):
        how = "torch.from_numpy"
    elif _describe_array(value) is not None or type(value).__module__ == "numpy":
        how = "torch.as_tensor"
    elif isinstance(value, (list, tuple)) and isinstance(_first_item(value), numbers.Number):
        how = "torch.tensor"
    elif isinstance(value, (list, tuple)) and isinstance(_first_item(value), torch.Tensor):
        how = "torch.stack"
    else:
        return ""
    return f"; pass a torch.Tensor ({how})"


def _first_item(value: list[Any] | tuple[Any, ...]) -> object:
    """The first item of ``value`` that is not a list or tuple, nested ones followed
    down (None when one is empty, or past 64 levels: a list may hold itself)."""
    item: object = value
    for _ in range(64):
        if not isinstance(item, (list, tuple)):
            return item
        if not item:
            return None
        item = item[0]
    return None


def finite_float(value: object) -> float | None:
    """``value`` as a finite float, or None when it is not a finite real number (a bool
    is not one here; an int too large for a float is not finite)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def real_float(value: numbers.Real) -> float:
    """A real number as a float, one too large for a float as the infinity of its sign
    (it is beyond every float, as the infinity is)."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf  # type: ignore[operator]


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
        if isinstance(value, int) and finite_float(value) is None:
            raise ValueError(
                f"{fn}: expected {name} to be a number a float can hold, but got {describe(value)}"
            )
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
    raise TypeError(
        f"{fn}: expected {name} to be {expected}, but got {describe(value)}{tensor_hint(value)}"
    )


REAL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
COMPLEX_DTYPES = (torch.complex64, torch.complex128)


def check_tensor(fn: str, name: str, value: object, *, complex_ok: bool = False) -> torch.Tensor:
    """``value`` if it is a strided tensor of a real floating dtype (or a complex one,
    with ``complex_ok``), else a TypeError naming ``fn``."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"{fn}: expected {name} to be a Tensor, but got {describe(value)}{tensor_hint(value)}"
        )
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
    (torch's own in-place ops let such aliased writes through unless a stride is 0),
    and is no leaf that requires grad, nor a view of one, while grad mode is on
    (autograd would refuse the write with a message that names no function)."""
    what = None
    if tensor.requires_grad and torch.is_grad_enabled():
        if tensor.is_leaf:
            what = "a leaf requiring grad"
        # (not while compiling: dynamo does not trace _is_view; autograd still refuses)
        elif not torch.compiler.is_compiling() and tensor._is_view():
            base = tensor._base
            if base is not None and base.is_leaf and base.requires_grad:
                what = "a view of a leaf requiring grad"
    if what is not None:
        raise ValueError(
            f"{fn}: expected {name} that is not a leaf requiring grad nor a view of one (it is "
            f"updated in place, which autograd refuses on such a tensor), but got "
            f"{describe(tensor)}, {what}; pass it detached or call under torch.no_grad()"
        )
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
            f"{ndim} dimensions, but got {short_repr(dim)}"
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
            f"{describe(cu_seqlens)}{tensor_hint(cu_seqlens)}"
        )
    if (
        cu_seqlens.dtype not in (torch.int32, torch.int64)
        or cu_seqlens.dim() != 1
        or cu_seqlens.layout != torch.strided
        or cu_seqlens.is_nested
    ):
        raise TypeError(
            f"{name}: expected cu_seqlens to be a 1-d int32 or int64 strided tensor with values "
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
        if cu_seqlens.is_meta:
            raise ValueError(
                f"{name}: expected cu_seqlens with values to read (its offsets are checked), "
                f"but got {describe(cu_seqlens)}"
            )
        check_offsets(name, cu_seqlens.tolist(), steps)
    return cu_seqlens


def check_packed_state(
    fn: str, first: tuple[str, torch.Tensor], cu_seqlens: object, initial: object,
    state: tuple[tuple[int, ...], str],
) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """``cu_seqlens`` and ``initial`` of a scan with a state per sequence, validated:
    ``first`` (name, tensor) is an operand (batch, L, ...) whose batch must be 1 with
    ``cu_seqlens``; ``initial`` is (batch, *shape), or (num_seqs, *shape) when packed,
    with ``state = (shape, its dimensions' names)``."""
    name, t = first
    batch, length = t.shape[0], t.shape[1]
    states = batch
    if cu_seqlens is not None:
        cu_seqlens = check_cu_seqlens(fn, cu_seqlens, length, t.device)
        if batch != 1:
            raise ValueError(
                f"{fn}: with cu_seqlens the sequences are packed along L of a batch of one: "
                f"expected batch 1, but got {name} {describe(t)}"
            )
        states = cu_seqlens.shape[0] - 1
    if initial is not None:
        initial = check_tensor(fn, "initial", initial)
        what = f"({'num_seqs' if cu_seqlens is not None else 'batch'}, {state[1]})"
        check_shape(fn, "initial", initial, (states, *state[0]), what)
    return cu_seqlens, initial


def check_offsets(name: str, cu: list[int], steps: int) -> None:
    """A ValueError naming ``name`` unless ``cu`` are non-decreasing offsets from 0 to
    ``steps``: also the raw ops' own check (a compiled graph skips the public one)."""
    if cu[0] != 0 or cu[-1] != steps or any(b < a for a, b in pairwise(cu)):
        raise ValueError(
            f"{name}: expected cu_seqlens to be non-decreasing offsets from 0 to the length "
            f"along dim ({steps}), but got {short_repr(cu)}"
        )


# --- the backend table -------------------------------------------------------------

BACKENDS = ("cpu", "triton", "torch", "loop")

_F = TypeVar("_F", bound=Callable[..., Any])


def assume_constant_result(fn: _F) -> _F:
    """``fn`` marked as ``torch.compiler.assume_constant_result`` marks it: torch.compile
    calls it once while tracing and uses its result as a constant. That function imports
    ``torch._dynamo`` (seconds, most of what ``import parascan`` cost with it:
    BENCHMARKS.md, "Figures the source cites") only to set this one attribute, so it is
    set here, and import stays free of work; a test checks that torch's own function
    still sets exactly this attribute."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


@assume_constant_result
def _kernel_library_error() -> str:
    """Constant for the process: torch.compile evaluates it once instead of tracing
    into the file system. "" means the library loads."""
    return kernel_library_error() or ""


@assume_constant_result
def _triton_importable() -> bool:
    """Constant for the process, as above: whether triton can be imported (not
    importing it)."""
    return importlib.util.find_spec("triton") is not None


def _triton_interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def on_their_device(fn: _F) -> _F:
    """``fn`` (a Triton backend's entry) run with the current CUDA device set to its
    first tensor argument's. Triton launches on the current device, so tensors on
    cuda:1 while cuda:0 is current would be read from the wrong GPU."""

    @functools.wraps(fn)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        first = next((a for a in args if isinstance(a, Tensor)), None)
        if first is None or first.device.type != "cuda":
            return fn(*args, **kwargs)
        with torch.cuda.device(first.device):
            return fn(*args, **kwargs)

    guarded.on_their_device = True  # type: ignore[attr-defined]
    return cast(_F, guarded)


class Function(torch.autograd.Function):
    """torch.autograd.Function, with each subclass's ``forward`` signature computed
    once: ``apply`` binds every call's arguments to it, and ``inspect.signature`` took
    a fifth of a small differentiable call's host time (BENCHMARKS.md, "Figures the
    source cites"; the host's time is what a GPU waits for)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        forward = cls.__dict__.get("forward")
        if isinstance(forward, staticmethod) and not hasattr(forward.__func__, "__signature__"):
            forward.__func__.__signature__ = inspect.signature(forward.__func__)  # type: ignore[attr-defined]


# The functions that apply parascan's Functions, kept opaque to dynamo (below).
_OPAQUE: list[Callable[..., Any]] = []


def opaque_to_dynamo(fn: _F) -> _F:
    """``fn``, a function of tensors and constants that applies autograd.Functions, as
    one call in torch.compile's graph: dynamo does not trace into it, AOTAutograd does,
    running the Functions themselves (their vmap rules, their ``jvp``) under whatever
    transforms surround the call.

    Traced by dynamo, a Function becomes its ``autograd_function_apply`` higher-order
    op, whose runtime Function (``ApplyTemplate``) has no vmap rule: ``vmap(grad(f))``
    and ``vmap(jacrev(f))`` raised "You tried to vmap over ApplyTemplate" under
    torch.compile. Nor can dynamo trace a Function that defines ``jvp``, so the compiled
    path had to use one without, and forward mode under torch.compile (``jvp``,
    ``vmap`` of ``jvp``) returned zero tangents. ``torch.compiler.allow_in_graph(fn)``
    says "opaque" but imports torch._dynamo (seconds; see assume_constant_result), so
    ``fn`` is marked by ``_allow_in_graph`` while dynamo traces the call, before it
    reaches ``fn``."""
    _OPAQUE.append(fn)

    @functools.wraps(fn)
    def call(*args: Any) -> Any:
        if torch.compiler.is_compiling():
            _allow_in_graph()
        return fn(*args)

    return cast(_F, call)


@assume_constant_result
def _allow_in_graph() -> bool:
    """Marks every ``opaque_to_dynamo`` function with ``torch.compiler.allow_in_graph``
    (idempotent). Dynamo runs it for real while tracing, taking its result as a constant:
    torch._dynamo is imported by then."""
    torch.compiler.allow_in_graph(list(_OPAQUE))
    return True


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
        # torch's reason for a string; for anything else it lists every element received
        reason = f" ({_clip(str(err), 300)})" if isinstance(device, str) else ""
        raise ValueError(
            f"parascan.backends: expected a device (a string such as 'cpu' or 'cuda:0', or a "
            f"torch.device), but got {describe(device)}{reason}"
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
            f"{fn}: expected backend to be one of {('auto', *BACKENDS)}, but got "
            f"{describe(backend)}"
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


# ---- the op builder -------------------------------------------------------------------


def conj(t: Tensor) -> Tensor:
    # conj_physical, not the lazy conj view: see resolved.
    return t.conj_physical() if t.is_complex() else t


def resolved(t: Tensor) -> Tensor:
    """Materialize lazy conjugate/negative views before backend code sees them.
    Under AOT dispatch (torch.compile) a custom op's body can run with the
    Conjugate key excluded, so a conj view would silently read as unconjugated."""
    return t.resolve_conj().resolve_neg()


def resolved_optional(t: Tensor | None) -> Tensor | None:
    return None if t is None else resolved(t)


def state_shape(t: Tensor, dim: int) -> tuple[int, ...]:
    dim %= t.dim()
    return (*t.shape[:dim], *t.shape[dim + 1 :])


def batch_first(t: Tensor | None, bdim: int | None, size: int) -> Tensor | None:
    """``t`` with its vmapped dim (or a new, expanded one) in front."""
    if t is None:
        return None
    return t.expand(size, *t.shape) if bdim is None else t.movedim(bdim, 0)


def batch_first_vmap(tensors: int, outputs: int) -> Callable[[Any], Callable[..., Any]]:
    """The vmap rule (given the op: ``custom_op``'s ``vmap``) of an op whose first
    ``tensors`` arguments are tensors (or None) of one logical shape (states: without
    ``dim``), followed by ``dim`` and plain arguments. A vmapped dimension becomes a
    new leading batch dimension of all of them (unbatched operands are expanded, no
    copy), ``dim`` shifts when it counts from the front, and every output is batched
    at 0."""

    def rule_of(op: Any) -> Callable[..., Any]:
        def rule(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> tuple[Any, Any]:
            n = info.batch_size
            batched = [
                batch_first(t, d, n) for t, d in zip(args[:tensors], in_dims[:tensors], strict=True)
            ]
            dim = args[tensors]
            result = op(*batched, dim + 1 if dim >= 0 else dim, *args[tensors + 1 :])
            return result, 0 if outputs == 1 else (0,) * outputs

        return rule

    return rule_of


def plain_eager() -> bool:
    """True when the call runs eagerly: no torch.compile, no torch.jit.trace (a kernel
    called directly is not recorded, and the trace would replay without it), no
    torch.func transform, no dispatch or torch-function mode (a mode sees the op), no
    forward-mode AD level open (dual tensors carry their tangents invisibly: a kernel
    called directly would drop them). Tensor subclasses, fake or functional, are ruled
    out by the caller's exact type checks."""
    return (
        not torch.compiler.is_compiling()
        and torch._C._get_tracing_state() is None
        and not torch._C._are_functorch_transforms_active()
        and torch._C._len_torch_dispatch_stack() == 0
        and not torch._C._is_torch_function_mode_enabled()
        and forward_ad._current_level < 0
    )


def eager_no_grad(tensors: Sequence[Tensor]) -> bool:
    """True when a call may run a C kernel directly, past its registered op: plain eager
    tensors (no subclass, transform, mode or compile; plain_eager) that autograd does
    not track (a generation loop runs under no_grad; a differentiable call takes the
    op)."""
    if not all(type(t) is Tensor for t in tensors) or not plain_eager():
        return False
    return not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors))


def loop_vmap(op: Callable[..., Any]) -> Callable[..., Any]:
    """A vmap rule that runs ``op`` once per vmapped element and stacks its results
    (every output batched at 0): for ops whose operands' shapes are fixed by a
    contract, so that a vmapped dim has no batch dimension it could always fold into
    (the state-space scans). Each argument with a vmapped dim is sliced; the others,
    plain values included, are passed as they are."""

    def rule(info: Any, in_dims: tuple[Any, ...], *args: Any) -> tuple[Any, Any]:
        results = []
        for i in range(info.batch_size):
            sliced = [
                a if d is None else a.select(d, i) for a, d in zip(args, in_dims, strict=True)
            ]
            results.append(op(*sliced))
        stacked = [torch.stack(parts) for parts in zip(*results, strict=True)]
        if isinstance(results[0], tuple):
            return tuple(stacked), (0,) * len(stacked)
        return stacked, [0] * len(stacked)

    return rule


def refuse_second_derivatives(public: str) -> NoReturn:
    """What the backward of a backward op's autograd.Function does: a clear error
    rather than silently zero second derivatives."""
    raise RuntimeError(
        f"{public}: second derivatives (double backward, hessians) are not implemented; "
        "the first derivatives of every input are"
    )


def _jvp_transforms() -> int:
    """How many torch.func forward-mode transforms (jvp, jacfwd) are open."""
    stack = torch._C._functorch.get_interpreter_stack() or []
    jvp = torch._C._functorch.TransformType.Jvp
    return sum(1 for interpreter in stack if interpreter.key() == jvp)


def nested_forward_mode() -> bool:
    """True when two torch.func forward-mode transforms are open: forward mode over
    forward mode (``jacfwd(jacfwd(f))``, a ``jvp`` of a ``jvp``). torch runs an
    autograd.Function's ``jvp`` with forward grad off, so the outer transform would not
    see the tangents' own computation: their derivatives would silently be zero. (Nested
    dual levels of torch.autograd.forward_ad are refused by torch itself.)"""
    return _jvp_transforms() > 1


@contextlib.contextmanager
def _compiled_jvp_counted() -> Iterator[None]:
    """A context in which torch.func.jvp, run under the forward-mode transforms of a
    compiled graph, nests in them as it does eagerly.

    torch.func.jvp keeps two counts in Python: its own nesting
    (``eager_transforms.JVP_NESTING``; the outermost jvp opens a dual level of
    torch.autograd.forward_ad) and that level (``forward_ad._current_level``, which
    ``make_dual`` reads). A compiled graph's ``jvp`` or ``jacfwd`` opens its functorch
    transform and its dual level (always level 0: torch refuses a second) through
    torch._C, counting neither (torch 2.13). So a jvp inside one (AOTAutograd tracing a
    Function's ``jvp``) opened a second level: "Nested forward mode AD is not supported
    at the moment". The counts are brought up to the transforms open for the duration,
    then restored."""
    from torch._functorch import eager_transforms

    open_transforms = _jvp_transforms()
    if open_transforms <= eager_transforms.JVP_NESTING:  # eager (or no transform)
        yield
        return
    counts = eager_transforms.JVP_NESTING, forward_ad._current_level
    eager_transforms.JVP_NESTING = open_transforms
    forward_ad._current_level = max(forward_ad._current_level, 0)
    try:
        yield
    finally:
        eager_transforms.JVP_NESTING, forward_ad._current_level = counts


def jvp_through(
    forward: Callable[..., tuple[Tensor, ...]],
    primals: tuple[Tensor | None, ...],
    tangents: tuple[Tensor | None, ...],
) -> tuple[Tensor, ...]:
    """The tangents of ``forward(*primals)``'s outputs: forward-mode AD (torch.func.jvp)
    through ``forward``, a function of differentiable torch ops (a ``torch`` backend's
    chunked forward). For the ``jvp`` of an autograd.Function whose own kernels have no
    forward mode. Absent operands stay None; operands that are not floating point (packed
    sequences' offsets) are held fixed; an operand without a tangent gets zeros."""
    moving = [
        i
        for i, p in enumerate(primals)
        if p is not None and (p.is_floating_point() or p.is_complex())
    ]

    def partial(*values: Tensor) -> tuple[Tensor, ...]:
        args = list(primals)
        for i, v in zip(moving, values, strict=True):
            args[i] = v
        return forward(*args)

    directions = tuple(
        torch.zeros_like(primals[i]) if tangents[i] is None else tangents[i].contiguous()  # type: ignore[arg-type,union-attr]
        for i in moving
    )
    # contiguous: a dual's tangent is laid out as its primal, which cannot be an
    # expanded operand (canonical forms broadcast D, for one)
    values = tuple(primals[i].contiguous() for i in moving)  # type: ignore[union-attr]
    if _jvp_transforms() or forward_ad._current_level < 0:
        # torch.func.jvp, jacfwd: functorch's transforms nest (a dual level of
        # torch.autograd.forward_ad under or over vmap or grad takes the duals below:
        # torch.func.jvp would open a second dual level, which torch refuses)
        with _compiled_jvp_counted():
            out_tangents = torch.func.jvp(partial, values, directions)[1]
        return tuple(out_tangents)
    # torch.autograd.forward_ad's dual level is open (and cannot be nested): duals at it
    # (autograd runs a Function's jvp with forward grad off: on again for the duals)
    with forward_ad._set_fwd_grad_enabled(True):
        duals = [
            forward_ad.make_dual(forward_ad.unpack_dual(v).primal, d)
            for v, d in zip(values, directions, strict=True)
        ]
        outs = partial(*duals)
        # an output built from no dual (L = 0: zeros, an initial state passed through
        # by the op's own rules) has no tangent: zeros, as torch.func.jvp gives
        tangents_out = [forward_ad.unpack_dual(o).tangent for o in outs]
        return tuple(
            torch.zeros_like(o) if t is None else t for o, t in zip(outs, tangents_out, strict=True)
        )


# --- The op builder ----------------------------------------------------------------------


def custom_op(
    name: str,
    schema: str,
    impl: Callable[..., Any],
    fake: Callable[..., Any],
    vmap: Callable[[Any], Callable[..., Any]] | None = None,
) -> Any:
    """The torch.library op ``parascan::<name>`` of ``schema`` (torch's schema language,
    e.g. ``"(Tensor x, Tensor? D, bool flag, str backend) -> Tensor[]"``): ``impl`` its
    body, ``fake`` its fake kernel (torch.compile), ``vmap`` the op's vmap rule given
    the op (default: one call per vmapped element, ``loop_vmap``). Both functions take
    the schema's arguments positionally."""
    op = torch.library.custom_op(f"parascan::{name}", impl, mutates_args=(), schema=schema)
    op.register_fake(fake)
    torch.library.register_vmap(f"parascan::{name}", (vmap or loop_vmap)(op))
    return op


def _contiguous(ts: Any) -> tuple[Tensor, ...]:
    return tuple(t.contiguous() for t in ts)


@dataclass(frozen=True)
class Operands:
    """A checkpointed family's canonical tensor operands, in order, declared once: the
    op schemas, the backends' argument counts and the number of gradients all follow
    from it. ``spec`` names them, space-separated, an optional one marked ``?``:
    ``Operands("q k v beta g? initial? cu_seqlens?")``. Every operand but ``cu_seqlens``
    (offsets) is differentiable."""

    spec: str

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n.rstrip("?") for n in self.spec.split())

    @property
    def schema(self) -> str:
        """The ops' tensor arguments: ``"Tensor q, ..., Tensor? g, ..."``."""
        return ", ".join(
            f"Tensor? {n[:-1]}" if n.endswith("?") else f"Tensor {n}" for n in self.spec.split()
        )

    @property
    def count(self) -> int:
        return len(self.names)

    @property
    def grads(self) -> int:
        """How many gradients a backward returns: of every operand but cu_seqlens."""
        return sum(n != "cu_seqlens" for n in self.names)

    @property
    def cu_at(self) -> int:
        """``cu_seqlens``'s position (a family without packed sequences raises)."""
        return self.names.index("cu_seqlens")


@dataclass(frozen=True)
class CheckpointedScan:
    """A scan whose forward returns ``(out, final, checkpoints)`` (the states every K
    steps, which its backward reads) and whose backward returns the gradients of its
    leading operands: the state-space scans (selective_scan, ssd_scan). What a family
    declares; :func:`checkpointed_scan` makes its ops and Functions.

    The ops take the ``operands`` (tensors), then ``consts`` (plain arguments, e.g.
    ``"bool softplus"``), then the backend's name; the backward op takes the tensors,
    ``checkpoints, grad_out, grad_final``, the consts and the backend, and returns the
    gradients of every operand but ``cu_seqlens`` (empty for an absent one). Every
    tensor reaches ``forward``/``backward`` with lazy conjugate and negative views
    resolved, and every result leaves contiguous, as the fake kernels say
    (torch.compile's graphs assert the strides they report)."""

    # the op's row of the backend table (OpBackends, above): its public
    # name (for errors: "parascan.ssd_scan") and its backends, each one's
    # forward(*tensors, *consts) -> (out, final, checkpoints) and
    # backward(*tensors, [*consts,] checkpoints, grad_out, grad_final) -> gradients;
    # forward mode differentiates the "torch" backend's forward
    row: Any
    name: str  # the ops: parascan::<name>, parascan::<name>_backward
    operands: Operands  # the tensors, in order (canonical.py's OPERANDS)
    consts: str
    # (*tensors, *consts, backend) -> empty (out, final, checkpoints): the fake kernel
    forward_shapes: Callable[..., tuple[Tensor, Tensor, Tensor]]
    # (tensors, consts) -> the grad_final standing for one that is None (grad_out's is
    # zeros like tensor ``out_like``)
    zero_final: Callable[..., Tensor]
    # whether the backends' backward takes the consts (after the tensors)
    backward_consts: bool = True
    # the tensor whose shape and dtype ``out`` has
    out_like: int = 0


@dataclass(frozen=True)
class _Built:
    """A CheckpointedScan's ops and counts, as the Functions below read them."""

    spec: CheckpointedScan
    tensors: int
    consts: int
    forward: Any  # the registered overloads (torch.compile traces these)
    backward: Any
    # the Functions of this arity (_fixed_arity): scan, backward
    functions: tuple[Any, Any]


# The built scans by op name. The Functions are module-level classes that take the name
# as their last argument and look the scan up here: torch.compile traces a Function
# reached through a module's globals, not one made inside a function.
_SCANS: dict[str, _Built] = {}


def checkpointed_scan(spec: CheckpointedScan) -> Callable[..., tuple[Tensor, Tensor]]:
    """``apply(*tensors, *consts, backend) -> (out, final)``, differentiable (reverse
    and forward mode, vmap, torch.compile) through two new torch.library ops. Second
    derivatives raise parascan's error."""
    n_tensors = spec.operands.count
    n_consts = len([c for c in spec.consts.split(",") if c.strip()])
    consts = f", {spec.consts}" if n_consts else ""

    def forward_impl(*args: Any) -> tuple[Tensor, ...]:
        *operands, backend = args
        resolved_args = [resolved_optional(t) for t in operands[:n_tensors]]
        return _contiguous(
            spec.row.backends[backend].forward(*resolved_args, *operands[n_tensors:])
        )

    forward_op = custom_op(
        spec.name,
        f"({spec.operands.schema}{consts}, str backend) -> (Tensor, Tensor, Tensor)",
        forward_impl,
        spec.forward_shapes,
    )

    def backward_impl(*args: Any) -> list[Tensor]:
        tensors = [resolved_optional(t) for t in args[:n_tensors]]
        checkpoints, grad_out, grad_final = args[n_tensors : n_tensors + 3]
        *plain, backend = args[n_tensors + 3 :]
        grads = spec.row.backends[backend].backward(
            *tensors, *(plain if spec.backward_consts else ()), checkpoints,
            resolved(grad_out), resolved(grad_final),
        )  # fmt: skip
        return list(_contiguous(grads))  # not in the operands' layouts: as the fake

    def backward_fake(*args: Any) -> list[Tensor]:
        first = args[0]
        return [
            t.new_empty(t.shape) if t is not None else first.new_empty(0)
            for t in args[: spec.operands.grads]
        ]

    backward_op = custom_op(
        f"{spec.name}_backward",
        f"({spec.operands.schema}, Tensor checkpoints, Tensor grad_out, Tensor grad_final"
        f"{consts}, "
        "str backend) -> Tensor[]",
        backward_impl,
        backward_fake,
    )
    arity = n_tensors + n_consts + 2  # the tensors, consts, backend and name
    _SCANS[spec.name] = _Built(
        spec,
        n_tensors,
        n_consts,
        getattr(torch.ops.parascan, spec.name).default,
        getattr(torch.ops.parascan, f"{spec.name}_backward").default,
        (
            _fixed_arity(_Scan, spec.name, arity),
            _fixed_arity(_Backward, spec.name, n_tensors + 3 + n_consts + 2),
        ),
    )
    name = spec.name

    def apply(*args: Any) -> tuple[Tensor, Tensor]:
        out, final, _ = _apply_function(*args, name)
        return out, final

    apply.forward_op = forward_op  # type: ignore[attr-defined]
    apply.backward_op = backward_op  # type: ignore[attr-defined]
    return apply


def _fixed_arity(base: type, name: str, arity: int) -> Any:
    """``base`` with a ``forward`` that says it takes ``arity`` arguments: torch.compile
    counts a Function's parameters to tell ``forward(ctx, ...)`` from ``forward(...)``."""
    generic = base.forward  # type: ignore[attr-defined]

    def forward(*args: Any) -> Any:
        return generic(*args)

    kind = inspect.Parameter.POSITIONAL_ONLY
    forward.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(f"arg{i}", kind) for i in range(arity)]
    )
    return type(f"{base.__name__}_{name}", (base,), {"forward": staticmethod(forward)})


class _Backward(Function):
    """A scan's backward op as a function of its own, so that torch.func transforms can
    run it (they track the backward's operations); differentiating it again raises."""

    generate_vmap_rule = True

    @staticmethod
    def forward(*args: Any) -> tuple[Tensor, ...]:
        *operands, name = args
        return tuple(_SCANS[name].backward(*operands))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.name = inputs[-1]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        refuse_second_derivatives(_SCANS[ctx.name].spec.row.op)

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        # forward mode over the backward (jacfwd of jacrev: hessians)
        refuse_second_derivatives(_SCANS[ctx.name].spec.row.op)


def _save(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    name = inputs[-1]
    n_tensors = _SCANS[name].tensors
    # The same tensors for backward and forward mode: under vmap (generate_vmap_rule)
    # torch keeps the vmapped dims of the last call's tensors only and reads them for
    # both; a shorter save_for_forward broke every backward through a vmapped scan
    # (grad of vmap; jacrev of jacfwd, whose jvp vmaps the primals too, of a non-linear
    # f) with torch's internal "flat_bdims must not be None".
    ctx.save_for_backward(*inputs[:n_tensors], output[2])
    ctx.save_for_forward(*inputs[:n_tensors], output[2])
    ctx.consts, ctx.backend, ctx.name = inputs[n_tensors:-2], inputs[-2], name
    # an unused output's gradient arrives as None, not as a tensor of zeros to fill (the
    # checkpoints' are large); backward makes what it needs
    ctx.set_materialize_grads(False)


class _Scan(Function):
    """A checkpointed scan (its name the last argument): (out, final, checkpoints), with
    forward-mode AD (torch.func.jvp, jacfwd)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(*args: Any) -> tuple[Tensor, Tensor, Tensor]:
        *operands, name = args
        result: tuple[Tensor, Tensor, Tensor] = _SCANS[name].forward(*operands)
        return result

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
        # The checkpoints stay differentiable, with a zero tangent (jvp): under vmap,
        # torch's generated rule passes mark_non_differentiable the batched output, which
        # marks nothing, and then fails on a None tangent (jvp, jacfwd of a vmapped
        # scan). Nothing reads them outside the op; backward gets None for them.
        _save(ctx, inputs, output)

    @staticmethod
    def backward(ctx: Any, grad_out: Opt, grad_final: Opt, _: Opt) -> tuple[Opt, ...]:
        built = _SCANS[ctx.name]
        *tensors, checkpoints = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(tensors[built.spec.out_like])
        if grad_final is None:
            grad_final = built.spec.zero_final(tensors, ctx.consts)
        grads = _apply_backward(
            *tensors, checkpoints, grad_out, grad_final, *ctx.consts, ctx.backend, ctx.name
        )
        need = ctx.needs_input_grad
        return (
            *(g if need[i] and tensors[i] is not None else None for i, g in enumerate(grads)),
            *(None for _ in range(built.tensors - built.spec.operands.grads + built.consts + 2)),
        )

    @staticmethod
    def jvp(ctx: Any, *tangents: Opt) -> tuple[Opt, ...]:
        # The kernels have no forward mode: the tangents come from forward-mode AD
        # through the torch backend's forward, at the primal point the scan ran at.
        built = _SCANS[ctx.name]

        def forward(*ops: Opt) -> tuple[Tensor, Tensor]:
            out, final, _ = built.spec.row.backends["torch"].forward(*ops, *ctx.consts)
            return out, final

        if nested_forward_mode():  # forward over forward: see nested_forward_mode
            refuse_second_derivatives(built.spec.row.op)
        *operands, checkpoints = ctx.saved_tensors
        t_out, t_final = jvp_through(forward, tuple(operands), tangents[: built.tensors])
        return t_out, t_final, torch.zeros_like(checkpoints)


@opaque_to_dynamo
def _apply_function(*args: Any) -> tuple[Tensor, Tensor, Tensor]:
    """The scan named ``args[-1]`` (its _Scan) applied to ``args``."""
    result: tuple[Tensor, Tensor, Tensor] = _SCANS[args[-1]].functions[0].apply(*args)
    return result


@opaque_to_dynamo
def _apply_backward(*args: Any) -> tuple[Tensor, ...]:
    """The backward of the scan named ``args[-1]`` (its _Backward) applied to ``args``."""
    grads: tuple[Tensor, ...] = _SCANS[args[-1]].functions[1].apply(*args)
    return grads
