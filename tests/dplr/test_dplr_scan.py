"""ps.dplr_delta_rule_scan (the generalized delta rule, RWKV-7) against the float64
loop (oracles.dplr_delta_rule_loop), on every backend of its row. The cases every
checkpointed scan owes are tests/checkpointed.py's, over the three gate forms (none,
per head, per key channel); here: what is the family's own (K, V of 1, 3, 65 and 129,
grouped heads, the delta rule as its special case, errors). RWKV-7's ranges and the
float32 drift are in test_dplr_ranges.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import parascan as ps
from checkpointed import ScanSpec, along, shared_tests
from parascan.dplr import autograd as dplr_ops
from parascan.dplr.canonical import CHECKPOINT_STEPS
from parascan.dplr.chunked import BLOCK

from conftest import assert_matches
from oracles import dplr_delta_rule_loop

F64 = torch.float64


def _draw(
    gen: torch.Generator, *, batch: int, length: int, states: int | None, hk: int = 2,
    hv: int = 4, dk: int = 5, dv: int = 3, gate: str = "head", strength: float = 2.0,
    scale: float | None = None,
) -> dict:  # fmt: skip
    """A float64 problem in RWKV-7's form: a = -kk, b = kk * rate (kk of unit length,
    rate in [0, 1]), log decays in [-strength, 0]; ``states``: the rows of the initial
    state (batch by default)."""

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=F64)

    def unit(*shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=gen, dtype=F64)

    kk = F.normalize(rand(batch, length, hk, dk), dim=-1)
    gates = {
        "none": None,
        "head": -strength * unit(batch, length, hv),
        "channel": -strength * unit(batch, length, hv, dk),
    }
    p = {
        "q": rand(batch, length, hk, dk),
        "k": rand(batch, length, hk, dk) / dk**0.5,
        "v": rand(batch, length, hv, dv),
        "a": -kk,
        "b": kk * unit(batch, length, hk, dk),
        "g": gates[gate],
        "initial": rand(batch if states is None else states, hv, dk, dv),
    }
    if scale is not None:
        p["scale"] = scale
    return p


DPLR = ScanSpec(
    name="dplr_delta_rule_scan",
    function=ps.dplr_delta_rule_scan,
    oracle=dplr_delta_rule_loop,
    draw=_draw,
    positional=("q", "k", "v", "a", "b"),
    timed=along(1, "q", "k", "v", "a", "b", "g"),
    optional=("g", "initial"),
    checkpoints={b: CHECKPOINT_STEPS[b] for b in dplr_ops.ROW.backends},
    backends=tuple(dplr_ops.ROW.backends),
    blocks=(BLOCK,),  # the torch backend's blocks
    forms={"none": {"gate": "none"}, "head": {"gate": "head"}, "channel": {"gate": "channel"}},
    optional_forms=("head", "channel"),
    tiny={"hk": 1, "hv": 2, "dk": 3, "dv": 2},
    vmapped=("v", "b"),
    overrides={"dtypes": {"length": 40}, "gradients": {"length": 100}},
)
TestShared = shared_tests(DPLR)

BACKENDS = list(dplr_ops.ROW.backends)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("dk", "dv"), [(1, 1), (3, 65), (65, 3), (129, 1)])
def test_awkward_widths_and_grouped_heads(backend: str, dk: int, dv: int) -> None:
    gen = torch.Generator().manual_seed(dk * 1000 + dv)
    p = _draw(gen, batch=1, length=37, states=None, hk=1, hv=2, dk=dk, dv=dv, gate="channel")
    want, want_final = dplr_delta_rule_loop(**p)
    f32 = {n: t.float() for n, t in p.items() if n not in ("q", "k", "v", "a", "b")}
    got, final = ps.dplr_delta_rule_scan(
        *(p[n].float() for n in ("q", "k", "v", "a", "b")), **f32, return_final=True,
        backend=backend,
    )  # fmt: skip
    assert_matches(got, want, torch.float32)
    assert_matches(final, want_final, torch.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gate", ["head", "channel"])
def test_the_delta_rule_is_a_special_case(backend: str, gate: str) -> None:
    """b = k, a = -beta exp(g) k and beta k for the key: ps.delta_rule_scan's result."""
    gen = torch.Generator().manual_seed(7)
    p = _draw(gen, batch=2, length=90, states=None, hk=2, hv=2, gate=gate)
    key = F.normalize(p["k"], dim=-1)
    beta = torch.rand(2, 90, 2, generator=gen, dtype=F64)
    decay = torch.exp(p["g"]) if gate == "channel" else torch.exp(p["g"])[..., None]
    got = ps.dplr_delta_rule_scan(
        p["q"], beta[..., None] * key, p["v"], -beta[..., None] * decay * key, key, g=p["g"],
        initial=p["initial"], backend=backend,
    )  # fmt: skip
    want = ps.delta_rule_scan(p["q"], key, p["v"], beta, g=p["g"], initial=p["initial"])
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def _valid() -> dict:
    return _draw(torch.Generator().manual_seed(0), batch=1, length=6, states=None)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"a": torch.zeros(1, 6, 2)},
            r"expected a of shape \(batch, L, Hk, K\) like q = \(1, 6, 2, 5\)",
        ),
        (
            {"b": torch.zeros(1, 6, 4, 5)},
            r"expected b of shape \(batch, L, Hk, K\) like q = \(1, 6, 2, 5\)",
        ),
        ({"v": torch.zeros(1, 6, 3, 3)}, r"positive multiple of q and k's Hk = 2"),
        ({"g": torch.zeros(1, 6, 4, 4)}, r"expected g of shape \(batch, L, Hv\)"),
        ({"initial": torch.zeros(2, 4, 5, 3)}, r"expected initial of shape"),
        ({"a": [[0.0]]}, r"expected a to be a Tensor, but got list"),
        ({"scale": "1"}, r"expected scale to be a finite number"),
        ({"backend": "triton"}, r"backend 'triton' is not"),
    ],
)
def test_bad_input_raises_before_any_kernel(change: dict, message: str) -> None:
    p = {**_valid(), **change}
    q, k, v, a, b = (p.pop(n) for n in ("q", "k", "v", "a", "b"))
    with pytest.raises((ValueError, TypeError, RuntimeError), match=message) as error:
        ps.dplr_delta_rule_scan(q, k, v, a, b, **p)
    assert str(error.value).startswith("parascan.dplr_delta_rule_scan: ")
