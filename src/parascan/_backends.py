"""Which backend computes a scan: the one backend table and its resolver.

The backends, and the devices they take:

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
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from parascan._checks import FLOAT_DTYPES
from parascan._native import kernel_library_error

__all__ = [
    "BACKENDS",
    "Backend",
    "OpBackends",
    "backends",
    "register",
    "resolve",
    "table",
    "unavailable_reason",
]

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
