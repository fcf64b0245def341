"""parascan's native layer: the C kernels, built into one shared library and loaded
with ctypes. This module locates and loads the library; ``bindings`` calls it; the C
sources shared by the kernels are beside them (abi.h: the argument structs).

Nothing is compiled here: the library is built by ``pip install`` (setup.py). When it
is missing or stale the ``cpu`` backend is unavailable and says why.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import os
from pathlib import Path

__all__ = ["kernel_library", "kernel_library_error", "kernel_library_path", "simd"]

_STEM = "_kernels"


def simd() -> bool:
    """Whether the C kernels that have a portable path besides their vector one (the SSD
    scan and layer, the generic block products) take the vector one where the CPU has
    it: yes, unless the environment sets ``PARASCAN_SIMD=0`` (the tests run both)."""
    return os.environ.get("PARASCAN_SIMD", "1") != "0"


ABI_VERSION = 12  # abi.h: PS_ABI_VERSION


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
