"""What patching a transformers model can save at most: the time of the model's own
linear layers alone, which :func:`parascan.integrations.transformers.patch` never
replaces.

``linear_calls(run)`` records every projection one run makes: each
``torch.nn.functional.linear`` call (the ``nn.Linear`` modules, and the projections a
fused layer applies to weights it is handed: Mamba-2's out projection inside
``mamba_split_conv1d_scan_combined``), each ``torch._grouped_mm`` call (the experts of a
mixture of experts, which ``torch.nn.functional.grouped_mm`` runs) and each
``torch.baddbmm(bias, input, weight)`` call (block-diagonal projections, as
RecurrentGemma's gates; any other baddbmm of three tensors counts too, so a model that
computed its attention so would see it counted). ``linear_time(calls, train, repeat)``
times them alone on inputs of the shapes seen (forward; with ``train``, forward and
backward with the gradients of input, weight and bias), the minimum of ``repeat`` runs.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["LinearCall", "linear_calls", "linear_time", "min_time"]

# A projection seen: (torch.nn.functional.linear, torch._grouped_mm or torch.baddbmm,
# input shape, weight, then the bias (None: none) or grouped_mm's group offsets).
LinearCall = tuple[Callable[..., torch.Tensor], torch.Size, torch.Tensor, "torch.Tensor | None"]

_GROUPED_MM: Callable[..., torch.Tensor] | None = getattr(torch, "_grouped_mm", None)


def min_time(fn: Callable[[], object], repeat: int) -> float:
    """The fastest of ``repeat`` runs of ``fn``, after one untimed run."""
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


class _LinearCalls(TorchFunctionMode):
    """Records the projections (see the module docstring) while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[LinearCall] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            self.seen.append((func, args[0].shape, args[1], bias))
        elif (
            _GROUPED_MM is not None
            and func is _GROUPED_MM
            and kwargs.get("bias") is None
            and kwargs.get("offs") is not None
        ):
            self.seen.append((_GROUPED_MM, args[0].shape, args[1], kwargs["offs"].clone()))
        elif func is torch.baddbmm and len(args) == 3 and not kwargs:
            self.seen.append((func, args[1].shape, args[2], args[0]))
        return func(*args, **kwargs)


def linear_calls(run: Callable[[], object]) -> list[LinearCall]:
    """The projections of one run of ``run``."""
    calls = _LinearCalls()
    with calls:
        run()
    return calls.seen


def linear_time(calls: list[LinearCall], train: bool, repeat: int) -> float:
    """The time of ``calls`` alone (the module docstring)."""

    def leaf(t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone().requires_grad_(train)

    inputs = [
        (
            func, torch.randn(shape, requires_grad=train), leaf(weight),
            extra if extra is None or func is _GROUPED_MM else leaf(extra),
        )
        for func, shape, weight, extra in calls
    ]  # fmt: skip

    def run() -> None:
        for func, x, w, extra in inputs:
            out: Any
            if func is _GROUPED_MM:
                out = func(x, w, offs=extra)
            elif func is torch.baddbmm:
                assert extra is not None  # its bias, recorded only where given
                out = torch.baddbmm(extra, x, w)
            else:
                out = func(x, w, extra)
            if train:
                out.backward(torch.ones_like(out))

    with torch.set_grad_enabled(train):
        return min_time(run, repeat)
