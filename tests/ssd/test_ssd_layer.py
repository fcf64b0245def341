"""Mamba-2's fused CPU layer (parascan.ssd.layer; C kernels in ssd/cpu_layer.h): the
causal convolution and the gated RMS norm against the float64 loops
(oracles.causal_conv_loop, oracles.gated_rms_norm_loop), values and gradients, on
lengths around the kernels' tiles (steps of 64, channels of 64, rows of 16), channel
counts and group sizes that no vector width divides, every filter width up to the
limit's neighbourhood, strided inputs, both instruction-set builds, and the same bits
for any thread count; then the whole layer through
parascan.compat.mamba_ssm.mamba_split_conv1d_scan_combined: float64 gradcheck, equal
to its unfused torch path, and who takes which path. The layer against mamba_ssm's
math in float64 is tests/compat/test_compat_mamba_split_conv.py."""

from __future__ import annotations

import math

import pytest
import torch

from parascan.compat import mamba_ssm
from parascan.ssd import layer as ssd_layer

from conftest import simd_path, threads
from oracles import causal_conv_loop, gated_rms_norm_loop

F64 = torch.float64


CONV_CASES = [  # (batch, length, channels, width, split)
    (1, 0, 5, 4, (3, 1, 1)),
    (2, 1, 3, 4, (1, 1, 1)),
    (1, 2, 7, 1, (7, 0, 0)),
    (2, 3, 70, 2, (60, 5, 5)),
    (1, 17, 66, 5, (0, 66, 0)),
    (1, 63, 129, 4, (100, 13, 16)),
    (2, 65, 20, 3, (4, 8, 8)),
    (1, 129, 64, 16, (32, 16, 16)),
]


def _conv_operands(case, dtype, seed=0):  # type: ignore[no-untyped-def]
    batch, length, channels, width, _ = case
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(batch, length, channels + 9, generator=g, dtype=F64)
    x = wide[..., 4 : 4 + channels]  # strided: a slice of the channels, as of zxbcdt
    w = torch.randn(channels, width, generator=g, dtype=F64) * 0.5
    b = torch.randn(channels, generator=g, dtype=F64) * 0.3
    return x.to(dtype), w.to(dtype), b.to(dtype)


@pytest.mark.parametrize("case", CONV_CASES)
@pytest.mark.parametrize("silu,bias", [(True, True), (False, False)])
@pytest.mark.parametrize("simd", [True, False], ids=["simd", "portable"])
def test_convolution_against_loop(case, silu, bias, simd) -> None:  # type: ignore[no-untyped-def]
    split = case[4]
    for dtype, tol in ((F64, 1e-12), (torch.float32, 2e-5)):
        x, w, b = _conv_operands(case, dtype)
        b = b if bias else None
        with simd_path(simd):
            pieces = ssd_layer.conv_forward(x, w, b, silu, split)
        want = causal_conv_loop(x.double(), w.double(), None if b is None else b.double(), silu)
        got = torch.cat(pieces, -1)
        assert got.dtype == dtype and all(p.is_contiguous() for p in pieces)
        assert [p.shape[-1] for p in pieces] == list(split)
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("case", CONV_CASES)
@pytest.mark.parametrize("silu,bias", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("simd", [True, False], ids=["simd", "portable"])
def test_convolution_gradients_against_loop(case, silu, bias, simd) -> None:  # type: ignore[no-untyped-def]
    split = case[4]
    x, w, b = (t.requires_grad_() for t in _conv_operands(case, F64, seed=1))
    bias_t = b if bias else None
    out = causal_conv_loop(x, w, bias_t, silu)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=F64)
    used = [x, w] + ([b] if bias else [])
    want = torch.autograd.grad(out, used, grad, allow_unused=True) if out.numel() else None
    grad_x = torch.full(x.shape, math.nan, dtype=F64)  # every element must be written
    with simd_path(simd):
        gw, gb = ssd_layer.conv_backward(
            x.detach(), w.detach(), None if bias_t is None else b.detach(), silu,
            tuple(grad.split(list(split), -1)), grad_x,
        )  # fmt: skip
    assert (gb is None) == (not bias)
    if want is None:  # L == 0: nothing flows
        assert not gw.abs().sum() and (gb is None or not gb.abs().sum())
        return
    torch.testing.assert_close(grad_x, want[0], rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(gw, want[1], rtol=1e-12, atol=1e-12)
    if bias:
        torch.testing.assert_close(gb, want[2], rtol=1e-12, atol=1e-12)


NORM_CASES = [  # (batch, length, dim, groups)
    (1, 0, 6, 2),
    (2, 1, 12, 1),
    (1, 3, 12, 3),
    (2, 17, 70, 2),
    (1, 33, 129, 3),
    (1, 16, 64, 1),
]


def _norm_operands(case, seed=0):  # type: ignore[no-untyped-def]
    batch, length, dim, _ = case
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(batch, length, dim, generator=g, dtype=F64)
    wide = torch.randn(batch, length, dim + 5, generator=g, dtype=F64) * 2
    z = wide[..., 2 : 2 + dim]  # strided, as of zxbcdt
    w = 1 + 0.3 * torch.randn(dim, generator=g, dtype=F64)
    return y, z, w


@pytest.mark.parametrize("case", NORM_CASES)
@pytest.mark.parametrize("before", [False, True])
@pytest.mark.parametrize("simd", [True, False], ids=["simd", "portable"])
def test_norm_and_its_gradients_against_loop(case, before, simd) -> None:  # type: ignore[no-untyped-def]
    groups = case[3]
    y, z, w = (t.requires_grad_() for t in _norm_operands(case))
    want = gated_rms_norm_loop(y, z, w, 1e-5, groups, before)
    with simd_path(simd):
        got, rstd = ssd_layer.norm_forward(y.detach(), z.detach(), w.detach(), 1e-5, groups,
                                           before)  # fmt: skip
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert rstd.shape == (*y.shape[:2], groups)
    y32, z32, w32 = (t.detach().float() for t in (y, z, w))  # float32 against the same loop
    with simd_path(simd):
        got32, _ = ssd_layer.norm_forward(y32, z32, w32, 1e-5, groups, before)
    torch.testing.assert_close(got32.double(), want.detach(), rtol=2e-5, atol=2e-5)
    grad = torch.randn(want.shape, generator=torch.Generator().manual_seed(3), dtype=F64)
    grad_z = torch.full(z.shape, math.nan, dtype=F64)
    with simd_path(simd):
        gy, gw = ssd_layer.norm_backward(y.detach(), z.detach(), w.detach(), rstd, grad, before,
                                         grad_z)  # fmt: skip
    if not want.numel():
        assert gy.numel() == 0 and not gw.abs().sum()
        return
    want_y, want_z, want_w = torch.autograd.grad(want, (y, z, w), grad)
    torch.testing.assert_close(gy, want_y, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(grad_z, want_z, rtol=1e-11, atol=1e-11)
    torch.testing.assert_close(gw, want_w, rtol=1e-11, atol=1e-11)


def test_same_bits_any_thread_count() -> None:
    """The sums over batch and time (the weights' gradients) run in a fixed order."""
    case = (2, 129, 130, 4, (100, 15, 15))
    x, w, b = _conv_operands(case, torch.float32)
    grads = tuple(torch.randn(2, 129, s) for s in case[4])
    y, z, nw = (t.float() for t in _norm_operands((2, 129, 130, 2)))
    results = []
    for n in (1, 2, 3):
        with threads(n):
            pieces = ssd_layer.conv_forward(x, w, b, True, case[4])
            gx = torch.empty(x.shape)
            gw, gb = ssd_layer.conv_backward(x, w, b, True, grads, gx)
            out, rstd = ssd_layer.norm_forward(y, z, nw, 1e-6, 2, False)
            gz = torch.empty(z.shape)
            gy, gnw = ssd_layer.norm_backward(y, z, nw, rstd, y, False, gz)
        results.append([*pieces, gx, gw, gb, out, rstd, gz, gy, gnw])
    for other in results[1:]:
        for a, c in zip(results[0], other, strict=True):
            assert torch.equal(a, c)


# --- the whole layer through the compat function ----------------------------------------

HEADS, HEADDIM, GROUPS, N, WIDTH = 4, 3, 2, 5, 4


def _layer(length, dtype=F64, seed=0, extra=0):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    dim, conv_dim = HEADS * HEADDIM, HEADS * HEADDIM + 2 * GROUPS * N

    def r(*shape, scale=1.0):  # type: ignore[no-untyped-def]
        return (scale * torch.randn(*shape, generator=g, dtype=F64)).to(dtype).requires_grad_()

    return dict(
        zxbcdt=r(2, length, 2 * extra + dim + conv_dim + HEADS), conv1d_weight=r(conv_dim, WIDTH,
        scale=0.5), conv1d_bias=r(conv_dim, scale=0.3), dt_bias=r(HEADS, scale=0.5),
        A=(-0.1 - torch.rand(HEADS, generator=g, dtype=F64)).to(dtype).requires_grad_(),
        D=r(HEADS), rmsnorm_weight=1 + r(dim, scale=0.2).detach().requires_grad_(),
        initial_states=r(2, HEADS, HEADDIM, N),
    )  # fmt: skip


def _call(ops, **kw):  # type: ignore[no-untyped-def]
    return mamba_ssm.mamba_split_conv1d_scan_combined(
        ops["zxbcdt"], ops["conv1d_weight"], ops["conv1d_bias"], ops["dt_bias"], ops["A"],
        ops["D"], 64, initial_states=ops["initial_states"], rmsnorm_weight=ops["rmsnorm_weight"],
        headdim=HEADDIM, ngroups=GROUPS, return_final_states=True, **kw,
    )  # fmt: skip


def test_layer_gradcheck_float64() -> None:
    ops = _layer(5, seed=4)
    names = list(ops)

    def fn(*tensors):  # type: ignore[no-untyped-def]
        out, final = _call(dict(zip(names, tensors, strict=True)), norm_before_gate=False,
                           dt_limit=(0.05, 2.0))  # fmt: skip
        return out, final

    # fast mode: the Jacobian against finite differences along random directions
    assert torch.autograd.gradcheck(fn, tuple(ops.values()), fast_mode=True)


@pytest.mark.parametrize("length", [0, 1, 2, 63, 64, 65, 129])
@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_layer_equals_the_unfused_path(monkeypatch, length, dtype) -> None:  # type: ignore[no-untyped-def]
    """Fused and unfused (the torch ops and parascan.ssd_scan) give the same values and
    gradients of every input, with and without the extra gated channels."""
    extra = 2 if length % 2 else 0
    ops = _layer(length, dtype, seed=5, extra=extra)
    if length % 2 == 0:  # D per channel, (nheads, headdim)
        ops["D"] = torch.randn(HEADS, HEADDIM, dtype=F64).to(dtype).requires_grad_()
    # some lengths with a dt_limit that clamps steps at both ends
    limit = (0.5, 0.9) if length % 4 < 2 else (0.0, math.inf)
    kw = dict(norm_before_gate=bool(length % 3), outproj_weight=None, dt_limit=limit)
    calls = [0]
    fused = ssd_layer.split_conv_scan

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return fused(*args, **kwargs)

    monkeypatch.setattr(ssd_layer, "split_conv_scan", counted)
    got = _call(ops, **kw)
    assert calls == [1]  # the fused path did run
    monkeypatch.setattr(ssd_layer, "usable", lambda *a, **k: False)
    want = _call(ops, **kw)
    assert calls == [1]

    def tol(t: torch.Tensor) -> dict[str, float]:
        """float32: rounding of sums over up to 2 L terms, relative to their scale."""
        if dtype == F64:
            return dict(rtol=1e-10, atol=1e-10)
        return dict(rtol=1e-4, atol=1e-4 * max(1.0, t.abs().max().item() if t.numel() else 0))

    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, **tol(b))
    gen = torch.Generator().manual_seed(6)
    grads = [torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in got]
    used = list(ops.values())
    got_g = torch.autograd.grad(got, used, grads, allow_unused=True)
    want_g = torch.autograd.grad(want, used, grads, allow_unused=True)
    for name, a, b in zip(ops, got_g, want_g, strict=True):
        if b is None:
            assert a is None or not a.abs().sum(), name
            continue
        torch.testing.assert_close(a, b, **tol(b), msg=lambda m, n=name: f"{n}: {m}")


def test_who_takes_the_fused_path(monkeypatch) -> None:
    """float32 and float64 CPU tensors without seq_idx take it; half precision, seq_idx,
    no norm and torch.compile go the unfused way."""
    calls = [0]
    inner = ssd_layer.split_conv_scan

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return inner(*args, **kwargs)

    monkeypatch.setattr(ssd_layer, "split_conv_scan", counted)
    ops = _layer(7, torch.float32)
    _call(ops)
    assert calls == [1]
    _call(ops, seq_idx=torch.zeros(2, 7, dtype=torch.int32))
    bf16 = {k: v.detach().to(torch.bfloat16) for k, v in ops.items()}
    _call(bf16)
    ops_no_norm = dict(ops, rmsnorm_weight=None)
    _call(ops_no_norm)
    assert calls == [1]
    compiled = torch.compile(lambda o: _call(o), backend="eager", fullgraph=False)
    with torch.no_grad():
        compiled(ops)
    assert calls == [1]


def test_layer_refuses_second_derivatives_and_keeps_first_ones() -> None:
    """create_graph: the first derivatives as without it; differentiating them again is
    a clear error (the C kernels build no graph), never silently wrong."""
    ops = _layer(9, seed=7)
    out, final = _call(ops)
    used = list(ops.values())
    plain = torch.autograd.grad((out.sum() + final.sum()), used, retain_graph=True)
    graphed = torch.autograd.grad((out.sum() + final.sum()), used, create_graph=True)
    for a, b in zip(plain, graphed, strict=True):
        torch.testing.assert_close(a, b.detach(), rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="mamba_split_conv1d_scan_combined: second deriv"):
        torch.autograd.grad(graphed[0].square().sum(), used[0])


def test_layer_without_dt_bias(monkeypatch) -> None:
    """dt_bias=None (mamba_ssm accepts it): the unfused path, against dt_bias zeros."""
    ops = _layer(6, seed=8)
    got = _call(dict(ops, dt_bias=None))
    want = _call(dict(ops, dt_bias=torch.zeros(HEADS, dtype=F64)))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(chunk_size=0), "chunk_size to be a positive int"),
        (dict(chunk_size=None), "chunk_size to be a positive int"),
        (dict(norm_before_gate=None), "norm_before_gate to be a bool"),  # a TypeError
        (dict(rmsnorm_eps=-1.0), "rmsnorm_eps to be a finite number"),
        (dict(rmsnorm_eps="1e-5"), "rmsnorm_eps to be a finite number"),
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_options_are_checked_on_both_paths(kw, match, dtype) -> None:  # type: ignore[no-untyped-def]
    ops = {k: v.detach().to(dtype) for k, v in _layer(3).items()}
    args = dict(chunk_size=64, norm_before_gate=True, rmsnorm_eps=1e-6) | kw
    error = TypeError if "bool" in match else ValueError  # check_flag's, as every flag's
    with pytest.raises(error, match=f"mamba_split_conv1d_scan_combined: expected {match}"):
        mamba_ssm.mamba_split_conv1d_scan_combined(
            ops["zxbcdt"], ops["conv1d_weight"], ops["conv1d_bias"], ops["dt_bias"], ops["A"],
            ops["D"], args["chunk_size"], initial_states=ops["initial_states"],
            rmsnorm_weight=ops["rmsnorm_weight"], rmsnorm_eps=args["rmsnorm_eps"],
            norm_before_gate=args["norm_before_gate"], headdim=HEADDIM, ngroups=GROUPS,
        )  # fmt: skip
