"""The state-space part of ``parascan bench``: the SSD scan's rows (Mamba-2) come from
bench_ssd.py and are listed, run and printed here with these. The selective scan:
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

import ctypes
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

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
from parascan.cli.timing import elapsed
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


AnySsmCase = SsmCase | SsdCase

DEFAULT_SSM_CASES: list[AnySsmCase] = [
    # the loops on 128 steps, scaled by 8: right for the forward, a lower bound for the
    # forward + backward (its cost per step grows with L: about 100 s whole here, which
    # --full runs), so parascan's forward + backward ratio here understates it
    SsmCase("mamba-1 scan", 1, 1536, 1024, 16, loop_steps=128),
    *DEFAULT_SSD_CASES,
]
FULL_SSM_CASES: list[AnySsmCase] = [
    SsmCase("mamba-1 scan", 1, 1536, 1024, 16),
    SsmCase("mamba-1 scan long", 2, 2048, 4096, 16, loop_steps=512),
    *FULL_SSD_CASES,
]
QUICK_SSM_CASES: list[AnySsmCase] = [SsmCase("mamba-1 scan", 1, 64, 128, 16), *QUICK_SSD_CASES]

_CHECKED = 8  # channels checked against the float64 loop
_DIRECTIONS = ("forward", "forward+backward")


def _impls() -> tuple[str, ...]:
    return ("parascan", "reference loop", "published loop")


def ssm_step_names(case: AnySsmCase) -> list[str]:
    if isinstance(case, SsdCase):
        return ssd_step_names(case)
    return [f"{case.name} {i} {d}" for i in _impls() for d in _DIRECTIONS]


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


def reference_loop(
    u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: torch.Tensor, z: torch.Tensor, delta_bias: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """The reference loop (module docstring), its contractions as products and sums."""
    return _loop(False, u, delta, A, B, C, D, z, delta_bias)


def published_loop(
    u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: torch.Tensor, z: torch.Tensor, delta_bias: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """The same loop with the published reference's einsums."""
    return _loop(True, u, delta, A, B, C, D, z, delta_bias)


def _loop(
    published: bool, u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
    C: torch.Tensor, D: torch.Tensor, z: torch.Tensor, delta_bias: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """The scan as the published reference computes it (variable B/C of (batch, N, L)):
    the (batch, dim, L, N) decays and inputs materialized, then a loop over L."""
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


def _peak_extra_mib(fn: Callable[[], object]) -> float | None:
    """Growth of the peak resident set during ``fn`` (Linux, glibc), in MiB. Blocks of
    64 KiB and more are first made to come from (and go back to) the OS directly, so
    that memory freed earlier and kept by malloc cannot hide an allocation."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, 64 * 1024)  # also turns off its dynamic growth
        libc.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set
        base = _status_kib("VmRSS")
        fn()
        return (_status_kib("VmHWM") - base) / 1024
    except (OSError, AttributeError):
        return None


_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise OSError(f"no {key} in /proc/self/status")


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
    (want * weight[:, c].double()).sum().backward()
    errors = []
    for got, ref in ((out[:, c], want), (grads[0][:, c], sub["u"].grad),
                     (grads[1][:, c], sub["delta"].grad)):  # fmt: skip
        assert ref is not None
        scale = max(1.0, ref.abs().max().item())
        errors.append((got.double() - ref.detach()).abs().max().item() / scale)
    return max(errors)


def _run_case(case: SsmCase, repeat: int, step: Callable[[str], None]) -> list[SsmRow]:
    x = _inputs(case)
    b, d, length, n = case.batch, case.dim, case.length, case.state
    weight = torch.randn(b, d, length, generator=torch.Generator().manual_seed(1))
    diff = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")

    def ours(**kw: torch.Tensor) -> torch.Tensor:
        out = selective_scan(
            kw["u"], kw["delta"], kw["A"], kw["B"], kw["C"], kw["D"], kw["z"],
            kw["delta_bias"], delta_softplus=True,
        )  # fmt: skip
        assert isinstance(out, torch.Tensor)
        return out

    Inputs = dict[str, torch.Tensor]

    def train(fn: Callable[..., torch.Tensor], xs: Inputs) -> tuple[torch.Tensor, ...]:
        leaves = {k: v.detach().requires_grad_() for k, v in xs.items()}
        out = fn(**leaves)
        grads = torch.autograd.grad(out, [leaves[k] for k in diff], weight[..., : out.shape[-1]])
        return (out, *grads)

    # correctness first: a wrong result gets no speed
    result = train(ours, x)
    error = _check(x, result[0], result[1:3], weight)
    correct = error <= 1e-4
    del result

    loop_steps = case.loop_steps or length
    scale = length / loop_steps
    short = {k: (v[..., :loop_steps] if v.dim() == 3 else v) for k, v in x.items()}
    grid = torch.randn(b * d * length * n)
    buf = torch.empty_like(grid)

    def exp_limit() -> object:
        return torch.exp(grid, out=buf)

    fns: dict[tuple[str, str], Callable[[], object]] = {
        ("parascan", "forward"): lambda: ours(**x),
        ("parascan", "forward+backward"): lambda: train(ours, x),
        ("reference loop", "forward"): lambda: reference_loop(**short),
        ("reference loop", "forward+backward"): lambda: train(reference_loop, short),
        ("published loop", "forward"): lambda: published_loop(**short),
        ("published loop", "forward+backward"): lambda: train(published_loop, short),
    }
    times: dict[tuple[str, str], list[float]] = {k: [] for k in fns}
    limits = []
    for i in range(repeat):
        limits.append(elapsed(exp_limit))
        for key, fn in fns.items():
            if key[0] == "parascan" and not correct:
                continue
            if key[0] != "parascan" and scale > 1 and i != min(1, repeat - 1):
                continue  # the long loop is timed once, warm (on the second repetition)
            times[key].append(elapsed(fn) * (1 if key[0] == "parascan" else scale))
    peak = _peak_extra_mib(lambda: train(ours, x)) if correct else None
    limit = statistics.median(limits)
    med = {k: statistics.median(v) if v else None for k, v in times.items()}
    rows = []
    for impl in _impls():
        for direction in _DIRECTIONS:
            step(f"{case.name} {impl} {direction}")
            t = med[(impl, direction)]
            loop_t = med[("reference loop", direction)]
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
                None if t is None else t * 1e3, limit * 1e3,
                None if t is None else t / limit,
                None if t is None or loop_t is None else loop_t / t,
                error if mine else None,
                peak if mine and direction == "forward+backward" else None,
                correct if mine else True, note,
            ))  # fmt: skip
    return rows


def run_ssm(
    cases: list[AnySsmCase], repeat: int, step: Callable[[str], None] = lambda _: None
) -> list[SsmRow | SsdRow]:
    """Every case's rows (see the module docstring; an SsdCase's from bench_ssd.py)."""
    rows: list[SsmRow | SsdRow] = []
    for case in cases:
        if isinstance(case, SsdCase):
            rows += run_ssd([case], repeat, step)
        else:
            rows += _run_case(case, repeat, step)
    return rows


def format_ssm(rows: list[SsmRow | SsdRow]) -> str:
    """The selective scan's table, then the SSD scan's (each when it has rows)."""
    ssd = [r for r in rows if isinstance(r, SsdRow)]
    selective = [r for r in rows if isinstance(r, SsmRow)]
    tables = ([_format_selective(selective)] if selective else []) + (
        [format_ssd(ssd)] if ssd else []
    )
    return "\n\n".join(tables)


def _format_selective(rows: list[SsmRow]) -> str:
    lines = [
        "Selective scan (Mamba-1: variable B/C, D, z, delta_bias, softplus; float32; x exp: "
        "time / torch.exp over batch*dim*L*N elements; x loop: speed-up over the reference loop)",
        f"{'case':<20} {'b,d,L,N':<16} {'implementation':<16} {'direction':<17} {'ms':>10} "
        f"{'x exp':>7} {'x loop':>7} {'error':>8} {'peak MiB':>9}  note",
    ]
    for r in rows:
        ms = "WRONG" if r.time_ms is None else f"{r.time_ms:.1f}"
        vs = "-" if r.vs_exp is None else f"{r.vs_exp:.2f}"
        sp = "-" if r.speedup_vs_loop is None else f"{r.speedup_vs_loop:.1f}"
        err = "" if r.max_error is None else f"{r.max_error:.1e}"
        peak = "" if r.peak_extra_mib is None else f"{r.peak_extra_mib:.0f}"
        lines.append(
            f"{r.case:<20} {','.join(map(str, r.shape)):<16} {r.impl:<16} {r.direction:<17} "
            f"{ms:>10} {vs:>7} {sp:>7} {err:>8} {peak:>9}  {r.note}"
        )
    return "\n".join(lines)
