"""The linear-attention and DPLR part of ``parascan bench``: ``ps.linear_attention_scan``
(GLA: a log decay per key channel) and ``ps.dplr_delta_rule_scan`` (RWKV-7: a = -kk,
b = kk * rate, g = w) at real models' shapes, float32, against what a CPU user runs
today and a FLOP limit, forward and forward + backward.

- ``naive loop``: the recurrence as fla's naive references compute it
  (``naive_recurrent_gla``; ``dplr_recurrence``, the DPLR naive of RWKV-7): a step
  loop as fla's naive_recurrent_* (one vectorized update of the whole (batch, H, K, V)
  float32 state per step, the same torch ops, dplr_recurrence's two copies of the state
  a step included), written here (fla is not needed).
  Forward only; timed on the first ``prefix`` steps and scaled to L (a step loop's
  cost grows as L), the note says so.
- ``fla naive``: fla's own naive function, where fla is importable (its file loaded
  alone: fla's package import takes seconds and Triton); forward only, like the above.
- ``parascan packed`` (cases with ``packed`` sequences): the same tokens as that many
  sequences of random lengths in one call (``cu_seqlens``); its ``x parascan`` is the
  cost of packing against one sequence.
- ``decode step`` and ``decode step, from memory``: one token with a state, against
  ``torch.add`` over the state (bench_kv.decode_rows).
- ``FLOP limit``: ``torch.bmm`` doing the recurrence's multiply-adds per token and
  head in one warm product, measured in the same run: 2 K V for linear attention (the
  decay and update, the output), 4 K V for DPLR (a^T S, the decay and update with its
  two rank-one writes, the output); forward + backward, three times that.

The issue's targets (float32, 2 threads): forward within 1.5x and forward + backward
within 3x of the limit; 15x faster than the naive loop forward at L = 1024; packed
within 1.1x of one sequence; the decoding step from memory within 3x of torch.add.
Every result is checked first against a float64 loop of the recurrence (written here,
on bench_kv.py's driver); a wrong result gets no speed. The rows, checks, timings,
table and decoding rows are bench_kv.py's, shared with the delta rule's.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
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
    value_heads,
)
from parascan.cli.common import cu_seqlens, run_cases

__all__ = [
    "DEFAULT_LINEAR_CASES",
    "FULL_LINEAR_CASES",
    "QUICK_LINEAR_CASES",
    "LinearCase",
    "LinearRow",
    "format_linear",
    "linear_step_names",
    "naive_loop",
    "reference_loop",
    "run_linear",
]

LINEAR, DPLR = "linear attention", "dplr"


@dataclass(frozen=True)
class LinearCase(KvCase):
    """A linear-attention or DPLR case (bench_kv.KvCase; ``prefix``: the naive loops
    timed on that many steps)."""

    family: str  # LINEAR (linear_attention_scan) or DPLR (dplr_delta_rule_scan)
    gate: str = "channel"  # log decays per key channel, per "head", or "none"


@dataclass
class LinearRow(KvRow):
    """A row of the linear-attention or DPLR table (bench_kv.KvRow)."""

    family: str = LINEAR


_GLA = LinearCase("gla 1.3B", 1, 1024, 4, 4, 256, 512, LINEAR, prefix=256, packed=8)
_RWKV7 = LinearCase("rwkv-7 2.9B", 1, 1024, 40, 40, 64, 64, DPLR, prefix=256, packed=8)
DEFAULT_LINEAR_CASES = [_GLA, _RWKV7]
# --full: the naive loops whole (the default times 256 of their steps)
FULL_LINEAR_CASES = [
    LinearCase("gla 1.3B", 1, 1024, 4, 4, 256, 512, LINEAR, packed=8),
    LinearCase("rwkv-7 2.9B", 1, 1024, 40, 40, 64, 64, DPLR, packed=8),
]
QUICK_LINEAR_CASES = [
    LinearCase("gla", 1, 64, 2, 4, 16, 32, LINEAR, prefix=32, packed=3),
    LinearCase("rwkv-7", 1, 64, 2, 2, 16, 16, DPLR, prefix=32, packed=3),
]

_MACS = {LINEAR: 2, DPLR: 4}  # multiply-adds per token and head, in units of K V


def format_linear(rows: list[LinearRow]) -> str:
    """The linear-attention table, then the DPLR table (each when it has rows)."""
    common = (
        "3x that forward+backward; the decode step: time / torch.add over the state; "
        "x parascan: this row's time / parascan's)"
    )
    heads = {
        LINEAR: "Linear attention (linear_attention_scan, GLA: a log decay per key channel; "
        "float32; x limit: time / torch.bmm of the recurrence's 2*K*V multiply-adds per token "
        "and head: decay+update, output; " + common,
        DPLR: "DPLR delta rule (dplr_delta_rule_scan, RWKV-7: a = -kk, b = kk*rate, g = w; "
        "float32; x limit: time / torch.bmm of the recurrence's 4*K*V multiply-adds per token "
        "and head: a^T S, decay+update with two rank-one writes, output; " + common,
    }
    targets = (
        "targets: x limit 1.5 forward, 3 forward+backward, 3 decode step from memory; "
        "naive loop x parascan 15 forward; parascan packed x parascan 1.1"
    )
    tables = [
        format_kv(mine, [heads[family], targets])
        for family in (LINEAR, DPLR)
        if (mine := [r for r in rows if r.family == family])
    ]
    return "\n\n".join(tables)


def _fla(case: LinearCase) -> Callable[..., Any] | None:
    """fla's naive function for the case's family (``naive_recurrent_gla``,
    ``dplr_recurrence``), its file loaded alone; None without fla, or for a gate it
    does not take (it takes one log decay per key channel)."""
    if case.gate != "channel":
        return None
    try:
        spec = importlib.util.find_spec("fla")
        if spec is None or not spec.submodule_search_locations:
            return None
        relative, name = (
            ("ops/gla/naive.py", "naive_recurrent_gla") if case.family == LINEAR
            else ("ops/generalized_delta_rule/dplr/naive.py", "dplr_recurrence")
        )  # fmt: skip
        # the first of the package's directories that has the file (a namespace
        # package, as an empty directory left by an uninstall makes, has several)
        path = next(
            p for root in spec.submodule_search_locations if (p := Path(root) / relative).is_file()
        )
        loader = importlib.util.spec_from_file_location(f"_parascan_bench_fla_{name}", path)
        if loader is None or loader.loader is None:
            return None
        module = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(module)
        fn: Callable[..., Any] = getattr(module, name)
        return fn
    except Exception:  # any failure to load it: no such row
        return None


def _directions(case: LinearCase) -> dict[str, tuple[str, ...]]:
    """Each implementation's directions: parascan's both (unless forward only), the
    naive loops' forward."""
    ours = DIRECTIONS if case.backward else DIRECTIONS[:1]
    names = {"parascan": ours, "parascan packed": ours if case.packed else ()}
    names |= {"naive loop": ("forward",), "fla naive": ("forward",) if _fla(case) else ()}
    return {name: ds for name, ds in names.items() if ds}


def linear_step_names(case: LinearCase) -> list[str]:
    return kv_step_names(case.name, _directions(case), case.decode)


def _inputs(case: LinearCase, length: int | None = None) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(case.seed)
    b, L = case.batch, case.length if length is None else length
    hk, hv, dk, dv = case.k_heads, case.v_heads, case.dk, case.dv
    x = {
        "q": torch.randn(b, L, hk, dk, generator=gen),
        "k": torch.randn(b, L, hk, dk, generator=gen),
        "v": torch.randn(b, L, hv, dv, generator=gen),
    }
    if case.family == DPLR:  # RWKV-7: kk l2-normalized, an in-context rate in (0, 1)
        kk = F.normalize(torch.randn(b, L, hk, dk, generator=gen), dim=-1)
        x["a"] = -kk
        x["b"] = kk * torch.sigmoid(torch.randn(b, L, hk, dk, generator=gen))
    if case.gate != "none":
        logits = torch.randn(
            (b, L, hv, dk) if case.gate == "channel" else (b, L, hv), generator=gen
        )
        # GLA: logsigmoid(.) / 16 (its gate_logit_normalizer); RWKV-7: w = -e^-0.5 sigmoid(.)
        x["g"] = (
            F.logsigmoid(logits) / 16 if case.family == LINEAR
            else -torch.exp(torch.tensor(-0.5)) * torch.sigmoid(logits)
        )  # fmt: skip
    return x


def _linear_step(x: dict[str, Tensor], s: Tensor) -> Tensor:
    return decayed(s, x.get("g")) + x["k"][..., None] * x["v"][:, :, None, :]


def _dplr_step(x: dict[str, Tensor], s: Tensor) -> Tensor:
    read = torch.einsum("bhkv,bhk->bhv", s, x["a"])  # a^T S[t-1]
    return _linear_step(x, s) + x["b"][..., None] * read[:, :, None, :]


def reference_loop(
    family: str, initial: Tensor | None = None, **x: Tensor
) -> tuple[Tensor, Tensor]:
    """(o, final state) of the family's recurrence one step at a time in float64."""
    return loop64(_linear_step if family == LINEAR else _dplr_step, x, initial)


def _naive_linear(x: dict[str, Tensor], h: Tensor) -> tuple[Tensor, Tensor]:
    # naive_recurrent_gla's step: h * exp(gk)[..., None] + k[..., None] * v[..., None, :]
    h = decayed(h, x.get("g")) + x["k"][..., None] * x["v"][..., None, :]
    return h, (x["q"][..., None] * h).sum(-2)


def _naive_dplr(x: dict[str, Tensor], h: Tensor) -> tuple[Tensor, Tensor]:
    # dplr_recurrence's step: the rank-one write b (a^T S) from the state before the decay;
    # it reads the state through a copy (S.clone()) for the read and for the decay both,
    # two more passes over the state a step, and copies the step's a and b
    a, b = x["a"].clone(), x["b"].clone()
    kv = x["k"][..., None] * x["v"][..., None, :]
    kv = kv + (h.clone() * a[..., None]).sum(-2, keepdim=True) * b[..., None]
    h = decayed(h.clone(), x.get("g")) + kv
    return h, torch.einsum("bhd,bhdm->bhm", x["q"], h)


def naive_loop(family: str, **x: Tensor) -> Tensor:
    """The family's recurrence as fla's naive references compute it, in float32: q and
    k repeated to the value heads (as a layer does), (batch, H, L, .) views, q scaled by
    K^-0.5, then a Python loop over L with one vectorized update of the whole (batch, H,
    K, V) state per step (no initial state), op for op as fla's functions run it (their
    copies of the state too: they make dplr_recurrence 1.2x to 1.4x slower)."""
    step = _naive_linear if family == LINEAR else _naive_dplr
    xs = {key: t.float().transpose(1, 2) for key, t in value_heads(x).items()}
    q, v = xs["q"], xs["v"]
    xs["q"] = q * q.shape[-1] ** -0.5
    h = q.new_zeros(v.shape[0], v.shape[1], q.shape[-1], v.shape[-1])
    o = torch.empty_like(v)
    for i in range(v.shape[2]):
        h, o[:, :, i] = step({key: t[:, :, i] for key, t in xs.items()}, h)
    return o.transpose(1, 2)


def _fla_call(case: LinearCase, fn: Callable[..., Any] | None, **x: Tensor) -> Tensor:
    """fla's naive function on the case's inputs: q and k repeated to the value heads;
    ``dplr_recurrence`` takes (batch, H, L, .) views."""
    assert fn is not None
    xs = value_heads(x)
    if case.family == LINEAR:
        out: Tensor = fn(xs["q"], xs["k"], xs["v"], xs["g"])[0]
        return out
    args = (xs[key].transpose(1, 2) for key in ("q", "k", "v", "a", "b", "g"))
    out = fn(*args, output_final_state=False)[0]
    return out.transpose(1, 2)


def _ours(family: str, **kw: Any) -> Callable[..., Tensor]:
    """parascan's call of the family (looked up on each call: a test may replace it)."""

    def call(**x: Tensor) -> Tensor:
        g = x.get("g")
        if family == LINEAR:
            out = ps.linear_attention_scan(x["q"], x["k"], x["v"], g=g, **kw)
        else:
            out = ps.dplr_delta_rule_scan(x["q"], x["k"], x["v"], x["a"], x["b"], g=g, **kw)
        assert isinstance(out, Tensor)
        return out

    return call


def _decoder(family: str, x: Mapping[str, Tensor]) -> Callable[[Tensor], tuple[Tensor, Tensor]]:
    """One decoding step of the family on the one-token inputs ``x`` from a state."""

    def decode(initial: Tensor) -> tuple[Tensor, Tensor]:
        q, k, v, g = x["q"], x["k"], x["v"], x.get("g")
        if family == LINEAR:
            out = ps.linear_attention_scan(q, k, v, g=g, initial=initial, return_final=True)
        else:
            out = ps.dplr_delta_rule_scan(
                q, k, v, x["a"], x["b"], g=g, initial=initial, return_final=True
            )
        assert isinstance(out, tuple)
        return out

    return decode


def _run_case(case: LinearCase, repeat: int, step: Callable[[str], None]) -> list[KvRow]:
    x = _inputs(case)
    L = case.length
    weight = torch.randn(
        case.batch, L, case.v_heads, case.dv, generator=torch.Generator().manual_seed(1)
    )
    cu = cu_seqlens(L, case.packed, case.seed + 2) if case.packed else None
    prefix = case.prefix if case.prefix and case.prefix < L else L
    short = {key: t[:, :prefix] for key, t in x.items()}
    fla = _fla(case)
    kind = "fla's naive_recurrent_gla" if case.family == LINEAR else "fla's dplr_recurrence"
    dirs = _directions(case)
    every: dict[str, Callable[[], Impl]] = {
        "parascan": lambda: Impl(_ours(case.family), x, dirs["parascan"], weight),
        "parascan packed": lambda: Impl(
            _ours(case.family, cu_seqlens=cu), x, dirs["parascan packed"], weight, cu
        ),
        "naive loop": lambda: Impl(
            partial(naive_loop, case.family), short, dirs["naive loop"],
            note=f"a step loop as {kind} (one vectorized update per step)",
        ),
        "fla naive": lambda: Impl(
            partial(_fla_call, case, fla), short, dirs["fla naive"], note=kind
        ),
    }  # fmt: skip
    impls = {name: every[name]() for name in dirs}
    reference = partial(reference_loop, case.family)
    row = partial(LinearRow, family=case.family)
    rows = kv_rows(case.name, impls, x, reference, _MACS[case.family], repeat, step, row)
    if case.decode:
        one = _inputs(case, 1)
        decode = _decoder(case.family, one)
        rows += decode_rows(case.name, one, decode, reference, repeat, step, row)
    return rows


# run_linear(cases, repeat, step): every case's rows
run_linear = partial(run_cases, _run_case)
