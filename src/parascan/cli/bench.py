"""``parascan bench``: parascan against its peers and the machine's memory bandwidth.

Summary of method. Every case (a shape, dim, dtype and thread count) is timed for
each implementation: parascan's backends, and the peers of ``peers.py``. Each
repetition times, back to back, two bandwidth limits and the implementation; the
medians are reported, so ratios stay meaningful on a noisy shared machine:
  - ``limit``: ``torch.add(x, y)`` over tensors of the case's size, scaled to the
    tensors the call moves (3 forward, 5 backward). It allocates its output, as the
    scan does, so it includes the page faults of fresh memory;
  - ``stream``: ``torch.add(x, y, out=o)`` into a warm buffer, scaled the same way:
    the bare streaming bandwidth, the stricter yardstick.
Every result is checked first against a float64 reference (the sequential loop;
for more than 8192 steps the float64 chunked torch backend, itself tested against
the loop): a parascan result beyond its dtype's tolerance, or a peer beyond 1e-3
relative, is reported as WRONG, never with a speed. log_linear_scan cases ("log"
in the name) scan log a and log b and report the absolute error in log x.

Workloads: ``DEFAULT_CASES`` (``parascan bench``) keeps the headline shapes for the
fast backend and runs the slow implementations, once each, on a smaller shape;
``FULL_CASES`` (``--full``) runs every case at full size; ``QUICK_CASES``
(``--quick``) is a smoke test; ``CUDA_CASES`` is ``--device cuda``'s. ``SWEEPS`` holds
each workload's sweep over T for ``--plot`` (``--quick``'s small).
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any, TextIO

import torch

from parascan._core import backends
from parascan.cli import peers
from parascan.cli.bench_generic import (
    DEFAULT_GENERIC_CASES,
    FULL_GENERIC_CASES,
    QUICK_GENERIC_CASES,
    GenericCase,
    format_generic,
    implementation_names,
    run_generic,
)
from parascan.cli.bench_packed import (
    DEFAULT_PACKED_CASES,
    FULL_PACKED_CASES,
    QUICK_PACKED_CASES,
    PackedCase,
    format_packed,
    run_packed,
)
from parascan.cli.bench_packed import implementation_names as packed_names
from parascan.cli.bench_selective import (
    DEFAULT_SSM_CASES,
    FULL_SSM_CASES,
    QUICK_SSM_CASES,
    AnySsmCase,
    SsmCase,
    format_ssm,
    run_ssm,
    ssm_step_names,
)
from parascan.cli.bench_ssd import SsdCase
from parascan.cli.common import cell, ms, ratio, rounds, table
from parascan.cli.info import summary
from parascan.cli.timing import elapsed as _elapsed
from parascan.cli.tolerance import TOLERANCE, relative_error
from parascan.first_order import linear_scan, log_linear_scan
from parascan.first_order.chunked import forward_linear
from parascan.first_order.ops import composed_backward
from parascan.first_order.reference import linear_loop
from parascan.first_order.semiring import LINEAR, LOG

__all__ = [
    "CUDA_CASES",
    "DEFAULT_CASES",
    "DEFAULT_GENERIC_CASES",
    "DEFAULT_PACKED_CASES",
    "DEFAULT_SSM_CASES",
    "FULL_CASES",
    "FULL_GENERIC_CASES",
    "FULL_PACKED_CASES",
    "FULL_SSM_CASES",
    "QUICK_CASES",
    "QUICK_GENERIC_CASES",
    "QUICK_PACKED_CASES",
    "QUICK_SSM_CASES",
    "SWEEPS",
    "WORKLOADS",
    "Case",
    "Row",
    "SsdCase",
    "SsmCase",
    "Sweep",
    "plot",
    "plot_labels",
    "run_bench",
]

# Peers are judged by a sanity bound, not parascan's own tolerance: their accuracy is
# part of what the table shows (the error column).
_PEER_TOLERANCE = 1e-3
_LOOP_REFERENCE_STEPS = 8192


@dataclass(frozen=True)
class Case:
    name: str
    shape: tuple[int, ...]
    dim: int
    dtype: torch.dtype = torch.float32
    backward: bool = True
    backends: tuple[str, ...] | None = None  # None: every backend available
    peers: bool = False
    threads: int | None = None  # None: torch.get_num_threads()
    op: str = "linear"  # "linear" (linear_scan) or "log" (log_linear_scan)
    device: str = "cpu"


@dataclass
class Row:
    case: str
    shape: tuple[int, ...]
    dim: int
    dtype: str
    threads: int
    impl: str
    kind: str  # "parascan" or "peer"
    direction: str  # "forward" or "backward"
    tensors: int
    time_ms: float | None
    limit_ms: float
    stream_ms: float
    ratio: float | None  # time / limit
    stream_ratio: float | None  # time / stream
    max_error: float | None
    correct: bool
    note: str = ""
    times_ms: list[float] = field(default_factory=list)


def _one_long_sequence(steps: int) -> Case:
    """Forward only, on the cpu and torch backends, and every peer."""
    return Case(
        "float32 one long sequence", (1, steps), -1, backward=False, backends=("cpu", "torch"),
        peers=True,
    )  # fmt: skip


_MAJOR, _CONTIG = (8, 4096, 1536), (8, 1536, 4096)
# `parascan bench --full`: every dtype, one thread against all, long sequences, both
# layouts of log_linear_scan, every peer at the headline shapes (about 10 minutes on 2 cores).
FULL_CASES = [
    Case("float32 time-major", _MAJOR, 1, peers=True),
    Case("float32 time-contiguous", _CONTIG, -1, peers=True),
    Case("float32 time-contiguous", _CONTIG, -1, backends=("cpu",), threads=1),
    Case("bfloat16 time-major", _MAJOR, 1, torch.bfloat16, backends=("cpu",)),
    Case("bfloat16 time-contiguous", _CONTIG, -1, torch.bfloat16, backends=("cpu",)),
    Case("float16 time-major", _MAJOR, 1, torch.float16, backends=("cpu",)),
    Case("float16 time-contiguous", _CONTIG, -1, torch.float16, backends=("cpu",)),
    Case("complex64 time-major", _MAJOR, 1, torch.complex64, backends=("cpu",)),
    Case("complex64 time-contiguous", _CONTIG, -1, torch.complex64, backends=("cpu",)),
    _one_long_sequence(10_000_000),
    Case("float32 one long sequence", (1, 2**24), -1, backward=False, backends=("cpu",)),
    Case("float32 four long sequences", (4, 10**6), -1, backward=False, backends=("cpu",)),
    Case("float32 small", (1, 64, 128), 1, backward=False, backends=("cpu",)),
    Case("log float32 time-major", _MAJOR, 1, backends=("cpu",), peers=True, op="log"),
    Case("log float32 time-contiguous", _CONTIG, -1, backends=("cpu",), peers=True, op="log"),
    Case(
        "log float32 long sequences",
        (4, 100_000),
        -1,
        backward=False,
        backends=("cpu",),
        peers=True,
        op="log",
    ),
]
# `parascan bench` (no arguments, the README's first command; under two minutes on 2 cores:
# 108 s measured on a shared machine at load average 6): the fast backend at the headline
# shapes; every backend and peer, the slow ones (the loop and chunked torch backends, the
# tree and log-space peers) timed once, on one sequence of the same length with half the
# channels, a sixteenth of the headline's elements; log_linear_scan likewise; one long
# sequence. Every ratio is to the limit measured in the same run at the row's own shape.
_MAJOR_SMALL, _CONTIG_SMALL = (1, 4096, 768), (1, 768, 4096)
DEFAULT_CASES = [
    Case("float32 time-major", _MAJOR, 1, backends=("cpu",)),
    Case("float32 time-contiguous", _CONTIG, -1, backends=("cpu",)),
    Case("float32 time-major", _MAJOR_SMALL, 1, peers=True),
    Case("float32 time-contiguous", _CONTIG_SMALL, -1, peers=True),
    Case("log float32 time-major", _MAJOR_SMALL, 1, backends=("cpu",), peers=True, op="log"),
    Case("log float32 time-contiguous", _CONTIG_SMALL, -1, backends=("cpu",), peers=True, op="log"),
    _one_long_sequence(2**22),
]
# `parascan bench --device cuda`: accelerated-scan's published forward figures with its
# CUDA kernel are 2.82 ms at (8, 1536, 16384) and 11.30 ms at (8, 1536, 65536).
CUDA_CASES = [
    Case(f"cuda float32 T={t}", (8, 1536, t), -1, peers=True, device="cuda")
    for t in (4096, 16384, 65536)
] + [
    Case("cuda bfloat16 T=16384", (8, 1536, 16384), -1, torch.bfloat16, device="cuda"),
    Case("cuda float32 few channels", (1, 4, 2**22), -1, backward=False, device="cuda"),
    Case("cuda log float32 T=16384", (8, 1536, 16384), -1, op="log", device="cuda"),
]
QUICK_CASES = [
    Case("float32 time-major", (2, 256, 192), 1, peers=True),
    Case("float32 time-contiguous", (2, 192, 256), -1, peers=True),
    Case("log float32 time-contiguous", (2, 192, 256), -1, peers=True, op="log"),
]
# The lists of cases (linear_scan, generic, packed, state-space) of `parascan bench --quick`,
# `parascan bench` and `parascan bench --full`.
WORKLOADS = {
    "quick": (QUICK_CASES, QUICK_GENERIC_CASES, QUICK_PACKED_CASES, QUICK_SSM_CASES),
    "default": (DEFAULT_CASES, DEFAULT_GENERIC_CASES, DEFAULT_PACKED_CASES, DEFAULT_SSM_CASES),
    "full": (FULL_CASES, FULL_GENERIC_CASES, FULL_PACKED_CASES, FULL_SSM_CASES),
}


@dataclass(frozen=True)
class Sweep:
    """The cases of ``--plot``: linear_scan forward in float32 over the last dim of
    ``(batch, channels, T)`` for each T of ``steps``, every backend and peer."""

    batch: int
    channels: int
    steps: tuple[int, ...]

    def cases(self) -> list[Case]:
        return [
            Case("sweep", (self.batch, self.channels, t), -1, backward=False, peers=True)
            for t in self.steps
        ]


# The sweep of each workload: --quick's is a smoke test of the plot (a few seconds: the
# slow implementations, the loop backend and the tree peers, run every T once).
SWEEPS = {
    "quick": Sweep(2, 64, (2**8, 2**10, 2**12)),
    "default": Sweep(4, 256, (2**10, 2**12, 2**14, 2**16)),
    "full": Sweep(4, 256, (2**10, 2**12, 2**14, 2**16)),
}


class _Progress:
    """A one-line progress bar on stderr (a line per step when not a terminal)."""

    def __init__(self, total: int, stream: TextIO = sys.stderr) -> None:
        self.total, self.done, self.stream = total, 0, stream
        self.tty = stream.isatty()

    def step(self, label: str) -> None:
        self.done += 1
        width = 30
        filled = width * self.done // max(self.total, 1)
        line = f"[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} {label}"
        if self.tty:
            self.stream.write(f"\r\033[K{line}")
            if self.done == self.total:
                self.stream.write("\n")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def _inputs(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gates in (0.9, 1) (long memory), positive tokens (so the real Heinsen formula
    applies), and an upstream gradient; for log cases, the logs of gates and tokens."""
    gen = torch.Generator().manual_seed(0)
    mag = 0.9 + 0.1 * torch.rand(case.shape, generator=gen)
    tokens = torch.rand(case.shape, generator=gen)
    grad = torch.rand(case.shape, generator=gen)
    if case.op == "log":
        gates, tokens = mag.log(), tokens.log()
    elif case.dtype.is_complex:
        phase = 0.1 * torch.rand(case.shape, generator=gen)
        gates = torch.polar(mag, phase)
        tokens = torch.complex(tokens, torch.rand(case.shape, generator=gen))
        grad = torch.complex(grad, grad.flip(-1))
    else:
        gates = mag
    return tuple(t.to(case.dtype).to(case.device) for t in (gates, tokens, grad))  # type: ignore[return-value]


def _reference(case: Case, gates: torch.Tensor, tokens: torch.Tensor, grad: torch.Tensor):  # type: ignore[no-untyped-def]
    high = torch.complex128 if case.dtype.is_complex else torch.float64
    a, b, g = gates.cpu().to(high), tokens.cpu().to(high), grad.cpu().to(high)
    scan = linear_loop if case.shape[case.dim] <= _LOOP_REFERENCE_STEPS else forward_linear
    if case.op == "log":  # log of the linear recurrence on exp(inputs), in float64
        out = scan(a.exp(), b.exp(), None, case.dim, False).log()
        if not case.backward:
            return out, None
        ga, gb, _ = composed_backward(LOG, scan, a, b, out, g, None, case.dim, False)
        return out, (ga, gb)
    out = scan(a, b, None, case.dim, False)
    if not case.backward:
        return out, None
    ga, gb, _ = composed_backward(LINEAR, scan, a, None, out, g, None, case.dim, False)
    return out, (ga, gb)


def _error(case: Case, got: torch.Tensor, want: torch.Tensor) -> float:
    """Relative error (see relative_error); for log cases the absolute error in log x,
    the accuracy a log-space user sees."""
    if case.op == "log":
        return (got.to(want.dtype) - want).abs().max().item() if want.numel() else 0.0
    return relative_error(got, want)


def _implementations(case: Case) -> list[tuple[str, str, Callable[..., torch.Tensor], str]]:
    """(name, kind, scan(gates, tokens), reason it cannot run or "")."""
    names = tuple(backends(case.device)) if case.backends is None else case.backends
    impls: list[tuple[str, str, Callable[..., torch.Tensor], str]] = []
    scan = log_linear_scan if case.op == "log" else linear_scan
    for b in names:

        def fn(a: torch.Tensor, x: torch.Tensor, b: str = b) -> torch.Tensor:
            return scan(a, x, case.dim, backend=b)

        impls.append((b, "parascan", fn, ""))
    if case.peers:
        table = peers.LOG_PEERS if case.op == "log" else peers.PEERS
        for name, peer in table.items():
            if name in peers.CUDA_ONLY and not case.device.startswith("cuda"):
                continue
            like = torch.empty((), dtype=case.dtype, device=case.device).expand(case.shape)
            why = peers.unsupported(name, like, case.dim)

            def pfn(a: torch.Tensor, x: torch.Tensor, peer: Any = peer) -> torch.Tensor:
                return peer(a, x, case.dim)  # type: ignore[no-any-return]

            impls.append((name, "peer", pfn, why or ""))
    return impls


def _bench_case(case: Case, repeat: int, progress: _Progress) -> list[Row]:
    before = torch.get_num_threads()
    if case.threads is not None:
        torch.set_num_threads(case.threads)
    try:
        return _bench_case_threads(case, repeat, progress)
    finally:
        torch.set_num_threads(before)


def _bench_case_threads(case: Case, repeat: int, progress: _Progress) -> list[Row]:
    gates, tokens, grad = _inputs(case)
    want, want_grads = _reference(case, gates, tokens, grad)
    warm = torch.empty_like(tokens)
    threads = torch.get_num_threads()
    directions = ("forward", "backward") if case.backward else ("forward",)
    rows: list[Row] = []

    def row(impl: str, kind: str, direction: str, **kw: Any) -> Row:
        return Row(
            case=case.name, shape=case.shape, dim=case.dim,
            dtype=str(case.dtype).removeprefix("torch."), threads=threads, impl=impl,
            kind=kind, direction=direction, tensors=3 if direction == "forward" else 5, **kw,
        )  # fmt: skip

    for name, kind, fn, why in _implementations(case):
        if why:
            rows += [
                row(name, kind, d, time_ms=None, limit_ms=0.0, stream_ms=0.0, ratio=None,
                    stream_ratio=None, max_error=None, correct=True, note=why)
                for d in directions
            ]  # fmt: skip
            progress.step(f"{case.name} {name}")
            continue
        a = gates.clone().requires_grad_(case.backward)
        b = tokens.clone().requires_grad_(case.backward)
        out = fn(a, b)
        errors = {"forward": _error(case, out.detach().cpu(), want)}
        if case.backward and want_grads is not None:
            got = torch.autograd.grad(out, (a, b), grad, retain_graph=True)
            errors["backward"] = max(
                relative_error(g.cpu(), w) for g, w in zip(got, want_grads, strict=True)
            )
        tol = TOLERANCE[case.dtype][1] if kind == "parascan" else _PEER_TOLERANCE
        fast = kind == "parascan" and name in ("cpu", "triton")

        def forward(a: torch.Tensor = a, b: torch.Tensor = b, fn: Any = fn) -> object:
            with torch.no_grad():
                return fn(a, b)

        def backward(out: torch.Tensor = out, a: torch.Tensor = a, b: torch.Tensor = b) -> object:
            return torch.autograd.grad(out, (a, b), grad, retain_graph=True)

        fns: dict[str, Callable[[], object]] = {
            "limit": lambda: torch.add(gates, tokens),
            "stream": lambda: torch.add(gates, tokens, out=warm),
            "forward": forward,
        }
        if case.backward:
            fns["backward"] = backward
        if fast:  # warm up the allocator, the thread pool and the caches
            _elapsed(fns["limit"], 1, case.device)
            _elapsed(forward, 1, case.device)
        calls = 1
        if tokens.numel() < 100_000:  # tiny calls: as many per sample as fill ~10 ms
            once = _elapsed(forward, 1, case.device)
            calls = max(1, min(200, int(0.01 / max(once, 1e-6))))
        times = rounds(fns, repeat if fast else 1, calls=calls, device=case.device)
        limit, stream = statistics.median(times["limit"]), statistics.median(times["stream"])
        for d in directions:
            scale = (3 if d == "forward" else 5) / 3
            ok = errors[d] <= tol
            t = statistics.median(times[d]) if ok else None
            rows.append(
                row(name, kind, d, time_ms=ms(t), limit_ms=limit * scale * 1e3,
                    stream_ms=stream * scale * 1e3, ratio=ratio(t, limit * scale),
                    stream_ratio=ratio(t, stream * scale), max_error=errors[d], correct=ok,
                    times_ms=[x * 1e3 for x in times[d]] if ok else [])
            )  # fmt: skip
        progress.step(f"{case.name} {name}")
        del out
    return rows


def _sweep(sweep: Sweep, repeat: int, progress: _Progress) -> list[Row]:
    return [row for case in sweep.cases() for row in _bench_case(case, repeat, progress)]


_SCAN_LINE = "{:<29}{!s:<19}{:>3} {:>3}  {:<21}{:<9}{:>10}{:>9}{:>9}{:>12}{}"


def format_table(rows: list[Row], info: dict[str, object]) -> str:
    simd = ",".join(info["cpu_simd"]) or "none"  # type: ignore[arg-type]
    head = [
        f"parascan {info['parascan']} | torch {info['torch']} | Python {info['python']}",
        f"{info['cpu']} | {info['threads']} threads | SIMD {simd}",
        "x limit: time / torch.add over the same bytes (allocating, as the scan does);",
        "x stream: time / torch.add into a warm buffer (bare bandwidth);",
        "both scaled to the tensors a call moves: 3 forward, 5 backward.",
        "log rows: log_linear_scan on log a, log b; forward error is absolute, in log x.",
        "",
    ]
    names = ("case", "shape", "dim", "thr", "impl", "pass", "time ms", "x limit", "x stream",
             "max rel err", "")  # fmt: skip
    cells = []
    for r in rows:
        if r.note or r.time_ms is None:
            time_s, ratio_s, stream_s = "n/a" if r.note else "WRONG", "-", "-"
        else:
            time_s = f"{r.time_ms:.3f}" if r.time_ms < 1 else f"{r.time_ms:.2f}"
            ratio_s, stream_s = f"{r.ratio:.2f}", f"{r.stream_ratio:.2f}"
        note = f"  ({r.note})" if r.note else ""
        cells.append((r.case, r.shape, r.dim, r.threads, r.impl, r.direction, time_s, ratio_s,
                      stream_s, cell(r.max_error, ".1e", ""), note))  # fmt: skip
    return table(head, _SCAN_LINE, names, cells)


def plot_labels(sweep: Sweep) -> tuple[str, str, str]:
    """The plot's x-axis label, y-axis label and title, in words."""
    title = (
        f"linear_scan forward in float32: {sweep.batch} sequences of {sweep.channels} "
        "channels, scanned along T"
    )
    return "sequence length T", "time per call (ms)", title


def plot(rows: list[Row], path: str, sweep: Sweep) -> tuple[str, str]:
    """Time against T for every implementation (the sweep's rows), with the limits;
    saved to ``path``. Returns the axis labels as the figure has them."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError(
            "parascan bench --plot needs matplotlib: pip install 'parascan[bench]'"
        ) from exc
    swept = [r for r in rows if r.case == "sweep" and r.time_ms is not None]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for impl in dict.fromkeys(r.impl for r in swept):
        pts = sorted((r.shape[-1], r.time_ms or 0.0) for r in swept if r.impl == impl)
        label = (
            f"parascan {impl}"
            if any(r.kind == "parascan" for r in swept if r.impl == impl)
            else impl
        )
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    limit = sorted({(r.shape[-1], r.limit_ms) for r in swept if r.impl == "cpu"})
    stream = sorted({(r.shape[-1], r.stream_ms) for r in swept if r.impl == "cpu"})
    ax.plot([p[0] for p in limit], [p[1] for p in limit], "k--", label="limit (torch.add)")
    ax.plot([p[0] for p in stream], [p[1] for p in stream], "k:", label="stream (add, warm out)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    xlabel, ylabel, title = plot_labels(sweep)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    labels = (ax.get_xlabel(), ax.get_ylabel())
    plt.close(fig)
    return labels


def run_bench(
    *,
    cases: list[Case] | None = None,
    generic_cases: list[GenericCase] | None = None,
    packed_cases: list[PackedCase] | None = None,
    ssm_cases: list[AnySsmCase] | None = None,
    backend_names: list[str] | None = None,
    repeat: int = 5,
    as_json: bool = False,
    plot_path: str | None = None,
    sweep: Sweep | None = None,
    out: TextIO = sys.stdout,
) -> int:
    """Run the cases, the generic-scan cases (bench_generic.py), the packed-sequence
    cases (bench_packed.py; the cpu backend's, left out when ``backend_names``
    omits it) and, when plotting, ``sweep`` (default: the default workload's); print
    tables or JSON. Returns 1 when any parascan result was wrong, else 0 (a wrong peer
    is reported, not an error of this program)."""
    sweep = SWEEPS["default"] if sweep is None else sweep
    cases = list(DEFAULT_CASES if cases is None else cases)
    generic = list(generic_cases or [])
    packed = list(packed_cases or [])
    ssm = list(ssm_cases or [])
    if backend_names:  # only these backends; a case that runs none of them is left out
        cases = [
            replace(
                c, backends=tuple(b for b in (c.backends or backend_names) if b in backend_names)
            )
            for c in cases
        ]
        cases = [c for c in cases if c.backends]
        generic = [replace(c, backends=tuple(backend_names)) for c in generic]
        if "cpu" not in backend_names:  # the packed and state-space rows time the cpu backend
            packed = []
            ssm = []
    steps = sum(len(_implementations(c)) for c in cases)
    if plot_path:
        steps += sum(len(_implementations(c)) for c in sweep.cases())
    steps += sum(len(implementation_names(c)) for c in generic)
    steps += sum(len(packed_names(c)) for c in packed)
    steps += sum(len(ssm_step_names(c)) for c in ssm)
    progress = _Progress(steps)
    rows = [row for case in cases for row in _bench_case(case, repeat, progress)]
    generic_rows = run_generic(generic, repeat, progress.step)
    packed_rows = run_packed(packed, repeat, progress.step)
    ssm_rows = run_ssm(ssm, repeat, progress.step)
    if plot_path:
        rows.extend(_sweep(sweep, repeat, progress))
    info = summary()
    if as_json:
        result = {
            "machine": info,
            "rows": [asdict(r) for r in rows],
            "generic_rows": [asdict(r) for r in generic_rows],
            "packed_rows": [asdict(r) for r in packed_rows],
            "ssm_rows": [asdict(r) for r in ssm_rows],
        }
        json.dump(result, out, indent=2)
        out.write("\n")
    else:
        print(format_table(rows, info), file=out)
        if generic_rows:
            print("\n" + format_generic(generic_rows), file=out)
        if packed_rows:
            print("\n" + format_packed(packed_rows), file=out)
        if ssm_rows:
            print("\n" + format_ssm(ssm_rows), file=out)
    if plot_path:
        plot(rows, plot_path, sweep)
    ours = [r.correct for r in rows if r.kind == "parascan"]
    ours += [r.correct for r in generic_rows if r.source == "parascan"]
    ours += [r.correct for r in packed_rows]
    ours += [r.correct for r in ssm_rows if r.impl.startswith("parascan")]  # packed rows too
    return 0 if all(ours) else 1
