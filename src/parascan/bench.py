"""``parascan bench``: the default workload, timed against the machine's memory
bandwidth limit measured in the same run.

The limit for a call that moves N tensors of a given size is the time of
``torch.add(x, y)`` (reads 2, writes 1 freshly allocated tensor, like the scan's
own output) scaled by N / 3. Each repetition times the limit and every
implementation back to back, and the medians are reported, so the ratio is
robust to the noise of a shared machine. A result whose error against the
float64 loop exceeds the dtype's tolerance is reported as WRONG, with no speed.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, TextIO

import torch

from parascan._backends import backends
from parascan._sysinfo import summary
from parascan._tolerance import TOLERANCE, relative_error
from parascan.linear import linear_scan
from parascan.linear import reference as linear_reference
from parascan.linear.ops import backward_via_scan

__all__ = ["DEFAULT_WORKLOADS", "Row", "Workload", "run_bench"]


@dataclass(frozen=True)
class Workload:
    name: str
    shape: tuple[int, ...]
    dim: int
    dtype: torch.dtype = torch.float32


@dataclass
class Row:
    workload: str
    shape: tuple[int, ...]
    dim: int
    dtype: str
    backend: str
    direction: str  # "forward" or "backward"
    tensors: int  # tensors of the problem's size moved: 3 forward, 5 backward
    time_ms: float | None
    limit_ms: float
    ratio: float | None
    max_error: float
    correct: bool
    times_ms: list[float] = field(default_factory=list)


DEFAULT_WORKLOADS = [
    Workload("linear_scan time-major", (8, 4096, 1536), 1),
    Workload("linear_scan time-contiguous", (8, 1536, 4096), -1),
]
QUICK_WORKLOADS = [
    Workload("linear_scan time-major", (2, 256, 192), 1),
    Workload("linear_scan time-contiguous", (2, 192, 256), -1),
]


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn: Callable[[], object], device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - start


def _bench_workload(
    w: Workload, names: list[str], repeat: int, device: torch.device, progress: _Progress
) -> list[Row]:
    gen = torch.Generator().manual_seed(0)
    gates = (0.9 + 0.1 * torch.rand(w.shape, generator=gen)).to(w.dtype).to(device)
    tokens = torch.randn(w.shape, generator=gen).to(w.dtype).to(device)
    grad_out = torch.randn(w.shape, generator=gen).to(w.dtype).to(device)

    # The float64 loop, forward and backward: the reference every result must match.
    high = torch.float64
    want = linear_reference.forward(gates.to(high), tokens.to(high), None, w.dim, False)
    want_ga, want_gb, _ = backward_via_scan(
        linear_reference.forward, gates.to(high), want, grad_out.to(high), None, w.dim, False
    )

    def limit() -> object:
        return torch.add(gates, tokens)

    rows: list[Row] = []
    for backend in names:
        a = gates.clone().requires_grad_()
        b = tokens.clone().requires_grad_()

        def forward(a: torch.Tensor = a, b: torch.Tensor = b, backend: str = backend) -> Any:
            with torch.no_grad():
                return linear_scan(a, b, w.dim, backend=backend)

        out = linear_scan(a, b, w.dim, backend=backend)

        def backward(out: torch.Tensor = out, a: torch.Tensor = a, b: torch.Tensor = b) -> Any:
            return torch.autograd.grad(out, (a, b), grad_out, retain_graph=True)

        fwd_err = relative_error(out.detach(), want)
        ga, gb = backward()
        bwd_err = max(relative_error(ga, want_ga), relative_error(gb, want_gb))
        tol = TOLERANCE[w.dtype][1]

        runs = max(1, repeat if backend not in ("loop",) else min(repeat, 2))
        limits, fwd_times, bwd_times = [], [], []
        for _ in range(2):  # warm up the allocator, the thread pool and the caches
            limit()
            forward()
        for _ in range(runs):
            limits.append(_time(limit, device))
            fwd_times.append(_time(forward, device))
            bwd_times.append(_time(backward, device))
        progress.step(f"{w.name} {backend}")
        lim = statistics.median(limits)
        for direction, tensors, times, err in (
            ("forward", 3, fwd_times, fwd_err),
            ("backward", 5, bwd_times, bwd_err),
        ):
            correct = err <= tol
            t = statistics.median(times) if correct else None
            limit_ms = lim * 1e3 * tensors / 3
            rows.append(
                Row(
                    workload=w.name,
                    shape=w.shape,
                    dim=w.dim,
                    dtype=str(w.dtype).removeprefix("torch."),
                    backend=backend,
                    direction=direction,
                    tensors=tensors,
                    time_ms=None if t is None else t * 1e3,
                    limit_ms=limit_ms,
                    ratio=None if t is None else t * 1e3 / limit_ms,
                    max_error=err,
                    correct=correct,
                    times_ms=[x * 1e3 for x in times] if correct else [],
                )
            )
        del out, ga, gb
    return rows


def format_table(rows: list[Row], info: dict[str, object]) -> str:
    lines = [
        f"parascan {info['parascan']} | torch {info['torch']} | Python {info['python']}",
        f"{info['cpu']} | {info['threads']} threads | SIMD {','.join(info['cpu_simd']) or 'none'}",  # type: ignore[arg-type]
        "limit = torch.add over the same bytes (3 tensors forward, 5 backward), same run",
        "",
        f"{'workload':<30}{'shape':<18}{'dim':>4}  {'backend':<8}{'pass':<9}"
        f"{'time ms':>10}{'limit ms':>10}{'x limit':>9}{'max rel err':>13}",
    ]
    for r in rows:
        time_s = f"{r.time_ms:10.2f}" if r.time_ms is not None else f"{'WRONG':>10}"
        ratio_s = f"{r.ratio:9.2f}" if r.ratio is not None else f"{'-':>9}"
        lines.append(
            f"{r.workload:<30}{r.shape!s:<18}{r.dim:>4}  {r.backend:<8}{r.direction:<9}"
            f"{time_s}{r.limit_ms:10.2f}{ratio_s}{r.max_error:13.1e}"
        )
    return "\n".join(lines)


def plot(rows: list[Row], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise RuntimeError(
            "parascan bench --plot needs matplotlib: pip install 'parascan[bench]'"
        ) from exc
    ok = [(r, r.ratio) for r in rows if r.ratio is not None]
    labels = [
        f"{r.workload.removeprefix('linear_scan ')}\n{r.backend} {r.direction}" for r, _ in ok
    ]
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(ok)), 4))
    ax.bar(range(len(ok)), [ratio for _, ratio in ok])
    ax.axhline(1.0, color="k", lw=0.8, ls="--", label="bandwidth limit (torch.add)")
    ax.set_xticks(range(len(ok)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("time / bandwidth limit")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_bench(
    *,
    workloads: list[Workload] | None = None,
    backend_names: list[str] | None = None,
    repeat: int = 5,
    device: str = "cpu",
    as_json: bool = False,
    plot_path: str | None = None,
    out: TextIO = sys.stdout,
) -> int:
    dev = torch.device(device)
    names = backend_names or backends(dev)
    workloads = workloads or DEFAULT_WORKLOADS
    progress = _Progress(len(workloads) * len(names))
    rows: list[Row] = []
    for w in workloads:
        rows.extend(_bench_workload(w, names, repeat, dev, progress))
    info = summary()
    if as_json:
        json.dump({"machine": info, "rows": [asdict(r) for r in rows]}, out, indent=2)
        out.write("\n")
    else:
        print(format_table(rows, info), file=out)
    if plot_path:
        plot(rows, plot_path)
    return 0 if all(r.correct for r in rows) else 1
