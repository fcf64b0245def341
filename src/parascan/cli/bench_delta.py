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
  model's layers cycle them (bench_kv.decode_rows); each checked first.
- ``FLOP limit``: ``torch.bmm`` doing the recurrence's 3 K V multiply-adds per token
  and head (the state's decay-and-update, its product with k and with q) in one warm
  product, measured in the same run; forward + backward, three times that.

Results are checked first against a float64 loop of the recurrence (written here, on
bench_kv.py's driver) on the first value heads and steps; a wrong result gets no speed.
The rows, their checks, timings and table, and the decoding step's rows are
bench_kv.py's, shared with the other (K, V)-state families.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import parascan as ps
from parascan.cli.bench_kv import (
    DIRECTIONS,
    Impl,
    KvCase,
    KvRow,
    decayed,
    decode_rows,
    format_kv,
    kv_rows,
    kv_step_names,
    loop64,
)
from parascan.cli.common import cu_seqlens, run_cases

__all__ = [
    "DEFAULT_DELTA_CASES",
    "QUICK_DELTA_CASES",
    "DeltaCase",
    "DeltaRow",
    "delta_step_names",
    "format_delta",
    "run_delta",
]


@dataclass(frozen=True)
class DeltaCase(KvCase):
    """A delta-rule case (bench_kv.KvCase; ``prefix``: transformers' fallback timed on
    that many steps)."""

    gate: str  # "head" (gated delta rule) or "channel" (KDA)


@dataclass
class DeltaRow(KvRow):
    """A row of the delta rule's table (bench_kv.KvRow)."""


DEFAULT_DELTA_CASES = [
    DeltaCase("qwen3.5 gated delta", 1, 1024, 16, 32, 128, 128, "head", packed=8),
    DeltaCase("qwen3.5 gated delta", 1, 4096, 16, 32, 128, 128, "head", prefix=1024, decode=False),
    DeltaCase("kimi linear KDA", 1, 1024, 32, 32, 128, 128, "channel", prefix=128),
]
QUICK_DELTA_CASES = [DeltaCase("gated delta", 1, 64, 2, 4, 16, 16, "head", packed=3)]


def format_delta(rows: list[DeltaRow]) -> str:
    head = (
        "Delta rule (q, k l2-normalized; float32; x limit: time / torch.bmm of the "
        "recurrence's 3*K*V multiply-adds per token and head, 3x that forward+backward; the "
        "decode step: time / torch.add over the state; x parascan: this row's time / parascan's)"
    )
    return format_kv(rows, [head])


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
    return DIRECTIONS if case.backward else DIRECTIONS[:1]


def delta_step_names(case: DeltaCase) -> list[str]:
    return kv_step_names(case.name, dict.fromkeys(_impls(case), _directions(case)), case.decode)


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


def _delta_step(x: dict[str, Tensor], s: Tensor) -> Tensor:
    s = decayed(s, x.get("g"))
    u = x["beta"][..., None] * (x["v"] - torch.einsum("bhkv,bhk->bhv", s, x["k"]))
    return s + x["k"][..., None] * u[:, :, None, :]


def _loop64(initial: Tensor | None = None, **x: Tensor) -> tuple[Tensor, Tensor]:
    """(o, final state) of the delta rule one step at a time in float64, q and k
    l2-normalized, scale K^-0.5: value head h reads q/k head h // (Hv / Hk)."""
    q, k = x["q"].double(), x["k"].double()
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    return loop64(_delta_step, {**x, "q": q, "k": k}, initial)


def _run_case(case: DeltaCase, repeat: int, step: Callable[[str], None]) -> list[KvRow]:
    x = _inputs(case)
    b, L, hv, dv = case.batch, case.length, case.v_heads, case.dv
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

    prefix = case.prefix if case.prefix and case.prefix < L else L
    dirs = _directions(case)
    every = {
        "parascan": lambda: Impl(ours, x, dirs, weight),
        "parascan packed": lambda: Impl(partial(ours, cu_seqlens=cu), x, dirs, weight, cu),
        "transformers": lambda: Impl(
            theirs, _inputs(case, prefix), dirs, weight[:, :prefix], None,
            "torch_chunk_gated_delta_rule" if case.gate == "head" else "chunk_kimi_delta_attention",
        ),
    }  # fmt: skip
    impls = {name: every[name]() for name in _impls(case)}
    rows = kv_rows(case.name, impls, x, _loop64, 3, repeat, step, DeltaRow)
    if case.decode:
        one = _inputs(case, 1)

        def decode(initial: Tensor) -> tuple[Tensor, Tensor]:
            q, k, v, beta, g = (one[key] for key in ("q", "k", "v", "beta", "g"))
            out = ps.delta_rule_scan(
                q, k, v, beta, g=g, qk_l2norm=True, initial=initial, return_final=True
            )
            assert isinstance(out, tuple)
            return out

        rows += decode_rows(case.name, one, decode, _loop64, repeat, step, DeltaRow)
    return rows


# run_delta(cases, repeat, step): every case's rows
run_delta = partial(run_cases, _run_case)
