"""Hypothesis property tests for the algebra of linear_scan, on every target."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import parascan as ps

from conftest import Target, assert_matches, random_tokens, targets
from oracles import linear_loop


@st.composite
def problems(draw, max_steps: int = 70):
    """A random recurrence: shape, dim, dtype, backend, reverse and seeded inputs (on
    the target's device)."""
    ndim = draw(st.integers(1, 3))
    shape = draw(st.lists(st.integers(1, 5), min_size=ndim, max_size=ndim))
    dim = draw(st.integers(-ndim, ndim - 1))
    shape[dim] = draw(st.integers(0, max_steps))
    dtype = draw(st.sampled_from([torch.float64, torch.complex128]))
    target: Target = draw(st.sampled_from(targets()))
    reverse = draw(st.booleans())
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    gates = (torch.rand(shape, generator=gen, dtype=torch.float64) * 1.6 - 0.8).to(dtype)
    tokens = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    state = shape[: dim % ndim] + shape[dim % ndim + 1 :]
    initial = torch.randn(state, generator=gen, dtype=torch.float64).to(dtype)
    on = target.device
    return gates.to(on), tokens.to(on), initial.to(on), dim, reverse, target.backend


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


def _shifted(gates: torch.Tensor, dim: int, reverse: bool) -> torch.Tensor:
    """The gates one step later in scan order (the next step's gate), 0 past the end."""
    steps = gates.shape[dim]
    no_gate = torch.zeros_like(gates.narrow(dim, 0, 1))
    if reverse:
        return torch.cat([no_gate, gates.narrow(dim, 0, steps - 1)], dim)
    return torch.cat([gates.narrow(dim, 1, steps - 1), no_gate], dim)


@settings(max_examples=60, deadline=None)
@given(problems())
def test_gradients_are_the_reverse_scan_of_the_float64_loop(problem) -> None:
    """Every gradient against autograd through the float64 loop (oracles.py), and
    that loop's gradients against the identity (arXiv 1709.04057): dL/dtokens is the
    upstream gradient scanned the other way over the conjugated gates shifted by one
    step, dL/dgates[t] = dL/dtokens[t] * conj(x[t-1]) and dL/dinitial is the
    gradient of the first step times conj(its gate): the reverse scan computed by
    the loop itself, independently of parascan."""
    gates, tokens, initial, dim, reverse, backend = problem
    steps = tokens.shape[dim]
    leaves = [t.clone().requires_grad_() for t in (gates, tokens, initial)]
    wide = [t.detach().cpu().clone().requires_grad_() for t in (gates, tokens, initial)]
    upstream = random_tokens(tuple(tokens.shape), tokens.dtype, torch.Generator().manual_seed(7))
    out = ps.linear_scan(*leaves[:2], dim, initial=leaves[2], reverse=reverse, backend=backend)
    got = torch.autograd.grad(out, leaves, upstream.to(out.device), allow_unused=True,
                              materialize_grads=True)  # fmt: skip
    x, _ = linear_loop(*wide[:2], dim, wide[2], reverse)
    want = torch.autograd.grad(x, wide, upstream, allow_unused=True, materialize_grads=True)
    for g, w in zip(got, want, strict=True):
        assert_matches(g, w, torch.float64)
    if steps == 0:
        return
    a, h0 = gates.cpu(), initial.cpu()
    grad_tokens, _ = linear_loop(_shifted(a, dim, reverse).conj(), upstream, dim,
                                 reverse=not reverse)  # fmt: skip
    before = h0.unsqueeze(dim)  # the state before the first step, in scan order
    if reverse:  # x[t+1], and the initial state at the end
        previous = torch.cat([x.detach().narrow(dim, 1, steps - 1), before], dim)
    else:  # x[t-1], and the initial state at the start
        previous = torch.cat([before, x.detach().narrow(dim, 0, steps - 1)], dim)
    first = grad_tokens.select(dim, steps - 1 if reverse else 0)
    first_gate = a.select(dim, steps - 1 if reverse else 0)
    for g, identity in zip(
        want, (grad_tokens * previous.conj(), grad_tokens, first * first_gate.conj()), strict=True
    ):
        assert_matches(g, identity, torch.float64)


@settings(max_examples=40, deadline=None)
@given(problems(max_steps=20))
def test_all_backends_agree_with_the_loop(problem) -> None:
    gates, tokens, initial, dim, reverse, _ = problem
    want, _ = linear_loop(gates.cpu(), tokens.cpu(), dim, initial.cpu(), reverse)
    for target in targets(backends=None):
        on = target.device
        got = ps.linear_scan(
            gates.to(on), tokens.to(on), dim, initial=initial.to(on), reverse=reverse,
            backend=target.backend,
        )  # fmt: skip
        assert_matches(got, want, torch.float64)


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
