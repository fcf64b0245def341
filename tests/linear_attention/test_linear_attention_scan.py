"""ps.linear_attention_scan (linear attention, simple GLA, RetNet, Lightning, GLA,
HGRN2) against the float64 loop (oracles.linear_attention_loop), on every backend of
its row. The cases every checkpointed scan owes are tests/checkpointed.py's, over the
three gate forms (none, per head, per key channel); here: what is linear attention's
own (K, V of 1, 3, 65 and 129, grouped heads, the scale, a hard reset, a fixed decay
as a broadcast view, errors)."""

from __future__ import annotations

import math

import pytest
import torch

import parascan as ps
from checkpointed import ScanSpec, along, shared_tests
from parascan.linear_attention import autograd as la_ops
from parascan.linear_attention.canonical import CHECKPOINT_STEPS
from parascan.linear_attention.chunked import BLOCK, CHANNEL_BLOCK

from conftest import assert_matches
from oracles import linear_attention_loop

F64 = torch.float64


def _draw(
    gen: torch.Generator, *, batch: int, length: int, states: int | None, hk: int = 2,
    hv: int = 4, dk: int = 5, dv: int = 3, gate: str = "head", strength: float = 2.0,
    scale: float | None = None,
) -> dict:  # fmt: skip
    """A float64 problem: log decays in [-strength, 0]; ``states``: the rows of the
    initial state (batch by default)."""

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=F64)

    def unit(*shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=gen, dtype=F64)

    gates = {
        "none": None,
        "head": -strength * unit(batch, length, hv),
        "channel": -strength * unit(batch, length, hv, dk),
    }
    p = {
        "q": rand(batch, length, hk, dk),
        "k": rand(batch, length, hk, dk) / math.sqrt(dk),
        "v": rand(batch, length, hv, dv),
        "g": gates[gate],
        "initial": rand(batch if states is None else states, hv, dk, dv),
    }
    if scale is not None:
        p["scale"] = scale
    return p


LINEAR_ATTENTION = ScanSpec(
    name="linear_attention_scan",
    function=ps.linear_attention_scan,
    oracle=linear_attention_loop,
    draw=_draw,
    positional=("q", "k", "v"),
    timed=along(1, "q", "k", "v", "g"),
    optional=("g", "initial"),
    checkpoints={b: CHECKPOINT_STEPS[b] for b in la_ops.ROW.backends},
    backends=tuple(la_ops.ROW.backends),
    blocks=(CHANNEL_BLOCK, BLOCK),  # the torch backend's blocks
    forms={"none": {"gate": "none"}, "head": {"gate": "head"}, "channel": {"gate": "channel"}},
    optional_forms=("head", "channel"),
    tiny={"hk": 1, "hv": 2, "dk": 3, "dv": 2},
    vmapped=("v", "q"),
    overrides={"dtypes": {"length": 40}, "gradients": {"length": 150}},
)
TestShared = shared_tests(LINEAR_ATTENTION)

BACKENDS = list(la_ops.ROW.backends)


def _run(p: dict, backend: str, **kw: object) -> tuple[torch.Tensor, torch.Tensor]:
    args = {n: p[n] for n in ("g", "initial", "scale") if n in p}
    return ps.linear_attention_scan(  # type: ignore[return-value]
        p["q"], p["k"], p["v"], **args, **kw, return_final=True, backend=backend
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("dk", "dv"), [(1, 1), (3, 65), (65, 3), (129, 1), (1, 129)])
@pytest.mark.parametrize("gate", ["none", "channel"])
def test_awkward_widths_and_grouped_heads(backend: str, dk: int, dv: int, gate: str) -> None:
    gen = torch.Generator().manual_seed(dk * 1000 + dv)
    p = _draw(gen, batch=1, length=67, states=None, hk=1, hv=2, dk=dk, dv=dv, gate=gate)
    want, want_final = linear_attention_loop(**p)
    got, final = _run({n: t.float() if isinstance(t, torch.Tensor) else t for n, t in p.items()},
                      backend)  # fmt: skip
    assert_matches(got, want, torch.float32)
    assert_matches(final, want_final, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_scale_and_a_hard_reset(backend: str) -> None:
    """A -inf log decay empties the state (the steps before it no longer reach the
    output); ``scale`` multiplies the output."""
    gen = torch.Generator().manual_seed(5)
    p = _draw(gen, batch=2, length=150, states=None, gate="channel", scale=0.37)
    p["g"][:, 70] = -torch.inf
    p["g"][0, 100, 1, :2] = -torch.inf
    want, want_final = linear_attention_loop(**p)
    got, final = _run(p, backend)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(final, want_final, rtol=1e-10, atol=1e-10)
    later = {n: (t[:, 70:] if n in ("q", "k", "v", "g") else t) for n, t in p.items()}
    later.pop("initial")
    torch.testing.assert_close(got[:, 70:], _run(later, backend)[0], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_fixed_decay_as_a_broadcast_view(backend: str) -> None:
    """RetNet's and Lightning's decays are fixed per head: a stride-0 view of (Hv,)
    gives the same as the materialized gate, gradient included (summed over the
    steps)."""
    gen = torch.Generator().manual_seed(6)
    p = _draw(gen, batch=2, length=40, states=None, gate="none")
    gamma = torch.log(1 - 2.0 ** (-5.0 - torch.arange(4, dtype=F64))).requires_grad_()
    view = gamma.expand(2, 40, 4)
    got = ps.linear_attention_scan(p["q"], p["k"], p["v"], g=view, backend=backend)
    want, _ = linear_attention_loop(p["q"], p["k"], p["v"], g=view)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    (grad,) = torch.autograd.grad(got.sum(), gamma)
    (expected,) = torch.autograd.grad(want.sum(), gamma)
    torch.testing.assert_close(grad, expected, rtol=1e-9, atol=1e-9)


def _valid() -> dict:
    return _draw(torch.Generator().manual_seed(0), batch=1, length=6, states=None)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"q": torch.zeros(1, 6, 2)}, r"expected q of shape \(batch, L, Hk, K\)"),
        ({"k": torch.zeros(1, 6, 2, 4)}, r"expected k of shape"),
        ({"v": torch.zeros(1, 6, 3, 3)}, r"positive multiple of q and k's Hk = 2"),
        ({"v": torch.zeros(1, 5, 4, 3)}, r"expected v of shape \(batch, L, Hv, V\)"),
        ({"g": torch.zeros(1, 6, 2)}, r"expected g of shape \(batch, L, Hv\)"),
        ({"initial": torch.zeros(1, 4, 3, 5)}, r"expected initial of shape"),
        ({"scale": float("nan")}, r"expected scale to be a finite number"),
        ({"return_final": 1}, r"return_final"),
        ({"backend": "cuda"}, r"backend"),
        ({"cu_seqlens": torch.tensor([0, 2, 1, 6])}, r"cu_seqlens"),
    ],
)
def test_bad_input_raises_before_any_kernel(change: dict, message: str) -> None:
    p = {**_valid(), **change}
    q, k, v = p.pop("q"), p.pop("k"), p.pop("v")
    with pytest.raises((ValueError, TypeError, RuntimeError), match=message) as error:
        ps.linear_attention_scan(q, k, v, **p)
    assert str(error.value).startswith("parascan.linear_attention_scan: ")
