"""Which backend computes a scan, per device.

cpu     compiled C kernels (CPU tensors)
triton  Triton kernels (CUDA tensors; not part of this version yet)
torch   pure PyTorch, parallel (chunked) algorithm, any device
loop    the sequential reference, any device, slow
"""

from __future__ import annotations

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
        return "this version of parascan has no Triton kernels yet"
    if backend in ("torch", "loop"):
        return None
    raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")


def backends(device: str | torch.device = "cpu") -> list[str]:
    """Names of the backends that can run on ``device``, fastest first.

    >>> backends("cpu")[-2:]
    ['torch', 'loop']
    """
    return [b for b in BACKENDS if unavailable_reason(b, device) is None]


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
