"""The delta-rule part of ``parascan bench``: ``ps.delta_rule_scan`` as the models of
transformers call it (q and k l2-normalized in the call, float32), against
transformers' own torch fallbacks and a FLOP limit, forward and forward + backward.

- ``transformers``: the unpatched torch fallback of the model family's modeling
  module: ``torch_chunk_gated_delta_rule`` (Qwen3.5's, chunk 64; q and k repeated to
  the value heads first, as the layer does) for the gated delta rule,
  ``chunk_kimi_delta_attention`` (Kimi Linear's, chunk 64) for KDA. Left out when
  transformers is not installed. A fallback that takes seconds is timed on the first
  ``prefix`` steps and scaled to L (its cost grows linearly with L: a Python loop
  over chunks); the note says so.
- ``parascan packed`` (cases with ``packed`` sequences): the same tokens as that many
  sequences of random lengths in one call (``cu_seqlens``); its ``x parascan`` is the
  cost of packing against one sequence.
- ``decode step``: one token with a state (L = 1), against ``torch.add`` over the
  state's bytes (the ``x limit`` of that row): the same state every call, and
  (``decode step, from memory``) states cycled through twice the largest cache, as a
  model's layers cycle them (_decode_rows).
- ``FLOP limit``: ``torch.bmm`` doing the recurrence's 3 K V multiply-adds per token
  and head (the state's decay-and-update, its product with k and with q) in one warm
  product, measured in the same run; forward + backward, three times that.

Results are checked first against a float64 loop of the recurrence (written here) on
the first ``_CHECKED`` value heads and ``_CHECKED_STEPS`` steps: the output relative to
its largest magnitude, within ``_TOLERANCE``; a wrong result gets no speed.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
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
    "DEFAULT_DELTA_CASES",
    "QUICK_DELTA_CASES",
    "DeltaCase",
    "DeltaRow",
    "delta_step_names",
    "format_delta",
    "run_delta",
]

_CHECKED = 2  # value heads checked against the float64 loop
_CHECKED_STEPS = 256
_TOLERANCE = 1e-4
_DIRECTIONS = ("forward", "forward+backward")


@dataclass(frozen=True)
class DeltaCase:
    name: str
    batch: int
    length: int
    k_heads: int
    v_heads: int
    dk: int
    dv: int
    gate: str  # "head" (gated delta rule) or "channel" (KDA)
    prefix: int = 0  # > 0: the fallback timed on this many steps, scaled to L
    packed: int = 0  # > 0: also the same tokens as this many packed sequences
    backward: bool = True
    decode: bool = True  # also the decoding step (L = 1) at this case's heads
    seed: int = 0


@dataclass
class DeltaRow:
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


DEFAULT_DELTA_CASES = [
    DeltaCase("qwen3.5 gated delta", 1, 1024, 16, 32, 128, 128, "head", packed=8),
    DeltaCase("qwen3.5 gated delta", 1, 4096, 16, 32, 128, 128, "head", prefix=1024, decode=False),
    DeltaCase("kimi linear KDA", 1, 1024, 32, 32, 128, 128, "channel", prefix=128),
]
QUICK_DELTA_CASES = [DeltaCase("gated delta", 1, 64, 2, 4, 16, 16, "head", packed=3)]

_LINE = "{:<20} {:<22} {:<16} {:<24} {:>9} {:>9} {:>8} {:>10} {:>8} {:>9}  {}"


def format_delta(rows: list[DeltaRow]) -> str:
    head = (
        "Delta rule (q, k l2-normalized; float32; x limit: time / torch.bmm of the "
        "recurrence's 3*K*V multiply-adds per token and head, 3x that forward+backward; the "
        "decode step: time / torch.add over the state; x parascan: this row's time / parascan's)"
    )
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
    return table([head], _LINE, names, cells)


def _fallback(case: DeltaCase) -> Callable[..., Any] | None:
    """transformers' unpatched fallback for the case's gate, or None."""
    import importlib

    family, name = (
        ("qwen3_5", "torch_chunk_gated_delta_rule") if case.gate == "head"
        else ("kimi_linear", "chunk_kimi_delta_attention")
    )  # fmt: skip
    try:
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    except ImportError:
        return None
    from parascan.integrations.transformers import _ORIGINALS

    fn = _ORIGINALS.get((module.__name__, name), getattr(module, name, None))
    return getattr(fn, "__wrapped__", fn)


def _impls(case: DeltaCase) -> tuple[str, ...]:
    base: tuple[str, ...] = ("parascan", "parascan packed") if case.packed else ("parascan",)
    return (*base, "transformers") if _fallback(case) is not None else base


def _directions(case: DeltaCase) -> tuple[str, ...]:
    return _DIRECTIONS if case.backward else _DIRECTIONS[:1]


def delta_step_names(case: DeltaCase) -> list[str]:
    rows = [f"{case.name} {i} {d}" for i in _impls(case) for d in _directions(case)]
    decode = ["decode step", "decode step, from memory"] if case.decode else []
    return [*rows, *(f"{case.name} {name}" for name in decode)]


def _inputs(case: DeltaCase, length: int | None = None) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(case.seed)
    b, L = case.batch, case.length if length is None else length
    hk, hv, dk, dv = case.k_heads, case.v_heads, case.dk, case.dv
    g_shape = (b, L, hv) if case.gate == "head" else (b, L, hv, dk)
    # log decays as the models' gates give them: -exp(A_log) * softplus(.), mostly small
    return {
        "q": torch.randn(b, L, hk, dk, generator=gen),
        "k": torch.randn(b, L, hk, dk, generator=gen),
        "v": torch.randn(b, L, hv, dv, generator=gen),
        "beta": torch.rand(b, L, hv, generator=gen),
        "g": -F.softplus(torch.randn(g_shape, generator=gen) - 2.0),
    }


def _loop64(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor) -> Tensor:
    """The delta rule one step at a time in float64, q and k l2-normalized, scale
    K^-0.5: value head h reads q/k head h // (Hv / Hk)."""
    q, k, v, beta, g = (t.double() for t in (q, k, v, beta, g))
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    r = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(r, 2), k.repeat_interleave(r, 2)
    s = v.new_zeros(v.shape[0], v.shape[2], q.shape[-1], v.shape[-1])
    outs = []
    for t in range(v.shape[1]):
        decay = torch.exp(g[:, t])
        s = s * (decay[..., None, None] if decay.dim() == 2 else decay[..., None])
        u = beta[:, t, :, None] * (v[:, t] - torch.einsum("bhkv,bhk->bhv", s, k[:, t]))
        s = s + k[:, t, :, :, None] * u[:, :, None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", s, q[:, t]) * q.shape[-1] ** -0.5)
    return torch.stack(outs, 1)


def _packed_reference(x: dict[str, Tensor], cu: Tensor) -> Tensor:
    """The first value heads of a packed call, each sequence alone by the float64 loop
    (q/k heads sliced so that the grouping stays that of the full call)."""
    r = x["v"].shape[2] // x["q"].shape[2]
    hk = max(1, _CHECKED // r)
    sliced = {key: t[:, :, :hk] if key in ("q", "k") else t[:, :, : hk * r] for key, t in x.items()}
    bounds = cu.tolist()
    parts = [
        _loop64(**{key: t[:, lo:hi] for key, t in sliced.items()})
        for lo, hi in itertools.pairwise(bounds)
        if hi > lo
    ]
    return torch.cat(parts, 1)[:, :, :_CHECKED]


def _run_case(case: DeltaCase, repeat: int, step: Callable[[str], None]) -> list[DeltaRow]:
    x = _inputs(case)
    b, L, hk, hv, dk, dv = case.batch, case.length, case.k_heads, case.v_heads, case.dk, case.dv
    weight = torch.randn(b, L, hv, dv, generator=torch.Generator().manual_seed(1))
    cu = cu_seqlens(L, case.packed, case.seed + 2) if case.packed else None
    hf = _fallback(case)

    def ours(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor, **kw: Any) -> Tensor:
        out = ps.delta_rule_scan(q, k, v, beta, g=g, qk_l2norm=True, **kw)
        assert isinstance(out, Tensor)
        return out

    def theirs(q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor) -> Tensor:
        assert hf is not None
        r = v.shape[2] // q.shape[2]
        if r > 1:  # the layer repeats q and k to the value heads before the call
            q, k = q.repeat_interleave(r, 2), k.repeat_interleave(r, 2)
        out: Tensor = hf(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]
        return out

    every: dict[str, Callable[..., Tensor]] = {
        "parascan": ours, "parascan packed": partial(ours, cu_seqlens=cu), "transformers": theirs,
    }  # fmt: skip
    impls = {name: every[name] for name in _impls(case)}

    # correctness first, on the first steps and value heads (packed: every step, each
    # sequence alone): a wrong result gets no speed
    n = min(L, _CHECKED_STEPS)
    head = {key: t[:, :n] for key, t in x.items()}
    want = _loop64(**head)[:, :, :_CHECKED]
    errors, correct = {}, {}
    for name, fn in impls.items():
        if name == "parascan packed":
            assert cu is not None
            got, want_packed = fn(**x)[:, :, :_CHECKED], _packed_reference(x, cu)
            errors[name] = relative_error(got, want_packed)
        else:
            errors[name] = relative_error(fn(**head)[:, :, :_CHECKED], want)
        correct[name] = errors[name] <= _TOLERANCE

    # the FLOP limit: 3 K V multiply-adds per token and head as one batched product
    fns = bmm_limits(b * hv, L, dk, 3 * dv)
    prefix = case.prefix if case.prefix and case.prefix < L else L
    short = _inputs(case, prefix)
    short_weight = weight[:, :prefix]
    for name, impl in impls.items():
        inputs, w = (short, short_weight) if name == "transformers" else (x, weight)
        fns[(name, "forward")] = partial(impl, **inputs)
        if case.backward:
            fns[(name, "forward+backward")] = partial(train, impl, inputs, w)
    times = rounds(fns, repeat, lambda key, _: key[0] == "limit" or correct[key[0]])
    # parascan's extra memory: never a state per step (one is b L Hv K V floats)
    peaks = {}
    if correct["parascan"]:
        peaks["forward"] = peak_extra_mib(partial(ours, **x))
        if case.backward:
            peaks["forward+backward"] = peak_extra_mib(partial(train, ours, x, weight))
    states_mib = b * L * hv * dk * dv * 4 / 2**20
    med = {key: median(t) for key, t in times.items()}
    med.update({
        (name, d): None if med[(name, d)] is None else med[(name, d)] * L / prefix  # type: ignore[operator]
        for name, d in med if name == "transformers"
    })  # fmt: skip
    notes = {"transformers": ("torch_chunk_gated_delta_rule" if case.gate == "head"
                              else "chunk_kimi_delta_attention")}  # fmt: skip
    if prefix < L:
        notes["transformers"] += f", timed on {prefix} of {L} steps, x{L / prefix:g}"
    if cu is not None:
        notes["parascan packed"] = f"{case.packed} sequences, cu_seqlens {cu.tolist()}"
    if peaks:
        notes["parascan"] = f"one (b,L,Hv,K,V) f32 tensor: {states_mib:.0f} MiB"
    rows = []
    for name in impls:
        for direction in _directions(case):
            step(f"{case.name} {name} {direction}")
            t, limit = med[(name, direction)], statistics.median(times[("limit", direction)])
            rows.append(DeltaRow(
                case.name, (b, L, hk, hv, dk, dv), torch.get_num_threads(), name, direction,
                ms(t), limit * 1e3, ratio(t, limit), ratio(t, med[("parascan", direction)]),
                errors[name], correct[name], notes.get(name, ""),
                peaks.get(direction) if name == "parascan" else None,
            ))  # fmt: skip
    if case.decode:
        rows += _decode_rows(case, repeat, step)
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


def _decode_rows(case: DeltaCase, repeat: int, step: Callable[[str], None]) -> list[DeltaRow]:
    """One token with a state against torch.add over the state: the same state call
    after call (it stays in the caches), and states cycled through twice the largest
    cache (each comes from memory, as in a model, whose other layers run between two
    steps of one layer). The kernel writes the final state past the caches
    (delta_rule/cpu_kernel.h, ps_delta_stream): the first row charges it for that, the
    second is the regime it is written for."""
    x = _inputs(case, 1)
    b, hv, dk, dv = case.batch, case.v_heads, case.dk, case.dv
    state_bytes = b * hv * dk * dv * 4
    known = last_level_cache_bytes()
    cache = known or 64 << 20
    count = min(_COLD_STATES_MAX, max(2, -(-2 * cache // state_bytes)))
    states = [torch.randn(b, hv, dk, dv) for _ in range(count)]
    outs = [torch.zeros_like(s) for s in states]  # faulted in before any round
    turn = {"limit": 0, "step": 0}

    def state(key: str, cycled: bool) -> int:
        if not cycled:
            return 0
        turn[key] = (turn[key] + 1) % count
        return turn[key]

    def add(cycled: bool) -> None:
        i = state("limit", cycled)
        torch.add(states[i], states[i], out=outs[i])

    def decode(cycled: bool) -> None:
        ps.delta_rule_scan(x["q"], x["k"], x["v"], x["beta"], g=x["g"], qk_l2norm=True,
                           initial=states[state("step", cycled)], return_final=True)  # fmt: skip

    rows = []
    cycled_mib = count * state_bytes / 2**20
    for cycled, name, note in (
        (False, "decode step", "the same state every call (in the caches)"),
        (True, "decode step, from memory",
         f"{count} states cycled, {cycled_mib:.0f} MiB, largest cache "
         + (f"{cache / 2**20:.1f} MiB" if known else "unknown, 64 MiB assumed")
         + ("" if count * state_bytes >= 2 * cache else ": fits the caches")),
    ):  # fmt: skip
        fns: dict[str, Callable[[], object]] = {
            "limit": partial(add, cycled), "step": partial(decode, cycled),
        }  # fmt: skip
        times = rounds(fns, repeat, calls=count if cycled else 20)
        step(f"{case.name} {name}")
        t, limit = median(times["step"]), statistics.median(times["limit"])
        rows.append(DeltaRow(
            case.name, (b, 1, case.k_heads, hv, dk, dv), torch.get_num_threads(), "parascan",
            name, ms(t), limit * 1e3, ratio(t, limit), None, None, True,
            f"one token with a state against torch.add over the {state_bytes >> 10} KiB state: "
            + note,
        ))  # fmt: skip
    return rows


# run_delta(cases, repeat, step): every case's rows
run_delta = partial(run_cases, _run_case)
