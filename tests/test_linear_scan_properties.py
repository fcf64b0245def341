"""Hypothesis property tests for the algebra of linear_scan."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import parascan as ps

from conftest import assert_matches

BACKENDS = ps.backends("cpu")


@st.composite
def problems(draw, max_steps: int = 70):
    """A random recurrence: shape, dim, dtype, backend, reverse and seeded inputs."""
    ndim = draw(st.integers(1, 3))
    shape = draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim))
    dim = draw(st.integers(-ndim, ndim - 1))
    shape[dim] = draw(st.integers(0, max_steps))
    dtype = draw(st.sampled_from([torch.float64, torch.complex128]))
    backend = draw(st.sampled_from(BACKENDS))
    reverse = draw(st.booleans())
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    gates = (torch.rand(shape, generator=gen, dtype=torch.float64) * 1.6 - 0.8).to(dtype)
    tokens = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    state = shape[: dim % ndim] + shape[dim % ndim + 1 :]
    initial = torch.randn(state, generator=gen, dtype=torch.float64).to(dtype)
    return gates, tokens, initial, dim, reverse, backend


@settings(max_examples=60, deadline=None)
@given(problems())
def test_reverse_is_flip_scan_flip(problem) -> None:
    gates, tokens, initial, dim, _, backend = problem
    out, final = ps.linear_scan(
        gates, tokens, dim, initial=initial, reverse=True, return_final=True, backend=backend
    )
    flipped, flipped_final = ps.linear_scan(
        gates.flip(dim), tokens.flip(dim), dim, initial=initial, return_final=True, backend=backend
    )
    assert_matches(out, flipped.flip(dim), torch.float64)
    assert_matches(final, flipped_final, torch.float64)


@settings(max_examples=60, deadline=None)
@given(problems(), st.data())
def test_scanning_a_concatenation_continues_from_the_final_state(problem, data) -> None:
    gates, tokens, initial, dim, reverse, backend = problem
    steps = tokens.shape[dim]
    cut = data.draw(st.integers(0, steps))
    whole, whole_final = ps.linear_scan(
        gates, tokens, dim, initial=initial, reverse=reverse, return_final=True, backend=backend
    )
    # The part scanned first is the head in time order: the start, or the end when reversed.
    first, second = (
        (slice(cut, steps), slice(0, cut)) if reverse else (slice(0, cut), slice(cut, steps))
    )

    def part(t, s):
        return t.narrow(dim, s.start, s.stop - s.start)

    out1, mid = ps.linear_scan(
        part(gates, first), part(tokens, first), dim, initial=initial, reverse=reverse,
        return_final=True, backend=backend,
    )  # fmt: skip
    out2, end = ps.linear_scan(
        part(gates, second), part(tokens, second), dim, initial=mid, reverse=reverse,
        return_final=True, backend=backend,
    )  # fmt: skip
    pieces = [out2, out1] if reverse else [out1, out2]
    assert_matches(torch.cat(pieces, dim), whole, torch.float64)
    assert_matches(end, whole_final, torch.float64)


@settings(max_examples=60, deadline=None)
@given(problems())
def test_backward_is_a_reverse_scan(problem) -> None:
    """dL/dtokens = the scan of the upstream gradient run the other way, over the
    conjugated gates shifted by one step (arXiv 1709.04057)."""
    gates, tokens, initial, dim, reverse, backend = problem
    tokens = tokens.clone().requires_grad_()
    upstream = torch.randn_like(tokens)
    out = ps.linear_scan(gates, tokens, dim, initial=initial, reverse=reverse, backend=backend)
    (grad,) = torch.autograd.grad(out, tokens, upstream)
    steps = tokens.shape[dim]
    if steps == 0:
        return
    no_gate = torch.zeros_like(gates.narrow(dim, 0, 1))
    if reverse:
        shifted = torch.cat([no_gate, gates.narrow(dim, 0, steps - 1)], dim)
    else:
        shifted = torch.cat([gates.narrow(dim, 1, steps - 1), no_gate], dim)
    want = ps.linear_scan(shifted.conj(), upstream, dim, reverse=not reverse, backend=backend)
    assert_matches(grad, want, torch.float64)


@settings(max_examples=40, deadline=None)
@given(problems(max_steps=20))
def test_all_backends_agree(problem) -> None:
    gates, tokens, initial, dim, reverse, _ = problem
    results = [
        ps.linear_scan(gates, tokens, dim, initial=initial, reverse=reverse, backend=b)
        for b in BACKENDS
    ]
    for r in results[1:]:
        assert_matches(r, results[0], torch.float64)


@settings(max_examples=40, deadline=None)
@given(problems(), st.integers(0, 70))
def test_log_scan_is_the_log_of_the_linear_scan(problem, cut) -> None:
    """log_linear_scan on the (complex) logs of any recurrence is the log of
    linear_scan's result, on every backend, and a concatenation continues from the
    final state."""
    gates, tokens, initial, dim, reverse, backend = problem
    c = torch.complex128
    la, lb, h0 = (t.to(c).log() for t in (gates, tokens, initial))
    h, final = ps.log_linear_scan(
        la, lb, dim, initial=h0, reverse=reverse, return_final=True, backend=backend
    )
    x, x_final = ps.linear_scan(
        gates.to(c), tokens.to(c), dim, initial=initial.to(c), reverse=reverse,
        return_final=True, backend=backend,
    )  # fmt: skip
    assert_matches(h.exp(), x, torch.complex128)
    assert_matches(final.exp(), x_final, torch.complex128)
    steps = la.shape[dim]
    cut = min(cut, steps)
    first, rest = (slice(0, cut), slice(cut, steps))
    if reverse:
        first, rest = rest, first
    part = [t.narrow(dim, first.start, first.stop - first.start) for t in (la, lb)]
    other = [t.narrow(dim, rest.start, rest.stop - rest.start) for t in (la, lb)]
    _, mid = ps.log_linear_scan(*part, dim, initial=h0, reverse=reverse, return_final=True)
    _, end = ps.log_linear_scan(*other, dim, initial=mid, reverse=reverse, return_final=True)
    assert_matches(end.exp(), x_final, torch.complex128)
