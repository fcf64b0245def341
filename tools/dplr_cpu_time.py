"""The DPLR C kernel's forward and backward at RWKV-7 2.9B's shape (1, 1024, 40 heads of
K = V = 64, a log decay per key channel) against ``torch.bmm`` doing the recurrence's
4 K V multiply-adds per token and head (3x that for forward + backward), on one thread,
in CPU time (``time.thread_time``: a busy machine's waits for a core are not counted,
which wall-clock timing on a shared 2-core machine could not separate); the best of
``--repeat`` alternated rounds (BENCHMARKS.md, run T).

    python tools/dplr_cpu_time.py [--repeat 7]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from parascan.dplr import cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    repeat = parser.parse_args().repeat
    torch.manual_seed(0)
    torch.set_num_threads(1)
    B, L, H, K, V = 1, 1024, 40, 64, 64
    kk = F.normalize(torch.randn(B, L, H, K), dim=-1)
    q, k, v = (
        torch.randn(B, L, H, K) * K**-0.5,
        torch.randn(B, L, H, K) * 0.1,
        torch.randn(B, L, H, V),
    )
    a, b, g = -kk, kk * torch.rand(B, L, H, K), -0.6 * torch.rand(B, L, H, K)
    lhs, rhs, buf = torch.randn(H, L, K), torch.randn(H, K, 4 * V), torch.empty(H, L, 4 * V)
    lhs3, rhs3 = torch.randn(H, L, 3 * K), torch.randn(H, 3 * K, 4 * V)
    checkpoints = cpu.forward(q, k, v, a, b, g, None, None)[2]
    grad_out, no_final = torch.randn(B, L, H, V), torch.empty(0, H, K, V)
    runs: dict[str, Callable[[], object]] = {
        "limit": lambda: torch.bmm(lhs, rhs, out=buf),
        "forward": lambda: cpu.forward(q, k, v, a, b, g, None, None, want_final=False),
        "limit x3": lambda: torch.bmm(lhs3, rhs3, out=buf),
        "backward": lambda: cpu.backward(
            q, k, v, a, b, g, None, None, checkpoints, grad_out, no_final
        ),
    }
    best = {name: float("inf") for name in runs}
    for _ in range(repeat):
        for name, fn in runs.items():
            start = time.thread_time()
            fn()
            best[name] = min(best[name], time.thread_time() - start)
    print(", ".join(f"{name} {1e3 * t:.1f} ms" for name, t in best.items()))
    print(
        f"forward {best['forward'] / best['limit']:.2f}x the limit, forward + backward "
        f"{(best['forward'] + best['backward']) / best['limit x3']:.2f}x"
    )


if __name__ == "__main__":
    main()
