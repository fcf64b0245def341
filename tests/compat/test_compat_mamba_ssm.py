"""parascan.compat.mamba_ssm against float64 loops written here from mamba_ssm 2.x's
documented conventions: u, delta, z (batch, dim, L); A (dim, N) real or complex; B, C
time-invariant (dim, N), shared (batch, N, L) or grouped (batch, G, N, L), and with a
complex A a variable B/C is real (..., 2L) with real and imaginary parts interleaved;
y = sum_n C h (2 Re of it when A is complex); out = (y + D u) * silu(z); the decoding
step in both of its layouts, (batch, dim, N) and (batch, heads, dim, N)."""

from __future__ import annotations

import itertools

import pytest
import torch

import parascan
from parascan.compat.mamba_ssm import (
    mamba_chunk_scan_combined,
    selective_scan_fn,
    selective_scan_ref,
    selective_state_update,
)

from conftest import assert_matches
from oracles import ssd_loop

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
SCANS = [selective_scan_fn, selective_scan_ref]


# --- the oracles --------------------------------------------------------------------------


def softplus(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x <= 20, torch.log1p(torch.exp(x)), x)


def silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + torch.exp(-x))


def step_operand(X: torch.Tensor, t: int, dim: int, length: int, cplx: bool) -> torch.Tensor:
    """B or C at step t for every (batch, channel): (batch or 1, dim, N), float64, read
    directly from mamba's layout (de-interleaving the complex variable form)."""
    if X.dim() == 2:  # (dim, N), complex when A is complex
        return (X.to(torch.complex128) if X.is_complex() else X.double())[None]
    if X.dim() == 3:
        X = X[:, None]  # one group
    if cplx:  # real (..., 2L): step t at 2t (real) and 2t + 1 (imaginary)
        pairs = X.double().reshape(*X.shape[:-1], length, 2)
        at_t = torch.view_as_complex(pairs.contiguous())[..., t]
    else:
        at_t = X.double()[..., t]  # (batch, G, N)
    per_group = dim // at_t.shape[1]
    return torch.stack([at_t[:, d // per_group] for d in range(dim)], dim=1)


def mamba_loop(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False):  # type: ignore[no-untyped-def]
    """(out, last_state): the recurrence one step at a time in float64 / complex128."""
    u, delta = u.double(), delta.double()
    batch, dim, length = u.shape
    cplx = A.is_complex()
    A = A.to(torch.complex128) if cplx else A.double()
    if delta_bias is not None:
        delta = delta + delta_bias.double()[:, None]
    if delta_softplus:
        delta = softplus(delta)
    h = torch.zeros(batch, dim, A.shape[1], dtype=A.dtype)
    ys = []
    for t in range(length):
        dt = delta[:, :, t, None]
        Bt = step_operand(B, t, dim, length, cplx)
        Ct = step_operand(C, t, dim, length, cplx)
        h = torch.exp(dt * A) * h + dt * Bt * u[:, :, t, None]
        y = (h * Ct).sum(-1)
        ys.append(2 * y.real if cplx else y)
    y = torch.stack(ys, dim=-1) if ys else u.new_zeros(batch, dim, 0)
    if D is not None:
        y = y + D.double()[:, None] * u
    if z is not None:
        y = y * silu(z.double())
    return y, h


def variable(gen, batch, groups, n, length, dtype, cplx):  # type: ignore[no-untyped-def]
    shape = (batch, n, 2 * length if cplx else length)
    if groups:
        shape = (batch, groups, *shape[1:])
    return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)


def invariant(gen, dim, n, cplx):  # type: ignore[no-untyped-def]
    X = torch.randn(dim, n, generator=gen, dtype=torch.float64)
    if cplx:
        return torch.complex(X, torch.randn(dim, n, generator=gen, dtype=torch.float64)).to(
            torch.complex64
        )
    return X.float()


def random_A(gen, dim, n, cplx):  # type: ignore[no-untyped-def]
    real = -torch.rand(dim, n, generator=gen, dtype=torch.float64) - 0.1
    if cplx:
        imag = torch.randn(dim, n, generator=gen, dtype=torch.float64) * 3
        return torch.complex(real, imag).to(torch.complex64)
    return real.float()


def case(gen, *, batch=2, dim=6, n=3, length=17, b_form="shared", c_form="shared", groups=2,
         cplx=False, dtype=torch.float32, extras=True):  # type: ignore[no-untyped-def]  # fmt: skip
    """Random inputs in mamba's conventions; weights (A, D, delta_bias, invariant B/C)
    in float32 / complex64 as mamba_ssm keeps them, activations in ``dtype``."""

    def bc(form):  # type: ignore[no-untyped-def]
        if form == "invariant":
            return invariant(gen, dim, n, cplx)
        return variable(gen, batch, groups if form == "grouped" else 0, n, length, dtype, cplx)

    u = torch.randn(batch, dim, length, generator=gen, dtype=torch.float64).to(dtype)
    delta = (torch.rand(batch, dim, length, generator=gen, dtype=torch.float64) - 0.5).to(dtype)
    args = dict(u=u, delta=delta, A=random_A(gen, dim, n, cplx), B=bc(b_form), C=bc(c_form))
    if extras:
        args["D"] = torch.randn(dim, generator=gen)
        args["z"] = torch.randn(batch, dim, length, generator=gen, dtype=torch.float64).to(dtype)
        args["delta_bias"] = torch.randn(dim, generator=gen) * 0.5
    return args


def on(device: str, args: dict) -> dict:  # type: ignore[type-arg]
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in args.items()}


# --- selective_scan_fn / selective_scan_ref ---------------------------------------------------

FORMS = list(itertools.product(["invariant", "shared", "grouped"], repeat=2))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fn", SCANS)
@pytest.mark.parametrize("cplx", [False, True], ids=["real", "complex"])
@pytest.mark.parametrize(("b_form", "c_form"), FORMS, ids=[f"B{b}-C{c}" for b, c in FORMS])
def test_matches_the_loop_in_every_form_of_B_and_C(device, fn, cplx, b_form, c_form) -> None:
    gen = torch.Generator().manual_seed(7)
    args = case(gen, cplx=cplx, b_form=b_form, c_form=c_form)
    out, last = fn(**on(device, args), delta_softplus=True, return_last_state=True)
    want, want_last = mamba_loop(**args, delta_softplus=True)
    assert out.dtype == torch.float32 and out.device.type == device
    assert last.dtype == (torch.complex64 if cplx else torch.float32)
    assert last.shape == (2, 6, 3)
    assert_matches(out, want, torch.float32)
    assert_matches(last, want_last, torch.complex64 if cplx else torch.float32)


@pytest.mark.parametrize("cplx", [False, True], ids=["real", "complex"])
@pytest.mark.parametrize("length", [0, 1, 2, 17, 64, 65])
@pytest.mark.parametrize("n", [1, 16])
def test_awkward_lengths_and_state_sizes(cplx, length, n) -> None:
    gen = torch.Generator().manual_seed(length * 31 + n)
    args = case(gen, dim=5, n=n, length=length, cplx=cplx, groups=5, b_form="grouped")
    out, last = selective_scan_fn(**args, delta_softplus=True, return_last_state=True)
    want, want_last = mamba_loop(**args, delta_softplus=True)
    assert out.shape == (2, 5, length)
    assert_matches(out, want, torch.float32)
    assert_matches(last, want_last, torch.complex64 if cplx else torch.float32)


@pytest.mark.parametrize("delta_softplus", [False, True])
@pytest.mark.parametrize("extras", [False, True], ids=["bare", "D-z-bias"])
def test_optional_arguments_and_the_plain_return(delta_softplus, extras) -> None:
    gen = torch.Generator().manual_seed(3)
    args = case(gen, extras=extras)
    if not delta_softplus:
        args["delta"] = args["delta"].abs()  # a positive step without softplus
    out = selective_scan_fn(**args, delta_softplus=delta_softplus)
    assert isinstance(out, torch.Tensor)
    assert_matches(out, mamba_loop(**args, delta_softplus=delta_softplus)[0], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("cplx", [False, True], ids=["real", "complex"])
def test_dtypes_of_the_results(dtype, cplx) -> None:
    gen = torch.Generator().manual_seed(5)
    args = case(gen, dtype=dtype, cplx=cplx, b_form="grouped", c_form="shared")
    if dtype == torch.float64:  # float64 weights too: the state is float64 / complex128
        args = {k: v.to(torch.complex128 if v.is_complex() else torch.float64) for k, v in
                args.items()}  # fmt: skip
    out, last = selective_scan_fn(**args, delta_softplus=True, return_last_state=True)
    want, want_last = mamba_loop(**args, delta_softplus=True)
    wide = dtype == torch.float64
    state = [[torch.float32, torch.complex64], [torch.float64, torch.complex128]][wide][cplx]
    assert out.dtype == dtype and last.dtype == state
    assert_matches(out, want, dtype)
    assert_matches(last, want_last, state if wide else torch.float32)


def test_the_interleaved_form_is_checked() -> None:
    gen = torch.Generator().manual_seed(1)
    args = case(gen, cplx=True)
    args["B"] = args["B"][..., :-1]  # 2L - 1 entries
    with pytest.raises(ValueError, match=r"selective_scan_fn: with a complex A, a variable B"):
        selective_scan_fn(**args)


def test_a_complex_variable_B_is_taken_as_it_is() -> None:
    gen = torch.Generator().manual_seed(2)
    args = case(gen, cplx=True, extras=False)
    interleaved = args["C"]
    args["C"] = torch.view_as_complex(
        interleaved.reshape(*interleaved.shape[:-1], -1, 2).contiguous()
    )
    got = selective_scan_fn(**args)
    want = selective_scan_fn(**{**args, "C": interleaved})
    torch.testing.assert_close(got, want)


# --- gradients ----------------------------------------------------------------------------


def grads_of(fn, args, names):  # type: ignore[no-untyped-def]
    """The gradients of a weighted sum of ``fn(**args) = (out, last_state)``."""
    leaves = {k: v.detach().clone().requires_grad_(k in names) for k, v in args.items()}
    out, last = fn(**leaves)
    w_out = torch.linspace(-1, 1, out.numel(), dtype=torch.float64).reshape(out.shape)
    w_last = torch.linspace(1, 2, last.numel(), dtype=torch.float64).reshape(last.shape)
    # The final state's gradient counts (parascan propagates it).
    loss = (out.double() * w_out).sum() + (last.real.double() * w_last).sum()
    if last.is_complex():
        loss = loss + (last.imag.double() * w_last.flip(0)).sum()
    loss.backward()
    return {k: leaves[k].grad for k in names}


@pytest.mark.parametrize("fn", SCANS)
@pytest.mark.parametrize("cplx", [False, True], ids=["real", "complex"])
@pytest.mark.parametrize(("b_form", "c_form"), [("shared", "grouped"), ("invariant", "shared")])
def test_gradients_of_every_argument_and_the_last_state(fn, cplx, b_form, c_form) -> None:
    gen = torch.Generator().manual_seed(11)
    args = case(gen, cplx=cplx, b_form=b_form, c_form=c_form, length=13)
    args = {k: v.to(torch.complex128 if v.is_complex() else torch.float64) for k, v in
            args.items()}  # fmt: skip
    names = list(args)
    got = grads_of(lambda **a: fn(**a, delta_softplus=True, return_last_state=True), args, names)
    want = grads_of(lambda **a: mamba_loop(**a, delta_softplus=True), args, names)
    for k in names:
        assert got[k] is not None, k
        assert got[k].shape == args[k].shape, k
        assert_matches(got[k], want[k], torch.float64)


def test_gradcheck_complex_interleaved() -> None:
    gen = torch.Generator().manual_seed(13)
    args = case(gen, cplx=True, length=4, dim=2, n=2, batch=1, groups=1, b_form="grouped")
    args = {k: v.to(torch.complex128 if v.is_complex() else torch.float64) for k, v in
            args.items()}  # fmt: skip
    names = list(args)

    def f(*leaves):  # type: ignore[no-untyped-def]
        out, last = selective_scan_fn(
            **dict(zip(names, leaves, strict=True)), delta_softplus=True, return_last_state=True
        )
        return out, torch.view_as_real(last)

    assert torch.autograd.gradcheck(f, [args[k].clone().requires_grad_() for k in names])


# --- selective_state_update -----------------------------------------------------------------


def update_oracle(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus):  # type: ignore[no-untyped-def]
    """(new state, out) in float64, in the heads layout, written from the formula."""
    heads, groups = state.shape[1], B.shape[1]
    dt = dt.double() + (0 if dt_bias is None else dt_bias.double())
    dt = softplus(dt) if dt_softplus else dt
    Bh = B.double().repeat_interleave(heads // groups, dim=1)[:, :, None]  # (batch, h, 1, N)
    Ch = C.double().repeat_interleave(heads // groups, dim=1)[:, :, None]
    new = (
        torch.exp(dt[..., None] * A.double()) * state.double()
        + dt[..., None] * Bh * (x.double()[..., None])
    )
    out = (new * Ch).sum(-1) + (0 if D is None else D.double() * x.double())
    if z is not None:
        out = out * silu(z.double())
    return new, out


def decode_inputs(gen, batch, heads, dim, n, groups, dtype=torch.float32):  # type: ignore[no-untyped-def]
    def r(*shape):  # type: ignore[no-untyped-def]
        return torch.randn(shape, generator=gen, dtype=torch.float64)

    return dict(
        x=r(batch, heads, dim).to(dtype),
        dt=(r(batch, heads, dim) * 0.5).to(dtype),
        A=-r(heads, dim, n).abs().float(),
        B=r(batch, groups, n).to(dtype),
        C=r(batch, groups, n).to(dtype),
        D=r(heads, dim).float(),
        z=r(batch, heads, dim).to(dtype),
        dt_bias=r(heads, dim).float(),
    )


def squeeze_heads(args: dict) -> dict:  # type: ignore[type-arg]
    """The (batch, dim, N) layout of a one-head, one-group input."""
    drop = {"x": 1, "dt": 1, "z": 1, "B": 1, "C": 1, "A": 0, "D": 0, "dt_bias": 0}
    return {k: v.squeeze(drop[k]) for k, v in args.items()}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["dim", "heads"])
@pytest.mark.parametrize("dt_softplus", [False, True])
def test_state_update_matches_the_formula(device, layout, dt_softplus) -> None:
    gen = torch.Generator().manual_seed(17)
    heads, groups = (1, 1) if layout == "dim" else (4, 2)
    args = decode_inputs(gen, 3, heads, 5, 16, groups)
    if not dt_softplus:
        args["dt"] = args["dt"].abs()
    state = torch.randn(3, heads, 5, 16, generator=gen)
    want_state, want_out = update_oracle(state, **args, dt_softplus=dt_softplus)
    if layout == "dim":
        args, state, want_state, want_out = (
            squeeze_heads(args),
            state[:, 0],
            want_state[:, 0],
            want_out[:, 0],
        )
    state = state.to(device)
    out = selective_state_update(state, **on(device, args), dt_softplus=dt_softplus)
    assert out.shape == args["x"].shape and out.dtype == torch.float32
    assert_matches(state, want_state, torch.float32)
    assert_matches(out, want_out, torch.float32)


@pytest.mark.parametrize("layout", ["dim", "heads"])
def test_decoding_step_by_step_equals_the_scan(layout) -> None:
    """L decoding steps from a zero state == selective_scan_fn over the L steps (the heads
    layout is the scan over heads * dim channels with groups of heads)."""
    gen = torch.Generator().manual_seed(19)
    batch, heads, dim, n, groups, length = 2, 4, 3, 5, 2, 9
    if layout == "dim":
        heads, groups = 1, 1
    steps = [decode_inputs(gen, batch, heads, dim, n, groups) for _ in range(length)]
    weights = {k: steps[0][k] for k in ("A", "D", "dt_bias")}
    state = torch.zeros(batch, heads, dim, n)
    outs = []
    for step in steps:
        args = {**step, **weights}
        if layout == "dim":
            outs.append(selective_state_update(state[:, 0], **squeeze_heads(args),
                                               dt_softplus=True))  # fmt: skip
        else:
            outs.append(selective_state_update(state, **args, dt_softplus=True))
    got = torch.stack(outs, dim=-1).reshape(batch, heads * dim, length)

    def over_time(key: str) -> torch.Tensor:
        return torch.stack([s[key] for s in steps], dim=-1)

    want, last = selective_scan_fn(
        over_time("x").reshape(batch, heads * dim, length),
        over_time("dt").reshape(batch, heads * dim, length),
        weights["A"].reshape(heads * dim, n),
        over_time("B"),  # (batch, groups, N, L)
        over_time("C"),
        weights["D"].reshape(-1),
        over_time("z").reshape(batch, heads * dim, length),
        weights["dt_bias"].reshape(-1),
        delta_softplus=True,
        return_last_state=True,
    )
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(state.reshape(batch, heads * dim, n), last, rtol=2e-5, atol=2e-5)


def test_state_batch_indices_pick_rows_of_a_pool() -> None:
    gen = torch.Generator().manual_seed(23)
    args = decode_inputs(gen, 3, 2, 4, 3, 1)
    pool = torch.randn(5, 2, 4, 3, generator=gen)
    before = pool.clone()
    idx = torch.tensor([4, -1, 1])
    out = selective_state_update(pool, **args, dt_softplus=True, state_batch_indices=idx)
    for b, row in enumerate(idx.tolist()):
        if row < 0:
            assert bool((out[b] == 0).all())
            continue
        one = {k: v[b : b + 1] if k in ("x", "dt", "z", "B", "C") else v for k, v in args.items()}
        want_state, want_out = update_oracle(before[row : row + 1], **one, dt_softplus=True)
        assert_matches(pool[row], want_state[0], torch.float32)
        assert_matches(out[b], want_out[0], torch.float32)
    for row in (0, 2, 3):  # untouched, padding included
        assert torch.equal(pool[row], before[row])


def test_empty_batches_and_pools() -> None:
    """Zero rows where mamba_ssm's conventions allow them: a batch of 0 with seq_idx and
    final states, and a pool of no state with every index padding, gave index_select's
    error; ssd_scan with 0 heads and D gave reshape's."""
    a = (torch.randn(0, 4, 2, 2), torch.rand(0, 4, 2), -torch.rand(2), torch.randn(0, 4, 1, 2),
         torch.randn(0, 4, 1, 2), 4)  # fmt: skip
    for seq in (torch.zeros(0, 4, dtype=torch.long), None):
        out, final = mamba_chunk_scan_combined(*a, seq_idx=seq, return_final_states=True)
        assert out.shape == (0, 4, 2, 2) and final.shape == (0, 2, 2, 2)
    x = torch.randn(2, 3)
    out = selective_state_update(
        torch.zeros(0, 3, 2), x, x.abs(), -torch.rand(3, 2), torch.randn(2, 2),
        torch.randn(2, 2), state_batch_indices=torch.tensor([-1, -1]),
    )  # fmt: skip
    assert out.shape == (2, 3) and not out.any()
    for D in (torch.ones(0), torch.ones(0, 2)):
        y = parascan.ssd_scan(torch.randn(1, 4, 0, 2), torch.rand(1, 4, 0), torch.rand(0),
                        torch.randn(1, 4, 1, 2), torch.randn(1, 4, 1, 2), D=D)  # fmt: skip
        assert y.shape == (1, 4, 0, 2)


def test_state_batch_indices_are_checked() -> None:
    gen = torch.Generator().manual_seed(29)
    args = decode_inputs(gen, 2, 1, 4, 3, 1)
    pool = torch.zeros(3, 1, 4, 3)
    fn = "parascan.compat.mamba_ssm.selective_state_update"
    for bad in (torch.tensor([0, 3]), torch.tensor([1, 1]), torch.tensor([0.0, 1.0])):
        with pytest.raises(ValueError, match=fn):
            selective_state_update(pool, **args, state_batch_indices=bad)


# --- mamba_chunk_scan_combined (Mamba-2) --------------------------------------------------
# mamba's conventions: x, z (batch, seqlen, nheads, headdim), dt (batch, seqlen, nheads),
# A, dt_bias (nheads,), B, C (batch, seqlen, ngroups, dstate), D (nheads,) or (nheads,
# headdim), initial_states (batch, nheads, headdim, dstate); seq_idx (batch, seqlen)
# restarts the state (from zeros) where the id changes; the returned states have C's dtype.


def ssd_case(gen, *, batch=2, length=17, heads=4, headdim=3, groups=2, n=5,
             dtype=torch.float32):  # type: ignore[no-untyped-def]  # fmt: skip
    def r(*shape, scale=1.0):  # type: ignore[no-untyped-def]
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dtype)

    return dict(
        x=r(batch, length, heads, headdim), dt=r(batch, length, heads, scale=0.5),
        A=-torch.rand(heads, generator=gen, dtype=torch.float64).float() - 0.1,
        B=r(batch, length, groups, n), C=r(batch, length, groups, n),
    )  # fmt: skip


def f64(args: dict) -> dict:  # type: ignore[type-arg]
    return {k: v.double() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


@pytest.mark.parametrize("length", [0, 1, 2, 63, 65, 129])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("d_shape", [None, "heads", "heads-headdim"])
def test_chunk_scan_matches_the_loop(length, groups, d_shape) -> None:
    gen = torch.Generator().manual_seed(length * 7 + groups)
    args = ssd_case(gen, length=length, groups=groups)
    if d_shape is not None:
        args["D"] = torch.randn((4,) if d_shape == "heads" else (4, 3), generator=gen)
    args["z"] = torch.randn(2, length, 4, 3, generator=gen)
    args["dt_bias"] = torch.randn(4, generator=gen) * 0.3
    init = torch.randn(2, 4, 3, 5, generator=gen)
    out, final = mamba_chunk_scan_combined(
        **args, chunk_size=64, initial_states=init, dt_softplus=True, dt_limit=(0.01, 2.0),
        return_final_states=True,
    )  # fmt: skip
    want, want_final = ssd_loop(**f64(args), dt_softplus=True, dt_limit=(0.01, 2.0),
                                initial=init.double())  # fmt: skip
    assert out.dtype == torch.float32 and final.dtype == torch.float32
    assert_matches(out, want, torch.float32)
    assert_matches(final, want_final, torch.float32)


def test_chunk_size_changes_nothing_and_the_returns_are_in_mamba_order() -> None:
    gen = torch.Generator().manual_seed(3)
    args = ssd_case(gen, batch=1, length=40)
    seq = torch.tensor([[0] * 10 + [1] * 30])
    cu = torch.tensor([0, 10, 40], dtype=torch.int32)
    plain = mamba_chunk_scan_combined(**args, chunk_size=8)
    assert isinstance(plain, torch.Tensor)
    assert torch.equal(plain, mamba_chunk_scan_combined(**args, chunk_size=256))
    kw = dict(chunk_size=16, seq_idx=seq, cu_seqlens=cu)
    out, final = mamba_chunk_scan_combined(**args, **kw, return_final_states=True)
    out2, varlen = mamba_chunk_scan_combined(**args, **kw, return_varlen_states=True)
    out3, final3, varlen3 = mamba_chunk_scan_combined(
        **args, **kw, return_final_states=True, return_varlen_states=True
    )
    assert final.shape == (1, 4, 3, 5) and varlen.shape == (2, 4, 3, 5)
    assert torch.equal(out, out2) and torch.equal(out, out3)
    assert torch.equal(final, final3) and torch.equal(varlen, varlen3)
    assert torch.equal(varlen[1], final[0])  # the last sequence ends the row


def test_seq_idx_restarts_each_sequence_in_every_row() -> None:
    gen = torch.Generator().manual_seed(5)
    args = ssd_case(gen, batch=3, length=21)
    args["D"] = torch.randn(4, generator=gen)
    init = torch.randn(3, 4, 3, 5, generator=gen)
    cuts = [[0, 5, 12, 21], [0, 21], [0, 1, 2, 20, 21]]  # one sequence of the whole row too
    seq = torch.zeros(3, 21, dtype=torch.int64)
    for r, row in enumerate(cuts):
        for s in range(len(row) - 1):
            seq[r, row[s] : row[s + 1]] = s + 10 * r
    out, final = mamba_chunk_scan_combined(
        **args, chunk_size=4, initial_states=init, seq_idx=seq, return_final_states=True
    )
    for r, row in enumerate(cuts):
        sub = {k: v[r : r + 1] if v.dim() >= 3 else v for k, v in f64(args).items()}
        starts = torch.zeros(len(row) - 1, 4, 3, 5, dtype=torch.float64)
        starts[0] = init[r].double()  # only the row's first sequence starts from it
        want, finals = ssd_loop(**sub, initial=starts, cu_seqlens=row)
        assert_matches(out[r : r + 1], want, torch.float32)
        assert_matches(final[r], finals[-1], torch.float32)


def test_varlen_states_with_empty_sequences() -> None:
    gen = torch.Generator().manual_seed(9)
    args = ssd_case(gen, batch=1, length=30)
    init = torch.randn(1, 4, 3, 5, generator=gen)
    row = [0, 0, 7, 7, 29, 30]
    seq = torch.tensor([[0] * 7 + [1] * 22 + [2]])
    out, varlen = mamba_chunk_scan_combined(
        **args, chunk_size=8, initial_states=init, seq_idx=seq,
        cu_seqlens=torch.tensor(row), return_varlen_states=True,
    )  # fmt: skip
    starts = torch.zeros(5, 4, 3, 5, dtype=torch.float64)
    starts[0] = init[0].double()  # the empty first sequence's state is the initial one
    _, finals = ssd_loop(**f64(args), initial=starts, cu_seqlens=row)
    starts[1] = init[0].double()  # the first non-empty one starts from it too
    want, finals2 = ssd_loop(**f64(args), initial=starts, cu_seqlens=row)
    assert_matches(out, want, torch.float32)
    expected = torch.stack([finals[0], finals2[1], finals[2] * 0, finals[3], finals[4]])
    assert_matches(varlen, expected, torch.float32)


def test_gradients_of_every_input_with_seq_idx() -> None:
    gen = torch.Generator().manual_seed(11)
    args = f64(ssd_case(gen, batch=2, length=6, heads=2, headdim=2, groups=1, n=2))
    args |= dict(D=torch.randn(2, 2, dtype=torch.float64), z=torch.randn(2, 6, 2, 2,
                 dtype=torch.float64), dt_bias=torch.randn(2, dtype=torch.float64))  # fmt: skip
    init = torch.randn(2, 2, 2, 2, dtype=torch.float64)
    names = [*args, "initial_states"]
    leaves = [t.clone().requires_grad_() for t in (*args.values(), init)]
    seq = torch.tensor([[0, 0, 1, 1, 1, 2], [4, 4, 4, 4, 4, 4]])

    def f(*ts):  # type: ignore[no-untyped-def]
        kw = dict(zip(names, ts, strict=True))
        return mamba_chunk_scan_combined(**kw, chunk_size=2, seq_idx=seq, dt_softplus=True,
                                         return_final_states=True)  # fmt: skip

    assert torch.autograd.gradcheck(f, leaves)


def test_chunk_scan_dtypes_of_the_results() -> None:
    gen = torch.Generator().manual_seed(13)
    args = ssd_case(gen, dtype=torch.bfloat16)
    out, final = mamba_chunk_scan_combined(**args, chunk_size=64, return_final_states=True)
    assert out.dtype == torch.bfloat16 and final.dtype == torch.bfloat16  # C's
    out, final = mamba_chunk_scan_combined(
        **args, chunk_size=64, return_final_states=True, state_dtype=torch.float32
    )
    want, want_final = ssd_loop(**f64(args))
    assert final.dtype == torch.float32
    assert_matches(out, want, torch.bfloat16)
    assert_matches(final, want_final, torch.bfloat16)


def test_chunk_scan_checks_its_conventions() -> None:
    gen = torch.Generator().manual_seed(17)
    args = ssd_case(gen, batch=1, length=10)
    fn = "parascan.compat.mamba_ssm.mamba_chunk_scan_combined"
    with pytest.raises(ValueError, match=f"{fn}: expected chunk_size"):
        mamba_chunk_scan_combined(**args, chunk_size=0)
    with pytest.raises(ValueError, match=f"{fn}: expected seq_idx"):
        mamba_chunk_scan_combined(**args, chunk_size=4, seq_idx=torch.zeros(1, 9, dtype=int))
    with pytest.raises(ValueError, match="needs cu_seqlens"):
        mamba_chunk_scan_combined(**args, chunk_size=4, return_varlen_states=True)
    with pytest.raises(ValueError, match="inside a sequence"):
        mamba_chunk_scan_combined(**args, chunk_size=4, cu_seqlens=torch.tensor([0, 4, 10]),
                                  return_varlen_states=True)  # fmt: skip
    two = ssd_case(gen, batch=2, length=10)
    with pytest.raises(ValueError, match="expected batch 1"):
        mamba_chunk_scan_combined(**two, chunk_size=4, cu_seqlens=torch.tensor([0, 10]),
                                  return_varlen_states=True)  # fmt: skip
    # the core function's checks, under this function's name (they named ssd_scan)
    with pytest.raises(
        ValueError, match=rf"^{fn}: expected dt .*\(parascan\.ssd_scan checked it\)$"
    ):
        mamba_chunk_scan_combined(**(args | {"dt": args["dt"][:, :5]}), chunk_size=4)
    # with seq_idx, a non-tensor initial_states was dropped and the scan ran from zeros
    seq = torch.tensor([[0] * 5 + [1] * 5])
    for initial in ("garbage", [1.0], 0.5):
        with pytest.raises(TypeError, match=f"{fn}: expected initial_states to be a strided"):
            mamba_chunk_scan_combined(**args, chunk_size=4, seq_idx=seq, initial_states=initial)
    # with seq_idx, a wrong dstate was reported in the packed shape the scan sees,
    # (num_seqs, ...), which the user never passed
    good = torch.zeros(1, *args["x"].shape[2:], args["B"].shape[-1])
    for initial in (good[..., :-1], good[:, :, :1], good[0]):
        with pytest.raises(ValueError, match=rf"{fn}: expected initial_states of shape "
                           rf"\(batch, nheads, headdim, dstate\) = \(1, "):  # fmt: skip
            mamba_chunk_scan_combined(**args, chunk_size=4, seq_idx=seq, initial_states=initial)
    mamba_chunk_scan_combined(**args, chunk_size=4, seq_idx=seq, initial_states=good)
    # ... and so were the other operands' (B as (1, 20, ...) for two rows of 10, say)
    two = {k: torch.cat([v, v]) if k in ("x", "dt", "B", "C") else v for k, v in args.items()}
    seq2 = torch.cat([seq, seq])
    for name, shape in (("B", r"\(batch, seqlen, ngroups, dstate\) = \(2, "),
                        ("C", r"\(batch, seqlen, ngroups, dstate\) like B = \(2, "),
                        ("dt", r"\(batch, seqlen, nheads\) = \(2, ")):  # fmt: skip
        with pytest.raises(ValueError, match=rf"{fn}: expected {name} of shape {shape}"):
            mamba_chunk_scan_combined(**(two | {name: two[name][:1]}), chunk_size=4,
                                      seq_idx=seq2)  # fmt: skip
    # batch 0 with seq_idx and initial_states: an empty result (was torch's index_copy_
    # error: the rows' index list was empty, so float)
    empty = {k: v[:0] if k in ("x", "dt", "B", "C") else v for k, v in args.items()}
    out = mamba_chunk_scan_combined(**empty, chunk_size=4, seq_idx=seq[:0],
                                    initial_states=good[:0])  # fmt: skip
    assert out.shape == (0, *args["x"].shape[1:])
    # an integer state_dtype rounded the returned states
    for state_dtype in (torch.int64, torch.bool, "float32"):
        with pytest.raises(TypeError, match=f"{fn}: expected state_dtype"):
            mamba_chunk_scan_combined(**args, chunk_size=4, return_final_states=True,
                                      state_dtype=state_dtype)  # fmt: skip
