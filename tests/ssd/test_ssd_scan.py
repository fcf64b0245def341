"""ps.ssd_scan (Mamba-2's scan) against the float64 loop (oracles.ssd_loop), on every
backend of its row. The cases every checkpointed scan owes (lengths around the
checkpoints, dtypes, packed sequences, gradients, gradcheck, forward mode, vmap,
compile, decoding, inputs untouched, optional arguments) are tests/checkpointed.py's;
here: the options (groups, D per head, dt_bias, softplus, dt_limit), non-contiguous
inputs, growing states, the decoding step of ps.selective_state_update, memory, the
raw ops, errors and the docstring."""

from __future__ import annotations

import doctest
import math
import os
from collections.abc import Callable
from itertools import pairwise

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.profiler import ProfilerActivity, profile

import parascan as ps
from checkpointed import (
    ScanSpec,
    along,
    cast,
    check_forward,
    draw,
    gradients,
    loss_weights,
    shared_tests,
    to,
)
from checkpointed import run as run_scan
from parascan.ssd import api as ssd_api
from parascan.ssd import autograd as ssd_ops
from parascan.ssd.canonical import CHECKPOINT_STEPS

from conftest import Target, assert_matches
from oracles import ssd_loop

F64 = torch.float64


def _draw(
    gen: torch.Generator, *, batch: int, length: int, states: int | None, heads: int = 6,
    headdim: int = 5, groups: int = 3, n: int = 4, D: str | None = "full", z: bool = True,
    bias: bool = True, softplus: bool = True, limit: tuple[float, float] = (0.0, math.inf),
) -> dict:  # fmt: skip
    """A float64 problem; ``states``: the rows of ``initial`` (batch by default); D of
    shape (heads, headdim) ("full"), (heads,) ("heads") or none."""

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=F64)

    p = {
        "x": rand(batch, length, heads, headdim),
        "dt": torch.rand(batch, length, heads, generator=gen, dtype=F64) - 0.3,
        "A": -0.2 - torch.rand(heads, generator=gen, dtype=F64),
        "B": rand(batch, length, groups, n),
        "C": rand(batch, length, groups, n),
        "D": {None: None, "full": rand(heads, headdim), "heads": rand(heads)}[D],
        "z": rand(batch, length, heads, headdim) if z else None,
        "dt_bias": 0.5 * rand(heads) if bias else None,
        "dt_softplus": softplus,
        "dt_limit": limit,
        "initial": rand(batch if states is None else states, heads, headdim, n),
    }
    if not softplus and not bias:
        p["dt"] = p["dt"] + 0.3  # positive steps without the softplus
    return p


SSD = ScanSpec(
    name="ssd_scan",
    function=ps.ssd_scan,
    oracle=ssd_loop,
    draw=_draw,
    positional=("x", "dt", "A", "B", "C"),
    timed=along(1, "x", "dt", "B", "C", "z"),
    optional=("D", "z", "dt_bias", "initial"),
    checkpoints={b: CHECKPOINT_STEPS[b] for b in ssd_ops.ROW.backends},
    backends=tuple(ssd_ops.ROW.backends),
    blocks=(64,),  # the torch backend's blocks
    wide=("A", "initial"),
    tiny={"heads": 2, "headdim": 2, "groups": 1, "n": 2, "limit": (0.05, 2.0)},
    vmapped=("x", "A"),
    gradient_cases={
        "everything": {},
        "one-group-D-per-head-limit": {"groups": 1, "D": "heads", "limit": (0.05, 0.5)},
        "plain": {"D": None, "z": False, "bias": False, "softplus": False, "initial": False},
        "packed": {"cu": (0, 0, 40, 64, 65, 150, 150)},
    },
    overrides={
        "lengths": {"heads": 4, "headdim": 3, "groups": 2},
        "gradients": {"length": 150},
        "compile": {"limit": (0.01, 5.0)},
    },
)
TestShared = shared_tests(SSD)

TARGETS = SSD.targets()
IDS = [str(t) for t in TARGETS]


def _problem(gen: torch.Generator, **options: object) -> dict:
    """SSD's problem of ``options`` (checkpointed.draw; length 20 and batch 2 by
    default, ``initial=False`` for none, ``states`` the initial state's rows)."""
    return draw(SSD, gen, {"length": 20, **options})


def _cast(p: dict, dtype: torch.dtype) -> dict:
    """The inputs in ``dtype``; A and the initial state in the state's precision."""
    return cast(SSD, p, dtype)


def _run(
    p: dict, backend: str, cu: list[int] | None = None, device: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The scan of ``p`` on ``backend``, run on ``device`` (the target's; the inputs'
    own by default), its outputs handed back on the inputs' device."""
    return run_scan(SSD, p, backend, device, cu)


def _check(
    p: dict, where: Target, dtype: torch.dtype = torch.float32, cu: list[int] | None = None
) -> None:
    check_forward(SSD, p, where, dtype, cu)


def _grads(
    p: dict, fn: Callable[[dict], tuple[torch.Tensor, torch.Tensor]],
    use: tuple[str, ...] = ("out", "final"),
) -> dict[str, torch.Tensor]:  # fmt: skip
    """The gradients of a weighted sum of the outputs named in ``use``."""
    return gradients(SSD, p, fn, lambda outputs: loss_weights(outputs, use))


OPTIONS = {
    "plain": {"D": None, "z": False, "bias": False, "softplus": False, "initial": False},
    "one-group": {"groups": 1},
    "group-per-head": {"groups": 6},
    "D-per-head": {"D": "heads"},
    "no-z": {"z": False},
    "bias-no-softplus": {"softplus": False},
    "softplus-no-bias": {"bias": False},
    "limit": {"limit": (0.05, 0.4)},
    "limit-above-0": {"softplus": False, "limit": (0.0, 0.3)},
    "no-initial": {"initial": False},
}


@pytest.mark.parametrize("where", TARGETS, ids=IDS)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_options_against_loop(where, gen, option):
    _check(_problem(gen, length=70, **OPTIONS[option]), where)


def test_dt_limit_beyond_the_dtype_is_no_limit(gen):
    """A bound that float32 (or any float) cannot hold clamps nothing on its side, as
    the infinity it rounds to: (0, 1e39) and (0, 10**400) were an OverflowError (torch's
    clamp, Python's float) instead of a scan."""
    p = {k: v.float() if torch.is_tensor(v) and v.is_floating_point() else v
         for k, v in _problem(gen, softplus=False, bias=False, length=9).items()}  # fmt: skip
    want = _run({**p, "dt_limit": (0.0, math.inf)}, "cpu")[0]
    for limit in ((0.0, 1e39), (0, 10**400), (-(10**400), 1e39)):
        got = _run({**p, "dt_limit": limit}, "cpu")[0]
        floor = 0.0 if limit[0] == 0 else -math.inf
        assert torch.equal(got, _run({**p, "dt_limit": (floor, math.inf)}, "cpu")[0])
    assert torch.equal(_run({**p, "dt_limit": (0, 10**400)}, "cpu")[0], want)


def test_dt_limit_default_lets_negative_steps_through(gen):
    """(0, inf) is no clamp at all (a negative step stays negative); any other limit
    clamps."""
    p = _problem(gen, softplus=False, bias=False, length=9)
    p["dt"] = p["dt"] - 1.0
    base = _run(p, "loop")[0]
    clamped = _run({**p, "dt_limit": (0.0, 100.0)}, "loop")[0]
    assert not torch.allclose(base, clamped)
    assert_matches(clamped, _run({**p, "dt": p["dt"].clamp(min=0.0)}, "loop")[0], F64)


@pytest.mark.parametrize("where", TARGETS, ids=IDS)
def test_non_contiguous_inputs(where, gen):
    p = _cast(_problem(gen, length=70, D="heads"), torch.float32)
    q = dict(p)
    for k in ("x", "z", "B", "C"):  # batch innermost
        q[k] = p[k].permute(1, 2, 3, 0).contiguous().permute(3, 0, 1, 2)
    q["dt"] = p["dt"].transpose(0, 2).contiguous().transpose(0, 2)
    q["initial"] = p["initial"].transpose(-1, -2).contiguous().transpose(-1, -2)
    q["A"] = torch.stack([p["A"], p["A"]], 1)[:, 0]
    assert not q["x"].is_contiguous() and not q["B"].is_contiguous()
    want_out, want_final = ssd_loop(**_cast(p, F64))
    out, final = _run(q, where.backend, device=where.device)
    assert out.is_contiguous()
    assert_matches(out, want_out, torch.float32)
    assert_matches(final, want_final, torch.float32)


# --- growing states: A > 0 (allowed: the contract does not require A <= 0) -------------
# The torch backend's dual form weighed a block's steps by exp of sums of up to 64 log
# decays: with a growing state those overflowed long before the state did (a zero
# state or zero inputs times inf: NaN, where the loop gives up to 1.3e288).


def _issue() -> dict:
    """The reported case: 12 steps of dt = 30, heads with A = 0 and A = 2 (the state
    grows by exp(60) a step, to 1.29e288), from no initial state."""
    ones = torch.ones(1, 12, 1, 1, dtype=F64)
    return {"x": torch.ones(1, 12, 2, 1, dtype=F64), "dt": torch.full((1, 12, 2), 30.0, dtype=F64),
            "A": torch.tensor([0.0, 2.0], dtype=F64), "B": ones, "C": ones.clone()}  # fmt: skip


def _growing(
    gen: torch.Generator, rate: float, live: int, length: int = 150, cu: list[int] | None = None,
    initial: float | None = None, scale: float = 1.0,
) -> dict:  # fmt: skip
    """A float64 problem whose first head's state grows by exp(rate * dt) a step (the
    steps as given, in [0.75, 1.25)), the others' by half that, not at all, or decaying;
    the inputs zero but for the last ``live`` steps of each sequence (the state stays 0
    until then, as it starts from none, or from ``initial`` times a random state), the
    inputs scaled by ``scale``."""
    batch = 1 if cu is not None else 2
    states = None if cu is None else len(cu) - 1
    p = _problem(gen, batch=batch, length=length, heads=4, headdim=3, groups=2, bias=False,
                 softplus=False, initial=initial is not None, states=states)  # fmt: skip
    p["dt"] = 0.75 + 0.5 * torch.rand(batch, length, 4, generator=gen, dtype=F64)
    p["A"] = torch.tensor([rate, -0.5, rate / 2, 0.0], dtype=F64)
    p["x"] = p["x"] * scale
    for lo, hi in pairwise(cu or [0, length]):
        p["x"][:, lo : max(lo, hi - live)] = 0
    if initial is not None:
        p["initial"] = p["initial"] * initial
    return p


# name -> (input dtype, cu_seqlens, _growing's arguments, or None for the issue's case):
# in every case the torch backend's blocks' weights overflowed where the loop is finite
GROWING = {
    "issue": (F64, None, None),
    # a block of 64 steps grows by more than exp(709) (float64's range), the state by
    # at most exp(660): zero inputs (and state) times inf made NaN
    "float64": (F64, None, {"rate": 15.0, "live": 35}),
    # inputs and initial state of 1e-200 grown by exp(675) to exp(1125), to 1e93 to
    # 1e289: inf before (weights of exp(> 709) times 1e-200)
    "float64-tiny": (
        F64,
        None,
        {"rate": 15.0, "live": 60, "length": 60, "initial": 1e-200, "scale": 1e-200},
    ),
    # growth past float32's range (exp(> 96) a block, exp(> 225) over L), the state
    # within it (at most exp(63) from the zeros)
    "float32": (torch.float32, None, {"rate": 2.0, "live": 25}),
    "packed-float64": (F64, [0, 0, 30, 100, 150, 150], {"rate": 15.0, "live": 30}),
    # initial states of 1e-250 grown by exp(> 675) (inf before), inputs in the last 10
    "packed-float64-initial": (
        F64,
        [0, 0, 30, 75, 120, 120],
        {"rate": 20.0, "live": 10, "initial": 1e-250},
    ),
    "packed-float32": (torch.float32, [0, 0, 30, 100, 150, 150], {"rate": 2.0, "live": 25}),
}


def _growing_case(gen: torch.Generator, case: str) -> tuple[dict, torch.dtype, list | None]:
    """GROWING[case]'s float64 problem, input dtype and cu_seqlens."""
    dtype, cu, options = GROWING[case]
    if options is None:
        return _issue(), dtype, cu
    options = {"length": 150 if cu is None else cu[-1], **options}
    return _growing(gen, cu=cu, **options), dtype, cu


# the dimension of each tensor's heads (compared each at its own scale: a growing
# head's values dwarf a decaying head's); B and C mix the heads of their group
HEADS_AT = {"out": 2, "final": 1, "x": 2, "dt": 2, "z": 2, "initial": 1, "A": 0, "D": 0}


def _fits(expected: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Where the float64 ``expected`` is finite and fits ``dtype`` with room to spare
    (below 1/16 of its largest value): there a backend computing in ``dtype`` owes it."""
    return expected.isfinite() & (expected.abs() < torch.finfo(dtype).max / 16)


def _matches_where(
    name: str, actual: torch.Tensor, expected: torch.Tensor, where: torch.Tensor,
    dtype: torch.dtype,
) -> None:  # fmt: skip
    """``actual`` finite and matching ``expected`` wherever ``where``, head by head."""
    dim = HEADS_AT.get(name)
    parts = [(actual, expected, where)] if dim is None else zip(
        actual.unbind(dim), expected.unbind(dim), where.unbind(dim), strict=True
    )  # fmt: skip
    for a, e, w in parts:
        assert a[w].isfinite().all(), (name, int((~a[w].isfinite()).sum()), int(w.sum()))
        assert_matches(a[w], e[w], dtype)


@pytest.mark.parametrize("where", TARGETS, ids=IDS)
@pytest.mark.parametrize("case", list(GROWING))
def test_growing_state_against_loop(where, gen, case):
    """A growing state (A > 0) on every backend against the float64 loop: the outputs
    and final states (all finite, and fitting float32 for float32 inputs), and every
    input's gradient wherever the loop's is finite and fits the dtype. In float32 a
    gradient's computation can overflow where its value fits (a zero state times an
    overflowed gradient of the state: the float32 loop's NaN, the semantics at that
    precision): those entries are compared wherever the loop backend's own float32
    gradient is finite."""
    p, dtype, cu = _growing_case(gen, case)
    p = _cast(p, dtype)
    state = F64 if dtype == F64 else torch.float32
    want = _grads(_cast(p, F64), lambda q: ssd_loop(**q, cu_seqlens=cu))
    want_out, want_final = ssd_loop(**_cast(p, F64), cu_seqlens=cu)
    assert _fits(want_out, dtype).all() and _fits(want_final, state).all()
    out, final = _run(p, where.backend, cu, where.device)
    _matches_where("out", out, want_out, _fits(want_out, dtype), dtype)
    _matches_where("final", final, want_final, _fits(want_final, state), state)
    got = _grads(p, lambda q: _run(q, where.backend, cu, where.device))
    owed = {k: _fits(w, state) for k, w in want.items()}
    if dtype != F64:
        loop = _grads(p, lambda q: _run(q, "loop", cu))
        owed = {k: m & loop[k].isfinite() for k, m in owed.items()}
    for k in want:
        assert owed[k].any(), k
        _matches_where(k, got[k], want[k], owed[k], state)
    # most of the gradients' entries are compared
    assert sum(int(m.sum()) for m in owed.values()) > 0.5 * sum(m.numel() for m in owed.values())


@pytest.mark.parametrize("where", TARGETS, ids=IDS)
@pytest.mark.parametrize("case", ["issue", "float64", "packed-float64-initial"])
def test_growing_state_forward_mode(where, gen, case):
    """torch.func.jvp with a growing state against the float64 loop's (every backend's
    tangents come from the torch backend's forward under forward-mode AD)."""
    p, _, cu = _growing_case(gen, case)
    names = [k for k, v in p.items() if isinstance(v, torch.Tensor)]
    primals = tuple(p[k] for k in names)
    tangents = tuple(torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in primals)

    def at(f):
        return lambda *ts: f({**p, **dict(zip(names, ts, strict=True))})

    _, want = torch.func.jvp(at(lambda q: ssd_loop(**q, cu_seqlens=cu)), primals, tangents)
    run = at(lambda q: _run(q, where.backend, cu, where.device))
    _, got = torch.func.jvp(run, primals, tangents)
    for name, g, w in zip(("out", "final"), got, want, strict=True):
        assert w.isfinite().any(), name  # not where the inputs' zeros grew past the range
        _matches_where(name, g, w, w.isfinite(), F64)


@pytest.mark.parametrize("where", TARGETS, ids=IDS)
def test_selective_state_update_steps_equal_the_scan(where, gen):
    """ps.selective_state_update over L steps, one at a time, in the multi-head layout
    (dt, A, D, dt_bias expanded over headdim and N), equals the scan."""
    p = to(_cast(_problem(gen, length=9), torch.float32), where.device)  # the steps too
    out, final = _run(p, where.backend)
    batch, length, heads, headdim = p["x"].shape
    n = p["B"].shape[-1]
    state = p["initial"].clone()
    for t in range(length):
        y = ps.selective_state_update(
            state, p["x"][:, t], p["dt"][:, t, :, None].expand(batch, heads, headdim),
            p["A"][:, None, None].expand(heads, headdim, n), p["B"][:, t], p["C"][:, t],
            p["D"], p["z"][:, t], p["dt_bias"][:, None].expand(heads, headdim), dt_softplus=True,
        )  # fmt: skip
        torch.testing.assert_close(y, out[:, t], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, final, rtol=1e-5, atol=1e-5)


def test_no_state_per_step_is_allocated(gen):
    """No allocation of the torch backend's forward and backward comes near a (batch,
    L, heads, headdim, N) tensor: the largest (the gradients of B and C) is 1/16 of it.
    (The loop backend runs the same driver; under the profiler it is too slow here.)"""
    p = _cast(_problem(gen, batch=1, length=512, heads=1, headdim=16, groups=1, n=64),
              torch.float32)  # fmt: skip
    x = p["x"].requires_grad_()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out, final = _run(p, "torch")
        (out.sum() + final.sum()).backward()
    largest = max(e.cpu_memory_usage for e in prof.events())
    assert x.grad is not None
    assert 0 < largest < x.numel() * 64 * 4 / 4


@pytest.mark.parametrize("where", TARGETS, ids=IDS)
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("want_final", [True, False], ids=["final", "no_final"])
def test_opcheck(where, gen, packed, want_final):
    """The raw ops: schema, fake kernel and AOT dispatch of the forward (opcheck); the
    backward's fake kernel against its real results. (opcheck cannot run the backward
    op itself: its checkers are dispatch modes, under which the torch.func.vjp inside
    the kernel cannot run.) Without want_final the final state has no rows, and so
    has grad_final (zeros)."""
    cu = [0, 10, 10, 70] if packed else None
    p = _cast(_problem(gen, batch=1, length=70, states=3 if packed else None), torch.float32)
    p = to(p, where.device)
    d = p["D"]
    cu_t = None if cu is None else torch.tensor(cu, device=where.device)
    args = (p["x"], p["dt"], p["A"], p["B"], p["C"], d, p["z"], p["initial"], cu_t,
            want_final, where.backend)  # fmt: skip
    torch.library.opcheck(ssd_ops.apply.forward_op, args)
    out, final, checkpoints = ssd_ops.apply.forward_op(*args)
    assert final.shape[0] == ((3 if packed else 1) if want_final else 0)
    backward_args = (*args[:9], checkpoints, torch.ones_like(out), torch.ones_like(final),
                     want_final, where.backend)  # fmt: skip
    real = ssd_ops.apply.backward_op(*backward_args)
    with FakeTensorMode() as mode:
        fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
                     for a in backward_args]  # fmt: skip
        fake = ssd_ops.apply.backward_op(*fake_args)
    assert [(t.shape, t.dtype) for t in fake] == [(t.shape, t.dtype) for t in real]


def test_every_backend_is_built_and_triton_refuses_cpu_tensors(gen):
    """The row has every backend of the project (none left 'coming'); the Triton one
    on a CPU tensor (no interpreter) says why it cannot run, and "auto" runs."""
    assert set(ssd_ops.ROW.backends) == {"cpu", "triton", "torch", "loop"}
    assert not ssd_ops.ROW.missing
    p = _cast(_problem(gen, length=5), torch.float32)
    assert ps.ssd_scan(p["x"], p["dt"], p["A"], p["B"], p["C"]).shape == p["x"].shape
    if not os.environ.get("TRITON_INTERPRET"):
        with pytest.raises(RuntimeError, match=r"parascan\.ssd_scan: backend 'triton' is not "
                           r"available: it runs on CUDA tensors"):  # fmt: skip
            _run(p, "triton")


@pytest.mark.parametrize(
    ("change", "cu", "error", "match"),
    [
        (lambda p: p.update(x=p["x"][0]), None, ValueError, "expected x of shape"),
        (lambda p: p.update(dt=p["dt"][:, :-1]), None, ValueError, "expected dt of shape"),
        (lambda p: p.update(A=p["A"][:-1]), None, ValueError, "expected A of shape"),
        (lambda p: p.update(B=torch.randn(2, 20, 4, 4)), None, ValueError, "group count"),
        (lambda p: p.update(B=torch.randn(2, 20, 4)), None, ValueError, "expected B of shape"),
        (lambda p: p.update(C=torch.randn(2, 20, 3, 5)), None, ValueError, "expected C of shape"),
        (lambda p: p.update(D=torch.randn(6, 4)), None, ValueError, "expected D of shape"),
        (lambda p: p.update(z=p["z"][..., :-1]), None, ValueError, "expected z of shape"),
        (lambda p: p.update(dt_bias=torch.randn(5)), None, ValueError, "expected dt_bias of"),
        (lambda p: p.update(initial=torch.randn(2, 6, 5, 3)), None, ValueError, "expected initi"),
        (lambda p: p.update(x=p["x"].to(torch.int64)), None, TypeError, "expected x to have"),
        (lambda p: p.update(B=p["B"].to(torch.int32)), None, TypeError, "expected B to have"),
        (lambda p: p.update(A=p["A"].to(torch.complex64)), None, TypeError, "expected A to hav"),
        (lambda p: p.update(dt=[1.0]), None, TypeError, "expected dt to be a Tensor"),
        (lambda p: p.update(dt_limit=(1.0, 0.5)), None, ValueError, "expected dt_limit"),
        (lambda p: p.update(dt_limit=0.5), None, ValueError, "expected dt_limit"),
        (lambda p: p.update(dt_limit=(math.nan, 1.0)), None, ValueError, "expected dt_limit"),
        # both beyond a float, min > max: both became inf and passed the order check
        (lambda p: p.update(dt_limit=(10**401, 10**400)), None, ValueError, "expected dt_limit"),
        (lambda p: p.update(dt_softplus=1), None, TypeError, "expected dt_softplus to be"),
        (lambda p: None, [0, 20], ValueError, "batch of one"),
    ],
)  # fmt: skip
def test_errors(gen, change, cu, error, match):
    p = _cast(_problem(gen), torch.float32)
    change(p)
    with pytest.raises(error, match=r"parascan\.ssd_scan: .*" + match):
        _run(p, "auto", cu)


@pytest.mark.parametrize(
    ("cu", "initial_rows", "match"),
    [
        ([0, 5, 19], 2, "expected cu_seqlens to be non-decreasing"),
        ([0, 12, 5, 20], 3, "expected cu_seqlens to be non-decreasing"),
        ([1, 20], 1, "expected cu_seqlens to be non-decreasing"),
        ([0, 5, 20], 3, r"expected initial of shape \(num_seqs"),
    ],
)
def test_packed_errors(gen, cu, initial_rows, match):
    p = _cast(_problem(gen, batch=1, states=initial_rows), torch.float32)
    with pytest.raises(ValueError, match=r"parascan\.ssd_scan: " + match):
        _run(p, "auto", cu)
    with pytest.raises(TypeError, match=r"parascan\.ssd_scan: expected cu_seqlens"):
        ps.ssd_scan(p["x"], p["dt"], p["A"], p["B"], p["C"], cu_seqlens=torch.tensor([0.0, 20]))


def test_docstring_example():
    result = doctest.testmod(ssd_api, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0
