"""Timing helpers shared by the benchmarks (common.py's ``rounds``, bench.py,
bench_generic.py, bench_packed.py, distributed/bench.py)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["elapsed", "event_back_to_back", "event_median", "median_time"]


def elapsed(fn: Callable[[], object], calls: int = 1, device: str = "cpu") -> float:
    """Seconds per call of ``fn``, over ``calls`` back-to-back calls (on a GPU, from
    an idle device to the end of the last kernel)."""
    gpu = device.startswith("cuda")
    if gpu:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if gpu:
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / calls


def median_time(fn: Callable[[], object], repeat: int) -> float:
    """The median of ``repeat`` single calls, after one call to warm up."""
    fn()
    return statistics.median(elapsed(fn) for _ in range(repeat))


def _events(fn: Callable[[], object], calls: int) -> float:
    """Seconds per call of ``calls`` back-to-back calls of ``fn``, timed by CUDA events
    from an idle device."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    stop.record()
    torch.cuda.synchronize()
    seconds: float = start.elapsed_time(stop) / 1e3
    return seconds / calls


def event_median(fn: Callable[[], object], reps: int = 20) -> float:
    """The median seconds of ``reps`` calls of ``fn`` on the current CUDA device, each
    timed by CUDA events from an idle device (the host's time per call included), after
    a warm-up call (tools/gpu's scripts)."""
    fn()
    torch.cuda.synchronize()
    return statistics.median(_events(fn, 1) for _ in range(reps))


def event_back_to_back(fn: Callable[[], object], calls: int = 20, rounds: int = 3) -> float:
    """Seconds per call of ``fn`` on the current CUDA device: CUDA events around
    ``calls`` back-to-back calls, the median of ``rounds``, after a warm-up call. Where
    the GPU is the slower side the host's time per call is hidden, as in a model's
    step; ``event_median``'s single calls after a synchronization include it (tools/gpu:
    0.36 ms per first-order call on an H200's host, more than the kernel's time at
    (8, 1536, 4096))."""
    fn()
    torch.cuda.synchronize()
    return statistics.median(_events(fn, calls) for _ in range(rounds))
