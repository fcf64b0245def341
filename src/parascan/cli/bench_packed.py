"""The packed-sequence part of ``parascan bench``: ``linear_scan(..., cu_seqlens=)`` on a
batch of sequences of random lengths packed along time, against the same tokens as
one sequence (what packing should cost: nothing more) and against scanning each
sequence by itself in a Python loop (what users write without ``cu_seqlens``).

Summary of method. Every packed result is first checked against a float64 scan of
each sequence alone on a few channels (the chunked torch backend in float64, itself
tested against the loop); a wrong result gets no speed. Each repetition then times
the limit (``torch.add`` over the case's tensors, scaled to the 3 a scan moves: read a
and b, write x) and the Python loop, and then, twice, runs the single-sequence scan
once untimed and times the packed and the single-sequence calls back to back, in one
order and then in the other. Why: on this machine a scan right after a large torch op
measured up to 2x slower than one right after another scan, packed or not alike (its
time in page faults for fresh 2 MiB pages after the torch op has given back memory of
small pages: 0.9 to 1.4 s against 0.25 to 0.4 s at 2^18 x 1024), and the second of two
scans in a row often slower than the first; the order used before (rotating over
limit, packed, single, loop) put the packed call after the limit or the loop in every
repetition and the single one after the packed call in most, which read 1.1x to 4.8x
where the two calls cost the same. Now each timed call follows a scan, and each of the
two takes each place once per repetition. Times are medians; the packed row's ratio
to the single-sequence row is the median over repetitions of the ratio of the two
calls' sums within one, which cancels what the machine's load does from one
repetition to the next (the loop's ratio is that of the medians).
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from itertools import pairwise

import torch

from parascan.cli.common import cell, median, ms, ratio, run_cases, table
from parascan.cli.timing import elapsed as _elapsed
from parascan.cli.tolerance import TOLERANCE, relative_error
from parascan.first_order import linear_scan
from parascan.first_order.chunked import forward_linear

__all__ = [
    "DEFAULT_PACKED_CASES",
    "FULL_PACKED_CASES",
    "QUICK_PACKED_CASES",
    "PackedCase",
    "PackedRow",
    "format_packed",
    "implementation_names",
    "run_packed",
]


@dataclass(frozen=True)
class PackedCase:
    name: str
    sequences: int
    tokens: int  # in all, packed along time
    channels: int
    seed: int = 0


@dataclass
class PackedRow:
    case: str
    shape: tuple[int, ...]
    sequences: int
    threads: int
    impl: str
    time_ms: float | None
    limit_ms: float
    ratio: float | None  # time / limit
    vs_one_sequence: float | None  # time / the single-sequence row's
    max_error: float | None
    correct: bool


# The shape: 64 sequences of random lengths, 2^20 tokens x 1024 channels
# (4 GiB per float32 tensor); the default workload runs a sixteenth of it.
FULL_PACKED_CASES = [PackedCase("packed 64 sequences", 64, 2**20, 1024)]
DEFAULT_PACKED_CASES = [PackedCase("packed 64 sequences", 64, 2**18, 256)]
QUICK_PACKED_CASES = [PackedCase("packed 8 sequences", 8, 2**12, 64)]


_PACKED_LINE = "{:<24} {:<18} {:<28} {:>9} {:>8} {:>6} {:>9}"


def format_packed(rows: list[PackedRow]) -> str:
    head = (
        "Packed sequences (linear_scan with cu_seqlens, forward, float32; x limit: "
        "torch.add over the same bytes; x one: the same tokens as one sequence)"
    )
    names = ("case", "shape", "implementation", "ms", "x limit", "x one", "error")
    cells = (
        (r.case, "x".join(map(str, r.shape)), r.impl, cell(r.time_ms, ".1f", "WRONG"),
         cell(r.ratio, ".2f"), cell(r.vs_one_sequence, ".2f"), cell(r.max_error, ".1e", ""))
        for r in rows
    )  # fmt: skip
    return table([head], _PACKED_LINE, names, cells)


_IMPLEMENTATIONS = ("cu_seqlens", "one sequence", "python loop over sequences")
_CHECKED_CHANNELS = 8


def implementation_names(case: PackedCase) -> tuple[str, ...]:
    return _IMPLEMENTATIONS


def _offsets(case: PackedCase) -> list[int]:
    cuts = random.Random(case.seed).sample(range(1, case.tokens), case.sequences - 1)
    return [0, *sorted(cuts), case.tokens]


def _check(out: torch.Tensor, gates: torch.Tensor, tokens: torch.Tensor,
           initial: torch.Tensor, cu: list[int]) -> float:  # fmt: skip
    """The largest relative error of a few channels against each sequence scanned
    alone in float64."""
    c = slice(0, _CHECKED_CHANNELS)
    a, b = gates[0, :, c].double(), tokens[0, :, c].double()
    want = torch.cat([
        forward_linear(a[lo:hi], b[lo:hi], initial[s, c].double(), 0, False)
        for s, (lo, hi) in enumerate(pairwise(cu))
    ])  # fmt: skip
    return relative_error(out[0, :, c], want)


def _run_case(case: PackedCase, repeat: int, step: Callable[[str], None]) -> list[PackedRow]:
    gen = torch.Generator().manual_seed(case.seed)
    shape = (1, case.tokens, case.channels)
    gates = torch.rand(shape, generator=gen)
    tokens = torch.rand(shape, generator=gen)
    cu = _offsets(case)
    cu_t = torch.tensor(cu)
    initial = torch.rand((case.sequences, case.channels), generator=gen)

    def loop() -> torch.Tensor:
        out = torch.empty_like(tokens)
        for s, (lo, hi) in enumerate(pairwise(cu)):
            out[:, lo:hi] = linear_scan(gates[:, lo:hi], tokens[:, lo:hi], 1,
                                        initial=initial[s : s + 1])  # fmt: skip
        return out

    impls: dict[str, Callable[[], object]] = {
        "cu_seqlens": lambda: linear_scan(gates, tokens, 1, initial=initial, cu_seqlens=cu_t),
        "one sequence": lambda: linear_scan(gates, tokens, 1, initial=initial[:1]),
        "python loop over sequences": loop,
    }
    error = _check(linear_scan(gates, tokens, 1, initial=initial, cu_seqlens=cu_t), gates,
                   tokens, initial, cu)  # fmt: skip
    correct = error <= TOLERANCE[torch.float32][1]

    def limit_fn() -> object:  # 3 tensors moved, as a forward scan
        return torch.add(gates, tokens)

    times: dict[str, list[float]] = {name: [] for name in impls}
    limits: list[float] = []
    paired: list[float] = []  # per repetition: packed / single, from calls side by side
    pair = ["cu_seqlens", "one sequence"] if correct else ["one sequence"]
    for _ in range(repeat):
        limits.append(_elapsed(limit_fn, 1, "cpu"))
        times["python loop over sequences"].append(_elapsed(loop, 1, "cpu"))
        # (scan) A B (scan) B A: each timed call follows a scan, first once and second once
        spent = dict.fromkeys(pair, 0.0)
        for order in (pair, pair[::-1]):
            impls["one sequence"]()  # untimed (see the module docstring)
            for name in order:
                seconds = _elapsed(impls[name], 1, "cpu")
                times[name].append(seconds)
                spent[name] += seconds
        if correct:
            paired.append(spent["cu_seqlens"] / spent["one sequence"])
    limit = statistics.median(limits)
    med = {name: median(t) for name, t in times.items()}
    vs_one = {name: ratio(t, med["one sequence"]) for name, t in med.items()}
    if paired:
        vs_one["cu_seqlens"] = statistics.median(paired)
    rows = []
    for name, t in med.items():
        step(f"{case.name} {name}")
        ours = name == "cu_seqlens"
        rows.append(PackedRow(
            case.name, shape, case.sequences, torch.get_num_threads(), name, ms(t), limit * 1e3,
            ratio(t, limit), vs_one[name], error if ours else None, correct if ours else True,
        ))  # fmt: skip
    return rows


# run_packed(cases, repeat, step): every case's rows (see the module docstring)
run_packed = partial(run_cases, _run_case)
