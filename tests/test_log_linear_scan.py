"""log_linear_scan against float64 loops: outputs, final states and every gradient,
for every backend, dtype and awkward length, on both memory layouts; the -inf
edge cases and huge magnitudes; accuracy over long sequences."""

from __future__ import annotations

import cmath
import math

import pytest
import torch

import parascan as ps

from conftest import (
    DTYPES,
    assert_matches,
    log_loop_oracle,
    loop_oracle,
    oracle_dtype,
    random_gates,
    random_tokens,
)

BACKENDS = ps.backends("cpu")
PARALLEL = [b for b in BACKENDS if b != "loop"]  # the loop is the reference, step by step
LENGTHS = [0, 1, 2, 33, 65, 257, 1031]
LAYOUTS = {
    "time-major": ((2, "T", 257), 1),
    "time-contiguous": ((9, "T"), -1),
    "time-contiguous-3d": ((2, 9, "T"), 2),
}
INF = math.inf


def _shape(template: tuple[object, ...], steps: int) -> tuple[int, ...]:
    return tuple(steps if s == "T" else s for s in template)  # type: ignore[misc]


def _state_shape(shape: tuple[int, ...], dim: int) -> tuple[int, ...]:
    d = dim % len(shape)
    return shape[:d] + shape[d + 1 :]


def log_inputs(
    shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """log gates with |a| in [0.5, 1) and log tokens: real logs of positive values,
    or complex logs of complex (so also negative) values."""
    gates = random_gates(shape, oracle_dtype(dtype), gen)
    if dtype.is_complex:
        tokens = random_tokens(shape, torch.complex128, gen)
        return gates.log().to(dtype), tokens.log().to(dtype)
    return gates.log().to(dtype), random_tokens(shape, torch.float64, gen).to(dtype)


def check_against_oracle(la, lb, dim, *, initial, reverse, backend, dtype, gen) -> None:
    """h, final and the gradients of every input on a random loss of both. Real:
    against the float64 log-space loop. Complex: exp(h) against the complex128
    linear loop of exp(inputs), and the loss is taken of exp(h), which is x."""
    inputs = {"la": la, "lb": lb} | ({} if initial is None else {"h0": initial})
    mine = {k: v.detach().clone().requires_grad_() for k, v in inputs.items()}
    high = {k: v.detach().to(oracle_dtype(dtype)).requires_grad_() for k, v in inputs.items()}
    out, final = ps.log_linear_scan(
        mine["la"], mine["lb"], dim, initial=mine.get("h0"), reverse=reverse,
        return_final=True, backend=backend,
    )  # fmt: skip
    assert out.dtype == dtype and out.is_contiguous()
    if dtype.is_complex:
        h0 = high.get("h0")
        want, want_final = loop_oracle(
            high["la"].exp(), high["lb"].exp(), dim, None if h0 is None else h0.exp(), reverse
        )
        got, got_final = out.exp(), final.exp()
    else:
        want, want_final = log_loop_oracle(high["la"], high["lb"], dim, high.get("h0"), reverse)
        got, got_final = out, final
    assert_matches(got, want.detach(), dtype)
    assert_matches(got_final, want_final.detach(), dtype)
    if want.numel() == 0:
        return
    w = random_tokens(tuple(out.shape), oracle_dtype(dtype), gen)
    wf = random_tokens(tuple(final.shape), oracle_dtype(dtype), gen)

    def loss(o, f):
        return (o * w.to(o.dtype)).real.sum() + (f * wf.to(f.dtype)).real.sum()

    mine_grads = torch.autograd.grad(loss(got, got_final), list(mine.values()))
    want_grads = torch.autograd.grad(loss(want, want_final), list(high.values()))
    for name, g, ref in zip(mine, mine_grads, want_grads, strict=True):
        assert g.dtype == dtype, name
        assert_matches(g, ref, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("steps", LENGTHS)
@pytest.mark.parametrize("layout", LAYOUTS, ids=list(LAYOUTS))
def test_matches_float64_loop(backend, dtype, steps, layout, gen) -> None:
    template, dim = LAYOUTS[layout]
    shape = _shape(template, steps)
    la, lb = log_inputs(shape, dtype, gen)
    h0 = log_inputs(_state_shape(shape, dim), dtype, gen)[1]
    for reverse, initial in ((False, None), (True, h0)):
        check_against_oracle(
            la, lb, dim, initial=initial, reverse=reverse, backend=backend, dtype=dtype, gen=gen
        )


def _python_log_loop(la: list[complex], lb: list[complex], h: complex, reverse: bool):
    """The float64 (complex128) loop in plain Python numbers: fast enough for 10^5 steps."""
    out = [0j] * len(la)
    for t in range(len(la) - 1, -1, -1) if reverse else range(len(la)):
        u, v = la[t] + h, lb[t]
        hi, lo = (u, v) if u.real >= v.real else (v, u)
        h = hi if lo.real == -INF else hi + cmath.log(1 + cmath.exp(lo - hi))
        out[t] = h
    return out


@pytest.mark.skipif("cpu" not in BACKENDS, reason="the cpu backend is not built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex64], ids=str)
def test_long_rows_chunked_over_time(dtype, gen) -> None:
    """Few rows longer than 2**16: the cpu kernel cuts time into chunks and chains
    their log-space carries; reverse with an initial state too."""
    rows, steps = 3, 2**16 + 8 * 1024
    la, lb = log_inputs((rows, steps), dtype, gen)
    h0 = log_inputs((rows,), dtype, gen)[1]
    for reverse in (False, True):
        out, final = ps.log_linear_scan(la, lb, -1, initial=h0, reverse=reverse, return_final=True)
        want = torch.tensor(
            [
                _python_log_loop(la[r].tolist(), lb[r].tolist(), complex(h0[r].item()), reverse)
                for r in range(rows)
            ],
            dtype=torch.complex128,
        )
        if dtype.is_complex:  # compare x = exp(h): the phase is defined modulo 2 pi
            out, final, want = out.exp(), final.exp(), want.exp()
        else:
            want = want.real
        assert_matches(out, want, dtype)
        assert_matches(final, want[:, 0 if reverse else -1], dtype)


@pytest.mark.parametrize("backend", PARALLEL)
def test_accuracy_at_100k_steps_float32(backend, gen) -> None:
    """The issue's accuracy bar: error in log x at most 1e-5 at T = 100000 for
    float32 inputs with a in [0.9, 1], where cumsum + logcumsumexp loses 5.7e-4."""
    a = 0.9 + 0.1 * torch.rand((4, 100_000), generator=gen, dtype=torch.float64)
    b = torch.rand((4, 100_000), generator=gen, dtype=torch.float64)
    la, lb = a.log().float(), b.log().float()
    want, _ = log_loop_oracle(la.double(), lb.double(), -1)
    got = ps.log_linear_scan(la, lb, -1, backend=backend)
    assert (got.double() - want).abs().max().item() <= 1e-5


def _edge_inputs(dtype: torch.dtype, gen: torch.Generator):
    """log_tokens -inf (b = 0) and log_gates -inf (a = 0) scattered, both at once,
    rows that stay log 0 for a while or for ever, and an initial state of -inf."""
    shape = (5, 40)
    la, lb = log_inputs(shape, dtype, gen)
    la, lb = la.clone(), lb.clone()
    r = torch.rand(shape, generator=gen)
    la[r < 0.2] = -INF
    lb[(r > 0.15) & (r < 0.45)] = -INF
    lb[1, :10] = -INF  # row 1: log 0 for the first 10 steps
    lb[2] = -INF  # row 2: log 0 throughout
    la[3, 5:8] = -INF  # row 3: gates 0 then tokens 0 together
    lb[3, 5:8] = -INF
    h0 = log_inputs((5,), dtype, gen)[1].clone()
    h0[0] = h0[2] = -INF
    return la, lb, h0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex128], ids=str)
@pytest.mark.parametrize("reverse", [False, True])
def test_minus_infinity_gives_exact_finite_gradients(backend, dtype, reverse, gen) -> None:
    """Against the linear-space loop on exp(inputs), where a zero is an ordinary
    number: the same values and the same (finite) gradients, no NaN anywhere."""
    la, lb, h0 = _edge_inputs(dtype, gen)
    for initial in (None, h0):
        inputs = [la, lb] + ([] if initial is None else [initial])
        mine = [t.clone().requires_grad_() for t in inputs]
        high = [t.to(oracle_dtype(dtype)).requires_grad_() for t in inputs]
        out, final = ps.log_linear_scan(
            mine[0], mine[1], -1, initial=mine[2] if initial is not None else None,
            reverse=reverse, return_final=True, backend=backend,
        )  # fmt: skip
        want, want_final = loop_oracle(
            high[0].exp(), high[1].exp(), -1,
            None if initial is None else high[2].exp(), reverse,
        )  # fmt: skip
        assert not out.isnan().any() and not final.isnan().any()
        assert (out.real == -INF).any()  # the edge cases are really there
        assert_matches(out.exp(), want.detach(), dtype)
        assert_matches(final.exp(), want_final.detach(), dtype)
        w = random_tokens(tuple(out.shape), oracle_dtype(dtype), gen)
        grads = torch.autograd.grad(
            (out.exp() * w.to(dtype)).real.sum() + final.exp().real.sum(), mine
        )
        want_grads = torch.autograd.grad((want * w).real.sum() + want_final.real.sum(), high)
        for g, ref in zip(grads, want_grads, strict=True):
            assert torch.isfinite(g).all()
            assert_matches(g, ref, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_minus_infinity_is_log_zero_with_zero_gradients(backend) -> None:
    la = torch.full((3, 9), -INF, requires_grad=True)
    lb = torch.full((3, 9), -INF, requires_grad=True)
    out = ps.log_linear_scan(la, lb, -1, backend=backend)
    assert torch.equal(out, torch.full((3, 9), -INF))
    out.exp().sum().backward()
    assert torch.equal(la.grad, torch.zeros(3, 9)) and torch.equal(lb.grad, torch.zeros(3, 9))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_huge_magnitudes(backend, dtype, gen) -> None:
    """Values far outside float range in linear space (x up to e^5000, gates
    e^+-30): the log-space loop in float64 is the oracle, gradients included."""
    la = (torch.rand((3, 200), generator=gen, dtype=torch.float64) - 0.5) * 60
    lb = torch.randn((3, 200), generator=gen, dtype=torch.float64) * 2000
    h0 = torch.tensor([4000.0, -4000.0, 0.0], dtype=torch.float64)
    for reverse in (False, True):
        inputs = [la.to(dtype), lb.to(dtype), h0.to(dtype)]
        mine = [t.clone().requires_grad_() for t in inputs]
        high = [t.double().requires_grad_() for t in inputs]
        out = ps.log_linear_scan(*mine[:2], -1, initial=mine[2], reverse=reverse, backend=backend)
        want, _ = log_loop_oracle(*high[:2], -1, high[2], reverse)
        assert torch.isfinite(out).all()
        rtol = 1e-6 if dtype == torch.float32 else 1e-12
        torch.testing.assert_close(out.double(), want.detach(), rtol=rtol, atol=0)
        w = random_tokens(tuple(out.shape), torch.float64, gen)
        grads = torch.autograd.grad((out * w.to(dtype)).sum(), mine)
        want_grads = torch.autograd.grad((want * w).sum(), high)
        for g, ref in zip(grads, want_grads, strict=True):
            assert torch.isfinite(g).all()
            # A weight exp(x - h) is only as precise as h is in absolute terms:
            # eps * |h|, with |h| in the thousands here.
            tol = 50 * torch.finfo(dtype).eps * want.abs().max().item()
            torch.testing.assert_close(g.double(), ref, rtol=tol, atol=tol * ref.abs().max())


@pytest.mark.parametrize("backend", BACKENDS)
def test_negative_values_through_complex_logs(backend, gen) -> None:
    """The documented recipe: a real recurrence with negative gates and tokens,
    through complex64 logs, read back as exp(h).real."""
    a = torch.empty((4, 300), dtype=torch.float64).uniform_(-1, 1, generator=gen)
    b = torch.randn((4, 300), generator=gen, dtype=torch.float64)
    want, _ = loop_oracle(a, b, -1)
    la, lb = (t.to(torch.complex64).log() for t in (a, b))
    got = ps.log_linear_scan(la, lb, -1, backend=backend).exp().real
    assert_matches(got, want, torch.complex64)
    got128 = ps.log_linear_scan(la.to(torch.complex128), lb.to(torch.complex128), -1).exp().real
    assert_matches(got128, loop_oracle(a, b, -1)[0], torch.complex64)  # inputs rounded to c64


def test_complex_result_is_the_principal_log(gen) -> None:
    la, lb = log_inputs((3, 500), torch.complex128, gen)
    out = ps.log_linear_scan(la, lb, -1)
    assert out.imag.abs().max() <= math.pi
    want, _ = loop_oracle(la.exp(), lb.exp(), -1)
    assert_matches(out, want.log(), torch.complex128)


@pytest.mark.parametrize("backend", BACKENDS)
def test_broadcasting_python_numbers_and_zero_d(backend, gen) -> None:
    lb = random_tokens((2, 7, 3), torch.float64, gen)
    out = ps.log_linear_scan(-0.1, lb, 1, initial=0.0, backend=backend)
    want, _ = log_loop_oracle(
        torch.tensor(-0.1, dtype=torch.float64), lb, 1, torch.zeros(2, 3, dtype=torch.float64)
    )
    assert_matches(out, want, torch.float64)
    la = random_tokens((7, 1), torch.float64, gen).requires_grad_()
    out = ps.log_linear_scan(la, lb, -2, backend=backend)
    want, _ = log_loop_oracle(la, lb, -2)
    assert_matches(out, want, torch.float64)
    (g,) = torch.autograd.grad(out.sum(), la)
    (want_g,) = torch.autograd.grad(want.sum(), la)
    assert g.shape == la.shape
    assert_matches(g, want_g, torch.float64)
    scalar = ps.log_linear_scan(torch.tensor(0.5), torch.tensor(1.5), 0, backend=backend)
    assert scalar.shape == () and scalar.item() == pytest.approx(1.5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_sequence_final_is_log_zero_or_initial(backend) -> None:
    out, final = ps.log_linear_scan(
        torch.zeros(3, 0), torch.zeros(3, 0), -1, return_final=True, backend=backend
    )
    assert out.shape == (3, 0) and torch.equal(final, torch.full((3,), -INF))
    h0 = torch.tensor([1.0, 2.0, 3.0])
    _, final = ps.log_linear_scan(
        torch.zeros(3, 0), torch.zeros(3, 0), -1, initial=h0, return_final=True, backend=backend
    )
    assert torch.equal(final, h0)


def test_concatenation_and_reverse_identities(gen) -> None:
    la, lb = log_inputs((4, 90), torch.float64, gen)
    whole = ps.log_linear_scan(la, lb, -1)
    first, final = ps.log_linear_scan(la[:, :40], lb[:, :40], -1, return_final=True)
    second = ps.log_linear_scan(la[:, 40:], lb[:, 40:], -1, initial=final)
    torch.testing.assert_close(torch.cat([first, second], -1), whole)
    rev = ps.log_linear_scan(la, lb, -1, reverse=True)
    torch.testing.assert_close(rev, ps.log_linear_scan(la.flip(-1), lb.flip(-1), -1).flip(-1))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda: ps.log_linear_scan(torch.zeros(3), torch.zeros(3, dtype=torch.int64), 0),
            TypeError,
            "log_tokens",
        ),
        (lambda: ps.log_linear_scan(torch.zeros(3), torch.zeros(4), 0), ValueError, "log_gates"),
        (lambda: ps.log_linear_scan(torch.zeros(3), torch.zeros(3), 1), IndexError, "dim"),
        (
            lambda: ps.log_linear_scan(
                torch.zeros(2, 3), torch.zeros(2, 3), 1, initial=torch.zeros(3)
            ),
            ValueError,
            "initial",
        ),
        (
            lambda: ps.log_linear_scan(
                torch.zeros(3), torch.zeros(3), 0, initial=torch.zeros((), dtype=torch.complex64)
            ),
            TypeError,
            "initial",
        ),
        (
            lambda: ps.log_linear_scan(torch.zeros(3), torch.zeros(3), 0, backend="nope"),
            ValueError,
            "backend",
        ),
        (lambda: ps.log_linear_scan(torch.zeros(3), [1.0, 2.0, 3.0], 0), TypeError, "log_tokens"),
    ],
)
def test_bad_input_errors_name_the_function(call, error, match) -> None:
    with pytest.raises(error, match=match) as info:
        call()
    assert "parascan.log_linear_scan" in str(info.value)
