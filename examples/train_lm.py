"""A small character-level language model built on parascan, trained across processes.

The recurrent layer is minGRU (Feng et al. 2024, "Were RNNs All We Needed?"):

    z[t]  = sigmoid(W_z x[t]),   c[t] = W_c x[t]
    h[t]  = (1 - z[t]) * h[t-1] + z[t] * c[t]          <- parascan.linear_scan

so the whole sequence is one parallel scan. The text is the source of a few modules of
Python's standard library, so nothing is downloaded.

Run on CPU with two processes (data parallel, DistributedDataParallel over gloo):

    torchrun --standalone --nproc_per_node 2 examples/train_lm.py

or with sequence parallelism: every rank takes the same sequences and scans its own
contiguous slice of time with parascan.distributed.linear_scan (one all-gather of
O(state) per layer per call), DDP still averaging the gradients:

    torchrun --standalone --nproc_per_node 2 examples/train_lm.py --seq-parallel

It prints the loss and the tokens per second (all ranks together).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import math
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import parascan as ps
import parascan.distributed as psd

MODULES = ["argparse", "collections", "inspect", "textwrap", "dataclasses", "typing"]


def corpus() -> torch.Tensor:
    """Bytes of some standard-library sources: a text that ships with Python."""
    text = "\n".join(inspect.getsource(importlib.import_module(m)) for m in MODULES)
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


class MinGRU(nn.Module):
    def __init__(self, width: int, sp_group: object | None) -> None:
        super().__init__()
        self.gate = nn.Linear(width, width)
        self.candidate = nn.Linear(width, width)
        self.out = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.sp_group = sp_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        z = torch.sigmoid(self.gate(y))
        tokens = z * self.candidate(y)
        if self.sp_group is None:
            h = ps.linear_scan(1 - z, tokens, dim=1)
        else:  # x holds this rank's slice of time; the state crosses ranks
            h = psd.linear_scan(1 - z, tokens, dim=1, group=self.sp_group)
        return x + self.out(h)


class LanguageModel(nn.Module):
    def __init__(self, width: int, layers: int, sp_group: object | None) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, width)
        self.layers = nn.ModuleList(MinGRU(width, sp_group) for _ in range(layers))
        self.head = nn.Linear(width, 256)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=16, help="sequences per step and rank")
    parser.add_argument("--length", type=int, default=256, help="characters per sequence")
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--seq-parallel", action="store_true")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    sp_group = dist.new_group() if args.seq_parallel else None
    torch.manual_seed(0)  # the same initial model on every rank
    model = DistributedDataParallel(LanguageModel(args.width, args.layers, sp_group))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data = corpus()
    # Data parallel: each rank draws its own sequences. Sequence parallel: all ranks
    # draw the same sequences and keep their own contiguous slice of time.
    gen = torch.Generator().manual_seed(1 if args.seq_parallel else 1 + rank)
    if args.seq_parallel and args.length % world:
        raise SystemExit("--length must be a multiple of the number of processes")
    shard = args.length // world if args.seq_parallel else args.length
    begin = rank * shard if args.seq_parallel else 0
    if rank == 0:
        mode = "sequence parallel" if args.seq_parallel else "data parallel"
        print(
            f"{world} processes, {mode}; {len(data):,} characters of text; "
            f"{sum(p.numel() for p in model.parameters()):,} parameters",
            flush=True,
        )

    started, seen = time.perf_counter(), 0
    for step in range(1, args.steps + 1):
        starts = torch.randint(0, len(data) - args.length - 1, (args.batch,), generator=gen)
        window = torch.stack([data[s : s + args.length + 1] for s in starts.tolist()])
        inputs = window[:, begin : begin + shard]
        targets = window[:, begin + 1 : begin + shard + 1]
        logits = model(inputs)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        seen += inputs.numel()
        if step % args.log_every == 0 or step == 1 or step == args.steps:
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            mean /= world
            elapsed = time.perf_counter() - started
            rate = seen * world / elapsed
            if rank == 0:
                print(
                    f"step {step:5d}  loss {mean.item():.3f}  "
                    f"({mean.item() / math.log(2):.2f} bits/char)  "
                    f"{rate:,.0f} tokens/s",
                    flush=True,
                )
    # Release DDP (and its pending gradient hooks) while the groups still exist.
    del model, optimizer
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
