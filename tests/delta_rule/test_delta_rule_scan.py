"""ps.delta_rule_scan (DeltaNet, Gated DeltaNet, KDA) against the float64 loop
(oracles.delta_rule_loop), on every backend of its row: the three gate forms,
grouped heads, K != V, options, lengths, dtypes, strong decays, packed sequences,
gradients, vmap, torch.func, compile, the decoding step and errors."""

from __future__ import annotations

import pytest
import torch

import parascan as ps
from parascan.delta_rule import autograd as delta_ops
from parascan.delta_rule.canonical import CHECKPOINT_STEPS

from conftest import Target, assert_matches, targets
from harness import forward_mode_checks
from oracles import delta_rule_loop

TARGETS = [t for t in targets() if t.backend in delta_ops.ROW.backends]
IDS = [str(t) for t in TARGETS]
# Lengths around the checkpoint intervals and the torch backend's blocks (32 and 64).
CHUNKS = sorted({CHECKPOINT_STEPS[b] for b in delta_ops.ROW.backends})
LENGTHS = sorted({0, 1, 2, 31, 33, 63, 64, 65, *(k + 1 for k in CHUNKS)})
GATES = ["none", "head", "channel"]
F64 = torch.float64


def _problem(
    gen: torch.Generator, batch: int = 2, length: int = 20, hk: int = 2, hv: int = 4,
    dk: int = 5, dv: int = 3, gate: str = "head", initial: bool = True,
    states: int | None = None, strength: float = 2.0,
) -> dict:  # fmt: skip
    """A float64 problem: beta in [0, 2], log decays in [-strength, 0], keys of unit
    length (the regime where the recurrence is stable, as with qk_l2norm: a step
    multiplies the state by I - beta k k^T, whose eigenvalues stay in [-1, 1])."""

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=F64)

    def unit(*shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=gen, dtype=F64)

    gates = {
        "none": None,
        "head": -strength * unit(batch, length, hv),
        "channel": -strength * unit(batch, length, hv, dk),
    }
    return {
        "q": rand(batch, length, hk, dk),
        "k": torch.nn.functional.normalize(rand(batch, length, hk, dk), dim=-1),
        "v": rand(batch, length, hv, dv),
        "beta": 2 * unit(batch, length, hv),
        "g": gates[gate],
        "initial": rand(batch if states is None else states, hv, dk, dv) if initial else None,
    }


def _cast(p: dict, dtype: torch.dtype) -> dict:
    """The inputs in ``dtype``; the initial state in the state's precision."""
    wide = F64 if dtype == F64 else torch.float32
    return {k: None if v is None else v.to(wide if k == "initial" else dtype) for k, v in p.items()}


def _to(p: dict, device: str) -> dict:
    """The problem's tensors on ``device``."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in p.items()}


def _run(
    p: dict, backend: str, cu: list[int] | None = None, device: str | None = None,
    **options: object,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The scan of ``p`` on ``backend``, run on ``device`` (the target's; the inputs'
    own by default), its outputs handed back on the inputs' device: comparisons with
    the CPU's float64 loop, gradients and tangents (through ``to``) work unchanged."""
    home = p["v"].device
    q = dict(p) if device is None else _to(p, device)
    args = [q.pop(k) for k in ("q", "k", "v", "beta")]
    cu_seqlens = None if cu is None else torch.tensor(cu, device=args[2].device)
    out, final = ps.delta_rule_scan(
        *args, **q, **options, return_final=True, cu_seqlens=cu_seqlens, backend=backend
    )
    assert out.device == final.device == args[2].device
    return out.to(home), final.to(home)


def _oracle(p: dict, cu: list[int] | None = None, **options: object):  # type: ignore[no-untyped-def]
    """The float64 loop, on the CPU."""
    wide = {k: None if v is None else v.to("cpu", F64) for k, v in p.items()}
    return delta_rule_loop(**wide, **options, cu_seqlens=cu)  # type: ignore[arg-type]


def _check(
    p: dict, where: Target, dtype: torch.dtype, cu: list[int] | None = None, **options: object
) -> None:
    """The scan on ``where`` (backend and device) against the loop, in ``dtype``."""
    q = _cast(p, dtype)
    want_out, want_final = _oracle(q, cu, **options)
    out, final = _run(q, where.backend, cu, where.device, **options)
    state = F64 if dtype == F64 else torch.float32
    assert out.dtype == dtype and final.dtype == state
    assert_matches(out, want_out, dtype)
    assert_matches(final, want_final, state)


@pytest.mark.parametrize("where", TARGETS, ids=IDS)
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("length", LENGTHS)
def test_lengths_against_loop(where, gen, gate, length):
    _check(_problem(gen, length=length, gate=gate), where, torch.float32)


@pytest.mark.parametrize("where", TARGETS, ids=IDS)
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, F64])
def test_dtypes_against_loop(where, gen, gate, dtype):
    _check(_problem(gen, length=40, gate=gate), where, dtype)


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
    leaves = _cast(p, torch.float32)
    _gradients_match(where, leaves, gen)


@pytest.mark.parametrize("where", TARGETS, ids=IDS)
@pytest.mark.parametrize("gate", ["head", "channel"])
def test_a_minus_infinity_decay_resets_the_state(where, gen, gate):
    """g = -inf (a hard reset: what an overflowing float16 gate becomes) forgets the
    state, finite in the outputs and every gradient, as in the loop."""
    p = _problem(gen, batch=1, length=70, gate=gate)
    p["g"][:, 10] = -torch.inf
    _check(p, where, F64)
    _gradients_match(where, _cast(p, torch.float32), gen)


@pytest.mark.parametrize("where", TARGETS, ids=IDS)
def test_non_contiguous_inputs(where, gen):
    """Views made on the target's device in float32: a copy (to a device or a dtype)
    of the strided k would be contiguous."""
    p = _to(_cast(_problem(gen, batch=2, length=40, gate="channel"), torch.float32), where.device)
    views = {
        "q": p["q"].transpose(0, 1).contiguous().transpose(0, 1),
        "k": torch.cat([p["k"], p["k"]], -1)[..., ::2],
        "v": p["v"].permute(3, 0, 1, 2).contiguous().permute(1, 2, 3, 0),
        "beta": p["beta"].transpose(1, 2).contiguous().transpose(1, 2),
    }
    views["k"].copy_(p["k"])
    assert not any(t.is_contiguous() for t in views.values())
    _check({**p, **views}, where, torch.float32, qk_l2norm=True)


def _gradients_match(where: Target, p: dict, gen: torch.Generator) -> None:
    """Every input's gradient (finite), the scan run on ``where``, against autograd
    through the float64 loop."""
    leaves = {k: v.clone().requires_grad_() for k, v in p.items() if v is not None}
    exact = {k: v.detach().to(F64).requires_grad_() for k, v in leaves.items()}
    out, final = _run({**p, **leaves}, where.backend, device=where.device, qk_l2norm=True)
    want_out, want_final = delta_rule_loop(**{**p, **exact}, qk_l2norm=True)
    w_out = torch.randn(out.shape, generator=gen, dtype=F64)
    w_fin = torch.randn(final.shape, generator=gen, dtype=F64)
    got = torch.autograd.grad((out.double() * w_out).sum() + (final.double() * w_fin).sum(),
                              list(leaves.values()))  # fmt: skip
    want = torch.autograd.grad((want_out * w_out).sum() + (want_final * w_fin).sum(),
                               list(exact.values()))  # fmt: skip
    for name, g, w in zip(leaves, got, want, strict=True):
        assert g.shape == leaves[name].shape, name
        assert g.isfinite().all(), name
        assert_matches(g, w, torch.float32 if g.dtype != F64 else F64)


@pytest.mark.parametrize("where", TARGETS, ids=IDS)
@pytest.mark.parametrize("gate", GATES)
def test_packed_equals_each_sequence_alone(where, gen, gate):
    cu = [0, 0, 30, 31, 100, 100, 170]
    p = _problem(gen, batch=1, length=170, gate=gate, states=len(cu) - 1)
    out, final = _run(p, where.backend, cu, where.device, qk_l2norm=True)
    for s in range(len(cu) - 1):
        lo, hi = cu[s], cu[s + 1]
        alone = {k: v[:, lo:hi] for k, v in p.items() if k != "initial" and v is not None}
        alone["g"] = None if p["g"] is None else alone["g"]
        alone["initial"] = p["initial"][s : s + 1]
        o, f = _run(alone, where.backend, device=where.device, qk_l2norm=True)
        torch.testing.assert_close(out[:, lo:hi], o)
        torch.testing.assert_close(final[s : s + 1], f)
    _check(p, where, F64, cu, qk_l2norm=True)


@pytest.mark.parametrize("where", TARGETS, ids=IDS)
@pytest.mark.parametrize("gate", GATES)
@pytest.mark.parametrize("packed", [False, True])
def test_gradcheck(where, gen, gate, packed):
    cu = [0, 3, 3, 9] if packed else None
    p = _problem(gen, batch=1 if packed else 2, length=9, hk=1, hv=2, dk=3, dv=2, gate=gate,
                 states=3 if packed else None)  # fmt: skip
    names = [k for k, v in p.items() if v is not None]

    def f(*ts):  # type: ignore[no-untyped-def]
        q = {**p, **dict(zip(names, ts, strict=True))}
        return _run(q, where.backend, cu, where.device, qk_l2norm=True)

    leaves = tuple(p[k].clone().requires_grad_() for k in names)
    # The whole Jacobian for the C kernel's hand-written backward; the loop and torch
    # backends (autograd through torch code on the checkpointed driver) against random
    # projections of it (fast_mode), which took 30 s of the suite in full.
    assert torch.autograd.gradcheck(f, leaves, fast_mode=where.backend != "cpu")


@pytest.mark.parametrize("where", TARGETS, ids=IDS)
@pytest.mark.parametrize("gate", GATES)
def test_gradients_against_loop_float32(where, gen, gate):
    """Every input's gradient in float32 against autograd through the float64 loop,
    over lengths that cross the checkpoints and blocks."""
    _gradients_match(where, _cast(_problem(gen, length=150, gate=gate), torch.float32), gen)


@pytest.mark.parametrize("where", TARGETS, ids=IDS)
def test_forward_mode(where, gen):
    p = _problem(gen, length=20, gate="channel")
    forward_mode_checks(lambda q: _run(q, where.backend, device=where.device),
                        lambda q: _oracle(q), p, "v", "parascan.delta_rule_scan", gen)  # fmt: skip


@pytest.mark.parametrize("where", TARGETS, ids=IDS)
def test_vmap_and_grad(where, gen):
    p = _to(_cast(_problem(gen, batch=1, length=70, initial=False), torch.float32), where.device)
    vs = torch.randn(3, *p["v"].shape, generator=gen).to(where.device)
    betas = torch.rand(3, *p["beta"].shape, generator=gen).to(where.device)

    def f(v, beta):  # type: ignore[no-untyped-def]
        return _run({**p, "v": v, "beta": beta}, where.backend, device=where.device)[0]

    got = torch.vmap(f)(vs, betas)
    torch.testing.assert_close(got, torch.stack([f(vs[i], betas[i]) for i in range(3)]))
    grad = torch.func.grad(lambda b: f(vs[0], b).square().sum())(betas[0])
    b0 = betas[0].clone().requires_grad_()
    f(vs[0], b0).square().sum().backward()
    torch.testing.assert_close(grad, b0.grad)


@pytest.mark.parametrize("where", TARGETS, ids=IDS)
@pytest.mark.parametrize("packed", [False, True])
def test_compile_fullgraph(where, gen, packed):
    cu = [0, 10, 10, 70] if packed else None
    p = _cast(_problem(gen, batch=1, length=70, gate="channel", states=3 if packed else None),
              torch.float32)  # fmt: skip
    p = _to(p, where.device)
    leaves = {k: v.clone().requires_grad_() for k, v in p.items() if v is not None}
    cu_t = None if cu is None else torch.tensor(cu, device=where.device)

    def f(q, cu_seqlens):  # type: ignore[no-untyped-def]
        q = dict(q)
        args = [q.pop(k) for k in ("q", "k", "v", "beta")]
        return ps.delta_rule_scan(*args, **q, qk_l2norm=True, return_final=True,
                                  cu_seqlens=cu_seqlens, backend=where.backend)  # fmt: skip

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    out, final = compiled({**p, **leaves}, cu_t)
    assert out.device == final.device == p["v"].device
    want_out, want_final = f(p, cu_t)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(final, want_final)
    (out.sum() + final.sum()).backward()
    eager = {k: v.clone().requires_grad_() for k, v in p.items() if v is not None}
    sum(t.sum() for t in f({**p, **eager}, cu_t)).backward()
    for k, v in leaves.items():
        torch.testing.assert_close(v.grad, eager[k].grad)


@pytest.mark.parametrize("where", TARGETS, ids=IDS)
@pytest.mark.parametrize("gate", GATES)
def test_decode_steps_equal_the_scan(where, gen, gate):
    """Calls of one step each, carrying the state, equal the scan."""
    p = _to(_cast(_problem(gen, length=9, gate=gate), torch.float32), where.device)  # the steps too
    out, final = _run(p, where.backend, device=where.device, qk_l2norm=True)
    state = p["initial"]
    for t in range(9):
        step = {k: None if v is None else v[:, t : t + 1] for k, v in p.items() if k != "initial"}
        o, state = _run({**step, "initial": state}, where.backend, device=where.device,
                        qk_l2norm=True)  # fmt: skip
        torch.testing.assert_close(o, out[:, t : t + 1])
    torch.testing.assert_close(state, final)


def test_inputs_untouched_and_auto_backend(gen):
    p = _cast(_problem(gen, length=30, gate="channel"), torch.float32)
    saved = {k: None if v is None else v.clone() for k, v in p.items()}
    out, _ = _run(p, "auto", qk_l2norm=True)
    for k, v in p.items():
        if v is not None:
            torch.testing.assert_close(v, saved[k], rtol=0, atol=0)
    # "auto" takes the row's first backend that runs on the CPU
    first = next(b for b in delta_ops.ROW.backends if b in ps.backends("cpu"))
    want, _ = _run(p, first, qk_l2norm=True)
    torch.testing.assert_close(out, want, rtol=0, atol=0)


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
