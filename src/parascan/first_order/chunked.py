"""The ``torch`` backend of the first-order scans: a parallel chunked scan in pure
PyTorch, over either semiring (semiring.py).

Summary of algorithm. The pair (a, b) stands for the map x -> a (x) x (+) b (the affine
map x -> a*x + b in the linear semiring), and maps compose associatively, so time can
be cut into K chunks of L ~ sqrt(T) steps:
  1. inside all chunks at once, walk the L positions: each chunk's local state
     (from a zero start) and the running product of its gates. That is L batched
     tensor ops, each over all K chunks and all channels;
  2. the chunks' end states obey a recurrence K steps long,
     end[k] = prod[k] * end[k-1] + local_end[k]: solve it the same way (recursion);
  3. add the state entering each chunk, times the running product: one op.
Work is O(T) (about 7 passes over the data), depth O(sqrt(T)) batched ops, so it
runs well on any device. It never divides by a gate: zero and tiny gates are exact.
The initial state is folded into the first token; reverse flips time.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from parascan._core import accumulate_dtype
from parascan.first_order.semiring import LINEAR, Semiring

__all__ = ["forward_linear", "scan"]

# Below this many steps one batched op per step is cheapest.
SEQUENTIAL_STEPS = 32


def _scan_time_first(a: Tensor, b: Tensor, ring: Semiring) -> Tensor:
    """x[t] = step(a[t], x[t-1], b[t]) along dim 0 from the empty state; a new tensor."""
    steps, rest = a.shape[0], a.shape[1:]
    x = torch.empty((steps, *rest), dtype=b.dtype, device=b.device)
    if steps <= SEQUENTIAL_STEPS:
        if steps:
            x[0] = b[0]
        for t in range(1, steps):
            ring.step_(a[t], x[t - 1], b[t], x[t])
        return x
    length = math.isqrt(steps - 1) + 1  # ceil(sqrt(steps))
    chunks = -(-steps // length)
    pad = chunks * length - steps
    if pad:
        a = torch.cat([a, a.new_full((pad, *rest), ring.one)])
        b = torch.cat([b, b.new_full((pad, *rest), ring.zero)])
    a = a.reshape(chunks, length, *rest)
    b = b.reshape(chunks, length, *rest)
    local = torch.empty_like(b)
    prod = torch.empty_like(a)
    local[:, 0] = b[:, 0]
    prod[:, 0] = a[:, 0]
    for j in range(1, length):
        ring.step_(a[:, j], local[:, j - 1], b[:, j], local[:, j])
        ring.compose_(prod[:, j - 1], a[:, j], prod[:, j])
    ends = _scan_time_first(prod[:, -1], local[:, -1], ring)
    entering = torch.cat([ends.new_full((1, *rest), ring.zero), ends[:-1]])
    ring.step_(prod, entering.unsqueeze(1).expand_as(prod), local, local)
    x.copy_(local.reshape(chunks * length, *rest)[:steps])
    return x


def _time_first(t: Tensor, dim: int, acc: torch.dtype, reverse: bool) -> Tensor:
    """``t`` with time moved to dim 0, in ``acc``, channels unit-stride when there are
    channels (each batched op then reads whole cache lines)."""
    t = t.movedim(dim, 0).to(acc)
    if reverse:
        t = t.flip(0)
    if t.dim() > 1 and t.stride(-1) != 1:
        t = t.contiguous()
    return t


def scan(
    ring: Semiring,
    gates: Tensor,
    tokens: Tensor,
    initial: Tensor | None,
    dim: int,
    reverse: bool,
) -> Tensor:
    """The chunked scan of ``ring``, with the contract of ``reference.loop``."""
    acc = accumulate_dtype(tokens.dtype)
    out = torch.empty(tokens.shape, dtype=tokens.dtype, device=tokens.device)
    if tokens.shape[dim] == 0:
        return out
    a = _time_first(gates, dim, acc, reverse)
    b = _time_first(tokens, dim, acc, reverse)
    if initial is not None:
        first = torch.empty_like(b[0])
        ring.step_(a[0], initial.to(acc), b[0], first)
        b = torch.cat([first.unsqueeze(0), b[1:]])
    x = _scan_time_first(a, b, ring)
    if reverse:
        x = x.flip(0)
    return out.copy_(x.movedim(0, dim))


def forward_linear(
    gates: Tensor, tokens: Tensor, initial: Tensor | None, dim: int, reverse: bool
) -> Tensor:
    """``scan`` in the linear semiring."""
    return scan(LINEAR, gates, tokens, initial, dim, reverse)
