"""The SSD-scan part of ``parascan bench``: ``ps.ssd_scan`` (Mamba-2's scan as the
Mamba-2 mixer calls it: one group of B/C, D per head, dt_bias and softplus, no z,
float32) against the ways it is computed without parascan, forward and forward +
backward.

- ``minimal SSD``: the chunked state-space-duality algorithm of the Mamba-2 paper,
  written here from its math (:func:`minimal_ssd`): per chunk of ``MINIMAL_CHUNK``
  steps, the diagonal blocks as a masked decay-weighted attention (``exp(segsum)``
  times ``C B^T``), the state each chunk leaves, those states passed from chunk to
  chunk by one more segsum over the chunks, and their contribution to each chunk's
  outputs; backward by autograd.
- ``transformers``: transformers' own torch fallback for Mamba-2's scan
  (``mamba2_chunk_scan`` of ``modeling_mamba2``, the unpatched original), chunk 128
  as the model's config has it; left out when transformers is not installed.
- ``parascan packed`` (cases with ``packed`` sequences): the same tokens as that many
  sequences of random lengths in one call (``cu_seqlens``), each scanned from a zero
  state; its ``x parascan`` is the cost of packing against one sequence.
- ``FLOP limit``: ``torch.bmm`` doing the recurrence's multiply-adds in one warm
  product, measured in the same run: forward, ``2 * batch * L * heads * headdim * N``
  (the state update and the output's contraction); forward + backward, three times
  that (the backward's gradients of the state and of the inputs). No algorithm does
  less arithmetic than the recurrence itself; the ratio says how far from dense
  matrix-product speed each one runs.

Summary of method. Each repetition times, back to back, the two limits and every
implementation; medians are reported with ratios to the limit and parascan's
speed-up over each implementation. Results are checked first against a float64
loop of the recurrence on the first ``_CHECKED`` heads (heads are independent: with
one group they share B and C): the output and the gradients of x and dt, relative
to the largest reference magnitude, within ``_TOLERANCE``. A wrong result gets no
speed (the row says WRONG). Peak extra memory of parascan's forward + backward is
the growth of the process's peak resident set (see bench_selective.py), next to the size
of one (batch, L, heads, headdim, N) float32 tensor.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import parascan as ps
from parascan.cli.common import (
    bmm_limits,
    cell,
    cu_seqlens,
    median,
    ms,
    peak_extra_mib,
    ratio,
    rounds,
    run_cases,
    table,
    train,
)
from parascan.cli.tolerance import relative_error

__all__ = [
    "DEFAULT_SSD_CASES",
    "FULL_SSD_CASES",
    "MINIMAL_CHUNK",
    "QUICK_SSD_CASES",
    "SsdCase",
    "SsdRow",
    "format_ssd",
    "minimal_ssd",
    "run_ssd",
    "ssd_step_names",
]

MINIMAL_CHUNK = 64  # the chunk of the minimal SSD (the paper's reference block length)
_TRANSFORMERS_CHUNK = 128  # Mamba2Config's default chunk_size
_CHECKED = 2  # heads checked against the float64 loop
_TOLERANCE = 1e-4
_DIRECTIONS = ("forward", "forward+backward")


@dataclass(frozen=True)
class SsdCase:
    name: str
    batch: int
    length: int
    heads: int
    headdim: int
    state: int
    groups: int = 1
    seed: int = 0
    packed: int = 0  # > 0: also the same tokens as this many packed sequences (batch 1)


@dataclass
class SsdRow:
    case: str
    shape: tuple[int, int, int, int, int, int]  # batch, L, heads, headdim, N, groups
    threads: int
    impl: str
    direction: str  # "forward" or "forward+backward"
    time_ms: float | None  # None: wrong result, or not run
    limit_ms: float  # the FLOP limit of the direction
    vs_limit: float | None  # time / limit
    parascan_speedup: float | None  # this row's time / parascan's
    max_error: float | None
    peak_extra_mib: float | None
    correct: bool
    note: str = ""


DEFAULT_SSD_CASES = [SsdCase("mamba-2 scan", 1, 512, 24, 64, 64, packed=8)]
FULL_SSD_CASES = [
    SsdCase("mamba-2 scan", 1, 512, 24, 64, 64, packed=8),
    SsdCase("mamba-2 scan long", 1, 4096, 24, 64, 64),
]
QUICK_SSD_CASES = [SsdCase("mamba-2 scan", 1, 80, 4, 16, 16)]


_SSD_LINE = "{:<18} {:<20} {:<15} {:<17} {:>9} {:>9} {:>8} {:>10} {:>8} {:>9}  {}"


def format_ssd(rows: list[SsdRow]) -> str:
    head = (
        "SSD scan (Mamba-2: 1 group of B/C, D, dt_bias, softplus; float32; x limit: time / "
        "torch.bmm of the recurrence's multiply-adds, 2*b*L*h*p*N forward, 3x that forward+"
        "backward; x parascan: this row's time / parascan's)"
    )
    names = ("case", "b,L,h,p,N,g", "implementation", "direction", "ms", "limit ms", "x limit",
             "x parascan", "error", "peak MiB", "note")  # fmt: skip
    cells = (
        (r.case, ",".join(map(str, r.shape)), r.impl, r.direction,
         "WRONG" if not r.correct else cell(r.time_ms, ".1f"), f"{r.limit_ms:.2f}",
         cell(r.vs_limit, ".2f"), cell(r.parascan_speedup, ".2f"), cell(r.max_error, ".1e", ""),
         cell(r.peak_extra_mib, ".0f", ""), r.note)
        for r in rows
    )  # fmt: skip
    return table([head], _SSD_LINE, names, cells)


def _transformers_scan() -> Callable[..., Tensor] | None:
    """transformers' unpatched ``mamba2_chunk_scan``, or None without transformers."""
    try:
        from transformers.models.mamba2 import modeling_mamba2
    except ImportError:
        return None
    from parascan.integrations.transformers import _ORIGINALS

    key = (modeling_mamba2.__name__, "mamba2_chunk_scan")
    return _ORIGINALS.get(key, getattr(modeling_mamba2, "mamba2_chunk_scan", None))


def _impls(case: SsdCase) -> tuple[str, ...]:
    base: tuple[str, ...] = ("parascan", "parascan packed") if case.packed else ("parascan",)
    base += ("minimal SSD",)
    return (*base, "transformers") if _transformers_scan() is not None else base


def ssd_step_names(case: SsdCase) -> list[str]:
    return [f"{case.name} {i} {d}" for i in _impls(case) for d in _DIRECTIONS]


def _inputs(case: SsdCase) -> dict[str, Tensor]:
    """Inputs drawn as a Mamba-2 layer sees them: A = -(1 .. heads) and steps between
    0.001 and 0.1 after softplus (its initialization), unit activations."""
    gen = torch.Generator().manual_seed(case.seed)
    b, length, h, p, n, g = (
        case.batch, case.length, case.heads, case.headdim, case.state, case.groups
    )  # fmt: skip
    step = torch.exp(torch.rand(h, generator=gen) * (torch.log(torch.tensor(100.0))) - 6.9)
    return {
        "x": torch.randn(b, length, h, p, generator=gen),
        "dt": torch.randn(b, length, h, generator=gen) * 0.1,
        "A": -torch.arange(1, h + 1, dtype=torch.float32),
        "B": torch.randn(b, length, g, n, generator=gen),
        "C": torch.randn(b, length, g, n, generator=gen),
        "D": torch.ones(h) + 0.1 * torch.randn(h, generator=gen),
        "dt_bias": step + torch.log(-torch.expm1(-step)),  # softplus^-1(step)
    }


def _segsum(a: Tensor) -> Tensor:
    """seg[..., i, j] = a[..., j+1] + ... + a[..., i] for i >= j (0 on the diagonal),
    -inf above it: each segment summed directly (a masked cumulative sum), not as a
    difference of running sums, which would cancel."""
    t = a.shape[-1]
    rep = a[..., None, :].expand(*a.shape, t).transpose(-1, -2)  # rep[..., i, j] = a[i]
    below = torch.ones(t, t, dtype=torch.bool, device=a.device).tril(-1)
    seg = rep.masked_fill(~below, 0).cumsum(-2)
    return seg.masked_fill(
        ~below.logical_or(torch.eye(t, dtype=torch.bool, device=a.device)), -torch.inf
    )


def minimal_ssd(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor, dt_bias: Tensor,
    chunk: int = MINIMAL_CHUNK,
) -> Tensor:  # fmt: skip
    """Mamba-2's scan (softplus(dt + dt_bias) steps, D per head, zero initial state)
    by the chunked state-space-duality algorithm, from the paper's math: x (b, L, h, p),
    dt (b, L, h), A (h,), B, C (b, L, g, n), D, dt_bias (h,)."""
    b, length, h, p = x.shape
    g, n = B.shape[2], B.shape[3]
    k = h // g
    step = F.softplus(dt + dt_bias)
    pad = (-length) % chunk
    c = (length + pad) // chunk
    xs = F.pad(x * step[..., None], (0, 0, 0, 0, 0, pad)).view(b, c, chunk, g, k, p)
    a = F.pad(step * A, (0, 0, 0, pad)).view(b, c, chunk, g, k).permute(0, 3, 4, 1, 2)
    Bc = F.pad(B, (0, 0, 0, 0, 0, pad)).view(b, c, chunk, g, n)
    Cc = F.pad(C, (0, 0, 0, 0, 0, pad)).view(b, c, chunk, g, n)
    cum = a.cumsum(-1)  # (b, g, k, c, l)
    # 1. within each chunk: y[l] = sum_{s <= l} exp(seg[l, s]) (C[l] . B[s]) x[s] dt[s]
    cb = torch.einsum("bclgn,bcsgn->bgcls", Cc, Bc)
    y_diag = torch.einsum("bgkcls,bgcls,bcsgkp->bclgkp", torch.exp(_segsum(a)), cb, xs)
    # 2. the state each chunk leaves, from a zero entering state
    decay_out = torch.exp(cum[..., -1:] - cum)
    states = torch.einsum("bclgn,bgkcl,bclgkp->bcgkpn", Bc, decay_out, xs)
    # 3. the states entering the chunks: passed along by a segsum over the chunks
    states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
    chunk_decay = torch.exp(_segsum(F.pad(cum[..., -1], (1, 0))))  # (b, g, k, c+1, c+1)
    entering = torch.einsum("bgkzc,bcgkpn->bzgkpn", chunk_decay, states)[:, :-1]
    # 4. each entering state's contribution to its chunk's outputs
    y_off = torch.einsum("bclgn,bcgkpn,bgkcl->bclgkp", Cc, entering, torch.exp(cum))
    y = (y_diag + y_off).reshape(b, c * chunk, h, p)[:, :length]
    return y + D[:, None] * x


def _loop64(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor,
            dt_bias: Tensor) -> Tensor:  # fmt: skip
    """The recurrence one step at a time (float64 inputs), heads reading group 0."""
    step = F.softplus(dt + dt_bias)
    h = x.new_zeros(x.shape[0], x.shape[2], x.shape[3], B.shape[-1])
    ys = []
    for t in range(x.shape[1]):
        s = step[:, t, :, None, None]
        h = torch.exp(s * A[:, None, None]) * h + s * x[:, t, :, :, None] * B[:, t, 0, None, None]
        ys.append((h * C[:, t, 0, None, None]).sum(-1))
    return torch.stack(ys, 1) + D[:, None] * x


def _reference(
    x: dict[str, Tensor], weight: Tensor, cu_seqlens: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """(out, grad x, grad dt) of the first heads, in float64; with ``cu_seqlens``, each
    packed sequence alone, from a zero state."""
    if cu_seqlens is not None:
        bounds = cu_seqlens.tolist()
        parts = [
            _reference({k: v[:, lo:hi] if v.dim() > 2 else v for k, v in x.items()},
                       weight[:, lo:hi])
            for lo, hi in itertools.pairwise(bounds)
            if hi > lo
        ]  # fmt: skip
        out, gx, gdt = (torch.cat(ts, 1) for ts in zip(*parts, strict=True))
        return out, gx, gdt
    heads = slice(0, _CHECKED)
    sub = {k: v.double() for k, v in x.items()}
    for k in ("x", "dt"):
        sub[k] = sub[k][:, :, heads].clone().requires_grad_()
    for k in ("A", "D", "dt_bias"):
        sub[k] = sub[k][heads]
    out = _loop64(**sub)
    gx, gdt = torch.autograd.grad(out, [sub["x"], sub["dt"]], weight[:, :, heads].double())
    return out.detach(), gx, gdt


def _error(got: tuple[Tensor, ...], want: tuple[Tensor, Tensor, Tensor]) -> float:
    return max(relative_error(g[:, :, :_CHECKED], w) for g, w in zip(got, want, strict=True))


def _run_case(case: SsdCase, repeat: int, step: Callable[[str], None]) -> list[SsdRow]:
    x = _inputs(case)
    b, length, h, p, n = case.batch, case.length, case.heads, case.headdim, case.state
    weight = torch.randn(b, length, h, p, generator=torch.Generator().manual_seed(1))
    hf = _transformers_scan()
    cu = cu_seqlens(length, case.packed, case.seed + 2) if case.packed else None

    def ours(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, **kw: Any) -> Tensor:
        out = ps.ssd_scan(x, dt, A, B, C, dt_softplus=True, **kw)
        assert isinstance(out, Tensor)
        return out

    def theirs(x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, **kw: Tensor) -> Tensor:
        assert hf is not None
        return hf(x, dt, A, B, C, chunk_size=_TRANSFORMERS_CHUNK, dt_softplus=True, **kw)

    every: dict[str, Callable[..., Tensor]] = {
        "parascan": ours, "parascan packed": partial(ours, cu_seqlens=cu),
        "minimal SSD": minimal_ssd, "transformers": theirs,
    }  # fmt: skip
    impls = {name: every[name] for name in _impls(case)}

    # correctness first: a wrong result gets no speed
    want = _reference(x, weight)
    want_packed = _reference(x, weight, cu) if cu is not None else want
    errors = {
        name: _error(train(fn, x, weight)[:3], want_packed if name == "parascan packed" else want)
        for name, fn in impls.items()
    }
    correct = {name: error <= _TOLERANCE for name, error in errors.items()}

    # the FLOP limits: the recurrence's multiply-adds as one dense batched product
    macs = 2 * b * length * h * p * n
    inner = 2 * n
    rows_l = max(1, macs // (b * h * p * inner))  # ~ L: (b*h, L, 2N) @ (b*h, 2N, p)
    fns = bmm_limits(b * h, rows_l, inner, p)
    for name, impl in impls.items():
        fns[(name, "forward")] = partial(impl, **x)
        fns[(name, "forward+backward")] = partial(train, impl, x, weight)
    times = rounds(fns, repeat, lambda key, _: key[0] == "limit" or correct[key[0]])
    peak = peak_extra_mib(lambda: train(ours, x, weight)) if correct["parascan"] else None
    med = {key: median(t) for key, t in times.items()}
    notes = {"minimal SSD": f"chunk {MINIMAL_CHUNK}",
             "transformers": f"mamba2_chunk_scan, chunk {_TRANSFORMERS_CHUNK}"}  # fmt: skip
    if cu is not None:
        notes["parascan packed"] = f"{case.packed} sequences, cu_seqlens {cu.tolist()}"
    size = f"one (b,L,h,p,N) f32 tensor: {b * length * h * p * n * 4 / 2**20:.0f} MiB"
    rows = []
    for name in impls:
        for direction in _DIRECTIONS:
            step(f"{case.name} {name} {direction}")
            t, limit = med[(name, direction)], statistics.median(times[("limit", direction)])
            both = name == "parascan" and direction == "forward+backward"  # where the peak is
            rows.append(SsdRow(
                case.name, (b, length, h, p, n, case.groups), torch.get_num_threads(), name,
                direction, ms(t), limit * 1e3, ratio(t, limit),
                ratio(t, med[("parascan", direction)]), errors[name], peak if both else None,
                correct[name], size if both and peak is not None else notes.get(name, ""),
            ))  # fmt: skip
    return rows


# run_ssd(cases, repeat, step): every case's rows (see the module docstring)
run_ssd = partial(run_cases, _run_case)
