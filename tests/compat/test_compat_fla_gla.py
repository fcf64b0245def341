"""parascan.compat.fla's linear-attention drop-ins (gla, simple_gla, linear_attn,
retention, lightning_attn) against a float64 loop written here from
flash-linear-attention 0.6's fused recurrent kernel (fla/ops/common/fused_recurrent.py,
one step at a time, per sequence and head)::

    S *= exp(g); S *= exp(gk)[:, None]; S *= exp(gv)[None, :]
    S += outer(k, v);  o = S^T (scale * q)

(``reverse``: the steps of each sequence from its last), the fixed decays of retention
(``log(1 - 2 ** (-5 - h))``) and Lightning attention (``-8 / H * (1 - layer_idx /
num_layers) * h``) and linear_attn's normalization (``o / (scale * q . z + 1e-10)``, z
the running key sum) from fla's sources; and, where fla is installed, against fla's own
naive torch references (fla/ops/*/naive.py, loaded from their files alone: importing fla
sets up its Triton kernels)."""

from __future__ import annotations

import ast
import importlib.util
import inspect
import math
import warnings
from pathlib import Path
from types import ModuleType

import pytest
import torch

from parascan.compat.fla import (
    chunk_gla,
    chunk_lightning_attn,
    chunk_linear_attn,
    chunk_retention,
    chunk_simple_gla,
    fused_chunk_linear_attn,
    fused_recurrent_gla,
    fused_recurrent_lightning_attn,
    fused_recurrent_linear_attn,
    fused_recurrent_retention,
    fused_recurrent_simple_gla,
)

from conftest import assert_matches

F64 = torch.float64


# --- fla's naive references -----------------------------------------------------------


def fla_naive(folder: str) -> ModuleType:
    """fla/ops/<folder>/naive.py of the installed fla, loaded from its file alone."""
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.importorskip("fla")  # not installed: an allowed skip
    assert spec is not None and spec.submodule_search_locations
    pytest.importorskip("einops")  # the naive modules import it
    path = Path(next(iter(spec.submodule_search_locations))) / "ops" / folder / "naive.py"
    loaded = importlib.util.spec_from_file_location(f"_fla_naive_{folder.replace('/', '_')}", path)
    assert loaded is not None and loaded.loader is not None
    module = importlib.util.module_from_spec(loaded)
    loaded.loader.exec_module(module)
    return module


# --- the reference ----------------------------------------------------------------------


def runs(batch, steps, cu):  # type: ignore[no-untyped-def]
    """(row, state, lo, hi) per sequence."""
    if cu is None:
        return [(b, b, 0, steps) for b in range(batch)]
    return [(0, n, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]


def la_loop(  # type: ignore[no-untyped-def]
    q, k, v, *, g=None, gk=None, gv=None, scale=None, h0=None, cu=None, reverse=False
):
    """fla's recurrence in float64: g (B, T, H), gk (B, T, H, K), gv (B, T, H, V) log
    decays; h0 (N, H, K, V). Returns (o, final (N, H, K, V))."""
    q, k, v = q.to(F64), k.to(F64), v.to(F64)
    batch, steps, heads, dk = q.shape
    dv = v.shape[-1]
    scale = dk**-0.5 if scale is None else scale
    o = torch.zeros(batch, steps, heads, dv, dtype=F64)
    finals = []
    for b, n, lo, hi in runs(batch, steps, cu):
        s = torch.zeros(heads, dk, dv, dtype=F64) if h0 is None else h0[n].to(F64)
        for t in range(hi - 1, lo - 1, -1) if reverse else range(lo, hi):
            if g is not None:
                s = s * torch.exp(g[b, t].to(F64))[:, None, None]
            if gk is not None:
                s = s * torch.exp(gk[b, t].to(F64))[:, :, None]
            if gv is not None:
                s = s * torch.exp(gv[b, t].to(F64))[:, None, :]
            s = s + k[b, t][:, :, None] * v[b, t][:, None, :]
            o[b, t] = torch.einsum("hk,hkv->hv", q[b, t] * scale, s)
        finals.append(s)
    return o, torch.stack(finals)


def key_sums(q, k, *, scale=None, z0=None, cu=None, reverse=False):  # type: ignore[no-untyped-def]
    """linear_attn's normalization: the denominators scale * q . z + 1e-10 (B, T, H, 1),
    z the keys summed so far (from the end with reverse) plus z0 (N, 1, H, K), and the
    final z (N, 1, H, K)."""
    q, k = q.to(F64), k.to(F64)
    batch, steps, heads, dk = q.shape
    scale = dk**-0.5 if scale is None else scale
    den = torch.zeros(batch, steps, heads, 1, dtype=F64)
    finals = []
    for b, n, lo, hi in runs(batch, steps, cu):
        z = torch.zeros(heads, dk, dtype=F64) if z0 is None else z0[n, 0].to(F64)
        for t in range(hi - 1, lo - 1, -1) if reverse else range(lo, hi):
            z = z + k[b, t]
            den[b, t, :, 0] = (q[b, t] * scale * z).sum(-1) + 1e-10
        finals.append(z.unsqueeze(0))
    return den, torch.stack(finals)


def retention_decay(heads: int) -> torch.Tensor:
    return torch.tensor([math.log(1 - 2.0 ** (-5 - h)) for h in range(heads)], dtype=F64)


def lightning_decay(heads: int, layer_idx: int, num_layers: int) -> torch.Tensor:
    slope = 8 / heads * (1 - layer_idx / num_layers)
    return torch.tensor([-slope * h for h in range(heads)], dtype=F64)


# --- inputs ---------------------------------------------------------------------------


def inputs(  # type: ignore[no-untyped-def]
    seed, batch=2, steps=7, heads=2, dk=3, dv=4, dtype=F64, cu=None, positive=False
):
    """q, k (B, T, H, K), v (B, T, H, V), log decays g (B, T, H), gk (B, T, H, K), gv
    (B, T, H, V) in [-1, 0), states h0 (N, H, K, V) and z0 (N, 1, H, K) > 0; q and k
    positive with ``positive`` (linear_attn's normalization divides by q . z)."""
    gen = torch.Generator().manual_seed(seed)
    n = batch if cu is None else len(cu) - 1

    def r(*shape):  # type: ignore[no-untyped-def]
        if positive:
            return (torch.rand(*shape, generator=gen, dtype=F64) + 0.1).to(dtype)
        return torch.randn(*shape, generator=gen, dtype=F64).to(dtype)

    def u(*shape):  # type: ignore[no-untyped-def]
        return torch.rand(*shape, generator=gen, dtype=F64).to(dtype)

    return {
        "q": r(batch, steps, heads, dk),
        "k": r(batch, steps, heads, dk) * dk**-0.5,
        "v": torch.randn(batch, steps, heads, dv, generator=gen, dtype=F64).to(dtype),
        "g": -u(batch, steps, heads),
        "gk": -u(batch, steps, heads, dk),
        "gv": -u(batch, steps, heads, dv),
        "h0": torch.randn(n, heads, dk, dv, generator=gen, dtype=F64).to(dtype),
        "z0": (u(n, 1, heads, dk) + 0.5).to(dtype),
    }


LINEAR = [chunk_linear_attn, fused_recurrent_linear_attn, fused_chunk_linear_attn]
FUNCTIONS = [
    chunk_gla, fused_recurrent_gla, chunk_simple_gla, fused_recurrent_simple_gla, *LINEAR,
    chunk_retention, fused_recurrent_retention, chunk_lightning_attn,
    fused_recurrent_lightning_attn,
]  # fmt: skip
REVERSE = [
    fused_recurrent_gla, fused_recurrent_simple_gla, fused_recurrent_linear_attn,
    fused_recurrent_retention, fused_recurrent_lightning_attn,
]  # fmt: skip
V_FIRST = [
    chunk_gla, fused_recurrent_gla, chunk_simple_gla, fused_recurrent_simple_gla,
    fused_recurrent_retention,
]  # fmt: skip
OUT_V = {chunk_gla, fused_chunk_linear_attn}  # o in v's dtype; the others in q's
KWARGS = {  # what each original reads from **kwargs (None: it has none)
    chunk_gla: None, fused_recurrent_gla: "transpose_state_layout",
    chunk_simple_gla: "chunk_size", fused_recurrent_simple_gla: "transpose_state_layout",
    chunk_linear_attn: None, fused_recurrent_linear_attn: None, fused_chunk_linear_attn: None,
    chunk_retention: "chunk_size", fused_recurrent_retention: "transpose_state_layout",
    chunk_lightning_attn: "chunk_size", fused_recurrent_lightning_attn: None,
}  # fmt: skip
LAYER = (1, 4)  # Lightning attention's layer_idx, num_layers in these tests


def name(fn) -> str:  # type: ignore[no-untyped-def]
    return f"parascan.compat.fla.{fn.__name__}"


def call(fn, x, *, h0=None, **options):  # type: ignore[no-untyped-def]
    """fn on inputs ``x`` by fla's positional conventions (linear_attn without
    normalize); the reference's decay kwargs."""
    q, k, v = x["q"], x["k"], x["v"]
    heads = q.shape[2]
    if fn is chunk_gla:
        return fn(q, k, v, x["gk"], initial_state=h0, **options), {"gk": x["gk"]}
    if fn is fused_recurrent_gla:
        return fn(q, k, v, x["gk"], initial_state=h0, **options), {"gk": x["gk"]}
    if fn in (chunk_simple_gla, fused_recurrent_simple_gla):
        return fn(q, k, v, x["g"], initial_state=h0, **options), {"g": x["g"]}
    if fn in LINEAR:
        options.setdefault("normalize", False)
        return fn(q, k, v, initial_state=h0, **options), {}
    if fn in (chunk_retention, fused_recurrent_retention):
        fixed = retention_decay(heads).expand(q.shape[:3])
        return fn(q, k, v, initial_state=h0, **options), {"g": fixed}
    fixed = lightning_decay(heads, *LAYER).expand(q.shape[:3])
    return fn(q, k, v, *LAYER, initial_state=h0, **options), {"g": fixed}


# --- signatures -------------------------------------------------------------------------

# flash-linear-attention 0.6.0 (fla-core): fla/ops/gla/{chunk,fused_recurrent}.py,
# fla/ops/simple_gla/{chunk,fused_recurrent}.py,
# fla/ops/linear_attn/{chunk,fused_recurrent,fused_chunk}.py,
# fla/ops/retention/{chunk,fused_recurrent}.py, fla/ops/lightning_attn/{chunk,fused_recurrent}.py
E = inspect.Parameter.empty
FLA_SIGNATURES = {
    chunk_gla: ("gla/chunk.py", [
        ("q", E), ("k", E), ("v", E), ("g", E), ("scale", None), ("initial_state", None),
        ("output_final_state", False), ("state_v_first", False), ("cu_seqlens", None),
        ("cu_seqlens_cpu", None),
    ]),
    fused_recurrent_gla: ("gla/fused_recurrent.py", [
        ("q", E), ("k", E), ("v", E), ("gk", None), ("gv", None), ("scale", None),
        ("initial_state", None), ("output_final_state", False), ("reverse", False),
        ("state_v_first", False), ("cu_seqlens", None), ("kwargs", "**"),
    ]),
    chunk_simple_gla: ("simple_gla/chunk.py", [
        ("q", E), ("k", E), ("v", E), ("g", None), ("g_gamma", None), ("scale", None),
        ("initial_state", None), ("output_final_state", False), ("state_v_first", False),
        ("cu_seqlens", None), ("cu_seqlens_cpu", None), ("kwargs", "**"),
    ]),
    fused_recurrent_simple_gla: ("simple_gla/fused_recurrent.py", [
        ("q", E), ("k", E), ("v", E), ("g", None), ("g_gamma", None), ("scale", None),
        ("initial_state", None), ("output_final_state", False), ("reverse", False),
        ("state_v_first", False), ("cu_seqlens", None), ("kwargs", "**"),
    ]),
    chunk_linear_attn: ("linear_attn/chunk.py", [
        ("q", E), ("k", E), ("v", E), ("scale", None), ("initial_state", None),
        ("output_final_state", False), ("normalize", True), ("cu_seqlens", None),
    ]),
    fused_recurrent_linear_attn: ("linear_attn/fused_recurrent.py", [
        ("q", E), ("k", E), ("v", E), ("scale", None), ("initial_state", None),
        ("output_final_state", False), ("reverse", False), ("normalize", False),
        ("cu_seqlens", None),
    ]),
    fused_chunk_linear_attn: ("linear_attn/fused_chunk.py", [
        ("q", E), ("k", E), ("v", E), ("scale", None), ("initial_state", None),
        ("output_final_state", False), ("normalize", True), ("cu_seqlens", None),
    ]),
    chunk_retention: ("retention/chunk.py", [
        ("q", E), ("k", E), ("v", E), ("scale", None), ("initial_state", None),
        ("output_final_state", False), ("cu_seqlens", None), ("kwargs", "**"),
    ]),
    fused_recurrent_retention: ("retention/fused_recurrent.py", [
        ("q", E), ("k", E), ("v", E), ("scale", None), ("initial_state", None),
        ("output_final_state", False), ("reverse", False), ("state_v_first", False),
        ("cu_seqlens", None), ("kwargs", "**"),
    ]),
    chunk_lightning_attn: ("lightning_attn/chunk.py", [
        ("q", E), ("k", E), ("v", E), ("layer_idx", E), ("num_layers", E), ("scale", None),
        ("initial_state", None), ("output_final_state", False), ("cu_seqlens", None),
        ("kwargs", "**"),
    ]),
    fused_recurrent_lightning_attn: ("lightning_attn/fused_recurrent.py", [
        ("q", E), ("k", E), ("v", E), ("layer_idx", E), ("num_layers", E), ("scale", None),
        ("initial_state", None), ("output_final_state", False), ("reverse", False),
        ("cu_seqlens", None),
    ]),
}  # fmt: skip


def source_signature(path: Path, function: str) -> list[tuple[str, object]]:
    """A function's parameters in an fla source file, read with ast (not imported)."""
    tree = ast.parse(path.read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function)
    args = node.args.args
    defaults = [E] * (len(args) - len(node.args.defaults)) + [
        ast.literal_eval(d) for d in node.args.defaults
    ]
    out: list[tuple[str, object]] = [(a.arg, d) for a, d in zip(args, defaults, strict=True)]
    if node.args.kwarg is not None:
        out.append((node.args.kwarg.arg, "**"))
    return out


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
    spec = importlib.util.find_spec("fla")
    if spec is None or not spec.submodule_search_locations:
        pytest.importorskip("fla")
    assert spec is not None and spec.submodule_search_locations
    root = Path(next(iter(spec.submodule_search_locations))) / "ops"
    for fn, (path, want) in FLA_SIGNATURES.items():
        assert source_signature(root / path, fn.__name__) == want, fn.__name__


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
        (o, final), decay = call(fn, x, h0=h0, output_final_state=True, scale=scale,
                                 cu_seqlens=cu_t)  # fmt: skip
        want, want_final = la_loop(x["q"], x["k"], x["v"], **decay, scale=scale, h0=h0, cu=cu)
        assert o.dtype == F64 and final.dtype == F64 and final.is_contiguous()
        assert_matches(o, want, F64)
        assert_matches(final, want_final, F64)
    (o, none), _ = call(fn, x, cu_seqlens=cu_t)
    assert none is None and o.shape == x["v"].shape


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dtypes_as_in_fla(fn, dtype) -> None:
    """o in q's or v's dtype as the original returns it, the final state float32."""
    x = inputs(4, dtype=dtype)
    x["v"] = x["v"].float()
    (o, final), decay = call(fn, x, h0=x["h0"], output_final_state=True)
    assert o.dtype == (torch.float32 if fn in OUT_V else dtype)
    assert final.dtype == torch.float32
    want, want_final = la_loop(x["q"], x["k"], x["v"], **decay, h0=x["h0"])
    assert_matches(o, want, dtype)
    assert_matches(final, want_final, dtype)


@pytest.mark.parametrize("fn", REVERSE, ids=lambda f: f.__name__)
@pytest.mark.parametrize("cu", [None, [0, 4, 4, 7]], ids=["batch", "packed"])
def test_reverse(fn, cu) -> None:
    x = inputs(5, batch=2 if cu is None else 1, cu=cu)
    cu_t = None if cu is None else torch.tensor(cu)
    (o, final), decay = call(fn, x, h0=x["h0"], output_final_state=True, reverse=True,
                             cu_seqlens=cu_t)  # fmt: skip
    want, want_final = la_loop(x["q"], x["k"], x["v"], **decay, h0=x["h0"], cu=cu, reverse=True)
    assert_matches(o, want, F64)
    assert_matches(final, want_final, F64)


@pytest.mark.parametrize("fn", V_FIRST, ids=lambda f: f.__name__)
def test_state_v_first_and_transpose_state_layout(fn) -> None:
    x = inputs(6)
    h0 = x["h0"]
    decay = call(fn, x)[1]
    want, want_final = la_loop(x["q"], x["k"], x["v"], **decay, h0=h0)
    h0_vk = h0.transpose(-1, -2).contiguous()
    (o, final), _ = call(fn, x, h0=h0_vk, output_final_state=True, state_v_first=True)
    assert final.shape == h0_vk.shape and final.is_contiguous()
    assert_matches(o, want, F64)
    assert_matches(final, want_final.transpose(-1, -2), F64)
    with pytest.raises(ValueError, match=r"expected initial_state of shape \(N, H, V, K\)"):
        call(fn, x, h0=h0, state_v_first=True)
    if KWARGS[fn] == "transpose_state_layout":
        with pytest.warns(DeprecationWarning, match="transpose_state_layout is deprecated"):
            (o2, final2), _ = call(fn, x, h0=h0_vk, output_final_state=True,
                                   transpose_state_layout=True)  # fmt: skip
        assert torch.equal(o2, o) and torch.equal(final2, final)
        with pytest.raises(ValueError, match=f"{name(fn)}: expected state_v_first or the"):
            call(fn, x, state_v_first=True, transpose_state_layout=True)


@pytest.mark.parametrize("cu", [None, [0, 2, 2, 7]], ids=["batch", "packed"])
@pytest.mark.parametrize("reverse", [False, True])
def test_gla_value_decays(cu, reverse) -> None:
    """fused_recurrent_gla's gv (per value channel), alone and with gk, in either
    direction and state layout."""
    x = inputs(7, batch=2 if cu is None else 1, dv=5, cu=cu)
    cu_t = None if cu is None else torch.tensor(cu)
    q, k, v, h0 = x["q"], x["k"], x["v"], x["h0"]
    for gk in (None, x["gk"]):
        want, want_final = la_loop(q, k, v, gk=gk, gv=x["gv"], h0=h0, cu=cu, reverse=reverse)
        o, final = fused_recurrent_gla(
            q,
            k,
            v,
            gk,
            x["gv"],
            initial_state=h0,
            output_final_state=True,
            reverse=reverse,
            cu_seqlens=cu_t,
        )
        assert_matches(o, want, F64)
        assert_matches(final, want_final, F64)
        o, final = fused_recurrent_gla(
            q, k, v, gk, x["gv"], initial_state=h0.transpose(-1, -2), output_final_state=True,
            reverse=reverse, state_v_first=True, cu_seqlens=cu_t,
        )  # fmt: skip
        assert_matches(o, want, F64)
        assert_matches(final.transpose(-1, -2), want_final, F64)
    o, _ = fused_recurrent_gla(q, k, v, reverse=reverse, cu_seqlens=cu_t)  # no decay
    assert_matches(o, la_loop(q, k, v, cu=cu, reverse=reverse)[0], F64)


def test_simple_gla_g_and_g_gamma() -> None:
    """g per step and head, g_gamma per head, both (their sum), neither (no decay)."""
    x = inputs(8)
    q, k, v, g = x["q"], x["k"], x["v"], x["g"]
    gamma = -torch.rand(2, generator=torch.Generator().manual_seed(9), dtype=F64)
    fixed = gamma.expand(q.shape[:3])
    for fn in (chunk_simple_gla, fused_recurrent_simple_gla):
        for g_, gamma_, want_g in ((g, None, g), (None, gamma, fixed), (g, gamma, g + fixed),
                                   (None, None, None)):  # fmt: skip
            o, final = fn(q, k, v, g_, gamma_, initial_state=x["h0"], output_final_state=True)
            want, want_final = la_loop(q, k, v, g=want_g, h0=x["h0"])
            assert_matches(o, want, F64)
            assert_matches(final, want_final, F64)


def test_retention_and_lightning_decays() -> None:
    """The fixed decays from the head index, the head count and (Lightning) the
    layer's place; float32 inputs get them in float32, as the originals."""
    x = inputs(10, heads=5, dtype=torch.float32)
    q, k, v = x["q"], x["k"], x["v"]
    fixed = retention_decay(5).expand(q.shape[:3])
    want = la_loop(q, k, v, g=fixed)[0]
    assert_matches(chunk_retention(q, k, v)[0], want, torch.float32)
    assert_matches(fused_recurrent_retention(q, k, v)[0], want, torch.float32)
    for layer_idx, num_layers in ((0, 1), (3, 12), (12, 12), (20, 12)):
        fixed = lightning_decay(5, layer_idx, num_layers).expand(q.shape[:3])
        want = la_loop(q, k, v, g=fixed)[0]
        for fn in (chunk_lightning_attn, fused_recurrent_lightning_attn):
            assert_matches(fn(q, k, v, layer_idx, num_layers)[0], want, torch.float32)


# --- linear_attn's normalize --------------------------------------------------------------


@pytest.mark.parametrize("fn", LINEAR, ids=lambda f: f.__name__)
@pytest.mark.parametrize("cu", [None, [0, 3, 3, 7]], ids=["batch", "packed"])
def test_linear_attn_normalize(fn, cu) -> None:
    x = inputs(11, batch=2 if cu is None else 1, cu=cu, positive=True)
    cu_t = None if cu is None else torch.tensor(cu)
    q, k, v, h0, z0 = x["q"], x["k"], x["v"], x["h0"], x["z0"]
    reverses = (False, True) if fn is fused_recurrent_linear_attn else (False,)
    for reverse in reverses:
        extra = {"reverse": reverse} if reverse else {}
        for initial, kv0, z0_ in ((None, None, None), (h0, h0, None), ((h0, z0), h0, z0),
                                  ((None, z0), None, z0)):  # fmt: skip
            num, want_kv = la_loop(q, k, v, h0=kv0, cu=cu, reverse=reverse)
            den, want_z = key_sums(q, k, z0=z0_, cu=cu, reverse=reverse)
            for final_state in (False, True):
                o, (kv, z) = fn(q, k, v, initial_state=initial, output_final_state=final_state,
                                normalize=True, cu_seqlens=cu_t, **extra)  # fmt: skip
                assert_matches(o, num / den, F64)
                assert_matches(z, want_z, F64)
                assert z.dtype == F64 and z.is_contiguous()
                if final_state:
                    assert_matches(kv, want_kv, F64)
                else:
                    assert kv is None
    if cu is not None:  # the empty sequence keeps its key sum
        _, (_, z) = fn(q, k, v, initial_state=(None, z0), normalize=True, cu_seqlens=cu_t)
        assert torch.equal(z[1], z0[1])


def test_linear_attn_normalize_dtypes() -> None:
    """o in q's (v's for fused_chunk) dtype promoted with k's, as fla's division; z in
    k's; with float32 states."""
    x = inputs(12, positive=True, dtype=torch.bfloat16)
    q, k, v = x["q"], x["k"].float(), x["v"]
    num, _ = la_loop(q, k, v)
    den, want_z = key_sums(q, k)
    for fn in LINEAR:
        o, (kv, z) = fn(q, k, v, normalize=True, output_final_state=True)
        assert o.dtype == torch.float32 and z.dtype == torch.float32
        assert kv.dtype == torch.float32
        assert_matches(o, num / den, torch.bfloat16)
        assert_matches(z, want_z, torch.bfloat16)


# --- fla's own naive references ------------------------------------------------------------


def test_gla_against_fla_s_naive_recurrent_gla() -> None:
    naive = fla_naive("gla")
    x = inputs(13, dtype=torch.float32, dk=5, dv=3)
    q, k, v, gk, h0 = x["q"], x["k"], x["v"], x["gk"], x["h0"]
    want, want_final = naive.naive_recurrent_gla(q, k, v, gk, h0, output_final_state=True)
    for fn in (chunk_gla, fused_recurrent_gla):
        o, final = fn(q, k, v, gk, initial_state=h0, output_final_state=True)
        assert_matches(o, want.double(), torch.float32)
        assert_matches(final, want_final.double(), torch.float32)


def test_simple_gla_against_fla_s_naive_references() -> None:
    naive = fla_naive("simple_gla")
    x = inputs(14, dtype=torch.float32, steps=20, dk=4, dv=6)
    q, k, v, g, h0 = x["q"], x["k"], x["v"], x["g"], x["h0"]
    want, want_final = naive.naive_recurrent_simple_gla(q, k, v, g, 0.8, h0, True)
    chunked, chunked_final = naive.naive_chunk_simple_gla(q, k, v, g, h0, True, 8, 0.8)
    for fn in (chunk_simple_gla, fused_recurrent_simple_gla):
        o, final = fn(q, k, v, g, scale=0.8, initial_state=h0, output_final_state=True)
        for reference, reference_final in ((want, want_final), (chunked, chunked_final)):
            assert_matches(o, reference.double(), torch.float32)
            assert_matches(final, reference_final.double(), torch.float32)


def test_linear_attn_against_fla_s_naive_recurrent_linear_attn() -> None:
    naive = fla_naive("linear_attn")
    x = inputs(15, dtype=torch.float32, positive=True)
    q, k, v, h0, z0 = x["q"], x["k"], x["v"], x["h0"], x["z0"]
    want, want_kv = naive.naive_recurrent_linear_attn(q, k, v, None, h0, True)
    for fn in LINEAR:
        o, kv = fn(q, k, v, initial_state=h0, output_final_state=True, normalize=False)
        assert_matches(o, want.double(), torch.float32)
        assert_matches(kv, want_kv.double(), torch.float32)
    want, (want_kv, want_z) = naive.naive_recurrent_linear_attn(
        q, k, v, 0.5, (h0, z0), True, normalize=True
    )
    for fn in LINEAR:
        o, (kv, z) = fn(q, k, v, 0.5, (h0, z0), True, normalize=True)
        assert_matches(o, want.double(), torch.float32)
        assert_matches(kv, want_kv.double(), torch.float32)
        assert_matches(z, want_z.double(), torch.float32)


def test_retention_against_fla_s_naive_retention() -> None:
    naive = fla_naive("retention")
    x = inputs(16, dtype=torch.float32, heads=4, steps=9)
    q, k, v = x["q"], x["k"], x["v"]
    want = naive.naive_retention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    for fn in (chunk_retention, fused_recurrent_retention):
        assert_matches(fn(q, k, v)[0], want.double(), torch.float32)


# --- gradients ---------------------------------------------------------------------------


def tiny(seed, cu=None, positive=False, heads=1):  # type: ignore[no-untyped-def]
    x = inputs(seed, batch=1, steps=5, heads=heads, dk=2, dv=2, cu=cu, positive=positive)
    return {n: t.clone().requires_grad_() for n, t in x.items()}


def test_gradcheck_gla() -> None:
    x = tiny(21, [0, 2, 2, 5])
    cu = torch.tensor([0, 2, 2, 5])

    def f(q, k, v, gk, gv, h0):  # type: ignore[no-untyped-def]
        return fused_recurrent_gla(q, k, v, gk, gv, 0.8, h0, True, True, True, cu)

    assert torch.autograd.gradcheck(f, [x[n] for n in ("q", "k", "v", "gk", "gv", "h0")])
    x = tiny(22)

    def c(q, k, v, g, h0):  # type: ignore[no-untyped-def]
        return chunk_gla(q, k, v, g, None, h0, True)

    assert torch.autograd.gradcheck(c, [x[n] for n in ("q", "k", "v", "gk", "h0")])


def test_gradcheck_simple_gla() -> None:
    x = tiny(23)
    gamma = (
        -torch.rand(1, generator=torch.Generator().manual_seed(24), dtype=F64)
    ).requires_grad_()

    def f(q, k, v, g, gamma, h0):  # type: ignore[no-untyped-def]
        return chunk_simple_gla(q, k, v, g, gamma, initial_state=h0, output_final_state=True)

    assert torch.autograd.gradcheck(f, [x["q"], x["k"], x["v"], x["g"], gamma, x["h0"]])


def test_gradcheck_linear_attn_normalize() -> None:
    x = tiny(25, [0, 3, 5], positive=True)
    cu = torch.tensor([0, 3, 5])

    def f(q, k, v, h0, z0):  # type: ignore[no-untyped-def]
        o, (kv, z) = fused_recurrent_linear_attn(q, k, v, None, (h0, z0), True, True, True, cu)
        return o, kv, z

    assert torch.autograd.gradcheck(f, [x[n] for n in ("q", "k", "v", "h0", "z0")])


def test_gradcheck_retention_and_lightning() -> None:
    x = tiny(26, heads=2)  # head 1 decays
    leaves = [x[n] for n in ("q", "k", "v", "h0")]

    def r(q, k, v, h0):  # type: ignore[no-untyped-def]
        return fused_recurrent_retention(q, k, v, None, h0, True, True)

    def lt(q, k, v, h0):  # type: ignore[no-untyped-def]
        return chunk_lightning_attn(q, k, v, 1, 3, 0.9, h0, True)

    assert torch.autograd.gradcheck(r, leaves)
    assert torch.autograd.gradcheck(lt, leaves)


def test_gradients_match_the_loop_s() -> None:
    """The backward of fused_recurrent_gla with gk and gv against autograd through the
    float64 loop."""
    x = tiny(27, [0, 3, 5])
    names = ("q", "k", "v", "gk", "gv", "h0")
    o, final = fused_recurrent_gla(
        x["q"],
        x["k"],
        x["v"],
        x["gk"],
        x["gv"],
        initial_state=x["h0"],
        output_final_state=True,
        cu_seqlens=torch.tensor([0, 3, 5]),
    )
    got = torch.autograd.grad(o.square().sum() + final.sum(), [x[n] for n in names])
    o, final = la_loop(x["q"], x["k"], x["v"], gk=x["gk"], gv=x["gv"], h0=x["h0"], cu=[0, 3, 5])
    want = torch.autograd.grad(o.square().sum() + final.sum(), [x[n] for n in names])
    for a, b in zip(got, want, strict=True):
        assert_matches(a, b, F64)


# --- errors -----------------------------------------------------------------------------


@pytest.mark.parametrize("fn", FUNCTIONS, ids=lambda f: f.__name__)
def test_bad_input_raises_naming_the_function(fn) -> None:
    fname = name(fn)
    x = inputs(28)
    one = {n: t[:1] for n, t in x.items()}
    with pytest.raises(ValueError, match=rf"{fname}: expected q of shape \(B, T, H, K\)"):
        call(fn, {**x, "q": x["q"][0]})
    with pytest.raises(ValueError, match=f"{fname}: expected k of shape"):
        call(fn, {**x, "k": x["k"][:, :, :1]})
    with pytest.raises(ValueError, match=rf"{fname}: expected v of shape \(B, T, H, V\) with"):
        call(fn, {**x, "v": torch.zeros(2, 7, 4, 4, dtype=F64)})
    with pytest.raises(ValueError, match=f"{fname}: expected v with at least one value channel"):
        call(fn, {**x, "v": x["v"][..., :0]})
    with pytest.raises(TypeError, match=f"{fname}: expected q to have a real floating"):
        call(fn, {**x, "q": x["q"].long()})
    with pytest.raises(TypeError, match=f"{fname}: expected v to be a Tensor"):
        call(fn, {**x, "v": [1.0]})
    with pytest.raises(ValueError, match=f"{fname}: with cu_seqlens .* batch of one"):
        call(fn, x, cu_seqlens=torch.tensor([0, 7]))
    with pytest.raises(ValueError, match=f"{fname}: expected cu_seqlens to be non-decreasing"):
        call(fn, one, cu_seqlens=torch.tensor([0, 5, 4, 7]))
    with pytest.raises(ValueError, match=rf"{fname}: expected initial_state of shape \(N, H, K"):
        call(fn, x, h0=x["h0"][:1])
    with pytest.raises(ValueError, match=rf"{fname}: expected initial_state .*sequences in cu_s"):
        call(fn, one, h0=x["h0"][:1], cu_seqlens=torch.tensor([0, 5, 7]))
    for scale in ("0.5", 10**400):
        with pytest.raises(TypeError, match=f"{fname}: expected scale or None to be a finite"):
            call(fn, x, scale=scale)
    with pytest.raises(TypeError, match=f"{fname}: expected output_final_state to be a bool"):
        call(fn, x, output_final_state=1)
    with pytest.raises(ValueError, match=f"{fname}: expected all tensors on one device"):
        call(fn, x, h0=x["h0"].to("meta"))
    with pytest.raises(ValueError) as info:  # K = 0: refused by the scan, named as the drop-in
        call(fn, {**x, "q": x["q"][..., :0], "k": x["k"][..., :0], "gk": x["gk"][..., :0]})
    assert str(info.value).startswith(f"{fname}: expected q with at least one head")
    assert str(info.value).endswith("(parascan.linear_attention_scan checked it)")
    if KWARGS[fn] is not None:
        with pytest.raises(TypeError, match=f"{fname}: got unexpected keyword argument.*foo"):
            call(fn, x, foo=1)
        with pytest.raises(ValueError, match=f"{fname}: expected inputs in the .*head_first"):
            call(fn, x, head_first=True)
        call(fn, x, head_first=False)
    else:
        with pytest.raises(TypeError, match="unexpected keyword argument 'foo'"):
            call(fn, x, foo=1)
    if KWARGS[fn] == "chunk_size":
        for size in (0, 48, 2.0, True):
            with pytest.raises(ValueError, match=f"{fname}: expected chunk_size to be None or a"):
                call(fn, x, chunk_size=size)
        call(fn, x, chunk_size=32)
    if fn in REVERSE:
        with pytest.raises(TypeError, match=f"{fname}: expected reverse to be a bool"):
            call(fn, x, reverse=None)
    if fn in V_FIRST:
        with pytest.raises(TypeError, match=f"{fname}: expected state_v_first to be a bool"):
            call(fn, x, state_v_first=None)
    if fn in (chunk_gla, chunk_simple_gla):
        with pytest.raises(ValueError, match=f"{fname}: expected cu_seqlens_cpu to hold"):
            call(
                fn, one, cu_seqlens=torch.tensor([0, 5, 7]), cu_seqlens_cpu=torch.tensor([0, 6, 7])
            )
        with pytest.raises(ValueError, match=f"{fname}: cu_seqlens_cpu is a CPU copy"):
            call(fn, x, cu_seqlens_cpu=torch.tensor([0, 7]))


def test_bad_gates_and_options_raise() -> None:
    x = inputs(29)
    q, k, v = x["q"], x["k"], x["v"]
    fname = name(chunk_gla)
    with pytest.raises(ValueError, match=rf"{fname}: expected g of shape \(B, T, H, K\) like q"):
        chunk_gla(q, k, v, x["g"])
    with pytest.raises(TypeError, match=f"{fname}: expected g to be a Tensor"):
        chunk_gla(q, k, v, None)
    fname = name(fused_recurrent_gla)
    with pytest.raises(ValueError, match=f"{fname}: expected gk of shape"):
        fused_recurrent_gla(q, k, v, x["gv"])
    with pytest.raises(ValueError, match=rf"{fname}: expected gv of shape \(B, T, H, V\)"):
        fused_recurrent_gla(q, k, v, None, x["gk"][..., :1])
    for fn in (chunk_simple_gla, fused_recurrent_simple_gla):
        fname = name(fn)
        with pytest.raises(ValueError, match=rf"{fname}: expected g of shape \(B, T, H\)"):
            fn(q, k, v, x["gk"])
        with pytest.raises(ValueError, match=rf"{fname}: expected g_gamma of shape \(H,\)"):
            fn(q, k, v, None, x["g"][0, 0, :1])
    for fn in (chunk_lightning_attn, fused_recurrent_lightning_attn):
        fname = name(fn)
        with pytest.raises(TypeError, match=f"{fname}: expected layer_idx to be an int"):
            fn(q, k, v, 1.0, 4)
        with pytest.raises(TypeError, match=f"{fname}: expected num_layers to be an int"):
            fn(q, k, v, 1, True)
        with pytest.raises(ValueError, match=f"{fname}: .* expected num_layers >= 1, but got 0"):
            fn(q, k, v, 1, 0)
    for fn in LINEAR:
        fname = name(fn)
        h0, z0 = x["h0"], x["z0"]
        with pytest.raises(TypeError, match=f"{fname}: a \\(kv_state, z_state\\) pair is"):
            fn(q, k, v, initial_state=(h0, z0), normalize=False)
        with pytest.raises(TypeError, match=f"{fname}: a \\(kv_state, z_state\\) pair is"):
            fn(q, k, v, initial_state=(h0, z0, z0), normalize=True)
        with pytest.raises(ValueError, match=rf"{fname}: expected z_state of shape \(N, 1, H, K\)"):
            fn(q, k, v, initial_state=(h0, z0[:, 0]), normalize=True)
        with pytest.raises(TypeError, match=f"{fname}: expected normalize to be a bool"):
            fn(q, k, v, normalize=None)


def test_inputs_are_not_modified() -> None:
    x = inputs(30, positive=True)
    before = {n: t.clone() for n, t in x.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for fn in FUNCTIONS:
            call(fn, x, h0=x["h0"], output_final_state=True)
        for fn in LINEAR:
            fn(x["q"], x["k"], x["v"], initial_state=(x["h0"], x["z0"]), normalize=True)
        fused_recurrent_gla(x["q"], x["k"], x["v"], x["gk"], x["gv"], initial_state=x["h0"],
                            reverse=True)  # fmt: skip
    for n, t in x.items():
        assert torch.equal(t, before[n]), n
