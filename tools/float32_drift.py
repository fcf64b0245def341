"""How far float32 drifts from float64 over a long sequence: the generalized delta rule
with RWKV-7's ranges (and with decays near 1) and gated linear attention, at L = 16384,
2 heads of K = V = 64, against the float64 ``loop`` backend; the error relative to the
output's largest magnitude, overall and per window of 4096 steps, DPLR on its C kernel
and its torch backend (BENCHMARKS.md).

    python tools/float32_drift.py [--length 16384]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import parascan as ps

_TESTS = Path(__file__).resolve().parent.parent / "tests"
sys.path[:0] = [str(_TESTS), str(_TESTS / "dplr")]  # the tests' inputs and oracles
from test_dplr_ranges import _relative, _rwkv7  # noqa: E402


def _windows(got: torch.Tensor, want: torch.Tensor, size: int) -> str:
    return ", ".join(
        f"{_relative(got[:, i : i + size], want[:, i : i + size]):.1e}"
        for i in range(0, want.shape[1], size)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=16384)
    length = parser.parse_args().length
    size = max(1, length // 4)
    names = ("q", "k", "v", "a", "b")
    for decay in ("rwkv", "near 1"):
        x = _rwkv7(length, decay, heads=2, dk=64, dv=64)
        want = ps.dplr_delta_rule_scan(*(x[n] for n in names), g=x["g"], backend="loop")
        for backend in [b for b in ("cpu", "torch") if b in ps.backends("cpu")]:
            got = ps.dplr_delta_rule_scan(
                *(x[n].float() for n in names), g=x["g"].float(), backend=backend
            )
            print(
                f"dplr ({backend}), {decay}: {_relative(got, want):.1e}; by window: "
                f"{_windows(got, want, size)}"
            )
    x = _rwkv7(length, "rwkv", heads=2, dk=64, dv=64)
    g = F.logsigmoid(torch.randn(x["g"].shape, dtype=torch.float64) + 4) / 16
    want = ps.linear_attention_scan(x["q"], x["k"], x["v"], g=g, backend="loop")
    got = ps.linear_attention_scan(*(x[n].float() for n in ("q", "k", "v")), g=g.float())
    print(f"gla: {_relative(got, want):.1e}; by window: {_windows(got, want, size)}")


if __name__ == "__main__":
    main()
