"""The state-space part of ``parascan bench``: the SSD scan's rows (Mamba-2) come from
bench_ssd.py, the delta rule's from bench_delta.py, linear attention's and DPLR's from
bench_linear_attention.py, and are listed, run and printed here with these. The selective scan:
``ps.selective_scan`` (Mamba-1's scan with variable B/C, D, z, delta_bias and softplus,
float32) against the way the scan is computed without parascan, forward and forward +
backward.

- ``reference loop``: the scan as its published reference computes it, written
  here from the math: the decays ``exp(dt A)`` and inputs ``dt B u`` materialized as
  (batch, dim, L, N) tensors, then a Python loop over L that updates the
  (batch, dim, N) state and contracts it with C (transformers' CPU fallback for
  Mamba computes its scan the same way); backward by autograd through that loop.
- ``published loop``: the same loop with the published reference's contraction,
  ``einsum("bdn,bn->bd", h, C[:, :, t])`` (and ``einsum("bdl,bnl,bdl->bdln")`` for
  the inputs): what ``selective_scan_ref`` runs, and what the issue timed (58 s
  forward + backward here). The ``reference loop`` above replaces those einsums by a
  product and a sum, about 20x faster on this CPU, so that parascan's headline
  ratio is not flattered; this row shows the ratio against the published form.
- ``exp limit``: ``torch.exp`` over batch * dim * L * N float32 elements into a warm
  buffer: the one cost no implementation avoids (one exponential per state element
  and step), measured in the same run.

Summary of method. Each repetition times, back to back, the exp limit and every
implementation; medians are reported with ratios to the exp limit and to the
reference loop. The loops' forward + backward take one to two minutes whole at the
default shape, so the default workload times them on the first ``loop_steps`` steps
and scales by L / loop_steps (``--full`` runs them whole): fair for the forward, a
lower bound for the forward + backward (the loop's backward costs more per step
the longer it is: autograd's select backward fills a (batch, dim, L, N) gradient
for every step). Results are checked first against a float64 loop on a few
channels (their output and the gradients of u and delta): a wrong result gets no
speed. Peak extra memory of forward + backward is the
growth of the process's peak resident set (Linux ``VmHWM``, reset before the
call), next to the size of one (batch, dim, L, N) float32 tensor.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from parascan.cli.bench_delta import (
    DEFAULT_DELTA_CASES,
    QUICK_DELTA_CASES,
    DeltaCase,
    DeltaRow,
    delta_step_names,
    format_delta,
    run_delta,
)
from parascan.cli.bench_kv import KvRow
from parascan.cli.bench_linear_attention import (
    DEFAULT_LINEAR_CASES,
    FULL_LINEAR_CASES,
    QUICK_LINEAR_CASES,
    LinearCase,
    LinearRow,
    format_linear,
    linear_step_names,
    run_linear,
)
from parascan.cli.bench_ssd import (
    DEFAULT_SSD_CASES,
    FULL_SSD_CASES,
    QUICK_SSD_CASES,
    SsdCase,
    SsdRow,
    format_ssd,
    run_ssd,
    ssd_step_names,
)
from parascan.cli.common import cell, median, ms, ratio, rounds, run_cases, table, train
from parascan.cli.common import peak_extra_mib as _peak_extra_mib  # tests/selective use it
from parascan.cli.tolerance import relative_error
from parascan.selective import selective_scan

__all__ = [
    "DEFAULT_SSM_CASES",
    "FULL_SSM_CASES",
    "QUICK_SSM_CASES",
    "AnySsmCase",
    "SsmCase",
    "SsmRow",
    "format_ssm",
    "run_ssm",
    "ssm_step_names",
]


@dataclass(frozen=True)
class SsmCase:
    name: str
    batch: int
    dim: int
    length: int
    state: int
    loop_steps: int | None = None  # the reference loop runs this many steps, scaled
    seed: int = 0


@dataclass
class SsmRow:
    case: str
    shape: tuple[int, int, int, int]  # batch, dim, L, N
    threads: int
    impl: str
    direction: str  # "forward" or "forward+backward"
    time_ms: float | None
    exp_limit_ms: float
    vs_exp: float | None  # time / exp limit
    speedup_vs_loop: float | None  # loop time / time
    max_error: float | None
    peak_extra_mib: float | None
    correct: bool
    note: str = ""


AnySsmCase = SsmCase | SsdCase | DeltaCase | LinearCase

DEFAULT_SSM_CASES: list[AnySsmCase] = [
    # the loops on 128 steps, scaled by 8: right for the forward, a lower bound for the
    # forward + backward (its cost per step grows with L: about 100 s whole here, which
    # --full runs), so parascan's forward + backward ratio here understates it
    SsmCase("mamba-1 scan", 1, 1536, 1024, 16, loop_steps=128),
    *DEFAULT_SSD_CASES,
    *DEFAULT_DELTA_CASES,
    *DEFAULT_LINEAR_CASES,
]
FULL_SSM_CASES: list[AnySsmCase] = [
    SsmCase("mamba-1 scan", 1, 1536, 1024, 16),
    SsmCase("mamba-1 scan long", 2, 2048, 4096, 16, loop_steps=512),
    *FULL_SSD_CASES,
    *DEFAULT_DELTA_CASES,
    *FULL_LINEAR_CASES,
]
QUICK_SSM_CASES: list[AnySsmCase] = [
    SsmCase("mamba-1 scan", 1, 64, 128, 16),
    *QUICK_SSD_CASES,
    *QUICK_DELTA_CASES,
    *QUICK_LINEAR_CASES,
]

_CHECKED = 8  # channels checked against the float64 loop
_DIRECTIONS = ("forward", "forward+backward")
_IMPLS = ("parascan", "reference loop", "published loop")


def ssm_step_names(case: AnySsmCase) -> list[str]:
    if isinstance(case, SsdCase):
        return ssd_step_names(case)
    if isinstance(case, DeltaCase):
        return delta_step_names(case)
    if isinstance(case, LinearCase):
        return linear_step_names(case)
    return [f"{case.name} {i} {d}" for i in _IMPLS for d in _DIRECTIONS]


def _inputs(case: SsmCase) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(case.seed)
    b, d, length, n = case.batch, case.dim, case.length, case.state

    def rand(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen) * scale + shift

    return {
        "u": rand(b, d, length),
        "delta": rand(b, d, length, scale=0.5, shift=-3.0),  # softplus: dt about 0.05
        "A": -torch.exp(rand(d, n, scale=0.5)),
        "B": rand(b, n, length),
        "C": rand(b, n, length),
        "D": rand(d),
        "z": rand(b, d, length),
        "delta_bias": rand(d, scale=0.1),
    }


def _loop(published: bool) -> Callable[..., torch.Tensor]:
    def loop(
        u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
        C: torch.Tensor, D: torch.Tensor, z: torch.Tensor, delta_bias: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """The scan as the published reference computes it (variable B/C of (batch, N,
        L)): the (batch, dim, L, N) decays and inputs materialized, then a loop over L."""
        dt = F.softplus(delta + delta_bias[:, None])
        decay = torch.exp(dt[..., None] * A[:, None, :])  # (b, d, L, N)
        if published:
            drive = torch.einsum("bdl,bnl,bdl->bdln", dt, B, u)
        else:
            drive = (dt * u)[..., None] * B.transpose(1, 2)[:, None]  # (b, d, L, N)
        h = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
        ys = []
        for t in range(u.shape[2]):
            h = decay[:, :, t] * h + drive[:, :, t]
            if published:
                ys.append(torch.einsum("bdn,bn->bd", h, C[:, :, t]))
            else:
                # a product and a sum: torch.einsum("bdn,bn->bd") is 20x slower here on
                # this strided C, and a slow baseline would flatter the ratios
                ys.append((h * C[:, None, :, t]).sum(-1))
        y = torch.stack(ys, dim=-1) + D[:, None] * u
        return y * F.silu(z)

    return loop


# The reference loop of the module docstring, its contractions as products and sums;
# the same loop with the published reference's einsums.
reference_loop, published_loop = _loop(published=False), _loop(published=True)


def _check(x: dict[str, torch.Tensor], out: torch.Tensor, grads: tuple[torch.Tensor, ...],
           weight: torch.Tensor) -> float:  # fmt: skip
    """Largest relative error of the output and of the gradients of u and delta on
    the first channels, against the float64 loop (channels are independent)."""
    c = slice(0, _CHECKED)
    sub = {k: v.double() for k, v in x.items()}
    for k in ("u", "delta", "z"):
        sub[k] = sub[k][:, c].clone().requires_grad_(k != "z")
    for k in ("A", "D", "delta_bias"):
        sub[k] = sub[k][c]
    want = reference_loop(**sub)
    gu, gdelta = torch.autograd.grad(want, [sub["u"], sub["delta"]], weight[:, c].double())
    pairs = ((out, want.detach()), (grads[0], gu), (grads[1], gdelta))
    return max(relative_error(got[:, c], ref) for got, ref in pairs)


def _run_case(case: SsmCase, repeat: int, step: Callable[[str], None]) -> list[SsmRow]:
    x = _inputs(case)
    b, d, length, n = case.batch, case.dim, case.length, case.state
    weight = torch.randn(b, d, length, generator=torch.Generator().manual_seed(1))

    def ours(**kw: Any) -> torch.Tensor:
        out = selective_scan(**kw, delta_softplus=True)
        assert isinstance(out, torch.Tensor)
        return out

    # correctness first: a wrong result gets no speed
    result = train(ours, x, weight)
    error = _check(x, result[0], result[1:3], weight)
    correct = error <= 1e-4
    del result

    loop_steps = case.loop_steps or length
    scale = length / loop_steps
    short = {k: (v[..., :loop_steps] if v.dim() == 3 else v) for k, v in x.items()}
    grid = torch.randn(b * d * length * n)
    buf = torch.empty_like(grid)
    impls = (("parascan", ours, x, weight),
             ("reference loop", reference_loop, short, weight[..., :loop_steps]),
             ("published loop", published_loop, short, weight[..., :loop_steps]))  # fmt: skip
    fns: dict[tuple[str, str], Callable[[], object]] = {
        ("exp limit", ""): lambda: torch.exp(grid, out=buf)
    }
    for name, fn, xs, w in impls:
        fns[(name, "forward")] = partial(fn, **xs)
        fns[(name, "forward+backward")] = partial(train, fn, xs, w)

    def timed(key: tuple[str, str], i: int) -> bool:
        if key[0] == "parascan":
            return correct
        # the long loop is timed once, warm (on the second repetition)
        return key[0] == "exp limit" or scale <= 1 or i == min(1, repeat - 1)

    times = rounds(fns, repeat, timed)
    peak = _peak_extra_mib(lambda: train(ours, x, weight)) if correct else None
    limit = statistics.median(times[("exp limit", "")])
    # the loops' times scaled from loop_steps steps to L
    med = {k: median([t * (scale if "loop" in k[0] else 1) for t in v]) for k, v in times.items()}
    rows = []
    for impl in _IMPLS:
        for direction in _DIRECTIONS:
            step(f"{case.name} {impl} {direction}")
            t = med[(impl, direction)]
            mine = impl == "parascan"
            note = ""
            if not mine and scale > 1:
                note = f"timed on {loop_steps} of {length} steps, x{scale:g}"
                if direction == "forward+backward":
                    note += " (a lower bound: the loop's backward grows faster than L)"
            published = med[("published loop", direction)]
            if mine and t is not None and published is not None:
                note = f"{published / t:.0f}x faster than the published loop"
            if mine and direction == "forward+backward" and peak is not None:
                size = b * d * length * n * 4 / 2**20
                note += f"{'; ' if note else ''}one (b,d,L,N) f32 tensor: {size:.0f} MiB"
            rows.append(SsmRow(
                case.name, (b, d, length, n), torch.get_num_threads(), impl, direction,
                ms(t), limit * 1e3, ratio(t, limit), ratio(med[("reference loop", direction)], t),
                error if mine else None,
                peak if mine and direction == "forward+backward" else None,
                correct if mine else True, note,
            ))  # fmt: skip
    return rows


def _run_any(
    case: AnySsmCase, repeat: int, step: Callable[[str], None]
) -> Iterable[SsmRow | SsdRow | KvRow]:
    """A case's rows (see the module docstring; an SsdCase's from bench_ssd.py)."""
    if isinstance(case, SsdCase):
        return run_ssd([case], repeat, step)
    if isinstance(case, DeltaCase):
        return run_delta([case], repeat, step)
    if isinstance(case, LinearCase):
        return run_linear([case], repeat, step)
    return _run_case(case, repeat, step)


# run_ssm(cases, repeat, step): every case's rows
run_ssm = partial(run_cases, _run_any)


_SELECTIVE_LINE = "{:<20} {:<16} {:<16} {:<17} {:>10} {:>7} {:>7} {:>8} {:>9}  {}"


def format_ssm(rows: list[SsmRow | SsdRow | KvRow]) -> str:
    """The selective scan's table, then the SSD scan's, the delta rule's, linear
    attention's and DPLR's (each when it has rows)."""
    ssd = [r for r in rows if isinstance(r, SsdRow)]
    delta = [r for r in rows if isinstance(r, DeltaRow)]
    linear = [r for r in rows if isinstance(r, LinearRow)]
    selective = [r for r in rows if isinstance(r, SsmRow)]
    head = (
        "Selective scan (Mamba-1: variable B/C, D, z, delta_bias, softplus; float32; x exp: "
        "time / torch.exp over batch*dim*L*N elements; x loop: speed-up over the reference loop)"
    )
    names = ("case", "b,d,L,N", "implementation", "direction", "ms", "x exp", "x loop", "error",
             "peak MiB", "note")  # fmt: skip
    cells = (
        (r.case, ",".join(map(str, r.shape)), r.impl, r.direction,
         cell(r.time_ms, ".1f", "WRONG"), cell(r.vs_exp, ".2f"), cell(r.speedup_vs_loop, ".1f"),
         cell(r.max_error, ".1e", ""), cell(r.peak_extra_mib, ".0f", ""), r.note)
        for r in selective
    )  # fmt: skip
    tables = (
        ([table([head], _SELECTIVE_LINE, names, cells)] if selective else [])
        + ([format_ssd(ssd)] if ssd else [])
        + ([format_delta(delta)] if delta else [])
        + ([format_linear(linear)] if linear else [])
    )
    return "\n\n".join(tables)
