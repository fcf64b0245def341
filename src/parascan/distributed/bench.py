"""``python -m parascan.distributed.bench``: sequence parallelism against one process.

For each world size (gloo on this machine, one torch thread per rank) and each T, the
sequence (batch, channels, T) float32 is split evenly along T; every rank times
``parascan.distributed.linear_scan`` on its shard, forward and forward + backward
(medians over repetitions; the slowest rank's median is reported, since a call ends
for everyone when the last rank is done). Also reported: the bytes each rank sends
per call (its part of the all-gathers: 2 states forward, 3 backward, whatever T), the
time of those all-gathers alone, and ``parascan.linear_scan`` of the whole sequence in
one process (1 thread, and all threads) for the overhead.
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.multiprocessing.spawn import spawn

from parascan.cli.timing import median_time

__all__ = ["main"]


def _timed_calls(
    scan: Callable[..., torch.Tensor], shape: tuple[int, ...], repeat: int
) -> tuple[float, float]:
    """(forward, forward + backward) median seconds of ``scan(gates, tokens, -1)``."""
    gen = torch.Generator().manual_seed(0)
    gates, tokens = 0.9 + 0.1 * torch.rand(shape, generator=gen), torch.rand(shape, generator=gen)
    a, b = gates.clone().requires_grad_(), tokens.clone().requires_grad_()

    def forward() -> object:
        with torch.no_grad():
            return scan(gates, tokens, -1)

    def both() -> object:
        return torch.autograd.grad(scan(a, b, -1).sum(), (a, b))

    return median_time(forward, repeat), median_time(both, repeat)


def _worker(rank: int, world: int, init: str, shape: tuple[int, int], steps: list[int],
            repeat: int, results: Any) -> None:  # fmt: skip
    import parascan.distributed as psd

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    rows = []
    for t in steps:
        payload = torch.empty(2, *shape)  # what each rank sends forward
        received = list(torch.empty(world, 2, *shape).unbind(0))
        dist.barrier()
        fwd, fwd_bwd = _timed_calls(psd.linear_scan, (*shape, t // world), repeat)
        dist.barrier()
        comm = median_time(functools.partial(dist.all_gather, received, payload), repeat)
        times = torch.tensor([fwd, fwd_bwd, comm], dtype=torch.float64)
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        rows.append(
            {
                "world": world, "T": t, "forward_ms": times[0].item() * 1e3,
                "forward_backward_ms": times[1].item() * 1e3,
                "allgather_ms": times[2].item() * 1e3,
                "bytes_sent_forward": payload.numel() * 4,
                "bytes_sent_backward": payload.numel() // 2 * 3 * 4,
            }
        )  # fmt: skip
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def _one_process(shape: tuple[int, int], steps: list[int], repeat: int) -> list[dict[str, Any]]:
    import parascan as ps

    rows = []
    before = torch.get_num_threads()
    for threads in sorted({1, before}):
        torch.set_num_threads(threads)
        for t in steps:
            fwd, fwd_bwd = _timed_calls(ps.linear_scan, (*shape, t), repeat)
            rows.append(
                {
                    "world": 1, "threads": threads, "T": t,
                    "forward_ms": fwd * 1e3,
                    "forward_backward_ms": fwd_bwd * 1e3,
                }
            )  # fmt: skip
    torch.set_num_threads(before)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parascan.distributed.bench")
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, nargs="+", default=[2**12, 2**14, 2**16, 2**18])
    parser.add_argument("--shape", type=int, nargs=2, default=[4, 64], help="batch channels")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    shape = (args.shape[0], args.shape[1])
    rows = _one_process(shape, args.steps, args.repeat)
    ctx = multiprocessing.get_context("spawn")
    for world in args.worlds:
        results = ctx.Queue()
        with tempfile.TemporaryDirectory() as tmp:
            spawn(
                _worker, args=(world, os.path.join(tmp, "init"), shape, args.steps, args.repeat,
                               results),
                nprocs=world, join=True,
            )  # fmt: skip
        rows.extend(results.get())
    if args.json:
        json.dump({"shape": shape, "rows": rows}, sys.stdout, indent=2)
        print()
        return 0
    print(f"shape ({shape[0]}, {shape[1]}, T) float32, time along the last dim; ms per call")
    print(f"{'ranks':>5} {'thr':>4} {'T':>8} {'forward':>9} {'fwd+bwd':>9} {'all-gather':>11}"
          f" {'bytes sent fwd/bwd':>19}")  # fmt: skip
    for r in rows:
        gather = f"{r['allgather_ms']:11.3f}" if "allgather_ms" in r else f"{'-':>11}"
        sent = (f"{r['bytes_sent_forward']:>9,}/{r['bytes_sent_backward']:<9,}"
                if "bytes_sent_forward" in r else f"{'-':>19}")  # fmt: skip
        print(f"{r['world']:>5} {r.get('threads', 1):>4} {r['T']:>8} {r['forward_ms']:9.3f}"
              f" {r['forward_backward_ms']:9.3f} {gather} {sent:>19}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
