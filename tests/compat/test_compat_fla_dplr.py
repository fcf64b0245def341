"""parascan.compat.fla's generalized-delta-rule drop-ins (chunk_dplr_delta_rule,
fused_recurrent_dplr_delta_rule, chunk_rwkv7, fused_recurrent_rwkv7) against a float64
loop written here from flash-linear-attention 0.6's fused recurrent kernel
(fla/ops/generalized_delta_rule/dplr/fused_recurrent.py, one step at a time, per
sequence and head)::

    S = exp(gk)[:, None] * S + outer(b, a^T S);  S += outer(k, v);  o = S^T (scale * q)

(``reverse``: the steps of each sequence from its last; RWKV-7: q = r, gk = w), and,
where fla is installed, against fla's own naive reference ``dplr_recurrence``
(fla/ops/generalized_delta_rule/dplr/naive.py, loaded from its file alone)."""

from __future__ import annotations

import ast
import importlib.util
import inspect
from pathlib import Path
from types import ModuleType

import pytest
import torch

from parascan.compat.fla import (
    chunk_dplr_delta_rule,
    chunk_rwkv7,
    fused_recurrent_dplr_delta_rule,
    fused_recurrent_rwkv7,
)

from conftest import assert_matches

F64 = torch.float64


def fla_source(*parts: str) -> Path:
    """A file of the installed fla's ops (an allowed skip where fla is not installed)."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.importorskip("fla")
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations)), "ops", *parts)


def fla_dplr_naive() -> ModuleType:
    """fla/ops/generalized_delta_rule/dplr/naive.py, loaded from its file alone."""
    path = fla_source("generalized_delta_rule", "dplr", "naive.py")
    pytest.importorskip("einops")  # the naive module imports it
    spec = importlib.util.spec_from_file_location("_fla_naive_dplr", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- the reference ----------------------------------------------------------------------


def dplr_loop(  # type: ignore[no-untyped-def]
    q, k, v, a, b, gk, *, scale=None, h0=None, cu=None, reverse=False
):
    """fla's recurrence in float64; h0 (N, H, K, V). Returns (o, final (N, H, K, V))."""
    q, k, v, a, b, gk = (t.to(F64) for t in (q, k, v, a, b, gk))
    batch, steps, heads, dk = q.shape
    dv = v.shape[-1]
    scale = dk**-0.5 if scale is None else scale
    spans = (
        [(r, r, 0, steps) for r in range(batch)]
        if cu is None
        else [(0, n, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    )
    o = torch.zeros(batch, steps, heads, dv, dtype=F64)
    finals = []
    for row, n, lo, hi in spans:
        s = torch.zeros(heads, dk, dv, dtype=F64) if h0 is None else h0[n].to(F64)
        for t in range(hi - 1, lo - 1, -1) if reverse else range(lo, hi):
            a_s = torch.einsum("hk,hkv->hv", a[row, t], s)
            s = torch.exp(gk[row, t])[:, :, None] * s + b[row, t][:, :, None] * a_s[:, None, :]
            s = s + k[row, t][:, :, None] * v[row, t][:, None, :]
            o[row, t] = torch.einsum("hk,hkv->hv", q[row, t] * scale, s)
        finals.append(s)
    return o, torch.stack(finals)


def inputs(seed, batch=2, steps=7, heads=2, dk=3, dv=4, dtype=F64, cu=None):  # type: ignore[no-untyped-def]
    """RWKV-7-like operands: q, k (B, T, H, K), v (B, T, H, V), kk unit-norm, a = -kk,
    b = kk * rate (rate in (0, 1)), log decays gk in [-1, 0), h0 (N, H, K, V): a
    transition Diag(exp(gk)) - rate kk kk^T, stable."""
    gen = torch.Generator().manual_seed(seed)
    n = batch if cu is None else len(cu) - 1

    def r(*shape):  # type: ignore[no-untyped-def]
        return torch.randn(*shape, generator=gen, dtype=F64)

    kk = r(batch, steps, heads, dk)
    kk = kk / kk.norm(dim=-1, keepdim=True).clamp_min(1e-6)
    rate = torch.rand(batch, steps, heads, dk, generator=gen, dtype=F64)
    x = {
        "q": r(batch, steps, heads, dk),
        "k": r(batch, steps, heads, dk) * dk**-0.5,
        "v": r(batch, steps, heads, dv),
        "a": -kk,
        "b": kk * rate,
        "gk": -torch.rand(batch, steps, heads, dk, generator=gen, dtype=F64),
        "h0": r(n, heads, dk, dv),
    }
    return {name: t.to(dtype) for name, t in x.items()}


DPLR = [chunk_dplr_delta_rule, fused_recurrent_dplr_delta_rule]
RWKV7 = [chunk_rwkv7, fused_recurrent_rwkv7]
FUNCTIONS = DPLR + RWKV7
CHUNKED = [chunk_dplr_delta_rule, chunk_rwkv7]


def name(fn) -> str:  # type: ignore[no-untyped-def]
    return f"parascan.compat.fla.{fn.__name__}"


def call(fn, x, *, h0=None, **options):  # type: ignore[no-untyped-def]
    """fn on inputs ``x`` by fla's positional conventions (RWKV-7: r, w, k, v, a, b)."""
    if fn in DPLR:
        return fn(x["q"], x["k"], x["v"], x["a"], x["b"], x["gk"], initial_state=h0, **options)
    return fn(x["q"], x["gk"], x["k"], x["v"], x["a"], x["b"], initial_state=h0, **options)


def loop(x, **options):  # type: ignore[no-untyped-def]
    return dplr_loop(x["q"], x["k"], x["v"], x["a"], x["b"], x["gk"], **options)


# --- signatures -------------------------------------------------------------------------

# flash-linear-attention 0.6.0 (fla-core): fla/ops/generalized_delta_rule/dplr/chunk.py,
# .../dplr/fused_recurrent.py, fla/ops/rwkv7/chunk.py, fla/ops/rwkv7/fused_recurrent.py
E = inspect.Parameter.empty
KERNEL_OPTIONS = [
    ("cu_seqlens", None), ("cu_seqlens_cpu", None), ("safe_gate", False), ("chunk_size", None),
    ("disable_recompute", False), ("cp_context", None), ("lower_bound", None),
]  # fmt: skip
FLA_SIGNATURES = {
    chunk_dplr_delta_rule: (("generalized_delta_rule", "dplr", "chunk.py"), [
        ("q", E), ("k", E), ("v", E), ("a", E), ("b", E), ("gk", E), ("scale", None),
        ("initial_state", None), ("output_final_state", False), *KERNEL_OPTIONS,
        ("kwargs", "**"),
    ]),
    fused_recurrent_dplr_delta_rule: (("generalized_delta_rule", "dplr", "fused_recurrent.py"), [
        ("q", E), ("k", E), ("v", E), ("a", E), ("b", E), ("gk", E), ("scale", None),
        ("initial_state", None), ("output_final_state", False), ("reverse", False),
        ("cu_seqlens", None),
    ]),
    chunk_rwkv7: (("rwkv7", "chunk.py"), [
        ("r", E), ("w", E), ("k", E), ("v", E), ("a", E), ("b", E), ("scale", 1.0),
        ("initial_state", None), ("output_final_state", False), *KERNEL_OPTIONS,
    ]),
    fused_recurrent_rwkv7: (("rwkv7", "fused_recurrent.py"), [
        ("r", E), ("w", E), ("k", E), ("v", E), ("a", E), ("b", E), ("scale", None),
        ("initial_state", None), ("output_final_state", True), ("cu_seqlens", None),
    ]),
}  # fmt: skip


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__name__)
def test_signature_is_fla_s(fn) -> None:
    params = list(inspect.signature(fn).parameters.values())
    _, want = FLA_SIGNATURES[fn]
    assert [p.name for p in params] == [n for n, _ in want]
    for p, (pname, default) in zip(params, want, strict=True):
        if default == "**":
            assert p.kind is inspect.Parameter.VAR_KEYWORD
        else:
            assert p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
            assert p.default is default or p.default == default, pname


def test_signatures_match_the_installed_fla_s_sources() -> None:
    for fn, (parts, want) in FLA_SIGNATURES.items():
        tree = ast.parse(fla_source(*parts).read_text())
        node = next(
            n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == fn.__name__
        )
        args = node.args.args
        defaults = [E] * (len(args) - len(node.args.defaults)) + [
            ast.literal_eval(d) for d in node.args.defaults
        ]
        got: list[tuple[str, object]] = list(zip((a.arg for a in args), defaults, strict=True))
        if node.args.kwarg is not None:
            got.append((node.args.kwarg.arg, "**"))
        assert got == want, fn.__name__


# --- results ----------------------------------------------------------------------------

SHAPES = {
    "batch K3 V65": {"batch": 2, "steps": 7, "dk": 3, "dv": 65},
    "packed K65 V3": {"batch": 1, "steps": 7, "dk": 65, "dv": 3, "cu": [0, 3, 3, 7]},
    "one step K1 V1": {"batch": 2, "steps": 1, "dk": 1, "dv": 1},
    "empty T": {"batch": 2, "steps": 0, "dk": 3, "dv": 3},
    "packed K1 V65": {"batch": 1, "steps": 5, "dk": 1, "dv": 65, "cu": [0, 0, 5]},
}


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_matches_fla_s_recurrence(fn, shape) -> None:
    x = inputs(3, **SHAPES[shape])
    cu = SHAPES[shape].get("cu")
    cu_t = None if cu is None else torch.tensor(cu)
    for h0, scale in ((None, None), (x["h0"], 0.7)):
        o, final = call(fn, x, h0=h0, output_final_state=True, scale=scale, cu_seqlens=cu_t)
        want, want_final = loop(x, scale=scale, h0=h0, cu=cu)
        assert o.dtype == F64 and final.dtype == F64 and final.is_contiguous()
        assert_matches(o, want, F64)
        assert_matches(final, want_final, F64)
    o, none = call(fn, x, cu_seqlens=cu_t, output_final_state=False)
    assert none is None and o.shape == x["v"].shape


def test_defaults_as_in_fla() -> None:
    """chunk_rwkv7's scale is 1.0 by default, the others' K ** -0.5;
    fused_recurrent_rwkv7 returns the final state by default, the others do not."""
    x = inputs(4)
    for fn in FUNCTIONS:
        o, final = call(fn, x)
        want, want_final = loop(x, scale=1.0 if fn is chunk_rwkv7 else None)
        assert_matches(o, want, F64)
        if fn is fused_recurrent_rwkv7:
            assert_matches(final, want_final, F64)
        else:
            assert final is None
    o, _ = chunk_rwkv7(x["q"], x["gk"], x["k"], x["v"], x["a"], x["b"], scale=None)
    assert_matches(o, loop(x)[0], F64)


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dtypes_as_in_fla(fn, dtype) -> None:
    """o in q's (r's) dtype from the chunked originals, v's from the fused recurrent
    ones; the final state float32."""
    x = inputs(5, dtype=dtype)
    x["v"] = x["v"].float()
    o, final = call(fn, x, h0=x["h0"], output_final_state=True)
    assert o.dtype == (dtype if fn in CHUNKED else torch.float32)
    assert final.dtype == torch.float32
    want, want_final = loop(x, h0=x["h0"], scale=None if fn is not chunk_rwkv7 else 1.0)
    assert_matches(o, want, dtype)
    assert_matches(final, want_final, dtype)


@pytest.mark.parametrize("cu", [None, [0, 4, 4, 7]], ids=["batch", "packed"])
def test_reverse(cu) -> None:
    x = inputs(6, batch=2 if cu is None else 1, cu=cu)
    cu_t = None if cu is None else torch.tensor(cu)
    o, final = call(fused_recurrent_dplr_delta_rule, x, h0=x["h0"], output_final_state=True,
                    reverse=True, cu_seqlens=cu_t)  # fmt: skip
    want, want_final = loop(x, h0=x["h0"], cu=cu, reverse=True)
    assert_matches(o, want, F64)
    assert_matches(final, want_final, F64)


def test_rwkv7_is_the_dplr_delta_rule_with_q_r_and_gk_w() -> None:
    x = inputs(7, batch=1, cu=[0, 2, 7])
    cu = torch.tensor([0, 2, 7])
    for rwkv, dplr in ((chunk_rwkv7, chunk_dplr_delta_rule),
                       (fused_recurrent_rwkv7, fused_recurrent_dplr_delta_rule)):  # fmt: skip
        got = call(rwkv, x, h0=x["h0"], scale=0.5, output_final_state=True, cu_seqlens=cu)
        want = call(dplr, x, h0=x["h0"], scale=0.5, output_final_state=True, cu_seqlens=cu)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)


def test_against_fla_s_naive_dplr_recurrence() -> None:
    naive = fla_dplr_naive()
    x = inputs(8, dtype=torch.float32, dk=5, dv=6)
    head_first = {n: t.transpose(1, 2) for n, t in x.items() if n != "h0"}
    want, want_final = naive.dplr_recurrence(
        head_first["q"], head_first["k"], head_first["v"], head_first["a"], head_first["b"],
        head_first["gk"], initial_state=x["h0"], output_final_state=True,
    )  # fmt: skip
    want = want.transpose(1, 2)
    for fn in FUNCTIONS:
        scale = {"scale": None} if fn is chunk_rwkv7 else {}  # the naive's K ** -0.5
        o, final = call(fn, x, h0=x["h0"], output_final_state=True, **scale)
        assert_matches(o, want.double(), torch.float32)
        assert_matches(final, want_final.double(), torch.float32)


# --- gradients ---------------------------------------------------------------------------


def tiny(seed, cu=None):  # type: ignore[no-untyped-def]
    x = inputs(seed, batch=1, steps=4, heads=1, dk=2, dv=2, cu=cu)
    return {n: t.clone().requires_grad_() for n, t in x.items()}


NAMES = ("q", "k", "v", "a", "b", "gk", "h0")


def test_gradcheck_dplr() -> None:
    x = tiny(21, [0, 2, 2, 4])
    cu = torch.tensor([0, 2, 2, 4])

    def f(q, k, v, a, b, gk, h0):  # type: ignore[no-untyped-def]
        return chunk_dplr_delta_rule(q, k, v, a, b, gk, 0.8, h0, True, cu)

    assert torch.autograd.gradcheck(f, [x[n] for n in NAMES])


def test_gradcheck_rwkv7() -> None:
    x = tiny(22)

    def f(r, w, k, v, a, b, h0):  # type: ignore[no-untyped-def]
        return fused_recurrent_rwkv7(r, w, k, v, a, b, None, h0)

    assert torch.autograd.gradcheck(f, [x[n] for n in ("q", "gk", "k", "v", "a", "b", "h0")])


def test_gradients_match_the_loop_s() -> None:
    """The backward of fused_recurrent_dplr_delta_rule (no backward in fla), reversed and
    packed, against autograd through the float64 loop."""
    x = tiny(23, [0, 3, 4])
    cu = [0, 3, 4]
    o, final = call(fused_recurrent_dplr_delta_rule, x, h0=x["h0"], output_final_state=True,
                    reverse=True, cu_seqlens=torch.tensor(cu))  # fmt: skip
    got = torch.autograd.grad(o.square().sum() + final.sum(), [x[n] for n in NAMES])
    o, final = loop(x, h0=x["h0"], cu=cu, reverse=True)
    want = torch.autograd.grad(o.square().sum() + final.sum(), [x[n] for n in NAMES])
    for a, b in zip(got, want, strict=True):
        assert_matches(a, b, F64)


# --- errors -----------------------------------------------------------------------------


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__name__)
def test_bad_input_raises_naming_the_function(fn) -> None:
    fname = name(fn)
    qn, gn = ("q", "gk") if fn in DPLR else ("r", "w")
    x = inputs(28)
    one = {n: t[:1] for n, t in x.items()}
    with pytest.raises(ValueError, match=rf"{fname}: expected {qn} of shape \(B, T, H, K\)"):
        call(fn, {**x, "q": x["q"][0]})
    for key, shown in (("k", "k"), ("a", "a"), ("b", "b"), ("gk", gn)):
        with pytest.raises(
            ValueError, match=rf"{fname}: expected {shown} of shape \(B, T, H, K\) like {qn}"
        ):
            call(fn, {**x, key: x[key][:, :, :1]})
    with pytest.raises(ValueError, match=rf"{fname}: expected v of shape \(B, T, H, V\) with"):
        call(fn, {**x, "v": torch.zeros(2, 7, 4, 4, dtype=F64)})
    with pytest.raises(TypeError, match=f"{fname}: expected {gn} to have a real floating"):
        call(fn, {**x, "gk": x["gk"].long()})
    with pytest.raises(ValueError, match=rf"{fname}: with cu_seqlens .* expected {qn} of shape"):
        call(fn, x, cu_seqlens=torch.tensor([0, 7]))
    with pytest.raises(ValueError, match=rf"{fname}: expected initial_state .*sequences in cu_s"):
        call(fn, one, h0=x["h0"][:1], cu_seqlens=torch.tensor([0, 5, 7]))
    with pytest.raises(TypeError, match=f"{fname}: expected scale or None to be a finite"):
        call(fn, x, scale="1")
    with pytest.raises(TypeError, match=f"{fname}: expected output_final_state to be a bool"):
        call(fn, x, output_final_state=None)
    with pytest.raises(ValueError, match=f"{fname}: expected all tensors on one device"):
        call(fn, x, h0=x["h0"].to("meta"))
    with pytest.raises(ValueError) as info:  # K = 0: refused by the scan, named as the drop-in
        call(fn, {n: t[..., :0] if n != "v" and n != "h0" else t for n, t in x.items()})
    assert str(info.value).startswith(f"{fname}: expected {qn} with at least one head")
    assert str(info.value).endswith("(parascan.dplr_delta_rule_scan checked it)")
    if fn in CHUNKED:
        for bound in (0.0, 1, 2.5):
            with pytest.raises(ValueError, match=f"{fname}: lower_bound .* expected a negative"):
                call(fn, x, lower_bound=bound)
        with pytest.raises(TypeError, match=f"{fname}: expected lower_bound or None to be a"):
            call(fn, x, lower_bound="-1")
        for size in (8, 48, 16.0):
            with pytest.raises(ValueError, match=f"{fname}: expected chunk_size to be None or a"):
                call(fn, x, chunk_size=size)
        with pytest.raises(TypeError, match=f"{fname}: expected safe_gate to be a bool"):
            call(fn, x, safe_gate=1)
        with pytest.raises(TypeError, match=f"{fname}: expected disable_recompute to be a bool"):
            call(fn, x, disable_recompute=None)
        with pytest.raises(ValueError, match=f"{fname}: context parallelism is not supported"):
            call(fn, x, cp_context=object())
        with pytest.raises(ValueError, match=f"{fname}: expected cu_seqlens_cpu to hold"):
            call(
                fn, one, cu_seqlens=torch.tensor([0, 5, 7]), cu_seqlens_cpu=torch.tensor([0, 6, 7])
            )
        want = call(fn, x, output_final_state=True)  # kernel options change nothing
        got = call(fn, x, output_final_state=True, safe_gate=True, chunk_size=64, lower_bound=-5.0,
                   disable_recompute=True)  # fmt: skip
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)
    if fn is chunk_dplr_delta_rule:
        with pytest.raises(TypeError, match=f"{fname}: got unexpected keyword argument.*foo"):
            call(fn, x, foo=1)
        with pytest.raises(ValueError, match=f"{fname}: expected inputs in the .*head_first"):
            call(fn, x, head_first=True)
    if fn is fused_recurrent_dplr_delta_rule:
        with pytest.raises(TypeError, match=f"{fname}: expected reverse to be a bool"):
            call(fn, x, reverse=1)


def test_inputs_are_not_modified() -> None:
    x = inputs(30)
    before = {n: t.clone() for n, t in x.items()}
    for fn in FUNCTIONS:
        call(fn, x, h0=x["h0"], output_final_state=True)
    call(fused_recurrent_dplr_delta_rule, x, h0=x["h0"], reverse=True)
    for n, t in x.items():
        assert torch.equal(t, before[n]), n
