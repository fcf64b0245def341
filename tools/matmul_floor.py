"""How fast patching can make a transformers model at most, on this machine.

    python tools/matmul_floor.py [--repeat R] [--model NAME ...]

For the bench's models (parascan.cli.bench_transformers, at its full sizes: 4 layers,
vocabulary 1024, 512 tokens, 2 threads; ``--model`` names one or more of its models,
the default ``mamba`` and ``mamba2``; its docstring gives each one's sizes), the time
of the workloads unpatched and patched (alternated in one process, min of R, as the
bench measures them), and the time of the model's own linear layers alone: every
linear projection the model runs (each torch.nn.functional.linear call: the nn.Linear
modules, among them the hybrids' MLPs and attention projections, and the out
projection that Mamba-2's fused layer applies to the weight it is handed; each
torch._grouped_mm call: the experts of a mixture of experts, as MiniMax's; each
torch.baddbmm call: block-diagonal projections, as RecurrentGemma's gates), timed on
inputs of the shapes it saw (forward; for the training step forward and backward, with
the gradients of input, weight and bias). The training step is timed for every model
but Mamba-1, whose unpatched step takes a minute.
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


# A projection seen: (torch.nn.functional.linear, torch._grouped_mm or torch.baddbmm,
# input shape, weight, then the bias (None: none) or grouped_mm's group offsets).
_Call = tuple[Callable[..., torch.Tensor], torch.Size, torch.Tensor, "torch.Tensor | None"]


class _LinearCalls(TorchFunctionMode):
    """Records every torch.nn.functional.linear call (nn.Linear modules, and the
    projections a fused layer applies to weights it is handed: Mamba-2's out projection
    inside mamba_split_conv1d_scan_combined), every torch._grouped_mm call (the
    experts' projections of a mixture of experts, which torch.nn.functional.grouped_mm
    runs) and every torch.baddbmm(bias, input, weight) call (block-diagonal
    projections, as RecurrentGemma's RG-LRU gates)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[_Call] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear:
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            self.seen.append((func, args[0].shape, args[1], bias))
        elif func is torch._grouped_mm and kwargs.get("bias") is None:
            self.seen.append((func, args[0].shape, args[1], kwargs["offs"].clone()))
        elif func is torch.baddbmm and len(args) == 3 and not kwargs:
            self.seen.append((func, args[1].shape, args[2], args[0]))
        return func(*args, **kwargs)


def _linear_shapes(run: Callable[[], object]) -> list[_Call]:
    """The projections of one run."""
    calls = _LinearCalls()
    with calls:
        run()
    return calls.seen


def _linear_time(calls: list[_Call], train: bool, repeat: int) -> float:
    def leaf(t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone().requires_grad_(train)

    inputs = [
        (
            func, torch.randn(shape, requires_grad=train), leaf(weight),
            extra if extra is None or func is torch._grouped_mm else leaf(extra),
        )
        for func, shape, weight, extra in calls
    ]  # fmt: skip

    def run() -> None:
        for func, x, w, extra in inputs:
            if func is torch._grouped_mm:
                out = func(x, w, offs=extra)
            elif func is torch.baddbmm:
                assert extra is not None  # its bias, recorded only where given
                out = torch.baddbmm(extra, x, w)
            else:
                out = func(x, w, extra)
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
                        best[on] = min(best[on], _min_time(fn, 1))
            with bt._patched(True):
                linear = _linear_time(_linear_shapes(fn), train, args.repeat)
            print(f"{name:11s} {label:10s} {best[False]:11.3f} {best[True]:9.3f} "
                  f"{best[False] / best[True]:7.2f}x {linear:8.3f} "
                  f"{best[False] / linear:5.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
