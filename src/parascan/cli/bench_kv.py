"""What the benches of the scans with a (K, V) state per head share (bench_delta.py,
bench_linear_attention.py): their rows and table, the float64 loop that checks them,
the run of a case's implementations against the multiply-add limit, and the decoding
step's rows.

- ``loop64``: the recurrence one step at a time in float64, over the whole (batch, Hv,
  K, V) state, a family's step given as a function; o[t] = K^-0.5 S[t]^T q[t] (on one
  thread: it is not timed).
- ``kv_rows``: every implementation checked first, then timed. The check: its output
  on the first ``CHECKED_STEPS`` steps against ``loop64`` on the first ``CHECKED``
  value heads (a packed call: every step, each sequence alone), relative to the
  largest magnitude, within ``TOLERANCE``; a wrong result gets no speed. The timing:
  after a call of each on its first few steps (one-time costs, as the imports of a
  process's first backward, stay untimed), rounds of the FLOP limits (``torch.bmm`` of
  the recurrence's multiply-adds, one warm product; 3x that forward + backward) and
  every implementation back to back, medians reported; a call slower than ``SLOW_S``
  in the first round is not timed again. An implementation given a prefix of L steps
  (a step loop: its cost grows as L) has its times scaled to L, and its note says so.
  parascan's peak extra memory is measured on its first timed call.
- ``decode_rows``: one token with a state (L = 1), checked against ``loop64`` (the
  output and the final state), against ``torch.add`` over the state's bytes: the same
  state every call, and (``decode step, from memory``) states cycled through twice
  the largest cache, as a model's layers cycle them.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import KW_ONLY, dataclass
from functools import partial
from pathlib import Path

import torch
from torch import Tensor

from parascan.cli.common import (
    bmm_limits,
    cell,
    median,
    ms,
    peak_extra_mib,
    ratio,
    rounds,
    table,
    train,
)
from parascan.cli.tolerance import relative_error

__all__ = [
    "CHECKED",
    "CHECKED_STEPS",
    "DECODE",
    "DIRECTIONS",
    "SLOW_S",
    "TOLERANCE",
    "Impl",
    "KvCase",
    "KvRow",
    "decayed",
    "decode_rows",
    "format_kv",
    "kv_rows",
    "kv_step_names",
    "last_level_cache_bytes",
    "loop64",
    "value_heads",
]

CHECKED = 2  # value heads checked against the float64 loop
CHECKED_STEPS = 256
TOLERANCE = 1e-4
SLOW_S = 2.0  # a call slower than this (seconds) in the first round is timed only once
_WARM_STEPS = 16  # each implementation is called once on this many steps before timing
DIRECTIONS = ("forward", "forward+backward")
DECODE = ("decode step", "decode step, from memory")

Step = Callable[[dict[str, Tensor], Tensor], Tensor]  # (inputs at step t, S[t-1]) -> S[t]
Reference = Callable[..., tuple[Tensor, Tensor]]  # (**inputs, initial=) -> (o, final)


@dataclass(frozen=True)
class KvCase:
    """A case of a (K, V)-state family: its shape; the rest by keyword."""

    name: str
    batch: int
    length: int
    k_heads: int
    v_heads: int
    dk: int
    dv: int
    _: KW_ONLY
    prefix: int = 0  # > 0: the slow peers timed on this many steps, scaled to L
    packed: int = 0  # > 0: also the same tokens as this many packed sequences
    backward: bool = True
    decode: bool = True  # also the decoding step (L = 1) at this case's heads
    seed: int = 0


@dataclass
class KvRow:
    case: str
    shape: tuple[int, int, int, int, int, int]  # batch, L, Hk, Hv, K, V
    threads: int
    impl: str
    direction: str
    time_ms: float | None
    limit_ms: float
    vs_limit: float | None
    parascan_speedup: float | None  # this row's time / parascan's
    max_error: float | None
    correct: bool
    note: str = ""
    peak_extra_mib: float | None = None  # parascan's rows: growth of the peak resident set


@dataclass(frozen=True)
class Impl:
    """One implementation of a case: ``fn(**inputs)`` is its output (batch, L, Hv, V).
    ``inputs`` may be a prefix of the case's steps (its times are scaled to L);
    ``weight`` is the upstream gradient of its forward + backward; ``cu`` marks a
    packed call (checked against each sequence alone; the note lists the offsets)."""

    fn: Callable[..., Tensor]
    inputs: Mapping[str, Tensor]
    directions: tuple[str, ...] = DIRECTIONS
    weight: Tensor | None = None
    cu: Tensor | None = None
    note: str = ""


_LINE = "{:<20} {:<22} {:<16} {:<24} {:>9} {:>9} {:>8} {:>10} {:>8} {:>9}  {}"


def format_kv(rows: Sequence[KvRow], head: Sequence[str]) -> str:
    """The table of a (K, V)-state family's rows under the lines of ``head``."""
    names = ("case", "b,L,Hk,Hv,K,V", "implementation", "direction", "ms", "limit ms",
             "x limit", "x parascan", "error", "peak MiB", "note")  # fmt: skip
    cells = (
        (r.case, ",".join(map(str, r.shape)), r.impl, r.direction,
         "WRONG" if not r.correct else cell(r.time_ms, ".3f" if (r.time_ms or 0) < 1 else ".1f"),
         f"{r.limit_ms:.2f}" if r.limit_ms >= 1 else f"{r.limit_ms:.3f}",
         cell(r.vs_limit, ".2f"), cell(r.parascan_speedup, ".2f"), cell(r.max_error, ".1e", ""),
         cell(r.peak_extra_mib, ".0f", ""),
         r.note)
        for r in rows
    )  # fmt: skip
    return table(head, _LINE, names, cells)


def kv_step_names(name: str, directions: Mapping[str, Sequence[str]], decode: bool) -> list[str]:
    """The progress labels of a case's rows: each implementation's directions, then the
    decoding step's."""
    rows = [f"{name} {impl} {d}" for impl, ds in directions.items() for d in ds]
    return [*rows, *(f"{name} {d}" for d in (DECODE if decode else ()))]


def decayed(s: Tensor, g: Tensor | None) -> Tensor:
    """Diag(exp(g)) S for a state S (batch, Hv, K, V): g None, (batch, Hv) per head or
    (batch, Hv, K) per key channel."""
    if g is None:
        return s
    decay = torch.exp(g)
    return s * (decay[..., None, None] if decay.dim() == 2 else decay[..., None])


def value_heads(x: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """x with the key-head tensors (q's head count, when the value heads are more)
    repeated to the value heads, as value head h reads head h // (Hv / Hk)."""
    hk, hv = x["q"].shape[2], x["v"].shape[2]
    return {
        key: t.repeat_interleave(hv // hk, 2) if hk != hv and t.shape[2] == hk else t
        for key, t in x.items()
    }


def loop64(
    step: Step, x: Mapping[str, Tensor], initial: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """(o, final state) of the recurrence ``S[t] = step(x at t, S[t-1])``, one step at a
    time in float64, o[t] = K^-0.5 S[t]^T q[t]; ``initial`` (batch, Hv, K, V) or zeros."""
    xs = value_heads({key: t.double() for key, t in x.items()})
    q, v = xs["q"], xs["v"]
    s = q.new_zeros(v.shape[0], v.shape[2], q.shape[-1], v.shape[-1])
    s = s if initial is None else initial.double()
    outs = []
    with _one_thread():
        for t in range(v.shape[1]):
            s = step({key: u[:, t] for key, u in xs.items()}, s)
            outs.append(torch.einsum("bhkv,bhk->bhv", s, q[:, t]) * q.shape[-1] ** -0.5)
    out = torch.stack(outs, 1) if outs else v.new_zeros(v.shape)
    return out, s


@contextmanager
def _one_thread() -> Iterator[None]:
    """torch on one thread inside: the reference's small ops, untimed, would wait on a
    second thread at every op where the machine's cores are shared (3x slower here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _first_heads(x: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """x on the key heads that serve the first CHECKED value heads (and those value
    heads), so that the grouping stays that of the full call."""
    hk, hv = x["q"].shape[2], x["v"].shape[2]
    r = hv // hk
    keep = max(1, CHECKED // r)
    return {
        key: t[:, :, :keep] if hk != hv and t.shape[2] == hk else t[:, :, : keep * r]
        for key, t in x.items()
    }


def _error(impl: Impl, x: Mapping[str, Tensor], reference: Reference) -> float:
    """The relative error of ``impl`` on the first CHECKED value heads: the first
    CHECKED_STEPS steps, or (packed) every step against each sequence alone."""
    sliced = _first_heads(x)
    if impl.cu is None:
        n = min(x["v"].shape[1], CHECKED_STEPS)
        got = impl.fn(**{key: t[:, :n] for key, t in x.items()})
        want = reference(**{key: t[:, :n] for key, t in sliced.items()})[0]
    else:
        got = impl.fn(**x)
        want = torch.cat([
            reference(**{key: t[:, lo:hi] for key, t in sliced.items()})[0]
            for lo, hi in itertools.pairwise(impl.cu.tolist())
            if hi > lo
        ], 1)  # fmt: skip
    return relative_error(got[:, :, :CHECKED], want[:, :, :CHECKED])


def _with_peak(
    fn: Callable[[], object], peaks: dict[str, float | None], key: str
) -> Callable[[], object]:
    """``fn``, its first call measured for the growth of the peak resident set."""

    def call() -> object:
        if key in peaks:
            return fn()
        kept: list[object] = []
        peaks[key] = peak_extra_mib(lambda: kept.append(fn()))
        return kept[0] if kept else None

    return call


def _call(spec: Impl, direction: str) -> Callable[[], object]:
    """The call of ``spec`` that a row of ``direction`` times."""
    if direction == "forward":
        return partial(spec.fn, **spec.inputs)
    assert spec.weight is not None, "forward+backward needs an upstream gradient"
    return partial(train, spec.fn, dict(spec.inputs), spec.weight)


def kv_rows(
    name: str,
    impls: Mapping[str, Impl],
    x: Mapping[str, Tensor],
    reference: Reference,
    macs: int,
    repeat: int,
    step: Callable[[str], None],
    row: Callable[..., KvRow],
) -> list[KvRow]:
    """A case's rows (``row`` instances): every implementation checked against
    ``reference`` on ``x`` (its inputs at full length), then timed against the FLOP
    limit of ``macs`` K V multiply-adds per token and head; parascan's peak extra
    memory beside it."""
    b, L, hk, dk = x["q"].shape
    hv, dv = x["v"].shape[2:]
    errors = {impl: _error(spec, x, reference) for impl, spec in impls.items()}
    correct = {impl: error <= TOLERANCE for impl, error in errors.items()}
    for impl, spec in impls.items():  # one-time costs (a first backward's imports) untimed
        if spec.cu is None and correct[impl]:
            few = {key: t[:, :_WARM_STEPS] for key, t in spec.inputs.items()}
            weight = None if spec.weight is None else spec.weight[:, :_WARM_STEPS]
            for d in spec.directions:
                _call(Impl(spec.fn, few, weight=weight), d)()
    fns = bmm_limits(b * hv, L, dk, macs * dv)
    peaks: dict[str, float | None] = {}
    for impl, spec in impls.items():
        for d in spec.directions:
            call = _call(spec, d)
            fns[(impl, d)] = _with_peak(call, peaks, d) if impl == "parascan" else call
    times = rounds(
        fns, repeat, lambda key, _: key[0] == "limit" or correct[key[0]], once_over=SLOW_S
    )
    scale = {impl: L / spec.inputs["v"].shape[1] for impl, spec in impls.items()}
    med = {key: median(t) for key, t in times.items()}
    med = {key: None if t is None else t * scale.get(key[0], 1.0) for key, t in med.items()}
    rows = []
    for impl, spec in impls.items():
        note = spec.note
        if spec.cu is not None:
            note = f"{len(spec.cu) - 1} sequences, cu_seqlens {spec.cu.tolist()}"
        if scale[impl] != 1:
            steps = spec.inputs["v"].shape[1]
            note += f"{'; ' if note else ''}timed on {steps} of {L} steps, x{scale[impl]:g}"
        for d in spec.directions:
            step(f"{name} {impl} {d}")
            t, limit = med[(impl, d)], statistics.median(times[("limit", d)])
            peak = peaks.get(d) if impl == "parascan" else None
            size = b * L * hv * dk * dv * 4 / 2**20
            extra = "" if peak is None else f"one (b,L,Hv,K,V) f32 tensor: {size:.0f} MiB"
            rows.append(row(
                name, (b, L, hk, hv, dk, dv), torch.get_num_threads(), impl, d, ms(t),
                limit * 1e3, ratio(t, limit), ratio(t, med.get(("parascan", d))), errors[impl],
                correct[impl], "; ".join(n for n in (note, extra) if n), peak,
            ))  # fmt: skip
    return rows


_COLD_STATES_MAX = 512  # states a from-memory decode row cycles through, at most


def last_level_cache_bytes() -> int | None:
    """The bytes of the CPU's largest cache level, over all its instances (a chip with
    several L3 slices, one per group of cores, has their sum), from Linux's sysfs; None
    where unknown."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    levels: dict[int, dict[str, int]] = {}  # level -> {shared_cpu_list: bytes}
    for index in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cache/index[0-9]*"):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            level = int((index / "level").read_text())
            shared = (index / "shared_cpu_list").read_text().strip()
            text = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        digits, scale = (text[:-1], units[text[-1]]) if text[-1:] in units else (text, 1)
        if digits.isdigit():
            levels.setdefault(level, {})[shared] = int(digits) * scale
    return sum(levels[max(levels)].values()) if levels else None


def decode_rows(
    name: str,
    x: Mapping[str, Tensor],
    decode: Callable[[Tensor], tuple[Tensor, Tensor]],
    reference: Reference,
    repeat: int,
    step: Callable[[str], None],
    row: Callable[..., KvRow],
) -> list[KvRow]:
    """The decoding step's rows: ``decode(initial)`` is one token (the inputs ``x``, L =
    1) from a state, (o, final state), checked against ``reference`` and timed against
    torch.add over the state: the same state call after call (it stays in the caches),
    and states cycled through twice the largest cache (each comes from memory, as in a
    model, whose other layers run between two steps of one layer). A kernel that
    writes the final state past the caches (delta_rule/cpu_kernel.h, ps_delta_stream)
    is charged for it by the first row; the second is the regime it is written for."""
    b, _, hk, dk = x["q"].shape
    hv, dv = x["v"].shape[2:]
    state_bytes = b * hv * dk * dv * 4
    known = last_level_cache_bytes()
    cache = known or 64 << 20
    count = min(_COLD_STATES_MAX, max(2, -(-2 * cache // state_bytes)))
    states = [torch.randn(b, hv, dk, dv) for _ in range(count)]
    outs = [torch.zeros_like(s) for s in states]  # faulted in before any round
    got, want = decode(states[0]), reference(**x, initial=states[0])
    error = max(relative_error(g, w) for g, w in zip(got, want, strict=True))
    correct = error <= TOLERANCE
    turn = {"limit": 0, "step": 0}

    def state(key: str, cycled: bool) -> int:
        if not cycled:
            return 0
        turn[key] = (turn[key] + 1) % count
        return turn[key]

    def add(cycled: bool) -> None:
        i = state("limit", cycled)
        torch.add(states[i], states[i], out=outs[i])

    def call(cycled: bool) -> None:
        decode(states[state("step", cycled)])

    rows = []
    cycled_mib = count * state_bytes / 2**20
    for cycled, direction, note in (
        (False, DECODE[0], "the same state every call (in the caches)"),
        (True, DECODE[1],
         f"{count} states cycled, {cycled_mib:.0f} MiB, largest cache "
         + (f"{cache / 2**20:.1f} MiB" if known else "unknown, 64 MiB assumed")
         + ("" if count * state_bytes >= 2 * cache else ": fits the caches")),
    ):  # fmt: skip
        fns: dict[str, Callable[[], object]] = {
            "limit": partial(add, cycled), "step": partial(call, cycled),
        }  # fmt: skip
        keep: Callable[[str, int], bool] = lambda key, _: key == "limit" or correct  # noqa: E731
        times = rounds(fns, repeat, keep, calls=count if cycled else 20)
        step(f"{name} {direction}")
        t, limit = median(times["step"]), statistics.median(times["limit"])
        rows.append(row(
            name, (b, 1, hk, hv, dk, dv), torch.get_num_threads(), "parascan", direction,
            ms(t), limit * 1e3, ratio(t, limit), None, error, correct,
            f"one token with a state against torch.add over the {state_bytes >> 10} KiB state: "
            + note,
        ))  # fmt: skip
    return rows
