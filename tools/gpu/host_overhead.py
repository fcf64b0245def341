"""The host's time per call of a first-order Triton forward, and where it goes:
``python tools/gpu/host_overhead.py [--dry]`` (not collected by pytest).

first_order_sweep.py found the host spending 0.3 to 0.6 ms per forward on an H200's
machine, more than the GPU's time at (8, 1536, 4096): the GPU waits for the host. This
times the public call, the backend's ``kernels.run`` and one bare kernel launch back
to back without synchronizing, then prints cProfile's top functions over 200 public
calls. ``--dry`` runs it on the CPU in Triton's interpreter on a tiny shape.
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
import time
from collections.abc import Callable

DRY = "--dry" in sys.argv
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

import parascan as ps  # noqa: E402
from parascan.first_order import triton_kernels as kernels  # noqa: E402

DEVICE = "cpu" if DRY else "cuda"
SHAPE = (2, 3, 20) if DRY else (8, 1536, 4096)
CALLS = 5 if DRY else 200


def host_us(fn: Callable[[], object], calls: int = CALLS) -> float:
    fn()
    if not DRY:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    seconds = (time.perf_counter() - start) / calls
    if not DRY:
        torch.cuda.synchronize()
    return seconds * 1e6


def main() -> None:
    a = 0.9 + 0.1 * torch.rand(SHAPE, device=DEVICE)
    b = torch.rand(SHAPE, device=DEVICE)

    def public() -> object:
        with torch.no_grad():
            return ps.linear_scan(a, b, -1, backend="triton")

    def run() -> object:
        return kernels.run(kernels.LINEAR, a, b, None, None, None, -1, False)

    out = torch.empty_like(b)
    flags = dict(MODE=kernels.LINEAR, IS_COMPLEX=False, ACC=kernels.tl.float32, HAS_INIT=False,
                 PACKED=False)  # fmt: skip
    tile, chunk = kernels.plan(SHAPE[-1], SHAPE[0] * SHAPE[1], 1)
    strides = (SHAPE[2], 1, 1)  # (outer, T, inner) = (batch x channels, T, 1)
    seq = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    channels = SHAPE[0] * SHAPE[1]

    def launch() -> object:
        return kernels._apply[(triton_cdiv(channels, tile.channels), 1)](
            a, *strides, b, *strides, b, *strides, b, *strides, b, 0, 0, 0, seq, b, b, out, out,
            channels, 1, SHAPE[-1], chunk, REVERSE=False, SINGLE=True, BLOCK_T=tile.steps,
            BLOCK_C=tile.channels, **flags,
        )  # fmt: skip

    print(f"shape {SHAPE}, tile {tile}, chunk {chunk}", flush=True)
    for name, fn in (("public linear_scan", public), ("kernels.run", run), ("one launch", launch),
                     ("torch.add", lambda: torch.add(a, b))):  # fmt: skip
        print(f"{name:20s} host {host_us(fn):8.1f} us per call", flush=True)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(CALLS):
        public()
    profile.disable()
    if not DRY:
        torch.cuda.synchronize()
    pstats.Stats(profile).sort_stats("cumulative").print_stats(35)
    pstats.Stats(profile).sort_stats("tottime").print_stats(25)


def triton_cdiv(x: int, y: int) -> int:
    return (x + y - 1) // y


if __name__ == "__main__":
    main()
