"""The ``cpu`` backend of the first-order scans: the C kernels of this folder (one
forward and one fused backward template, cpu_forward.h and cpu_backward.h,
instantiated per semiring and dtype in cpu.c), through parascan._native.bindings,
whose entries take the semiring's name where every backend takes the semiring."""

from __future__ import annotations

from collections.abc import Callable
from typing import Concatenate, ParamSpec, TypeVar

from parascan._native import bindings
from parascan.first_order.semiring import Semiring

__all__ = ["backward", "forward"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _by_semiring(
    entry: Callable[Concatenate[str, _P], _R],
) -> Callable[Concatenate[Semiring, _P], _R]:
    def kernel(ring: Semiring, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        return entry(ring.name, *args, **kwargs)

    return kernel


# The contract of ``reference.loop``, CPU tensors of one dtype (``verified`` and
# ``cu_seqlens``: see bindings.scan_forward).
forward = _by_semiring(bindings.scan_forward)
# The fused backward: reads gates (and tokens, which only the log semiring's reads;
# None otherwise), out and grad_out once, and writes the gradients of gates, tokens
# and initial once (the equations: _native/abi.h).
backward = _by_semiring(bindings.scan_backward)
