"""How fast patching can make a transformers model at most, on this machine.

    python tools/matmul_floor.py [--repeat R] [--model NAME ...]

For the bench's models (parascan.cli.bench_transformers, at its full sizes: 4 layers,
vocabulary 1024, 512 tokens, 2 threads; ``--model`` names one or more of its models,
the default ``mamba`` and ``mamba2``; its docstring gives each one's sizes), the time
of the workloads unpatched and patched (alternated in one process, min of R, as the
bench measures them), and the time of the model's own linear layers alone
(parascan.cli.linear_floor: every projection the model runs, the hybrids' MLPs and
attention projections, Mamba-2's fused out projection, a mixture's experts and
RecurrentGemma's block-diagonal gates among them, timed alone on inputs of the shapes it
saw; for the training step forward and backward). `parascan bench --models` prints the
same linear time beside each row; this tool alternates more rounds and adds xLSTM,
which the patch leaves alone. The training step is timed for every model
but Mamba-1, whose unpatched step takes a minute.
parascan.integrations.transformers.patch() replaces the scans and convolutions, never
these projections (nor the hybrids' full-attention layers, whose attention itself is
not counted here), so

    bound = unpatched time / time of the linear layers

is the largest speed-up patching could give, were everything else free.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from parascan.cli import bench_transformers as bt
from parascan.cli.linear_floor import linear_calls, linear_time, min_time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--model", action="append", choices=sorted(bt.MODEL_CLASSES),
        help="a model to measure (repeatable; default: mamba and mamba2)",
    )  # fmt: skip
    args = parser.parse_args()
    torch.set_num_threads(2)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'model':11s} {'workload':10s} {'unpatched s':>11s} {'patched s':>9s} {'speed-up':>8s}"
          f" {'linear s':>8s} {'bound':>6s}")  # fmt: skip
    for name in args.model or ["mamba", "mamba2"]:
        torch.manual_seed(0)
        model = bt._model(name, bt._HIDDEN.get(name, 768), 4, None, 1024, False)
        ids = torch.randint(0, 1024, (1, 512))

        def forward(model: Any = model, ids: torch.Tensor = ids) -> None:
            model.eval()
            with torch.no_grad():
                model(ids, use_cache=False)

        # transformers' xLSTM trains only without its cache (with it, its backward fails
        # on a state updated in place); the others train as the bench runs them
        cache = {"use_cache": False} if name == "xlstm" else {}

        def train_step(model: Any = model, ids: torch.Tensor = ids, cache: Any = cache) -> None:
            model.train()
            model.zero_grad(set_to_none=True)
            model(ids, labels=ids, **cache).loss.backward()

        workloads = [("forward", forward, False)]
        if name != "mamba":  # Mamba-1's unpatched step takes a minute: 195x in the bench
            workloads.append(("train step", train_step, True))
        for label, fn, train in workloads:
            best = {False: float("inf"), True: float("inf")}
            for on in (False, True):
                with bt._patched(on):
                    fn()
            for _ in range(args.repeat):
                for on in (False, True):
                    with bt._patched(on):
                        best[on] = min(best[on], min_time(fn, 1))
            with bt._patched(True):
                linear = linear_time(linear_calls(fn), train, args.repeat)
            print(f"{name:11s} {label:10s} {best[False]:11.3f} {best[True]:9.3f} "
                  f"{best[False] / best[True]:7.2f}x {linear:8.3f} "
                  f"{best[False] / linear:5.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
