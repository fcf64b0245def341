"""ps.delta_rule_scan (DeltaNet, Gated DeltaNet, KDA) against the float64 loop
(oracles.delta_rule_loop), on every backend of its row. The cases every checkpointed
scan owes (lengths around the checkpoints, dtypes, packed sequences, gradients,
gradcheck, forward mode, vmap, compile, decoding, inputs untouched, optional
arguments) are tests/checkpointed.py's, over the three gate forms (none, per head, per
channel); here: grouped heads and K != V, qk_l2norm and scale, strong decays,
non-contiguous inputs, errors, transformers' reading of the recurrence, and qk_l2norm
of vectors whose squares overflow."""

from __future__ import annotations

import pytest
import torch

import parascan as ps
from checkpointed import (
    ScanSpec,
    along,
    cast,
    check_forward,
    check_gradients,
    draw,
    oracle,
    shared_tests,
    to,
)
from checkpointed import run as run_scan
from parascan.delta_rule import autograd as delta_ops
from parascan.delta_rule.canonical import CHECKPOINT_STEPS

from conftest import Target, assert_matches
from oracles import delta_rule_loop

F64 = torch.float64


def _draw(
    gen: torch.Generator, *, batch: int, length: int, states: int | None, hk: int = 2,
    hv: int = 4, dk: int = 5, dv: int = 3, gate: str = "head", strength: float = 2.0,
    qk_l2norm: bool = False, scale: float | None = None,
) -> dict:  # fmt: skip
    """A float64 problem: beta in [0, 2], log decays in [-strength, 0], keys of unit
    length (the regime where the recurrence is stable, as with qk_l2norm: a step
    multiplies the state by I - beta k k^T, whose eigenvalues stay in [-1, 1]);
    ``states``: the rows of the initial state (batch by default). qk_l2norm and scale
    are in the problem where given."""

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
        "k": torch.nn.functional.normalize(rand(batch, length, hk, dk), dim=-1),
        "v": rand(batch, length, hv, dv),
        "beta": 2 * unit(batch, length, hv),
        "g": gates[gate],
        "initial": rand(batch if states is None else states, hv, dk, dv),
    }
    if qk_l2norm:
        p["qk_l2norm"] = True
    if scale is not None:
        p["scale"] = scale
    return p


L2NORM = {"qk_l2norm": True}
DELTA_RULE = ScanSpec(
    name="delta_rule_scan",
    function=ps.delta_rule_scan,
    oracle=delta_rule_loop,
    draw=_draw,
    positional=("q", "k", "v", "beta"),
    timed=along(1, "q", "k", "v", "beta", "g"),
    optional=("g", "initial"),
    checkpoints={b: CHECKPOINT_STEPS[b] for b in delta_ops.ROW.backends},
    backends=tuple(delta_ops.ROW.backends),
    blocks=(32, 64),  # the torch backend's blocks
    forms={"none": {"gate": "none"}, "head": {"gate": "head"}, "channel": {"gate": "channel"}},
    optional_forms=("head", "channel"),
    tiny={"hk": 1, "hv": 2, "dk": 3, "dv": 2},
    vmapped=("v", "beta"),
    overrides={
        "dtypes": {"length": 40},
        "gradients": {"length": 150, **L2NORM},
        "separate": L2NORM,
        "gradcheck": L2NORM,
        "decode": L2NORM,
        "compile": L2NORM,
        "untouched": L2NORM,
        "auto": L2NORM,
        "optional": L2NORM,
    },
)
TestShared = shared_tests(DELTA_RULE)

TARGETS = DELTA_RULE.targets()
IDS = [str(t) for t in TARGETS]
GATES = list(DELTA_RULE.forms)


def _problem(gen: torch.Generator, **options: object) -> dict:
    """DELTA_RULE's problem of ``options`` (checkpointed.draw: length 70, batch 2 by
    default; ``initial=False`` for none)."""
    return draw(DELTA_RULE, gen, options)


def _cast(p: dict, dtype: torch.dtype) -> dict:
    return cast(DELTA_RULE, p, dtype)


def _run(
    p: dict, backend: str, cu: list[int] | None = None, device: str | None = None,
    **options: object,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The scan of ``p`` (with ``options``) on ``backend``, run on ``device`` (the
    inputs' own by default), its outputs handed back on the inputs' device."""
    return run_scan(DELTA_RULE, {**p, **options}, backend, device, cu)


def _oracle(p: dict, cu: list[int] | None = None, **options: object):  # type: ignore[no-untyped-def]
    """The float64 loop, on the CPU."""
    return oracle(DELTA_RULE, {**p, **options}, cu)


def _check(
    p: dict, where: Target, dtype: torch.dtype, cu: list[int] | None = None, **options: object
) -> None:
    """The scan on ``where`` (backend and device) against the loop, in ``dtype``."""
    check_forward(DELTA_RULE, {**p, **options}, where, dtype, cu)


def _gradients_match(where: Target, p: dict) -> None:
    """Every input's gradient (finite) in float32 with qk_l2norm, the scan run on
    ``where``, against autograd through the float64 loop."""
    check_gradients(DELTA_RULE, {**p, **L2NORM}, where)


@pytest.mark.parametrize("where", TARGETS, ids=IDS)
@pytest.mark.parametrize(
    ("dk", "dv", "hk", "hv"), [(3, 17, 1, 3), (17, 3, 3, 3), (100, 4, 1, 2), (128, 128, 1, 1)]
)
def test_sizes_and_groups(where, gen, dk, dv, hk, hv):
    p = _problem(gen, batch=1, length=70, hk=hk, hv=hv, dk=dk, dv=dv, gate="channel")
    _check(p, where, torch.float32, qk_l2norm=True)


@pytest.mark.parametrize("where", TARGETS, ids=IDS)
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize(
    "options", [{}, {"qk_l2norm": True}, {"scale": 0.3}, {"qk_l2norm": True, "scale": 2.0}]
)
def test_options_against_loop(where, gen, gate, options):
    _check(_problem(gen, length=70, gate=gate, initial=False), where, F64, **options)


@pytest.mark.parametrize("where", TARGETS, ids=IDS)
@pytest.mark.parametrize("gate", ["head", "channel"])
def test_strong_decays(where, gen, gate):
    """Log decays down to -50 a step (exp(-50) ~ 2e-22: the state forgets at once)
    and beta in [0, 2]: finite and equal to the loop."""
    p = _problem(gen, length=100, gate=gate, strength=50.0)
    _check(p, where, torch.float32, qk_l2norm=True)
    _check(p, where, F64)


@pytest.mark.parametrize("where", TARGETS, ids=IDS)
@pytest.mark.parametrize("gate", ["head", "channel"])
def test_strong_then_weak_decays_float32(where, gen, gate):
    """Strong decays (-200 a step) then weak ones (-0.001) within one block: the
    weights between the weak steps must not inherit the rounding of the strong ones'
    running sum (the torch backend once took them as differences of it: 1e-4 off)."""
    p = _problem(gen, batch=1, length=64, hk=1, hv=1, dk=8, dv=8, gate=gate)
    p["g"] = torch.full_like(p["g"], -0.001)
    p["g"][:, :40] = -200.0
    _check(p, where, torch.float32)
    _gradients_match(where, p)


@pytest.mark.parametrize("where", TARGETS, ids=IDS)
@pytest.mark.parametrize("gate", ["head", "channel"])
def test_a_minus_infinity_decay_resets_the_state(where, gen, gate):
    """g = -inf (a hard reset: what an overflowing float16 gate becomes) forgets the
    state, finite in the outputs and every gradient, as in the loop."""
    p = _problem(gen, batch=1, length=70, gate=gate)
    p["g"][:, 10] = -torch.inf
    _check(p, where, F64)
    _gradients_match(where, p)


@pytest.mark.parametrize("where", TARGETS, ids=IDS)
def test_non_contiguous_inputs(where, gen):
    """Views made on the target's device in float32: a copy (to a device or a dtype)
    of the strided k would be contiguous."""
    p = to(_cast(_problem(gen, batch=2, length=40, gate="channel"), torch.float32), where.device)
    views = {
        "q": p["q"].transpose(0, 1).contiguous().transpose(0, 1),
        "k": torch.cat([p["k"], p["k"]], -1)[..., ::2],
        "v": p["v"].permute(3, 0, 1, 2).contiguous().permute(1, 2, 3, 0),
        "beta": p["beta"].transpose(1, 2).contiguous().transpose(1, 2),
    }
    views["k"].copy_(p["k"])
    assert not any(t.is_contiguous() for t in views.values())
    _check({**p, **views}, where, torch.float32, qk_l2norm=True)


def test_errors(gen):
    p = _problem(gen, batch=2, length=6, gate="head")
    q, k, v, beta = p["q"], p["k"], p["v"], p["beta"]
    fn = "parascan.delta_rule_scan"
    cases = [
        (ValueError, "q of shape", lambda: ps.delta_rule_scan(q[0], k, v, beta)),
        (ValueError, "k of shape", lambda: ps.delta_rule_scan(q, k[:, :5], v, beta)),
        (ValueError, "multiple of", lambda: ps.delta_rule_scan(q, k, v[:, :, :3], beta[:, :, :3])),
        (ValueError, "beta of shape", lambda: ps.delta_rule_scan(q, k, v, beta[:, :, :1])),
        (ValueError, "K >= 1", lambda: ps.delta_rule_scan(q[..., :0], k[..., :0], v, beta)),
        (ValueError, "positive multiple", lambda: ps.delta_rule_scan(
            q, k, v[:, :, :0], beta[:, :, :0])),
        (ValueError, "V >= 1", lambda: ps.delta_rule_scan(q, k, v[..., :0], beta)),
        (ValueError, "g of shape", lambda: ps.delta_rule_scan(q, k, v, beta, g=beta[..., :2])),
        (TypeError, "dtype", lambda: ps.delta_rule_scan(q.long(), k, v, beta)),
        (TypeError, "dtype", lambda: ps.delta_rule_scan(q, k, v, beta.to(torch.complex128))),
        (ValueError, "batch 1", lambda: ps.delta_rule_scan(
            q, k, v, beta, cu_seqlens=torch.tensor([0, 6]))),
        (ValueError, "initial of shape", lambda: ps.delta_rule_scan(
            q, k, v, beta, initial=p["initial"][:1])),
        (TypeError, "scale", lambda: ps.delta_rule_scan(q, k, v, beta, scale="1")),
        (TypeError, "scale", lambda: ps.delta_rule_scan(q, k, v, beta, scale=10**400)),
        (TypeError, "scale", lambda: ps.delta_rule_scan(q, k, v, beta, scale=float("nan"))),
        (TypeError, "scale", lambda: ps.delta_rule_scan(q, k, v, beta, scale=True)),
        (TypeError, "qk_l2norm", lambda: ps.delta_rule_scan(q, k, v, beta, qk_l2norm=1)),
        (TypeError, "return_final", lambda: ps.delta_rule_scan(q, k, v, beta, return_final=None)),
        (RuntimeError, "Triton kernel", lambda: ps.delta_rule_scan(
            q, k, v, beta, backend="triton")),
    ]  # fmt: skip
    for error, words, call in cases:
        with pytest.raises(error, match=words) as info:
            call()
        assert str(info.value).startswith(fn), str(info.value)


@pytest.mark.parametrize("where", TARGETS, ids=IDS)
@pytest.mark.parametrize("fallback", ["chunk", "recurrent"])
def test_matches_transformers_gated_delta_rule(where, gen, fallback):
    """transformers' own torch fallbacks of the gated delta rule (Qwen3.5's), an
    outside reading of the same recurrence: equal outputs and final states."""
    transformers = pytest.importorskip("transformers")
    del transformers
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    theirs = getattr(qwen, f"torch_{fallback}_gated_delta_rule")
    theirs = getattr(theirs, "__wrapped__", theirs)
    p = _problem(gen, batch=2, length=70, hk=3, hv=3, dk=8, dv=6, gate="head")
    o, final = _run(p, where.backend, device=where.device, qk_l2norm=True)
    want_o, want_final = theirs(
        p["q"], p["k"], p["v"], p["g"], p["beta"], initial_state=p["initial"],
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    # they compute in float32 whatever the inputs' dtype
    assert_matches(o, want_o.to(F64), torch.float32)
    assert_matches(final, want_final.to(F64), torch.float32)


@pytest.mark.parametrize("where", TARGETS, ids=IDS)
@pytest.mark.parametrize("dtype", [torch.float32, F64])
@pytest.mark.parametrize("grad", [False, True])
def test_l2norm_of_vectors_whose_squares_overflow(where, gen, dtype, grad):
    """qk_l2norm on q and k whose sum of squares overflows the dtype (|x| ~ 1e24 in
    float32, 1e180 in float64): the norm is still defined, the outputs those of the
    same directions at ordinary magnitudes (sum(x * x) once made every row 0). Without
    gradients the C kernel normalizes (the inference path, and a decoding step's)."""
    huge = 2.0**80 if dtype == torch.float32 else 2.0**600
    p = _problem(gen, batch=2, length=40, gate="head")
    ordinary = {**p, "q": p["q"] * 2.0**80, "k": p["k"] * 2.0**80}  # float64 squares fit
    want_out, want_final = _oracle(ordinary, qk_l2norm=True)
    q = _cast({**p, "q": p["q"] * huge, "k": p["k"] * huge}, dtype)
    assert not torch.isfinite((q["q"] * q["q"]).sum(-1)).all()  # the plain sum overflows
    if grad:
        for name in ("q", "k", "v"):
            q[name].requires_grad_()
    out, final = _run(q, where.backend, device=where.device, qk_l2norm=True)
    assert_matches(out, want_out, dtype)
    assert_matches(final, want_final, dtype)
    if grad and dtype == torch.float32:  # float64 squares of 1e24 fit: the loop's gradients
        exact = {k: v.detach().to(F64).requires_grad_() for k, v in q.items() if v is not None}
        w_out = torch.randn(out.shape, generator=gen, dtype=F64)
        want = torch.autograd.grad(
            (_oracle(exact, qk_l2norm=True)[0] * w_out).sum(), [exact[n] for n in "qkv"]
        )
        got = torch.autograd.grad((out.double() * w_out).sum(), [q[n] for n in "qkv"])
        for g, w in zip(got, want, strict=True):
            assert g.isfinite().all()
            assert_matches(g, w, dtype)
    # one decoding step from the state, as a generation loop makes it
    step = {k: v[:, :1] if k != "initial" else final for k, v in q.items() if v is not None}
    o1, _ = _run({**step, "g": q["g"][:, :1]}, where.backend, device=where.device, qk_l2norm=True)
    cont = {k: v[:, :1] if k != "initial" else want_final for k, v in ordinary.items()}
    assert_matches(o1, _oracle({**cont, "g": ordinary["g"][:, :1]}, qk_l2norm=True)[0], dtype)


@pytest.mark.parametrize("where", TARGETS, ids=IDS)
def test_an_overflowing_product_of_finite_inputs_is_never_silently_zero(where):
    """q[1] . k[0] = 1e40 overflows float32 while the loop's output, q[1] . (k[0] u[0])
    = 1e10, does not: the chunked form's weight overflows, and its mask once zeroed every
    non-finite entry on and below the diagonal too (nan_to_num), giving a silent 0. A
    backend gives the loop's 1e10 or a non-finite value, never a finite wrong one."""
    q = torch.zeros(1, 2, 1, 1)
    k = torch.zeros(1, 2, 1, 1)
    v = torch.zeros(1, 2, 1, 1)
    q[0, 1], k[0, 0], v[0, 0] = 1e20, 1e20, 1e-30
    beta = torch.ones(1, 2, 1)
    p = {"q": q, "k": k, "v": v, "beta": beta, "g": None, "initial": None}
    out, _ = _run(p, where.backend, device=where.device, scale=1.0)
    want = _oracle(_cast(p, F64), scale=1.0)[0]
    assert want[0, 1, 0, 0] == pytest.approx(1e10, rel=1e-6)
    got = out[0, 1, 0, 0]
    assert not got.isfinite() or got.item() == pytest.approx(1e10, rel=1e-5), got


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_l2norm_keeps_the_plain_formulas_bits(gen, dtype):
    """The rescaled l2norm scales by powers of two: wherever the plain formula
    x * rsqrt(sum(x * x) + 1e-6) does not overflow, the same bits (as fla's)."""
    from parascan.delta_rule.api import _l2norm

    for scale in (1e-4, 0.5, 1.0, 1.99, 3.0, 1e3, 1e12):
        x = (torch.randn(200, 48, generator=gen, dtype=F64) * scale).to(dtype)
        plain = x * (torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6) * 0.25)
        assert torch.equal(_l2norm(x, 0.25), plain), scale
