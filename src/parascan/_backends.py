"""Which backend computes a scan, per device.

cpu     compiled C kernels (CPU tensors)
triton  Triton kernels (CUDA tensors; also CPU tensors under TRITON_INTERPRET=1, for
        testing, when asked for by name)
torch   pure PyTorch, parallel (chunked) algorithm, any device
loop    the sequential reference, any device, slow
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable

import torch

from parascan._native import kernel_library_error

__all__ = ["BACKENDS", "backends", "resolve_backend", "unavailable_reason"]

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
    dev = _device(device)
    return [
        b
        for b in BACKENDS
        if unavailable_reason(b, dev) is None and (b != "triton" or dev.type == "cuda")
    ]


def resolve_backend(fn: str, backend: object, device: torch.device) -> str:
    """The concrete backend for ``backend`` (``"auto"`` picks the fastest available)."""
    if not isinstance(backend, str) or backend not in ("auto", *BACKENDS):
        raise ValueError(
            f"{fn}: expected backend to be one of {('auto', *BACKENDS)}, but got {backend!r}"
        )
    if backend == "auto":
        available = backends(device)
        if not available:
            raise RuntimeError(f"{fn}: no backend can run on device {device}")
        return available[0]
    reason = unavailable_reason(backend, device)
    if reason is not None:
        raise RuntimeError(f"{fn}: backend {backend!r} is not available: {reason}")
    return backend
