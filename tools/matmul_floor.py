"""How fast patching can make a transformers model at most, on this machine.

    python tools/matmul_floor.py [--repeat R] [--model NAME ...]

For the bench's models (parascan.cli.bench_transformers, at its full sizes: 4 layers,
vocabulary 1024, 512 tokens, 2 threads; ``--model`` names one or more of ``mamba``
and ``mamba2``, hidden 768, the default both, and ``qwen3_5`` and ``kimi_linear``,
hidden 1024, three of the four layers linear attention: the gated delta rule and Kimi
Delta Attention), the time of the workloads unpatched and patched (alternated in one
process, min of R, as the bench measures them), and the time of the model's own linear
layers alone: every linear projection the model runs (each
torch.nn.functional.linear call: the nn.Linear modules, among them the hybrids' MLPs and
attention projections, and the out projection that Mamba-2's fused layer applies to the
weight it is handed), timed on inputs of the shapes it saw (forward; for the training
step forward and backward, with the gradients of input, weight and bias). The training
step is timed for every model but Mamba-1, whose unpatched step takes a minute.
parascan.integrations.transformers.patch() replaces the scans and convolutions, never
these projections (nor the hybrids' full-attention layers, whose attention itself is
not counted here), so

    bound = unpatched time / time of the linear layers

is the largest speed-up patching could give, were everything else free.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from parascan.cli import bench_transformers as bt


def _min_time(fn: Callable[[], object], repeat: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


class _LinearCalls(TorchFunctionMode):
    """Records the (input shape, weight, bias) of every torch.nn.functional.linear call:
    nn.Linear modules, and the projections a fused layer applies to weights it is
    handed (Mamba-2's out projection inside mamba_split_conv1d_scan_combined)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[torch.Size, torch.Tensor, torch.Tensor | None]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            self.seen.append((args[0].shape, args[1], bias))
        return func(*args, **kwargs)


def _linear_shapes(run: Callable[[], object]) -> list[tuple[torch.Size, Any, Any]]:
    """The (input shape, weight, bias) of every linear projection of one run."""
    with _LinearCalls() as calls:
        run()
    return calls.seen


def _linear_time(shapes: list[tuple[torch.Size, Any, Any]], train: bool, repeat: int) -> float:
    inputs = [
        (
            torch.randn(shape, requires_grad=train),
            weight.detach().clone().requires_grad_(train),
            None if bias is None else bias.detach().clone().requires_grad_(train),
        )
        for shape, weight, bias in shapes
    ]

    def run() -> None:
        for x, w, b in inputs:
            out = torch.nn.functional.linear(x, w, b)
            if train:
                out.backward(torch.ones_like(out))

    with torch.set_grad_enabled(train):
        return _min_time(run, repeat)


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

        def train_step(model: Any = model, ids: torch.Tensor = ids) -> None:
            model.train()
            model.zero_grad(set_to_none=True)
            model(ids, labels=ids).loss.backward()

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
                        best[on] = min(best[on], _min_time(fn, 1))
            with bt._patched(True):
                linear = _linear_time(_linear_shapes(fn), train, args.repeat)
            print(f"{name:11s} {label:10s} {best[False]:11.3f} {best[True]:9.3f} "
                  f"{best[False] / best[True]:7.2f}x {linear:8.3f} "
                  f"{best[False] / linear:5.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
