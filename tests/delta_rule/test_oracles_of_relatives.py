"""The float64 loops of the delta rule's relatives (oracles.linear_attention_loop and
oracles.dplr_delta_rule_loop), written ahead of their scans, against what they must
equal: linear attention against its closed form (a causally masked product, with
decays per head or per channel), and the diagonal-plus-low-rank delta rule against
linear attention (no low-rank part) and against oracles.delta_rule_loop (b = k^,
a = -beta exp(g) k^, k = beta k^); grouped heads, initial states and packed
sequences included."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from oracles import delta_rule_loop, dplr_delta_rule_loop, linear_attention_loop

F64 = torch.float64
CU = [0, 3, 3, 8, 13]  # packed: an empty sequence among four


def _rand(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=F64)


def _problem(gen: torch.Generator, gate: str, batch: int = 2, length: int = 13) -> dict:
    """q, k (batch, L, 1, 3), v (batch, L, 2, 2): two value heads reading one key head;
    g none, per head or per channel; an initial state per batch row."""
    hk, hv, dk, dv = 1, 2, 3, 2
    g = {
        "none": None,
        "head": -torch.rand(batch, length, hv, generator=gen, dtype=F64),
        "channel": -torch.rand(batch, length, hv, dk, generator=gen, dtype=F64),
    }[gate]
    return {
        "q": _rand(gen, batch, length, hk, dk),
        "k": torch.nn.functional.normalize(_rand(gen, batch, length, hk, dk), dim=-1),
        "v": _rand(gen, batch, length, hv, dv),
        "g": g,
        "initial": _rand(gen, batch, hv, dk, dv),
    }


def _closed_form(p: dict, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Linear attention without a loop: o[t] = scale (sum_{s <= t} (q[t] * w[t, s] .
    k[s]) v[s] + (q[t] * exp(G[t])) S0) and S = sum_s (exp(G[-1] - G[s]) * k[s]) v[s]^T
    + exp(G[-1]) S0, with G the running sum of the log decays per channel."""
    q, k, v, initial = p["q"], p["k"], p["v"], p["initial"]
    batch, length, hv, dk = v.shape[0], v.shape[1], v.shape[2], q.shape[3]
    g = p["g"]
    if g is None:
        g = torch.zeros(batch, length, hv, dk, dtype=F64)
    elif g.dim() == 3:
        g = g[..., None].expand(batch, length, hv, dk)
    q = q.repeat_interleave(hv // q.shape[2], dim=2)
    k = k.repeat_interleave(hv // k.shape[2], dim=2)
    total = g.cumsum(1)  # (batch, L, Hv, K)
    causal = torch.ones(length, length, dtype=torch.bool).tril()[None, :, :, None, None]
    weights = torch.where(causal, (total[:, :, None] - total[:, None, :]).exp(), 0.0)
    o = torch.einsum("bthi,btshi,bshi,bshv->bthv", q, weights, k, v)
    o = o + torch.einsum("bthi,bhiv->bthv", q * total.exp(), initial)
    last = total[:, -1:]
    final = torch.einsum("bshi,bshv->bhiv", (last - total).exp() * k, v)
    final = final + last[:, 0, :, :, None].exp() * initial
    return scale * o, final


@pytest.mark.parametrize("gate", ["none", "head", "channel"])
def test_linear_attention_is_its_closed_form(gate):
    gen = torch.Generator().manual_seed(1)
    p = _problem(gen, gate)
    want_o, want_final = _closed_form(p, 0.7)
    o, final = linear_attention_loop(**p, scale=0.7)
    torch.testing.assert_close(o, want_o)
    torch.testing.assert_close(final, want_final)
    # the default scale is K^-1/2, and no initial state is a zero one
    o, final = linear_attention_loop(**{**p, "initial": None})
    want_o, want_final = _closed_form({**p, "initial": torch.zeros_like(p["initial"])}, 3**-0.5)
    torch.testing.assert_close(o, want_o)
    torch.testing.assert_close(final, want_final)


@pytest.mark.parametrize("loop", [linear_attention_loop, delta_rule_loop, dplr_delta_rule_loop])
def test_packed_sequences_are_each_scanned_alone(loop):
    """cu_seqlens restarts the state at each offset from that sequence's initial row;
    an empty sequence's final state is its initial one."""
    gen = torch.Generator().manual_seed(2)
    p = _problem(gen, "channel", batch=1, length=CU[-1])
    p["initial"] = _rand(gen, len(CU) - 1, 2, 3, 2)
    extra = {
        linear_attention_loop: {},
        delta_rule_loop: {"beta": torch.rand(1, CU[-1], 2, generator=gen, dtype=F64)},
        dplr_delta_rule_loop: {
            "a": -_rand(gen, 1, CU[-1], 2, 3) / 4,
            "b": _rand(gen, 1, CU[-1], 1, 3) / 4,
        },
    }[loop]
    o, final = loop(**p, **extra, cu_seqlens=CU)
    assert final.shape == (len(CU) - 1, 2, 3, 2)
    for s, (lo, hi) in enumerate(pairwise(CU)):
        alone = {k: v[:, lo:hi] for k, v in {**p, **extra}.items() if k != "initial"}
        want_o, want_final = loop(**alone, initial=p["initial"][s : s + 1])
        torch.testing.assert_close(o[:, lo:hi], want_o)
        torch.testing.assert_close(final[s : s + 1], want_final)


@pytest.mark.parametrize("gate", ["none", "head", "channel"])
@pytest.mark.parametrize("packed", [False, True])
def test_dplr_with_the_delta_rules_low_rank_part_is_the_delta_rule(gate, packed):
    """b = k^, a = -beta exp(g) * k^ and k = beta k^: (Diag(exp(g)) + b a^T) S + k v^T
    = (I - beta k^ k^T) Diag(exp(g)) S + beta k^ v^T, the delta rule's step. beta is
    per value head, so a and k have the value heads; q and b keep the key head."""
    gen = torch.Generator().manual_seed(3)
    p = _problem(gen, gate, batch=1 if packed else 2)
    cu = CU if packed else None
    if packed:
        p["initial"] = _rand(gen, len(CU) - 1, 2, 3, 2)
    beta = 2 * torch.rand(p["v"].shape[:3], generator=gen, dtype=F64)
    key = p["k"].expand(-1, -1, 2, -1)  # k^ as each value head reads it
    decay = torch.ones(()) if p["g"] is None else p["g"].exp()
    decay = decay[..., None] if decay.dim() == 3 else decay
    want = delta_rule_loop(p["q"], p["k"], p["v"], beta, p["g"], 0.6, initial=p["initial"],
                           cu_seqlens=cu)  # fmt: skip
    got = dplr_delta_rule_loop(
        p["q"], beta[..., None] * key, p["v"], -beta[..., None] * decay * key, p["k"], p["g"],
        0.6, p["initial"], cu,
    )  # fmt: skip
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


@pytest.mark.parametrize("gate", ["none", "head", "channel"])
def test_dplr_without_its_low_rank_part_is_linear_attention(gate):
    gen = torch.Generator().manual_seed(4)
    p = _problem(gen, gate)
    zero = torch.zeros_like(p["q"])
    got = dplr_delta_rule_loop(p["q"], p["k"], p["v"], zero, zero, p["g"], None, p["initial"])
    want = linear_attention_loop(**p)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)


def test_empty_sequences_and_gradients():
    """L = 0 gives no outputs and the initial state; the loops are differentiable
    (they are the gradient oracles of their scans)."""
    gen = torch.Generator().manual_seed(5)
    p = _problem(gen, "channel", length=0)
    for loop, extra in ((linear_attention_loop, {}),
                        (dplr_delta_rule_loop, {"a": p["q"], "b": p["k"]})):  # fmt: skip
        o, final = loop(**p, **extra)
        assert o.shape == (2, 0, 2, 2)
        torch.testing.assert_close(final, p["initial"])
    p = _problem(gen, "channel", length=4)
    leaves = {k: v.requires_grad_() for k, v in p.items()}
    o, final = dplr_delta_rule_loop(**p, a=p["q"] / 4, b=p["k"] / 4)
    grads = torch.autograd.grad(o.sum() + final.sum(), list(leaves.values()))
    assert all(g.isfinite().all() and g.abs().sum() > 0 for g in grads)
