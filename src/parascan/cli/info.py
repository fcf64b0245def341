"""Facts about this machine and build, for ``parascan info`` and benchmark headers."""

from __future__ import annotations

import platform
from pathlib import Path

import torch

from parascan._core import backends
from parascan._native import kernel_library_error

__all__ = ["cpu_flags", "cpu_model", "summary"]


def _cpuinfo() -> str:
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""


def cpu_model() -> str:
    for line in _cpuinfo().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    """The SIMD extensions the kernels can use that this CPU reports."""
    for line in _cpuinfo().splitlines():
        if line.startswith("flags"):
            have = set(line.split(":", 1)[1].split())
            return [f for f in ("avx2", "fma", "f16c", "avx512f") if f in have]
    return []


def summary() -> dict[str, object]:
    from parascan import __version__

    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    info: dict[str, object] = {
        "parascan": __version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_simd": cpu_flags(),
        "threads": torch.get_num_threads(),
        "cpu_kernels": kernel_library_error() or "loaded",
        "backends": {d: backends(d) for d in devices},
    }
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name()
    return info
