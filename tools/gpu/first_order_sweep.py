"""Where the first-order Triton forward loses time on a GPU, and which tile and launch
plan would be faster: ``python tools/gpu/first_order_sweep.py [--json FILE] [--dry]``
(not collected by pytest).

For each shape of gpu_bench.py's first-order table (float32 forward), and each tile
(``Blocks``) and program target of the launch plan (``triton_kernels.plan`` aims at
about 2048 programs), it prints:

- ``sync``: the CUDA-event median of single calls, each after a synchronization
  (gpu_bench.py's method: the call's host time is inside the interval);
- ``b2b``: the same events around 20 back-to-back calls, over 20 (the host time is
  hidden where the GPU is the slower side);
- ``host``: the host's seconds per call over those 20 calls, without synchronizing;
- each against a device copy of the forward's three tensors (``% copy``).

Every variant is first checked against the float64 ``torch`` backend on an awkward
shape in the same layout (a tile's masks and chunk edges), and at the timed shape
against the default plan's result: a wrong variant gets no time. Results are printed
and flushed as they come, so a run cut off at its limit keeps them. ``--dry`` runs
the script on the CPU on tiny shapes in Triton's interpreter, to prove it before a
GPU's time is spent.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

DRY = "--dry" in sys.argv
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402

import parascan as ps  # noqa: E402
from parascan.cli.timing import event_median  # noqa: E402
from parascan.cli.tolerance import relative_error  # noqa: E402
from parascan.first_order import triton_kernels as kernels  # noqa: E402

DEVICE = "cpu" if DRY else "cuda"
SHAPES = [  # (name, shape, dim): gpu_bench.py's FIRST_ORDER
    ("T=4096 time last", (8, 1536, 4096), -1),
    ("T=4096 time-major", (8, 4096, 1536), 1),
    ("T=65536 time last", (8, 1536, 65536), -1),
    ("T=65536 time-major", (8, 65536, 1536), 1),
]
AWKWARD = {-1: (3, 77, 1000), 1: (3, 1000, 333)}
B = kernels.Blocks
VARIANTS: dict[int, list[tuple[Any, int]]] = {  # dim -> [(tile, program target)]
    -1: [(kernels.TIME_CONTIGUOUS, 2048), (B(4, 64, 64), 2048), (B(16, 64, 64), 2048),
         (B(8, 128, 128), 2048), (B(4, 128, 128), 2048)],
    1: [(kernels.TIME_MAJOR, 2048), (B(256, 1, 16), 2048), (B(64, 1, 16), 4096),
        (B(128, 8, 32), 2048), (B(256, 1, 16), 4096)],
}  # fmt: skip
if DRY:
    SHAPES = [("dry time last", (2, 5, 300), -1), ("dry time-major", (2, 300, 5), 1)]
    AWKWARD = {-1: (2, 3, 37), 1: (2, 37, 3)}
    VARIANTS = {
        -1: [(B(2, 4, 8), 2048), (B(2, 8, 8), 16)],
        1: [(B(4, 1, 4), 2048), (B(4, 2, 4), 16)],
    }

REAL_PLAN = kernels.plan


def use(tile: Any, programs: int) -> None:
    """Make the launch plan use ``tile`` and aim at ``programs`` programs."""

    def plan(steps: int, channels: int, time_stride: int, chunk: int | None = None):  # type: ignore[no-untyped-def]
        if chunk is None:
            per_tile = max(1, programs // triton.cdiv(channels, tile.channels))
            chunk = max(tile.min_chunk, triton.cdiv(steps, per_tile))
        return tile, tile.steps * triton.cdiv(chunk, tile.steps)

    kernels.plan = plan


def scan(a: torch.Tensor, b: torch.Tensor, dim: int) -> torch.Tensor:
    with torch.no_grad():
        return ps.linear_scan(a, b, dim, backend="triton")


def inputs(shape: tuple[int, ...], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(DEVICE).manual_seed(seed)
    a = 0.9 + 0.1 * torch.rand(shape, generator=gen, device=DEVICE)
    return a, torch.rand(shape, generator=gen, device=DEVICE)


def timings(fn: Callable[[], object]) -> dict[str, float]:
    if DRY:
        start = time.perf_counter()
        fn()
        t = time.perf_counter() - start
        return {"sync": t, "b2b": t, "host": t}
    sync = event_median(fn, 10)
    calls = 20
    torch.cuda.synchronize()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    host = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - host) / calls
    stop.record()
    torch.cuda.synchronize()
    return {"sync": sync, "b2b": start.elapsed_time(stop) / 1e3 / calls, "host": host}


def main() -> None:
    rows: list[dict[str, Any]] = []
    out_path = sys.argv[sys.argv.index("--json") + 1] if "--json" in sys.argv else None
    oracles = {}
    for dim, shape in AWKWARD.items():
        a, b = inputs(shape, seed=1)
        oracles[dim] = (a, b, ps.linear_scan(a.double(), b.double(), dim, backend="torch"))
    for name, shape, dim in SHAPES:
        a, b = inputs(shape)
        # read + written: three tensors' bytes, as the one-chunk forward moves (a, b, out)
        copy = torch.empty(3 * a.numel() // 2, dtype=torch.float32, device=DEVICE)
        dst = torch.empty_like(copy)
        copy_s = timings(lambda copy=copy, dst=dst: dst.copy_(copy))["b2b"] if not DRY else 1.0
        del copy, dst
        kernels.plan = REAL_PLAN
        default = scan(a, b, dim)
        for tile, programs in VARIANTS[dim]:
            use(tile, programs)
            label = f"{tile.channels}x{tile.steps} min {tile.min_chunk}, {programs} programs"
            oa, ob, want = oracles[dim]
            try:
                error = max(
                    relative_error(scan(oa, ob, dim).double(), want),
                    relative_error(scan(a, b, dim).double(), default.double()),
                )
            except Exception as exc:  # a tile Triton cannot compile: reported, not fatal
                failure = f"{name:19s} {label:34s} FAILED {type(exc).__name__}: {exc}"
                print(failure[:300], flush=True)
                continue
            _, chunk = kernels.plan(shape[dim], a.numel() // shape[dim], a.stride(dim))
            row: dict[str, Any] = {
                "case": name, "shape": list(shape), "dim": dim, "tile": [tile.channels, tile.steps],
                "min_chunk": tile.min_chunk, "programs_target": programs, "chunk": chunk,
                "error": error, "copy_ms": copy_s * 1e3,
            }  # fmt: skip
            if error <= 1e-5:
                t = timings(lambda a=a, b=b, dim=dim: scan(a, b, dim))
                row.update({k + "_ms": v * 1e3 for k, v in t.items()})
                row["copy_fraction_b2b"] = copy_s / t["b2b"]
                row["copy_fraction_sync"] = copy_s / t["sync"]
                print(
                    f"{name:19s} {label:34s} chunk {chunk:6d}  sync {t['sync'] * 1e3:7.3f} ms "
                    f"({100 * copy_s / t['sync']:5.1f}% copy)  b2b {t['b2b'] * 1e3:7.3f} ms "
                    f"({100 * copy_s / t['b2b']:5.1f}% copy)  host {t['host'] * 1e6:6.1f} us  "
                    f"err {error:.1e}",
                    flush=True,
                )
            else:
                print(f"{name:19s} {label:34s} WRONG err {error:.1e}", flush=True)
            rows.append(row)
            if out_path:
                with open(out_path, "w", encoding="utf-8") as f:
                    json.dump(rows, f, indent=1)
        kernels.plan = REAL_PLAN
        del a, b, default
        if not DRY:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
