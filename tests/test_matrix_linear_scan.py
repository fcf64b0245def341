"""matrix_linear_scan against a float64 loop written here: every backend, dtypes,
lengths, broadcasting, reverse, initial and final states, all gradients, vmap,
forward mode, compile, opcheck and errors."""

from __future__ import annotations

import pytest
import torch

import parascan as ps
from parascan.matrix.ops import matrix_linear_scan_op

from conftest import assert_matches, oracle_dtype

BACKENDS = ["cpu", "torch", "loop"]
LENGTHS = [0, 1, 2, 3, 17, 64, 65]


def oracle(w, b, h=None, reverse=False):
    """x[t] = w[t] @ x[t-1] + b[t], one step at a time; returns (x, final)."""
    steps, d = b.shape[-2], b.shape[-1]
    batch = torch.broadcast_shapes(w.shape[:-3], b.shape[:-2], () if h is None else h.shape[:-1])
    dtype = torch.promote_types(w.dtype, b.dtype)
    state = torch.zeros((*batch, d), dtype=dtype) if h is None else h.expand(*batch, d)
    out = [None] * steps
    for t in range(steps - 1, -1, -1) if reverse else range(steps):
        state = (w[..., t, :, :] @ state.unsqueeze(-1)).squeeze(-1) + b[..., t, :]
        out[t] = state
    x = torch.stack(out, -2) if steps else torch.zeros((*batch, 0, d), dtype=dtype)
    return x.expand(*batch, steps, d), state.expand(*batch, d)


def make(shapes, dtype, seed=0):
    """Weights scaled to keep the states bounded, biases, initial (or None)."""
    g = torch.Generator().manual_seed(seed)
    w_shape, b_shape, h_shape = shapes
    d = b_shape[-1]
    real = torch.float64
    w = torch.randn(w_shape, generator=g, dtype=real) / (1.2 * d**0.5)
    b = torch.randn(b_shape, generator=g, dtype=real)
    h = None if h_shape is None else torch.randn(h_shape, generator=g, dtype=real)
    if dtype.is_complex:
        w = torch.complex(w, torch.randn(w_shape, generator=g, dtype=real) / (1.2 * d**0.5))
        w = w / 2**0.5
        b = torch.complex(b, torch.randn(b_shape, generator=g, dtype=real))
        h = None if h is None else h.to(torch.complex128)
    return w.to(dtype), b.to(dtype), None if h is None else h.to(dtype)


def shapes_for(steps, d=5):
    return [
        ((steps, d, d), (steps, d), (d,)),
        ((steps, d, d), (steps, d), None),
        ((2, 1, steps, d, d), (3, steps, d), (2, 3, d)),  # broadcast batch dims
        ((steps, d, d), (4, steps, d), (4, 1)),  # weights shared; initial along d
    ]


def backend_dtypes():
    for backend in BACKENDS:
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            yield backend, dtype
    for backend in ("torch", "loop"):
        yield backend, torch.complex128


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("steps", LENGTHS)
@pytest.mark.parametrize(("backend", "dtype"), list(backend_dtypes()))
def test_matches_the_loop(backend, dtype, steps, reverse) -> None:
    for i, shapes in enumerate(shapes_for(steps)):
        w, b, h = make(shapes, dtype, seed=steps + i)
        before = [t.clone() for t in (w, b) + ((h,) if h is not None else ())]
        out, final = ps.matrix_linear_scan(
            w, b, initial=h, reverse=reverse, return_final=True, backend=backend
        )
        o = oracle_dtype(dtype)
        want, want_final = oracle(w.to(o), b.to(o), None if h is None else h.to(o), reverse)
        assert out.dtype == dtype and out.is_contiguous()
        assert_matches(out, want, dtype)
        assert_matches(final, want_final, dtype)
        for t, saved in zip((w, b, h), before, strict=False):
            assert torch.equal(t, saved)


def test_auto_backend_and_complex64() -> None:
    w, b, h = make(((33, 3, 3), (2, 33, 3), (3,)), torch.complex64, seed=4)
    o = torch.complex128
    assert_matches(ps.matrix_linear_scan(w, b, initial=h), oracle(w.to(o), b.to(o), h.to(o))[0],
                   torch.complex64)  # fmt: skip
    with pytest.raises(RuntimeError, match=r"'cpu' is not available for torch\.complex64"):
        ps.matrix_linear_scan(w, b, backend="cpu")


def test_long_sequence_float32_and_transposed_weights() -> None:
    w, b, h = make(((3000, 16, 16), (3000, 16), (16,)), torch.float64, seed=1)
    want = oracle(w.mT, b, h)[0]
    for backend in BACKENDS:
        got = ps.matrix_linear_scan(w.float().mT, b.float(), initial=h.float(), backend=backend)
        assert_matches(got, want, torch.float32)


def test_concatenation_continues_from_the_final_state() -> None:
    w, b, h = make(((2, 40, 4, 4), (2, 40, 4), (2, 4)), torch.float64, seed=2)
    whole = ps.matrix_linear_scan(w, b, initial=h)
    head, final = ps.matrix_linear_scan(w[:, :13], b[:, :13], initial=h, return_final=True)
    tail = ps.matrix_linear_scan(w[:, 13:], b[:, 13:], initial=final)
    torch.testing.assert_close(whole, torch.cat([head, tail], -2))


# --- gradients -------------------------------------------------------------------


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("steps", [1, 2, 17])
@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_match_the_loop(backend, steps, reverse) -> None:
    for i, shapes in enumerate(shapes_for(steps, d=4)):
        w, b, h = make(shapes, torch.float64, seed=10 + i)
        inputs = [t.requires_grad_() for t in (w, b, h) if t is not None]
        g = torch.Generator().manual_seed(i)
        out, final = ps.matrix_linear_scan(
            w, b, initial=h, reverse=reverse, return_final=True, backend=backend
        )
        co, cf = (
            torch.randn(out.shape, generator=g, dtype=torch.float64),
            torch.randn(final.shape, generator=g, dtype=torch.float64),
        )
        got = torch.autograd.grad((out * co).sum() + (final * cf).sum(), inputs)
        want_out, want_final = oracle(w, b, h, reverse)
        want = torch.autograd.grad((want_out * co).sum() + (want_final * cf).sum(), inputs)
        for a, e in zip(got, want, strict=True):
            assert a.shape == e.shape
            torch.testing.assert_close(a, e)


def test_complex_gradients_match_the_loop() -> None:
    w, b, h = make(((9, 3, 3), (2, 9, 3), (3,)), torch.complex128, seed=5)
    inputs = [t.requires_grad_() for t in (w, b, h)]
    for backend in ("torch", "loop"):
        got = torch.autograd.grad(
            ps.matrix_linear_scan(w, b, initial=h, backend=backend).abs().square().sum(), inputs
        )
        want = torch.autograd.grad(oracle(w, b, h)[0].abs().square().sum(), inputs)
        for a, e in zip(got, want, strict=True):
            torch.testing.assert_close(a, e)


@pytest.mark.parametrize("reverse", [False, True])
def test_gradcheck_and_gradgradcheck(reverse) -> None:
    w, b, h = make(((2, 1, 5, 3, 3), (3, 5, 3), (3,)), torch.float64, seed=6)
    inputs = tuple(t.requires_grad_() for t in (w, b, h))

    def fn(w, b, h):
        return ps.matrix_linear_scan(w, b, initial=h, reverse=reverse, return_final=True)

    assert torch.autograd.gradcheck(fn, inputs)
    assert torch.autograd.gradgradcheck(fn, inputs)


def test_half_gradients_are_computed_in_float32() -> None:
    w, b, h = make(((20, 4, 4), (20, 4), (4,)), torch.float64, seed=7)
    want = torch.autograd.grad(oracle(w.requires_grad_(), b, h)[0].sum(), w)[0]
    w16 = w.detach().to(torch.bfloat16).requires_grad_()
    got = torch.autograd.grad(
        ps.matrix_linear_scan(w16, b.bfloat16(), initial=h.bfloat16()).sum(), w16
    )[0]
    assert got.dtype == torch.bfloat16
    assert_matches(got, want, torch.bfloat16)


# --- torch.func, compile, opcheck -------------------------------------------------


def test_vmap_per_sample_gradients_and_jvp() -> None:
    w, b, h = make(((3, 12, 4, 4), (3, 12, 4), (3, 4)), torch.float64, seed=8)
    batched = torch.func.vmap(lambda w, b, h: ps.matrix_linear_scan(w, b, initial=h))(w, b, h)
    torch.testing.assert_close(batched, oracle(w, b, h)[0])
    shared = torch.func.vmap(lambda b: ps.matrix_linear_scan(w[0], b), in_dims=0)(b)
    torch.testing.assert_close(shared, oracle(w[0], b)[0])

    def loss(w, b, h):
        return ps.matrix_linear_scan(w, b, initial=h).square().sum()

    per_sample = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1, 2)))(w, b, h)
    wr, br, hr = (t.clone().requires_grad_() for t in (w, b, h))
    want = torch.autograd.grad(oracle(wr, br, hr)[0].square().sum(), (wr, br, hr))
    for a, e in zip(per_sample, want, strict=True):
        torch.testing.assert_close(a, e)

    tangents = make(((3, 12, 4, 4), (3, 12, 4), (3, 4)), torch.float64, seed=9)
    _, jvp = torch.func.jvp(
        lambda w, b, h: ps.matrix_linear_scan(w, b, initial=h), (w, b, h), tangents
    )
    _, want_jvp = torch.func.jvp(lambda w, b, h: oracle(w, b, h)[0], (w, b, h), tangents)
    torch.testing.assert_close(jvp, want_jvp)


def test_compile_fullgraph() -> None:
    w, b, h = make(((2, 9, 3, 3), (2, 9, 3), (2, 3)), torch.float64, seed=3)
    fn = torch.compile(
        lambda w, b, h: ps.matrix_linear_scan(w, b, initial=h, reverse=True), fullgraph=True
    )
    torch.testing.assert_close(fn(w, b, h), oracle(w, b, h, reverse=True)[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend) -> None:
    w, b, h = make(((2, 1, 6, 3, 3), (1, 3, 6, 3), (2, 3, 3)), torch.float64, seed=1)
    for args in ((w, b, h, False, backend), (w, b, None, True, backend)):
        torch.library.opcheck(matrix_linear_scan_op, args)


# --- errors ----------------------------------------------------------------------


def test_errors_say_what_was_expected_and_received() -> None:
    w, b = torch.randn(5, 3, 3), torch.randn(5, 3)
    name = r"parascan\.matrix_linear_scan: "
    with pytest.raises(TypeError, match=name + "expected weights to be a Tensor"):
        ps.matrix_linear_scan([[1.0]], b)
    with pytest.raises(ValueError, match=name + r"expected weights of shape.*\(5, 3, 2\)"):
        ps.matrix_linear_scan(w[..., :2], b)
    with pytest.raises(ValueError, match=r"biases of shape \(\*batch, T, d\) = \(\*batch, 5, 3\)"):
        ps.matrix_linear_scan(w, b[:4])
    with pytest.raises(ValueError, match=r"initial of shape \(\*batch, d\) with d = 3.*\(2,\)"):
        ps.matrix_linear_scan(w, b, initial=torch.zeros(2))
    with pytest.raises(ValueError, match=r"shapes that broadcast"):
        ps.matrix_linear_scan(w.expand(2, 5, 3, 3), b.expand(3, 5, 3))
    with pytest.raises(TypeError, match=r"expected biases to have a floating or complex dtype"):
        ps.matrix_linear_scan(w, b.int())
    with pytest.raises(TypeError, match=r"expected reverse to be a bool"):
        ps.matrix_linear_scan(w, b, reverse="yes")
    with pytest.raises(ValueError, match=r"expected backend to be one of"):
        ps.matrix_linear_scan(w, b, backend="gpu")
