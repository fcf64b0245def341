"""matrix_linear_scan beyond the harness (test_matrix_against_loop.py): the auto
backend, a long float32 sequence, concatenation, gradcheck, vmap, forward mode,
compile, opcheck and errors, against the float64 loop (oracles.py)."""

from __future__ import annotations

import pytest
import torch

import parascan as ps
from parascan.matrix.autograd import matrix_linear_scan_op

from conftest import assert_matches
from oracles import matrix_loop

# matrix_linear_scan has no Triton kernel (the harness checks that it says so)
pytestmark = pytest.mark.targets(backends=("cpu", "torch", "loop"))


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


def test_auto_backend_and_complex64() -> None:
    w, b, h = make(((33, 3, 3), (2, 33, 3), (3,)), torch.complex64, seed=4)
    o = torch.complex128
    want = matrix_loop(w.to(o), b.to(o), h.to(o))[0]
    assert_matches(ps.matrix_linear_scan(w, b, initial=h), want, torch.complex64)
    with pytest.raises(RuntimeError, match=r"'cpu' is not available for torch\.complex64"):
        ps.matrix_linear_scan(w, b, backend="cpu")


def test_long_sequence_float32_and_transposed_weights(target) -> None:
    w, b, h = make(((3000, 16, 16), (3000, 16), (16,)), torch.float64, seed=1)
    want = matrix_loop(w.mT, b, h)[0]
    w, b, h = (t.float().to(target.device) for t in (w, b, h))
    got = ps.matrix_linear_scan(w.mT, b, initial=h, backend=target.backend)
    assert_matches(got, want, torch.float32)


def test_concatenation_continues_from_the_final_state() -> None:
    w, b, h = make(((2, 40, 4, 4), (2, 40, 4), (2, 4)), torch.float64, seed=2)
    whole = ps.matrix_linear_scan(w, b, initial=h)
    head, final = ps.matrix_linear_scan(w[:, :13], b[:, :13], initial=h, return_final=True)
    tail = ps.matrix_linear_scan(w[:, 13:], b[:, 13:], initial=final)
    torch.testing.assert_close(whole, torch.cat([head, tail], -2))


# --- gradients -------------------------------------------------------------------


@pytest.mark.parametrize("reverse", [False, True])
def test_gradcheck_and_gradgradcheck(reverse) -> None:
    w, b, h = make(((2, 1, 5, 3, 3), (3, 5, 3), (3,)), torch.float64, seed=6)
    inputs = tuple(t.requires_grad_() for t in (w, b, h))

    def fn(w, b, h):
        return ps.matrix_linear_scan(w, b, initial=h, reverse=reverse, return_final=True)

    assert torch.autograd.gradcheck(fn, inputs)
    assert torch.autograd.gradgradcheck(fn, inputs)


# --- torch.func, compile, opcheck -------------------------------------------------


def test_vmap_per_sample_gradients_and_jvp() -> None:
    w, b, h = make(((3, 12, 4, 4), (3, 12, 4), (3, 4)), torch.float64, seed=8)
    batched = torch.func.vmap(lambda w, b, h: ps.matrix_linear_scan(w, b, initial=h))(w, b, h)
    torch.testing.assert_close(batched, matrix_loop(w, b, h)[0])
    shared = torch.func.vmap(lambda b: ps.matrix_linear_scan(w[0], b), in_dims=0)(b)
    torch.testing.assert_close(shared, matrix_loop(w[0], b)[0])

    def loss(w, b, h):
        return ps.matrix_linear_scan(w, b, initial=h).square().sum()

    per_sample = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1, 2)))(w, b, h)
    wr, br, hr = (t.clone().requires_grad_() for t in (w, b, h))
    want = torch.autograd.grad(matrix_loop(wr, br, hr)[0].square().sum(), (wr, br, hr))
    for a, e in zip(per_sample, want, strict=True):
        torch.testing.assert_close(a, e)

    tangents = make(((3, 12, 4, 4), (3, 12, 4), (3, 4)), torch.float64, seed=9)
    _, jvp = torch.func.jvp(
        lambda w, b, h: ps.matrix_linear_scan(w, b, initial=h), (w, b, h), tangents
    )
    _, want_jvp = torch.func.jvp(lambda w, b, h: matrix_loop(w, b, h)[0], (w, b, h), tangents)
    torch.testing.assert_close(jvp, want_jvp)


def test_compile_fullgraph() -> None:
    w, b, h = make(((2, 9, 3, 3), (2, 9, 3), (2, 3)), torch.float64, seed=3)
    fn = torch.compile(
        lambda w, b, h: ps.matrix_linear_scan(w, b, initial=h, reverse=True), fullgraph=True
    )
    torch.testing.assert_close(fn(w, b, h), matrix_loop(w, b, h, reverse=True)[0])


def test_opcheck(target) -> None:
    w, b, h = make(((2, 1, 6, 3, 3), (1, 3, 6, 3), (2, 3, 3)), torch.float64, seed=1)
    w, b, h = (t.to(target.device) for t in (w, b, h))
    backend = target.backend
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
