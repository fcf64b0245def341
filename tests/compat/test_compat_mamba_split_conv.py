"""parascan.compat.mamba_ssm.mamba_split_conv1d_scan_combined (Mamba-2's fused layer)
against a float64 reference written here from mamba_ssm 2.x's documented math: split
zxbcdt into (zx0, z, xBC, dt); a causal depthwise convolution of xBC (+ bias, silu),
reading nothing across a change of seq_idx; the SSD scan (oracles.ssd_loop) with
softplus(dt + dt_bias) and dt_limit; D; the output gated by silu(z) or a gated RMS norm
over ngroups groups (before or after the gate); the swish-gated extra channels; the
output projection. Values and gradients of every input."""

from __future__ import annotations

import math

import pytest
import torch

from parascan.compat.mamba_ssm import mamba_split_conv1d_scan_combined

from oracles import ssd_loop

HEADS, HEADDIM, GROUPS, N, WIDTH, OUT = 4, 3, 2, 5, 4, 6


def reference(
    zxbcdt, weight, bias, dt_bias, A, D, *, initial=None, seq_idx=None, dt_limit=(0.0, math.inf),
    silu=True, norm=None, eps=1e-6, before_gate=True, proj=None, proj_bias=None, groups=GROUPS,
):  # type: ignore[no-untyped-def]  # fmt: skip
    """The layer in float64, one step and one tap at a time."""
    zxbcdt = zxbcdt.double()
    batch, length, channels = zxbcdt.shape
    dim = HEADS * HEADDIM
    conv_dim = weight.shape[0]
    extra = (channels - dim - conv_dim - HEADS) // 2
    zx0, z, xbc, dt = zxbcdt.split([2 * extra, dim, conv_dim, HEADS], -1)
    ids = torch.zeros(batch, length, dtype=torch.long) if seq_idx is None else seq_idx
    conv = []
    for t in range(length):
        acc = torch.zeros(batch, conv_dim, dtype=torch.float64)
        if bias is not None:
            acc = acc + bias.double()
        for k in range(WIDTH):
            s = t - (WIDTH - 1) + k
            if s >= 0:
                same = (ids[:, s] == ids[:, t]).double()[:, None]
                acc = acc + weight[:, k].double() * xbc[:, s] * same
        conv.append(acc * torch.sigmoid(acc) if silu else acc)
    xbc = torch.stack(conv, 1) if conv else xbc.new_zeros(batch, 0, conv_dim)
    n = (conv_dim - dim) // (2 * groups)
    x, B, C = xbc.split([dim, groups * n, groups * n], -1)
    gate = z.unflatten(-1, (HEADS, HEADDIM))
    cu = None
    if seq_idx is not None:  # batch 1: the offsets where the id changes
        assert batch == 1
        cu = [0, *((seq_idx[0, 1:] != seq_idx[0, :-1]).nonzero()[:, 0] + 1).tolist(), length]
        if initial is not None:
            initial = torch.cat([initial, initial.new_zeros(len(cu) - 2, *initial.shape[1:])])
    y, final = ssd_loop(
        x.unflatten(-1, (HEADS, HEADDIM)), dt, A.double(), B.unflatten(-1, (groups, n)),
        C.unflatten(-1, (groups, n)), D=D.double(), z=gate if norm is None else None,
        dt_bias=dt_bias.double(), dt_softplus=True, dt_limit=dt_limit,
        initial=None if initial is None else initial.double(), cu_seqlens=cu,
    )  # fmt: skip
    y = y.flatten(-2)
    if norm is not None:
        g = z * torch.sigmoid(z)
        y = y if before_gate else y * g
        parts = y.unflatten(-1, (groups, -1))
        y = (parts / torch.sqrt(parts.pow(2).mean(-1, keepdim=True) + eps)).flatten(-2)
        y = y * norm.double()
        y = y * g if before_gate else y
    if extra:
        left, right = zx0.split([extra, extra], -1)
        y = torch.cat([left * torch.sigmoid(left) * right, y], -1)
    if proj is not None:
        y = y @ proj.double().T
        if proj_bias is not None:
            y = y + proj_bias.double()
    return y, final[-1:] if seq_idx is not None else final


def operands(batch, length, extra=0, dtype=torch.float64, seed=0):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    dim, conv_dim = HEADS * HEADDIM, HEADS * HEADDIM + 2 * GROUPS * N

    def r(*shape, scale=1.0):  # type: ignore[no-untyped-def]
        return (scale * torch.randn(*shape, generator=gen, dtype=torch.float64)).to(dtype)

    return dict(
        zxbcdt=r(batch, length, 2 * extra + dim + conv_dim + HEADS),
        weight=r(conv_dim, WIDTH, scale=0.5), bias=r(conv_dim, scale=0.3),
        dt_bias=r(HEADS, scale=0.5), A=-torch.rand(HEADS, generator=gen, dtype=torch.float64)
        .to(dtype) - 0.1, D=r(HEADS), norm=1 + r(dim, scale=0.2),
        proj=r(OUT, dim + extra, scale=0.3), proj_bias=r(OUT), initial=r(batch, HEADS, HEADDIM, N),
    )  # fmt: skip


def call(ops, **kw):  # type: ignore[no-untyped-def]
    return mamba_split_conv1d_scan_combined(
        ops["zxbcdt"], ops["weight"], kw.pop("bias", ops["bias"]), ops["dt_bias"], ops["A"],
        ops["D"], 64, headdim=HEADDIM, ngroups=GROUPS, **kw,
    )  # fmt: skip


CASES = [  # (length, extra, options)
    (0, 0, dict()),
    (1, 0, dict(norm=True)),
    (3, 3, dict(norm=True, before_gate=False, proj=True)),
    (17, 0, dict(norm=True, before_gate=False, proj=True, initial=True)),
    (65, 2, dict(proj=True, silu=False, no_bias=True, dt_limit=(0.01, 0.5))),
]


def options(ops, opts):  # type: ignore[no-untyped-def]
    """(keywords of the reference, keywords of the call) for a case."""
    ref = dict(
        silu=opts.get("silu", True), norm=ops["norm"] if opts.get("norm") else None,
        before_gate=opts.get("before_gate", True), proj=ops["proj"] if opts.get("proj") else None,
        proj_bias=ops["proj_bias"] if opts.get("proj") else None,
        initial=ops["initial"] if opts.get("initial") else None,
        dt_limit=opts.get("dt_limit", (0.0, math.inf)),
    )  # fmt: skip
    got = dict(
        activation="silu" if ref["silu"] else None, rmsnorm_weight=ref["norm"],
        norm_before_gate=ref["before_gate"], outproj_weight=ref["proj"],
        outproj_bias=ref["proj_bias"], initial_states=ref["initial"], dt_limit=ref["dt_limit"],
        return_final_states=True,
    )  # fmt: skip
    if opts.get("no_bias"):
        got["bias"] = None
    return ref, got


@pytest.mark.parametrize("length,extra,opts", CASES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_values_and_final_state(length, extra, opts, dtype) -> None:  # type: ignore[no-untyped-def]
    ops = operands(2, length, extra, dtype)
    ref_kw, kw = options(ops, opts)
    want, want_final = reference(
        ops["zxbcdt"], ops["weight"], None if opts.get("no_bias") else ops["bias"],
        ops["dt_bias"], ops["A"], ops["D"], **ref_kw,
    )  # fmt: skip
    got, final = call(ops, **kw)
    assert got.dtype == dtype and final.dtype == dtype
    tol = dict(rtol=1e-9, atol=1e-9) if dtype == torch.float64 else dict(rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(got.double(), want, **tol)
    torch.testing.assert_close(final.double(), want_final, **tol)


@pytest.mark.parametrize("length,extra,opts", CASES[1:4])
def test_gradients_of_every_input(length, extra, opts) -> None:  # type: ignore[no-untyped-def]
    ops = {k: v.requires_grad_() for k, v in operands(2, length, extra, seed=1).items()}
    ref_kw, kw = options(ops, opts)
    want, want_final = reference(
        ops["zxbcdt"], ops["weight"], ops["bias"], ops["dt_bias"], ops["A"], ops["D"], **ref_kw
    )
    got, final = call(ops, **kw)
    gen = torch.Generator().manual_seed(2)
    g, g_final = (
        torch.randn(got.shape, generator=gen, dtype=got.dtype),
        torch.randn(final.shape, generator=gen, dtype=final.dtype),
    )
    used = [v for v in ops.values() if v.requires_grad]
    want_grads = torch.autograd.grad((want * g).sum() + (want_final * g_final).sum(), used,
                                     allow_unused=True)  # fmt: skip
    got_grads = torch.autograd.grad((got * g).sum() + (final * g_final).sum(), used,
                                    allow_unused=True)  # fmt: skip
    for name, a, b in zip(ops, got_grads, want_grads, strict=True):
        assert (a is None) == (b is None), name
        if a is not None:
            torch.testing.assert_close(
                a, b, rtol=1e-9, atol=1e-9, msg=lambda m, n=name: f"{n}: {m}"
            )


def test_seq_idx_keeps_packed_sequences_apart() -> None:
    """Neither the convolution nor the scan reads across a change of id; the initial
    state enters the first sequence only; the gradients follow."""
    ops = {k: v.requires_grad_() for k, v in operands(1, 13, seed=3).items()}
    seq_idx = torch.tensor([[0] * 5 + [1] * 2 + [2] * 6], dtype=torch.int32)
    ref_kw, kw = options(ops, dict(norm=True, proj=True, initial=True))
    want, want_final = reference(
        ops["zxbcdt"], ops["weight"], ops["bias"], ops["dt_bias"], ops["A"], ops["D"],
        seq_idx=seq_idx, **ref_kw,
    )  # fmt: skip
    got, final = call(ops, seq_idx=seq_idx, **kw)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(final, want_final, rtol=1e-9, atol=1e-9)
    used = list(ops.values())
    want_grads = torch.autograd.grad(want.sum() + want_final.sum(), used, allow_unused=True)
    got_grads = torch.autograd.grad(got.sum() + final.sum(), used, allow_unused=True)
    for a, b in zip(got_grads, want_grads, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_bad_arguments_are_named() -> None:
    ops = operands(1, 3)
    with pytest.raises(ValueError, match="mamba_split_conv1d_scan_combined: expected activation"):
        call(ops, activation="gelu")
    with pytest.raises(ValueError, match="headdim must be given"):
        mamba_split_conv1d_scan_combined(
            ops["zxbcdt"], ops["weight"], None, ops["dt_bias"], ops["A"], ops["D"], 64
        )
    with pytest.raises(ValueError, match="expected conv1d_weight"):
        mamba_split_conv1d_scan_combined(
            ops["zxbcdt"][..., :-1], ops["weight"], None, ops["dt_bias"], ops["A"], ops["D"], 64,
            headdim=HEADDIM, ngroups=GROUPS,
        )  # fmt: skip
    # headdim with D (nheads,): True and 0 read the channels in another layout silently
    d1 = ops["D"][:, 0] if ops["D"].dim() == 2 else ops["D"]
    for headdim in (True, 0, -2, 2.0, "2"):
        with pytest.raises(ValueError, match="expected headdim to be a positive int"):
            mamba_split_conv1d_scan_combined(
                ops["zxbcdt"], ops["weight"], None, ops["dt_bias"], ops["A"], d1, 64,
                headdim=headdim, ngroups=GROUPS,
            )  # fmt: skip


def test_integer_arguments_may_be_any_integers_but_bools() -> None:
    """headdim, ngroups and chunk_size taken from a numpy config (numpy.int64) work as
    Python ints do (they raised "expected a positive int"); numpy's bool is refused as
    Python's is, and so is a tensor (torch.tensor(True) would read as 1)."""
    np = pytest.importorskip("numpy")
    ops = operands(1, 5)
    d1 = ops["D"][:, 0] if ops["D"].dim() == 2 else ops["D"]

    def run(headdim, ngroups, chunk):  # type: ignore[no-untyped-def]
        return mamba_split_conv1d_scan_combined(
            ops["zxbcdt"], ops["weight"], ops["bias"], ops["dt_bias"], ops["A"], d1, chunk,
            headdim=headdim, ngroups=ngroups,
        )  # fmt: skip

    want = run(HEADDIM, GROUPS, 64)
    for kind in (np.int64, np.int32, np.uint8):
        got = run(kind(HEADDIM), kind(GROUPS), kind(64))
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    for bad in (np.True_, torch.tensor(HEADDIM), torch.tensor(True)):
        with pytest.raises(ValueError, match="expected headdim to be a positive int"):
            run(bad, GROUPS, 64)
    with pytest.raises(ValueError, match="expected ngroups to be a positive int"):
        run(HEADDIM, np.int64(0), 64)


def test_a_projection_of_another_dtype_is_taken_like_the_other_operands() -> None:
    """outproj_weight (and its bias) in float64 with a float32 zxbcdt: the projection in
    the output's dtype, as the convolution's and the norm's weights are taken (it was
    torch's "expected m1 and m2 to have the same dtype", naming no function)."""
    ops = {k: v.float() for k, v in operands(1, 9, extra=2).items()}
    want = call(ops, outproj_weight=ops["proj"], outproj_bias=ops["proj_bias"])
    got = call(ops, outproj_weight=ops["proj"].double(), outproj_bias=ops["proj_bias"].double())
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def _bad_operands():  # type: ignore[no-untyped-def]
    """name -> (keywords changed in a valid call on the fused path (float32, a norm), the
    error type, what its message says): each operand the layer reads itself, checked by
    the drop-in under its own name before anything runs."""
    dim, conv_dim = HEADS * HEADDIM, HEADS * HEADDIM + 2 * GROUPS * N
    f32 = torch.float32
    return {
        "rmsnorm_weight shape": (dict(rmsnorm_weight=torch.ones(dim + 1)), ValueError,
                                 r"expected rmsnorm_weight of shape \(nheads \* headdim,\)"),
        "integer zxbcdt": (dict(zxbcdt=lambda o: o["zxbcdt"].to(torch.int32)), TypeError,
                           "expected zxbcdt to have a real floating dtype"),
        "integer conv1d_weight": (dict(weight=lambda o: o["weight"].to(torch.int64)), TypeError,
                                  "expected conv1d_weight to have a real floating dtype"),
        "complex conv1d_bias": (dict(bias=torch.zeros(conv_dim, dtype=torch.complex64)),
                                TypeError, "expected conv1d_bias to have a real floating dtype"),
        "conv1d_bias shape": (dict(bias=torch.zeros(3)), ValueError,
                              r"expected conv1d_bias of shape \(conv_dim,\)"),
        "dt_bias a list": (dict(dt_bias=[0.0] * HEADS), TypeError,
                           "expected dt_bias to be a strided Tensor"),
        "integer A": (dict(A=torch.ones(HEADS, dtype=torch.int64)), TypeError,
                      "expected A to have a real floating dtype"),
        "A shape": (dict(A=-torch.ones(HEADS + 1)), ValueError, r"expected A of shape \(nheads,\)"),
        "D a list": (dict(D=[1.0] * HEADS), TypeError, "expected D to be a strided Tensor"),
        "initial_states shape": (dict(initial_states=torch.zeros(1, HEADS, HEADDIM, N + 1)),
                                 ValueError, "expected initial_states of shape"),
        "outproj_weight shape": (dict(outproj_weight=torch.zeros(OUT, dim + 1)), ValueError,
                                 "expected outproj_weight of shape"),
        "outproj_bias shape": (dict(outproj_weight=torch.zeros(OUT, dim),
                                    outproj_bias=torch.zeros(OUT + 1)), ValueError,
                               "expected outproj_bias of shape"),
        "float seq_idx": (dict(seq_idx=torch.zeros(1, 5)), ValueError,
                          "expected seq_idx to be an integer tensor"),
        "return_final_states a string": (dict(return_final_states="no"), TypeError,
                                         "expected return_final_states to be a bool"),
        "norm_before_gate None": (dict(norm_before_gate=None), TypeError,
                                  "expected norm_before_gate to be a bool"),
        "rmsnorm_eps too large for a float": (dict(rmsnorm_eps=10**400), ValueError,
                                              "expected rmsnorm_eps to be a finite number"),
        "0-d outproj_weight": (dict(outproj_weight=torch.tensor(1.0)), ValueError,
                               "expected outproj_weight of shape"),
        "integer state_dtype": (dict(state_dtype=torch.int64), TypeError,
                                "expected state_dtype to be None or a floating"),
        "rmsnorm_weight on another device": (
            dict(rmsnorm_weight=torch.ones(dim, dtype=f32, device="meta")), ValueError,
            "expected all tensors on one device"),
    }  # fmt: skip


BAD = _bad_operands()


@pytest.mark.parametrize("case", list(BAD))
def test_every_operand_is_checked_under_the_drop_ins_name(case) -> None:
    """A wrong shape of rmsnorm_weight gave torch's broadcasting error, an integer zxbcdt
    'silu_cpu not implemented for Int', an integer conv1d_weight was cast silently and
    a wrong conv1d_bias reached the C kernel's internal guard: each now gets the drop-in's
    own error, and nothing runs."""
    change, error, message = BAD[case]
    ops = operands(1, 5, dtype=torch.float32)
    keywords = dict(rmsnorm_weight=ops["norm"])
    names = {"zxbcdt": "zxbcdt", "weight": "weight", "bias": "bias", "dt_bias": "dt_bias",
             "A": "A", "D": "D"}  # fmt: skip
    for key, value in change.items():
        value = value(ops) if callable(value) else value
        if key in names:
            ops[key] = value
        else:
            keywords[key] = value
    with pytest.raises(error, match=rf"^parascan\.compat\.mamba_ssm\."
                                    rf"mamba_split_conv1d_scan_combined: {message}"):  # fmt: skip
        call(ops, **keywords)
