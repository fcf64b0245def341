"""parascan.compat.fla's delta-rule drop-ins (chunk_delta_rule, fused_recurrent_delta_rule,
chunk_gated_delta_rule, fused_recurrent_gated_delta_rule, chunk_kda, fused_recurrent_kda)
against a float64 loop written here from flash-linear-attention's kernels (its
fused_recurrent kernels, one step at a time, per sequence and value head):

    q, k = q / sqrt(sum(q^2) + 1e-6), ...     with use_qk_l2norm_in_kernel
    S *= exp(g); S *= exp(gk)[:, None]; S *= exp(gv)[None, :]
    u = beta * (v - S^T k);  S += outer(k, u);  o = S^T (scale * q)

with value head hv reading q/k head hv // (HV // H), states (N, HV, K, V), and the
in-kernel gates and beta written out from fla's gate references (naive_gdn_gate,
naive_kda_gate, naive_kda_lowerbound_gate, fused_beta_sigmoid)."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

from parascan.compat.fla import (
    chunk_delta_rule,
    chunk_gated_delta_rule,
    chunk_kda,
    fused_recurrent_delta_rule,
    fused_recurrent_gated_delta_rule,
    fused_recurrent_kda,
)

from conftest import assert_matches

F64 = torch.float64


# --- the reference ------------------------------------------------------------------


def fla_loop(  # type: ignore[no-untyped-def]
    q, k, v, beta, g=None, gk=None, gv=None, scale=None, h0=None, cu=None, l2norm=False,
    chunk=None,
):  # fmt: skip
    """fla's recurrence in float64, one step at a time. beta (B, T, HV) or (B, T, HV, V);
    g (B, T, HV), gk (B, T, HV, K), gv (B, T, HV, V) log decays; h0 (N, HV, K, V).
    Returns (o, final (N, HV, K, V)), and with ``chunk`` also the states entering each
    chunk of ``chunk`` steps of each sequence, stacked as (B or 1, NT, HV, K, V)."""
    q, k, v, beta = q.to(F64), k.to(F64), v.to(F64), beta.to(F64)
    batch, steps, heads, dk = q.shape
    value_heads, dv = v.shape[2], v.shape[3]
    group = value_heads // heads
    scale = dk**-0.5 if scale is None else scale
    runs = (
        [(b, b, 0, steps) for b in range(batch)]
        if cu is None
        else [(0, n, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    )
    o = torch.zeros(batch, steps, value_heads, dv, dtype=F64)
    finals = []
    entering: dict[tuple[int, int], list[torch.Tensor]] = {}
    for b, n, lo, hi in runs:
        per_head = []
        for hv in range(value_heads):
            h = hv // group
            s = torch.zeros(dk, dv, dtype=F64) if h0 is None else h0[n, hv].to(F64)
            for t in range(lo, hi):
                if chunk is not None and (t - lo) % chunk == 0:
                    entering.setdefault((n, (t - lo) // chunk), []).append(s)
                qt, kt = q[b, t, h], k[b, t, h]
                if l2norm:
                    qt = qt / torch.sqrt((qt * qt).sum() + 1e-6)
                    kt = kt / torch.sqrt((kt * kt).sum() + 1e-6)
                if g is not None:
                    s = s * torch.exp(g[b, t, hv].to(F64))
                if gk is not None:
                    s = s * torch.exp(gk[b, t, hv].to(F64))[:, None]
                if gv is not None:
                    s = s * torch.exp(gv[b, t, hv].to(F64))[None, :]
                u = beta[b, t, hv] * (v[b, t, hv] - kt @ s)
                s = s + torch.outer(kt, u)
                o[b, t, hv] = s.T @ (qt * scale)
            per_head.append(s)
        finals.append(torch.stack(per_head))
    final = torch.stack(finals)
    if chunk is None:
        return o, final
    if cu is None:  # (B, NT, ...): every row has the same chunks
        nt = -(-steps // chunk)
        h = torch.stack([
            torch.stack([torch.stack(entering[b, c]) for c in range(nt)])
            for b in range(batch)
        ]) if nt else torch.zeros(batch, 0, value_heads, dk, dv, dtype=F64)  # fmt: skip
    else:  # (1, NT over all sequences, ...)
        keys = sorted(entering)
        h = torch.stack([torch.stack(entering[key]) for key in keys]).unsqueeze(0)
    return o, final, h


def softplus(x: torch.Tensor) -> torch.Tensor:
    """fla's softplus: x above 20, log(1 + exp(x)) below."""
    return torch.where(x > 20, x, torch.log1p(torch.exp(torch.clamp(x, max=20))))


def gdn_gate(g, a_log, dt_bias):  # type: ignore[no-untyped-def]
    x = g.to(F64) + (0 if dt_bias is None else dt_bias.to(F64))
    return -torch.exp(a_log.to(F64)) * softplus(x)


def kda_gate(g, a_log, dt_bias, lower_bound=None):  # type: ignore[no-untyped-def]
    heads, dk = g.shape[-2:]
    x = g.to(F64) + (0 if dt_bias is None else dt_bias.to(F64).view(heads, dk))
    if lower_bound is None:
        return -torch.exp(a_log.to(F64)).view(heads, 1) * softplus(x)
    if a_log is not None:
        x = torch.exp(a_log.to(F64)).view(heads, 1) * x
    return lower_bound * torch.sigmoid(x)


# --- inputs ---------------------------------------------------------------------------


def inputs(  # type: ignore[no-untyped-def]
    seed, batch=2, steps=12, heads=2, group=2, dk=3, dv=4, dtype=F64, cu=None, v_dtype=None
):
    """q, k (B, T, H, K), v (B, T, HV, V), beta (B, T, HV) in (0, 1), a per-head log
    decay (B, T, HV) and a per-key one (B, T, HV, K) in [-1, 0), an initial state
    (N, HV, K, V); k unit-norm (stable without the in-kernel l2norm)."""
    gen = torch.Generator().manual_seed(seed)
    hv = heads * group
    n = batch if cu is None else len(cu) - 1

    def r(*shape):  # type: ignore[no-untyped-def]
        return torch.randn(*shape, generator=gen, dtype=F64)

    def u(*shape):  # type: ignore[no-untyped-def]
        return torch.rand(*shape, generator=gen, dtype=F64)

    k = r(batch, steps, heads, dk)
    k = k / k.norm(dim=-1, keepdim=True)
    return {
        "q": r(batch, steps, heads, dk).to(dtype),
        "k": k.to(dtype),
        "v": r(batch, steps, hv, dv).to(v_dtype or dtype),
        "beta": u(batch, steps, hv).to(dtype),
        "g": -u(batch, steps, hv).to(dtype),
        "gk": -u(batch, steps, hv, dk).to(dtype),
        "h0": r(n, hv, dk, dv).to(dtype),
    }


def call(fn, x, *, h0=None, **options):  # type: ignore[no-untyped-def]
    """fn on inputs ``x`` by fla's positional conventions; the reference's decay kwargs."""
    q, k, v, beta = x["q"], x["k"], x["v"], x["beta"]
    if fn in (chunk_delta_rule, fused_recurrent_delta_rule):
        return fn(q, k, v, beta, initial_state=h0, **options), {}
    if fn is chunk_gated_delta_rule:
        return fn(q, k, v, x["g"], beta, initial_state=h0, **options), {"g": x["g"]}
    if fn is fused_recurrent_gated_delta_rule:  # gk, gv sit between g and beta
        return fn(q, k, v, x["g"], beta=beta, initial_state=h0, **options), {"g": x["g"]}
    return fn(q, k, v, x["gk"], beta, initial_state=h0, **options), {"gk": x["gk"]}


DELTA = [chunk_delta_rule, fused_recurrent_delta_rule]
GATED = [chunk_gated_delta_rule, fused_recurrent_gated_delta_rule]
KDA = [chunk_kda, fused_recurrent_kda]
FUNCTIONS = DELTA + GATED + KDA
# all but chunk_delta_rule, whose original asserts q, k and v of one dtype (as the drop-in)
MIXED_DTYPES = FUNCTIONS[1:]
Q_DTYPE = {chunk_delta_rule, fused_recurrent_delta_rule, chunk_gated_delta_rule, chunk_kda}


def name(fn) -> str:  # type: ignore[no-untyped-def]
    return f"parascan.compat.fla.{fn.__name__}"


# --- signatures -------------------------------------------------------------------------

# flash-linear-attention 0.6.0 (fla-core): fla/ops/delta_rule/chunk.py,
# fla/ops/delta_rule/fused_recurrent.py, fla/ops/gated_delta_rule/chunk.py,
# fla/ops/gated_delta_rule/fused_recurrent.py, fla/ops/kda/chunk.py,
# fla/ops/kda/fused_recurrent.py
FLA_SIGNATURES = {
    chunk_delta_rule: [
        ("q", None), ("k", None), ("v", None), ("beta", None), ("scale", None),
        ("initial_state", None), ("output_final_state", False),
        ("use_qk_l2norm_in_kernel", False), ("cu_seqlens", None), ("cu_seqlens_cpu", None),
        ("kwargs", "**"),
    ],
    fused_recurrent_delta_rule: [
        ("q", None), ("k", None), ("v", None), ("beta", None), ("scale", None),
        ("initial_state", None), ("output_final_state", False),
        ("use_qk_l2norm_in_kernel", False), ("cu_seqlens", None),
    ],
    chunk_gated_delta_rule: [
        ("q", None), ("k", None), ("v", None), ("g", None), ("beta", None), ("scale", None),
        ("initial_state", None), ("output_final_state", False),
        ("use_qk_l2norm_in_kernel", False), ("use_beta_sigmoid_in_kernel", False),
        ("allow_neg_eigval", False), ("state_v_first", False), ("cu_seqlens", None),
        ("cu_seqlens_cpu", None), ("chunk_indices", None), ("cp_context", None),
        ("kwargs", "**"),
    ],
    fused_recurrent_gated_delta_rule: [
        ("q", None), ("k", None), ("v", None), ("g", None), ("gk", None), ("gv", None),
        ("beta", None), ("scale", None), ("initial_state", None),
        ("output_final_state", False), ("use_qk_l2norm_in_kernel", False),
        ("use_gate_in_kernel", False), ("A_log", None), ("dt_bias", None),
        ("use_beta_sigmoid_in_kernel", False), ("allow_neg_eigval", False),
        ("state_v_first", False), ("cu_seqlens", None), ("kwargs", "**"),
    ],
    chunk_kda: [
        ("q", None), ("k", None), ("v", None), ("g", None), ("beta", None), ("scale", None),
        ("initial_state", None), ("output_final_state", False),
        ("use_qk_l2norm_in_kernel", False), ("use_gate_in_kernel", False),
        ("use_beta_sigmoid_in_kernel", False), ("allow_neg_eigval", False),
        ("safe_gate", False), ("lower_bound", None), ("disable_recompute", False),
        ("return_intermediate_states", False), ("state_v_first", False),
        ("cu_seqlens", None), ("cu_seqlens_cpu", None), ("cp_context", None),
        ("use_graph", False), ("max_num_seqs", None), ("kwargs", "**"),
    ],
    fused_recurrent_kda: [
        ("q", None), ("k", None), ("v", None), ("g", None), ("beta", None), ("A_log", None),
        ("dt_bias", None), ("scale", None), ("initial_state", None),
        ("output_final_state", False), ("use_qk_l2norm_in_kernel", False),
        ("use_gate_in_kernel", False), ("use_beta_sigmoid_in_kernel", False),
        ("allow_neg_eigval", False), ("lower_bound", None), ("state_v_first", False),
        ("cu_seqlens", None), ("kwargs", "**"),
    ],
}  # fmt: skip
# parameters with no default in fla
REQUIRED = {"q", "k", "v", "g", "beta"}
OPTIONAL_G = {fused_recurrent_gated_delta_rule}  # g=None there, and beta=None in two
OPTIONAL_BETA = {fused_recurrent_delta_rule, fused_recurrent_gated_delta_rule}


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__name__)
def test_signature_is_fla_s(fn) -> None:
    params = list(inspect.signature(fn).parameters.values())
    assert [p.name for p in params] == [n for n, _ in FLA_SIGNATURES[fn]]
    for p, (pname, default) in zip(params, FLA_SIGNATURES[fn], strict=True):
        if default == "**":
            assert p.kind is inspect.Parameter.VAR_KEYWORD
            continue
        assert p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
        optional = (pname == "g" and fn in OPTIONAL_G) or (pname == "beta" and fn in OPTIONAL_BETA)
        if pname in REQUIRED and not optional:
            assert p.default is inspect.Parameter.empty, pname
        else:
            assert p.default is default, pname


# --- results ----------------------------------------------------------------------------


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, F64])
@pytest.mark.parametrize("cu", [None, [0, 5, 5, 12]], ids=["batch", "packed"])
def test_matches_fla_s_recurrence(fn, dtype, cu) -> None:
    group = 1 if fn in DELTA else 2  # fla's delta rule has no grouped value heads
    x = inputs(3, batch=2 if cu is None else 1, group=group, dtype=dtype, cu=cu)
    cu_t = None if cu is None else torch.tensor(cu)
    for h0 in (None, x["h0"]):
        for l2norm, scale in ((False, None), (True, 0.7)):
            (o, final), decay = call(
                fn, x, h0=h0, output_final_state=True, use_qk_l2norm_in_kernel=l2norm,
                scale=scale, cu_seqlens=cu_t,
            )  # fmt: skip
            want, want_final = fla_loop(
                x["q"], x["k"], x["v"], x["beta"], **decay, scale=scale, h0=h0, cu=cu,
                l2norm=l2norm,
            )  # fmt: skip
            assert o.dtype == dtype and o.shape == x["v"].shape
            assert final.dtype == (F64 if dtype == F64 else torch.float32)
            assert final.shape == x["h0"].shape and final.is_contiguous()
            assert_matches(o, want, dtype)
            assert_matches(final, want_final, dtype)
            if cu is not None:  # the empty sequence keeps its initial state
                empty = torch.zeros_like(final[1]) if h0 is None else h0[1]
                assert torch.equal(final[1], empty.to(final.dtype))
    (o, none), _ = call(fn, x, cu_seqlens=cu_t)
    assert none is None and o.shape == x["v"].shape


@pytest.mark.parametrize("fn", MIXED_DTYPES, ids=lambda f: f.__name__)
def test_output_dtype_is_q_s_or_v_s_as_in_fla(fn) -> None:
    x = inputs(4, dtype=torch.bfloat16, v_dtype=torch.float32)
    (o, final), decay = call(fn, x, h0=x["h0"].float(), output_final_state=True)
    assert o.dtype == (torch.bfloat16 if fn in Q_DTYPE else torch.float32)
    assert final.dtype == torch.float32
    want, want_final = fla_loop(x["q"], x["k"], x["v"], x["beta"], **decay, h0=x["h0"])
    assert_matches(o, want, torch.bfloat16)
    assert_matches(final, want_final, torch.bfloat16)


@pytest.mark.parametrize("fn", DELTA, ids=lambda f: f.__name__)
def test_delta_rule_takes_grouped_value_heads_too(fn) -> None:
    x = inputs(5, group=3)
    (o, final), _ = call(fn, x, h0=x["h0"], output_final_state=True)
    want, want_final = fla_loop(x["q"], x["k"], x["v"], x["beta"], h0=x["h0"])
    assert_matches(o, want, F64)
    assert_matches(final, want_final, F64)


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__name__)
def test_empty_sequence_and_batch(fn) -> None:
    x = inputs(6, steps=0)
    (o, final), _ = call(fn, x, h0=x["h0"], output_final_state=True)
    assert o.shape == x["v"].shape and torch.equal(final, x["h0"])
    x = inputs(6, batch=1, steps=4, cu=[0, 0, 4, 4])
    (o, final), decay = call(
        fn, x, h0=x["h0"], output_final_state=True, cu_seqlens=torch.tensor([0, 0, 4, 4])
    )
    want, want_final = fla_loop(x["q"], x["k"], x["v"], x["beta"], **decay, h0=x["h0"],
                                cu=[0, 0, 4, 4])  # fmt: skip
    assert_matches(o, want, F64)
    assert_matches(final, want_final, F64)


# --- in-kernel gates and beta -----------------------------------------------------------


@pytest.mark.parametrize("fn", GATED, ids=lambda f: f.__name__)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("cu", [None, [0, 7, 7, 12]], ids=["batch", "packed"])
def test_gated_delta_rule_gate_in_kernel(fn, bias, cu) -> None:
    x = inputs(7, batch=2 if cu is None else 1, cu=cu)
    gen = torch.Generator().manual_seed(8)
    raw = 3 * torch.randn(x["g"].shape, generator=gen, dtype=F64)
    raw[..., 0, 0] = 25.0  # softplus is linear above 20
    a_log = torch.randn(4, generator=gen, dtype=F64) * 0.5
    dt_bias = torch.randn(4, generator=gen, dtype=F64) if bias else None
    cu_t = None if cu is None else torch.tensor(cu)
    x = {**x, "g": raw}
    (o, final), _ = call(
        fn, x, h0=x["h0"], output_final_state=True, use_gate_in_kernel=True, A_log=a_log,
        dt_bias=dt_bias, cu_seqlens=cu_t,
    )  # fmt: skip
    want, want_final = fla_loop(x["q"], x["k"], x["v"], x["beta"], g=gdn_gate(raw, a_log, dt_bias),
                                h0=x["h0"], cu=cu)  # fmt: skip
    assert_matches(o, want, F64)
    assert_matches(final, want_final, F64)
    # without use_gate_in_kernel the fused recurrent original ignores A_log and dt_bias
    if fn is fused_recurrent_gated_delta_rule:
        (o, _), _ = call(fn, x, A_log=a_log, dt_bias=dt_bias, cu_seqlens=cu_t)
        want, _ = fla_loop(x["q"], x["k"], x["v"], x["beta"], g=raw, cu=cu)
        assert_matches(o, want, F64)


@pytest.mark.parametrize("fn", GATED + KDA, ids=lambda f: f.__name__)
@pytest.mark.parametrize("neg", [False, True])
def test_beta_sigmoid_in_kernel(fn, neg) -> None:
    x = inputs(9)
    logits = 2 * torch.randn(x["beta"].shape, generator=torch.Generator().manual_seed(1),
                             dtype=F64)  # fmt: skip
    (o, final), decay = call(
        fn, {**x, "beta": logits}, h0=x["h0"], output_final_state=True,
        use_beta_sigmoid_in_kernel=True, allow_neg_eigval=neg,
    )  # fmt: skip
    beta = torch.sigmoid(logits) * (2 if neg else 1)
    want, want_final = fla_loop(x["q"], x["k"], x["v"], beta, **decay, h0=x["h0"])
    assert_matches(o, want, F64)
    assert_matches(final, want_final, F64)


@pytest.mark.parametrize("fn", KDA, ids=lambda f: f.__name__)
@pytest.mark.parametrize(
    "a_log, bias, lower_bound",
    [(True, True, None), (True, False, None), (True, True, -5.0), (False, True, -2.5),
     (False, False, -1.0)],
)  # fmt: skip
def test_kda_gate_in_kernel(fn, a_log, bias, lower_bound) -> None:
    x = inputs(10)
    gen = torch.Generator().manual_seed(11)
    raw = 2 * torch.randn(x["gk"].shape, generator=gen, dtype=F64)
    a = torch.randn(4, generator=gen, dtype=F64) * 0.5 if a_log else None
    dt_bias = torch.randn(4 * 3, generator=gen, dtype=F64) if bias else None
    options = {"use_gate_in_kernel": True, "A_log": a, "dt_bias": dt_bias,
               "lower_bound": lower_bound}  # fmt: skip
    if fn is chunk_kda and lower_bound is not None:
        options["safe_gate"] = True  # with lower_bound in [-5, 0): the same results
    (o, final), _ = call(fn, {**x, "gk": raw}, h0=x["h0"], output_final_state=True, **options)
    want, want_final = fla_loop(
        x["q"], x["k"], x["v"], x["beta"], gk=kda_gate(raw, a, dt_bias, lower_bound),
        h0=x["h0"],
    )  # fmt: skip
    assert_matches(o, want, F64)
    assert_matches(final, want_final, F64)
    # without use_gate_in_kernel: g is the log decay; A_log, dt_bias, lower_bound unused
    del options["use_gate_in_kernel"]
    (o, _), _ = call(fn, {**x, "gk": x["gk"]}, **options)
    want, _ = fla_loop(x["q"], x["k"], x["v"], x["beta"], gk=x["gk"])
    assert_matches(o, want, F64)


def test_kda_a_log_and_dt_bias_shapes() -> None:
    """A_log is read as HV numbers and dt_bias as HV * K, whatever their shape (Kimi
    Linear's A_log is (1, 1, HV, 1))."""
    x = inputs(12)
    gen = torch.Generator().manual_seed(13)
    raw = torch.randn(x["gk"].shape, generator=gen, dtype=F64)
    a = torch.randn(1, 1, 4, 1, generator=gen, dtype=F64)
    dt_bias = torch.randn(4, 3, generator=gen, dtype=F64)
    want, _ = fla_loop(x["q"], x["k"], x["v"], x["beta"], gk=kda_gate(raw, a.flatten(), dt_bias))
    for fn in KDA:
        (o, _), _ = call(fn, {**x, "gk": raw}, use_gate_in_kernel=True, A_log=a, dt_bias=dt_bias)
        assert_matches(o, want, F64)


# --- per value channel: beta (B, T, HV, V), gk and gv --------------------------------


@pytest.mark.parametrize("cu", [None, [0, 3, 3, 12]], ids=["batch", "packed"])
@pytest.mark.parametrize("v_first", [False, True])
def test_per_channel_beta_and_decays(cu, v_first) -> None:
    x = inputs(14, batch=2 if cu is None else 1, cu=cu)
    gen = torch.Generator().manual_seed(15)
    beta = torch.rand(x["v"].shape, generator=gen, dtype=F64)
    gv = -torch.rand(x["v"].shape, generator=gen, dtype=F64)
    cu_t = None if cu is None else torch.tensor(cu)
    h0 = x["h0"]
    given = h0.transpose(-1, -2).contiguous() if v_first else h0

    def check(out, **decay):  # type: ignore[no-untyped-def]
        o, final = out
        want, want_final = fla_loop(x["q"], x["k"], x["v"], beta, **decay, h0=h0, cu=cu)
        assert_matches(o, want, F64)
        assert_matches(final.transpose(-1, -2) if v_first else final, want_final, F64)

    q, k, v, g, gk = x["q"], x["k"], x["v"], x["g"], x["gk"]
    common = {"initial_state": given, "output_final_state": True, "cu_seqlens": cu_t}
    for decays in ({}, {"g": g}, {"gk": gk}, {"gv": gv}, {"g": g, "gk": gk, "gv": gv},
                   {"gk": gk, "gv": gv}, {"g": g, "gv": gv}):  # fmt: skip
        out = fused_recurrent_gated_delta_rule(
            q, k, v, **decays, beta=beta, state_v_first=v_first, **common
        )
        check(out, **decays)
        if decays:  # gk and gv with a per-head beta too
            out = fused_recurrent_gated_delta_rule(
                q, k, v, **decays, beta=x["beta"], state_v_first=v_first, **common
            )
            o, final = out
            want, want_final = fla_loop(q, k, v, x["beta"], **decays, h0=h0, cu=cu)
            assert_matches(o, want, F64)
            assert_matches(final.transpose(-1, -2) if v_first else final, want_final, F64)
    check(fused_recurrent_kda(q, k, v, gk, beta, state_v_first=v_first, **common), gk=gk)
    if not v_first:  # the delta rule has no state_v_first
        x1 = inputs(16, batch=2 if cu is None else 1, cu=cu, group=1)
        beta1 = torch.rand(x1["v"].shape, generator=gen, dtype=F64)
        o, final = fused_recurrent_delta_rule(
            x1["q"], x1["k"], x1["v"], beta1, initial_state=x1["h0"], output_final_state=True,
            cu_seqlens=cu_t,
        )  # fmt: skip
        want, want_final = fla_loop(x1["q"], x1["k"], x1["v"], beta1, h0=x1["h0"], cu=cu)
        assert_matches(o, want, F64)
        assert_matches(final, want_final, F64)


def test_beta_defaults_to_ones() -> None:
    x = inputs(17, group=1)
    want, _ = fla_loop(x["q"], x["k"], x["v"], torch.ones_like(x["beta"]))
    assert_matches(fused_recurrent_delta_rule(x["q"], x["k"], x["v"])[0], want, F64)
    x = inputs(17)
    ones = torch.ones_like(x["beta"])
    want, _ = fla_loop(x["q"], x["k"], x["v"], ones, g=x["g"])
    o, _ = fused_recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"])
    assert_matches(o, want, F64)
    # fla: beta = ones, then the in-kernel sigmoid
    want, _ = fla_loop(x["q"], x["k"], x["v"], torch.sigmoid(ones), g=x["g"])
    o, _ = fused_recurrent_gated_delta_rule(
        x["q"], x["k"], x["v"], x["g"], use_beta_sigmoid_in_kernel=True
    )
    assert_matches(o, want, F64)


# --- the state layout -----------------------------------------------------------------


@pytest.mark.parametrize("fn", GATED + KDA, ids=lambda f: f.__name__)
def test_state_v_first_and_transpose_state_layout(fn) -> None:
    x = inputs(18)
    h0 = x["h0"]
    want, want_final = fla_loop(x["q"], x["k"], x["v"], x["beta"],
                                **call(fn, x)[1], h0=h0)  # fmt: skip
    h0_vk = h0.transpose(-1, -2).contiguous()
    (o, final), _ = call(fn, x, h0=h0_vk, output_final_state=True, state_v_first=True)
    assert final.shape == h0_vk.shape and final.is_contiguous()
    assert_matches(o, want, F64)
    assert_matches(final, want_final.transpose(-1, -2), F64)
    with pytest.warns(DeprecationWarning, match="transpose_state_layout is deprecated"):
        (o2, final2), _ = call(fn, x, h0=h0_vk, output_final_state=True,
                               transpose_state_layout=True)  # fmt: skip
    assert torch.equal(o2, o) and torch.equal(final2, final)
    with pytest.raises(ValueError, match=f"{name(fn)}: expected state_v_first or the"):
        call(fn, x, state_v_first=True, transpose_state_layout=True)
    shape = r"expected initial_state of shape \(N, HV, V, K\)"
    with pytest.raises(ValueError, match=f"{name(fn)}: {shape}"):
        call(fn, x, h0=h0, state_v_first=True)


# --- options that steer kernels only ---------------------------------------------------


def test_tiling_options_do_not_change_results() -> None:
    x = inputs(19, batch=1, cu=[0, 4, 12])
    cu = torch.tensor([0, 4, 12])
    base = {"initial_state": x["h0"], "output_final_state": True, "cu_seqlens": cu}
    q, k, v, beta, g, gk = x["q"], x["k"], x["v"], x["beta"], x["g"], x["gk"]
    want = chunk_delta_rule(q, k, v[:, :, ::2], beta[:, :, ::2], initial_state=x["h0"][:, ::2],
                            output_final_state=True, cu_seqlens=cu)  # fmt: skip
    for size in (16, 32, 64):
        got = chunk_delta_rule(
            q, k, v[:, :, ::2], beta[:, :, ::2], initial_state=x["h0"][:, ::2],
            output_final_state=True, cu_seqlens=cu, cu_seqlens_cpu=cu.clone(), chunk_size=size,
            head_first=False,
        )  # fmt: skip
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    want = chunk_gated_delta_rule(q, k, v, g, beta, **base)
    got = chunk_gated_delta_rule(q, k, v, g, beta, **base, chunk_size=16, chunk_indices=cu,
                                 cu_seqlens_cpu=cu.int())  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    want = chunk_kda(q, k, v, gk, beta, **base)
    got = chunk_kda(q, k, v, gk, beta, **base, chunk_size=32, disable_recompute=True,
                    safe_gate=True)  # fmt: skip
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("cu", [None, [0, 70, 70, 75, 140]], ids=["batch", "packed"])
@pytest.mark.parametrize("v_first", [False, True])
def test_chunk_kda_intermediate_states(cu, v_first) -> None:
    x = inputs(20, batch=2 if cu is None else 1, steps=140 if cu else 70, heads=1, group=2,
               dk=2, dv=2, cu=cu, dtype=torch.float32)  # fmt: skip
    h0 = x["h0"]
    cu_t = None if cu is None else torch.tensor(cu)
    want, want_final, want_h = fla_loop(x["q"], x["k"], x["v"], x["beta"], gk=x["gk"], h0=h0,
                                        cu=cu, chunk=32)  # fmt: skip
    given = h0.transpose(-1, -2).contiguous() if v_first else h0
    with torch.inference_mode():
        o, final, h = chunk_kda(
            x["q"], x["k"], x["v"], x["gk"], x["beta"], initial_state=given,
            output_final_state=True, cu_seqlens=cu_t, chunk_size=32, state_v_first=v_first,
            return_intermediate_states=True,
        )  # fmt: skip
        o2, none, h2 = chunk_kda(
            x["q"], x["k"], x["v"], x["gk"], x["beta"], initial_state=given, cu_seqlens=cu_t,
            chunk_size=32, state_v_first=v_first, return_intermediate_states=True,
        )  # fmt: skip
    assert none is None
    nt = 2 * 3 if cu is None else 3 + 0 + 1 + 3
    assert h.shape == (1 if cu else 2, nt // (1 if cu else 2), 2, 2, 2)
    assert h.dtype == torch.float32 and h.shape == h2.shape
    flip = (lambda t: t.transpose(-1, -2)) if v_first else (lambda t: t)
    assert_matches(o, want, torch.float32)
    assert_matches(o2, want, torch.float32)
    assert_matches(flip(final), want_final, torch.float32)
    assert_matches(flip(h), want_h, torch.float32)


# --- gradients ---------------------------------------------------------------------------


def tiny(seed, cu=None):  # type: ignore[no-untyped-def]
    x = inputs(seed, batch=1 if cu else 2, steps=5, heads=1, group=2, dk=2, dv=2, cu=cu)
    return {name: t.clone().requires_grad_() for name, t in x.items()}


@pytest.mark.parametrize("cu", [None, [0, 2, 2, 5]], ids=["batch", "packed"])
def test_gradcheck_delta_rule(cu) -> None:
    x = tiny(21, cu)
    cu_t = None if cu is None else torch.tensor(cu)

    def f(q, k, v, beta, h0):  # type: ignore[no-untyped-def]
        return chunk_delta_rule(q, k, v, beta, 0.8, h0, True, True, cu_t)

    assert torch.autograd.gradcheck(f, [x[n] for n in ("q", "k", "v", "beta", "h0")])

    def g(q, k, v, beta, h0):  # type: ignore[no-untyped-def]
        return fused_recurrent_delta_rule(q, k, v, beta, None, h0, True, False, cu_t)

    assert torch.autograd.gradcheck(g, [x[n] for n in ("q", "k", "v", "beta", "h0")])


def test_gradcheck_gated_delta_rule_with_in_kernel_gate() -> None:
    x = tiny(22)
    gen = torch.Generator().manual_seed(23)
    a_log = torch.randn(2, generator=gen, dtype=F64, requires_grad=True)
    dt_bias = torch.randn(2, generator=gen, dtype=F64, requires_grad=True)

    def f(q, k, v, g, beta, h0, a, b):  # type: ignore[no-untyped-def]
        return chunk_gated_delta_rule(
            q, k, v, g, beta, initial_state=h0, output_final_state=True,
            use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True,
            allow_neg_eigval=True, use_gate_in_kernel=True, A_log=a, dt_bias=b,
        )  # fmt: skip

    def fr(q, k, v, g, beta, h0, a, b, gk, gv):  # type: ignore[no-untyped-def]
        return fused_recurrent_gated_delta_rule(
            q, k, v, g, gk, gv, beta, initial_state=h0, output_final_state=True,
            use_gate_in_kernel=True, A_log=a, dt_bias=b, state_v_first=True,
        )  # fmt: skip

    leaves = [x[n] for n in ("q", "k", "v", "g", "beta", "h0")] + [a_log, dt_bias]
    assert torch.autograd.gradcheck(f, leaves)
    gv = (-torch.rand(x["v"].shape, generator=gen, dtype=F64)).requires_grad_()
    assert torch.autograd.gradcheck(fr, [*leaves, x["gk"], gv])


@pytest.mark.parametrize("lower_bound", [None, -3.0])
def test_gradcheck_kda_with_in_kernel_gate(lower_bound) -> None:
    x = tiny(24, [0, 3, 5])
    gen = torch.Generator().manual_seed(25)
    a_log = torch.randn(2, generator=gen, dtype=F64, requires_grad=True)
    dt_bias = torch.randn(4, generator=gen, dtype=F64, requires_grad=True)
    cu = torch.tensor([0, 3, 5])

    def f(q, k, v, g, beta, h0, a, b):  # type: ignore[no-untyped-def]
        return chunk_kda(
            q, k, v, g, beta, initial_state=h0, output_final_state=True,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, lower_bound=lower_bound,
            A_log=a, dt_bias=b, cu_seqlens=cu,
        )  # fmt: skip

    def fr(q, k, v, g, beta, h0, a, b):  # type: ignore[no-untyped-def]
        return fused_recurrent_kda(
            q, k, v, g, beta, a, b, initial_state=h0, output_final_state=True,
            use_gate_in_kernel=True, lower_bound=lower_bound, use_beta_sigmoid_in_kernel=True,
            cu_seqlens=cu,
        )  # fmt: skip

    leaves = [x[n] for n in ("q", "k", "v", "gk", "beta", "h0")] + [a_log, dt_bias]
    assert torch.autograd.gradcheck(f, leaves)
    assert torch.autograd.gradcheck(fr, leaves)


def test_gradients_match_the_loop_s() -> None:
    """The backward of a per-channel-beta fused_recurrent_kda (no backward in fla)
    against autograd through the float64 loop."""
    x = tiny(26)
    beta = torch.rand(x["v"].shape, generator=torch.Generator().manual_seed(27), dtype=F64)
    beta.requires_grad_()
    names = ("q", "k", "v", "gk", "h0")
    o, final = fused_recurrent_kda(
        x["q"], x["k"], x["v"], x["gk"], beta, initial_state=x["h0"], output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    got = torch.autograd.grad(o.square().sum() + final.sum(), [x[n] for n in names] + [beta])
    o, final = fla_loop(x["q"], x["k"], x["v"], beta, gk=x["gk"], h0=x["h0"], l2norm=True)
    want = torch.autograd.grad(o.square().sum() + final.sum(), [x[n] for n in names] + [beta])
    for a, b in zip(got, want, strict=True):
        assert_matches(a, b, F64)


# --- errors -----------------------------------------------------------------------------


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__name__)
def test_bad_input_raises_naming_the_function(fn) -> None:
    fname = name(fn)
    x = inputs(28, group=1 if fn in DELTA else 2)
    with pytest.raises(ValueError, match=rf"{fname}: expected q of shape \(B, T, H, K\)"):
        call(fn, {**x, "q": x["q"][0]})
    with pytest.raises(ValueError, match=f"{fname}: expected k of shape"):
        call(fn, {**x, "k": x["k"][:, :, :1]})
    with pytest.raises(ValueError, match=f"{fname}: expected v's head count HV to be a multiple"):
        call(fn, {**x, "v": torch.zeros(2, 12, 3, 4, dtype=F64)})
    with pytest.raises(ValueError, match=f"{fname}: expected beta of shape"):
        call(fn, {**x, "beta": x["beta"][:, :, :1]})
    with pytest.raises(TypeError, match=f"{fname}: expected q to have a real floating"):
        call(fn, {**x, "q": x["q"].long()})
    with pytest.raises(ValueError, match=f"{fname}: with cu_seqlens .* batch of one"):
        call(fn, x, cu_seqlens=torch.tensor([0, 12]))
    with pytest.raises(ValueError, match=f"{fname}: expected cu_seqlens to be non-decreasing"):
        call(fn, {n: t[:1] for n, t in x.items()}, cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match=f"{fname}: expected initial_state of shape"):
        call(fn, x, h0=x["h0"][:1])
    with pytest.raises(ValueError, match=rf"{fname}: expected initial_state .*sequences in cu_s"):
        call(fn, {n: t[:1] for n, t in x.items()}, h0=x["h0"][:1],
             cu_seqlens=torch.tensor([0, 5, 12]))  # fmt: skip
    for scale in ("0.5", 10**400):  # an int no float holds was an OverflowError
        with pytest.raises(TypeError, match=f"{fname}: expected scale or None to be a finite"):
            call(fn, x, scale=scale)
    with pytest.raises(TypeError, match=f"{fname}: expected output_final_state to be a bool"):
        call(fn, x, output_final_state=1)
    with pytest.raises(TypeError, match=f"{fname}: expected use_qk_l2norm_in_kernel to be a"):
        call(fn, x, use_qk_l2norm_in_kernel=None)
    with pytest.raises(ValueError, match=f"{fname}: expected all tensors on one device"):
        call(fn, x, h0=x["h0"].to("meta"))
    if fn is not fused_recurrent_delta_rule:  # which has no **kwargs
        with pytest.raises(TypeError, match=f"{fname}: got unexpected keyword argument.*foo"):
            call(fn, x, foo=1)
        with pytest.raises(ValueError, match=f"{fname}: expected inputs in the .*head_first"):
            call(fn, x, head_first=True)
    if fn in (chunk_delta_rule, chunk_gated_delta_rule, chunk_kda):
        with pytest.raises(ValueError, match=f"{fname}: expected chunk_size to be one of"):
            call(fn, x, chunk_size=128)
        with pytest.raises(ValueError, match=f"{fname}: expected cu_seqlens_cpu to hold"):
            call(fn, {n: t[:1] for n, t in x.items()}, cu_seqlens=torch.tensor([0, 5, 12]),
                 cu_seqlens_cpu=torch.tensor([0, 6, 12]))  # fmt: skip
        with pytest.raises(ValueError, match=f"{fname}: cu_seqlens_cpu is a CPU copy"):
            call(fn, x, cu_seqlens_cpu=torch.tensor([0, 12]))
    if fn in GATED + KDA:
        with pytest.raises(ValueError, match=f"{fname}: allow_neg_eigval=True doubles"):
            call(fn, x, allow_neg_eigval=True)
        with pytest.raises(ValueError, match=f"{fname}: expected g of shape"):
            call(fn, {**x, "g": x["g"][..., :1], "gk": x["gk"][..., :1]})
        with pytest.raises(ValueError, match=f"{fname}: use_gate_in_kernel=True .* A_log"):
            call(fn, x, use_gate_in_kernel=True)
        with pytest.raises(TypeError, match=f"{fname}: expected use_gate_in_kernel to be a"):
            call(fn, x, use_gate_in_kernel="yes")
        with pytest.raises(TypeError, match=f"{fname}: expected state_v_first to be a bool"):
            call(fn, x, state_v_first=None)
    if fn in (chunk_gated_delta_rule, chunk_kda):
        with pytest.raises(ValueError, match=f"{fname}: context parallelism is not supported"):
            call(fn, x, cp_context=object())
    if fn in GATED:
        with pytest.raises(ValueError, match=f"{fname}: expected dt_bias of HV = 4 elements"):
            call(fn, x, use_gate_in_kernel=True, A_log=torch.zeros(4), dt_bias=torch.zeros(3))
        with pytest.raises(ValueError, match=f"{fname}: expected A_log of HV = 4 elements"):
            call(fn, x, use_gate_in_kernel=True, A_log=torch.zeros(2))
    if fn in KDA:
        with pytest.raises(ValueError, match=f"{fname}: expected dt_bias of HV \\* K = 12"):
            call(fn, x, use_gate_in_kernel=True, A_log=torch.zeros(4), dt_bias=torch.zeros(4))
        with pytest.raises(TypeError, match=f"{fname}: expected lower_bound or None to be a"):
            call(fn, x, use_gate_in_kernel=True, lower_bound="-5")
    if fn is fused_recurrent_gated_delta_rule:
        with pytest.raises(ValueError, match=f"{fname}: use_gate_in_kernel=True .* expected g"):
            fn(x["q"], x["k"], x["v"], use_gate_in_kernel=True, A_log=torch.zeros(4))
        with pytest.raises(ValueError, match=f"{fname}: expected gk of shape"):
            fn(x["q"], x["k"], x["v"], gk=x["g"])
        with pytest.raises(ValueError, match=f"{fname}: expected gv of shape"):
            fn(x["q"], x["k"], x["v"], gv=x["gk"])
    if fn is chunk_gated_delta_rule:
        with pytest.raises(TypeError, match=f"{fname}: expected g to be a Tensor"):
            fn(x["q"], x["k"], x["v"], None, x["beta"])
    if fn is chunk_kda:
        for bound in (None, -6.0, 0.0):
            with pytest.raises(ValueError, match=f"{fname}: safe_gate=True .* expected lower_b"):
                call(fn, x, use_gate_in_kernel=True, A_log=torch.zeros(4), safe_gate=True,
                     lower_bound=bound)  # fmt: skip
        with pytest.raises(ValueError, match=f"{fname}: return_intermediate_states=True is for"):
            call(fn, x, return_intermediate_states=True)
        with torch.inference_mode(), pytest.raises(ValueError, match=f"{fname}: expected return_"):
            call(fn, x, return_intermediate_states=True, disable_recompute=True)


def test_refused_as_the_original_asserts() -> None:
    """Issue 52: where fla 0.6 asserts, the drop-in raises a ValueError or TypeError
    naming itself (it accepted these): fused_recurrent_delta_rule's scale <= 0,
    chunk_delta_rule's q, k and v of different dtypes, chunk_kda's use_graph with a
    max_num_seqs other than cu_seqlens' count."""
    x = inputs(30, group=1)
    fname = name(fused_recurrent_delta_rule)
    for scale in (0, 0.0, -0.0, -0.5):
        with pytest.raises(ValueError, match=rf"{fname}: expected scale > 0 \(or None: K \*\* "
                           rf"-0.5\), as the original asserts, but got {scale!r}"):  # fmt: skip
            call(fused_recurrent_delta_rule, x, scale=scale)
    fname = name(chunk_delta_rule)
    for other in ("q", "k", "v"):
        d = {n: "float32" if n == other else "float64" for n in ("q", "k", "v")}
        with pytest.raises(TypeError, match=rf"{fname}: expected q, k and v of one dtype, as the "
                           rf"original asserts, but got q torch.{d['q']}, k torch.{d['k']} and "
                           rf"v torch.{d['v']}$"):  # fmt: skip
            call(chunk_delta_rule, {**x, other: x[other].float()})
    fname, packed = name(chunk_kda), {n: t[:1] for n, t in inputs(31, group=2).items()}
    cu = torch.tensor([0, 5, 12])
    with pytest.raises(ValueError, match=rf"{fname}: use_graph=True .* expected 3 sequences, but "
                       "got cu_seqlens with 2"):  # fmt: skip
        call(chunk_kda, packed, cu_seqlens=cu, use_graph=True, max_num_seqs=3)
    with pytest.raises(TypeError, match=f"{fname}: expected use_graph to be a bool"):
        call(chunk_kda, packed, use_graph=None)
    with pytest.raises(TypeError, match=f"{fname}: expected max_num_seqs to be an int or None"):
        call(chunk_kda, packed, max_num_seqs=2.0)


def test_accepted_where_the_original_does_not_check() -> None:
    """The other side of each choice: only fused_recurrent_delta_rule's original asserts
    scale > 0 and only chunk_delta_rule's one dtype, so the others take both (the
    float64 loop's results); chunk_kda's use_graph, with a matching max_num_seqs or
    none, and a max_num_seqs without use_graph change nothing, as in the original."""
    x = inputs(32, group=1)
    (o, _), _ = call(chunk_delta_rule, x, scale=-0.5)
    assert_matches(o, fla_loop(x["q"], x["k"], x["v"], x["beta"], scale=-0.5)[0], F64)
    for fn in MIXED_DTYPES:
        x = inputs(32, group=1 if fn in DELTA else 2)
        (o, _), decay = call(fn, {**x, "k": x["k"].float()})
        want = fla_loop(x["q"], x["k"].float(), x["v"], x["beta"], **decay)[0]
        assert_matches(o, want, torch.float32)
    x = {n: t[:1] for n, t in inputs(33, group=2).items()}
    cu = torch.tensor([0, 5, 12])
    want = call(chunk_kda, x, cu_seqlens=cu, output_final_state=True)[0]
    for options in ({"use_graph": True}, {"use_graph": True, "max_num_seqs": 2},
                    {"max_num_seqs": 7}):  # fmt: skip
        got = call(chunk_kda, x, cu_seqlens=cu, output_final_state=True, **options)[0]
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__name__)
def test_errors_of_delta_rule_scan_name_the_drop_in(fn) -> None:
    """K = 0, which parascan.delta_rule_scan refuses after the drop-in's own checks,
    came out under that function's name; now under the drop-in's, ending with it."""
    x = inputs(34, dk=0, group=1 if fn in DELTA else 2)
    with pytest.raises(ValueError) as info:
        call(fn, x)
    message = str(info.value)
    assert message.startswith(f"{name(fn)}: expected q with at least one head"), message
    assert message.endswith("(parascan.delta_rule_scan checked it)"), message


def test_inputs_are_not_modified() -> None:
    x = inputs(29)
    before = {n: t.clone() for n, t in x.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for fn in GATED + KDA:
            call(fn, x, h0=x["h0"], output_final_state=True, use_beta_sigmoid_in_kernel=True)
    for n, t in x.items():
        assert torch.equal(t, before[n]), n
