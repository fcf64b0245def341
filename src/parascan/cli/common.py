"""What the bench modules share: the loop over cases, rounds of timings and their
medians, ratios, one training step, the peak memory of a call, packed sequences'
offsets, the matrix-product FLOP limits, and table lines."""

from __future__ import annotations

import ctypes
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TypeVar

import torch

from parascan.cli.timing import elapsed

__all__ = [
    "bmm_limits",
    "cell",
    "cu_seqlens",
    "median",
    "ms",
    "peak_extra_mib",
    "ratio",
    "rounds",
    "run_cases",
    "table",
    "train",
]

K = TypeVar("K")
C = TypeVar("C")
R = TypeVar("R")


def run_cases(
    run_case: Callable[[C, int, Callable[[str], None]], Iterable[R]],
    cases: Iterable[C],
    repeat: int,
    step: Callable[[str], None] = lambda _: None,
) -> list[R]:
    """Every case's rows, one case after another; ``step`` is called with a label as
    each row is done (the progress bar)."""
    return [row for case in cases for row in run_case(case, repeat, step)]


def rounds(
    fns: Mapping[K, Callable[[], object]],
    repeat: int,
    keep: Callable[[K, int], bool] = lambda key, i: True,
    calls: int = 1,
    device: str = "cpu",
    once_over: float | None = None,
) -> dict[K, list[float]]:
    """Seconds per call of each of ``fns`` (over ``calls`` calls), in ``repeat`` rounds:
    each round times them back to back in order, so that a slow spell of a shared
    machine hits them alike; ``keep(key, round)`` false leaves one out of that round,
    and one whose first time is over ``once_over`` seconds is not timed again (a call
    of seconds is its own long sample; repeating it would cost the run minutes)."""
    times: dict[K, list[float]] = {key: [] for key in fns}
    for i in range(repeat):
        for key, fn in fns.items():
            slow = once_over is not None and bool(times[key]) and times[key][0] > once_over
            if keep(key, i) and not slow:
                times[key].append(elapsed(fn, calls, device))
    return times


def median(times: list[float]) -> float | None:
    """The median, or None when nothing was timed (a wrong result is not)."""
    return statistics.median(times) if times else None


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def ratio(num: float | None, den: float | None) -> float | None:
    return None if num is None or den is None else num / den


def train(
    fn: Callable[..., torch.Tensor], inputs: dict[str, torch.Tensor], weight: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """``fn(**inputs)`` and the gradients of all its inputs, for the upstream gradient
    ``weight``."""
    leaves = {k: v.detach().requires_grad_() for k, v in inputs.items()}
    out = fn(**leaves)
    return (out, *torch.autograd.grad(out, list(leaves.values()), weight))


def cu_seqlens(length: int, packed: int, seed: int) -> torch.Tensor:
    """``packed`` sequences of random lengths (some may be empty) covering ``length``
    steps: their int32 offsets, drawn from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    cuts = torch.randint(0, length + 1, (packed - 1,), generator=gen).sort().values
    return torch.cat([torch.tensor([0]), cuts, torch.tensor([length])]).to(torch.int32)


def bmm_limits(
    batch: int, rows: int, inner: int, cols: int
) -> dict[tuple[str, str], Callable[[], object]]:
    """The FLOP limits of rows ``("limit", direction)``: ``torch.bmm`` of random
    (batch, rows, inner) by (batch, inner, cols) matrices forward, and of 3x that inner
    dim forward+backward, into one warm output."""
    lhs = torch.randn(batch, rows, inner)
    rhs = torch.randn(batch, inner, cols)
    buf = torch.empty(batch, rows, cols)
    lhs3 = torch.randn(batch, rows, 3 * inner)
    rhs3 = torch.randn(batch, 3 * inner, cols)
    return {
        ("limit", "forward"): lambda: torch.bmm(lhs, rhs, out=buf),
        ("limit", "forward+backward"): lambda: torch.bmm(lhs3, rhs3, out=buf),
    }


def peak_extra_mib(fn: Callable[[], object]) -> float | None:
    """Growth of the peak resident set during ``fn`` (Linux, glibc), in MiB. Blocks of
    64 KiB and more are made to come from (and go back to) the OS directly during
    ``fn``, so that memory freed earlier and kept by malloc cannot hide an allocation.

    Afterwards malloc keeps blocks up to 32 MiB, as glibc's own dynamic threshold does
    once blocks of that size have been freed: setting the threshold turns that growth off
    for the rest of the process, and left at 64 KiB every later block of that size
    would be a fresh mapping, its pages faulted in and zeroed at each allocation: the
    bench's DPLR naive loop (temporaries of 640 KiB a step) ran 4x slower after a peak
    measurement than before it, and every allocating call somewhat slower."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, 64 * 1024)  # also turns off its dynamic growth
    except (OSError, AttributeError):
        return None
    try:
        libc.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set
        base = _status_kib("VmRSS")
        fn()
        return (_status_kib("VmHWM") - base) / 1024
    except (OSError, AttributeError):
        return None
    finally:  # whatever failed above: never left at 64 KiB
        libc.mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX)
        libc.mallopt(_M_TRIM_THRESHOLD, 2 * _MMAP_THRESHOLD_MAX)


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling for its dynamic threshold (64-bit)


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise OSError(f"no {key} in /proc/self/status")


def cell(value: float | None, spec: str, missing: str = "-") -> str:
    """``value`` formatted by ``spec``; ``missing`` for None."""
    return missing if value is None else format(value, spec)


def table(
    head: Sequence[str], line: str, names: Sequence[str], rows: Iterable[Sequence[object]]
) -> str:
    """The lines of ``head``, then ``line`` (a ``str.format`` template, one field per
    column) filled with the column names and with each row's cells."""
    return "\n".join([*head, line.format(*names), *(line.format(*cells) for cells in rows)])
