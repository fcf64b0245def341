"""associative_scan and associative_reduce beyond the harness (test_generic_against_fold.py):
reverse against flip . scan . flip for non-commutative combines, a long chunked scan,
copies, integers, gradcheck, vmap, compile, errors and the algebra (hypothesis),
against the sequential folds of oracles.py."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils import _pytree as pytree

import parascan as ps

from harness import COMBINES, first_order
from oracles import fold, fold_scan


def _g(seed):
    return torch.Generator().manual_seed(seed)


def case(name, n, seed=0):
    """(combine, elems, dim) for a combine of harness.COMBINES at length n, float64."""
    combine = COMBINES[name]
    g = _g(seed)
    inputs = {
        k: combine.draw(k, tuple(n if s == "T" else s for s in shape), g)
        for k, shape in combine.shapes.items()
    }
    return combine.fn, combine.tree(inputs), combine.dim


def assert_tree_close(actual, expected):
    assert pytree.tree_structure(actual) == pytree.tree_structure(expected)
    for a, e in zip(pytree.tree_leaves(actual), pytree.tree_leaves(expected), strict=True):
        assert a.shape == e.shape
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", ["matmul", "quaternion", "affine"])
def test_reverse_is_flip_scan_flip_for_non_commutative(name) -> None:
    f, elems, dim = case(name, 37, seed=3)
    d = dim % pytree.tree_leaves(elems)[0].dim()
    flipped = pytree.tree_map(lambda x: x.flip(d), elems)
    expected = pytree.tree_map(lambda x: x.flip(d), ps.associative_scan(f, flipped, dim))
    assert_tree_close(ps.associative_scan(f, elems, dim, reverse=True), expected)
    # and it is not the forward scan read backwards: the order matters here
    forward = ps.associative_scan(f, elems, dim)
    assert not torch.allclose(pytree.tree_leaves(forward)[0], pytree.tree_leaves(expected)[0])


def test_long_chunked_scan_with_tail() -> None:
    # 4099 = 64 * 64 + 3: chunks, a recursive scan of their totals and a partial tail.
    f, elems, dim = case("first_order_time_major", 4099, seed=5)
    assert_tree_close(ps.associative_scan(f, elems, dim), fold_scan(f, elems, dim))


def test_single_element_results_are_copies() -> None:
    x = torch.randn(1, 3)
    out = ps.associative_scan(torch.add, x, 0)
    out.add_(1.0)
    torch.testing.assert_close(ps.associative_reduce(torch.add, x, 0), x[0])
    assert not torch.equal(out, x)


def test_integer_elements() -> None:
    x = torch.tensor([3, 1, 4, 1, 5, 9, 2, 6])
    torch.testing.assert_close(
        ps.associative_scan(torch.maximum, x, 0), torch.tensor([3, 3, 4, 4, 5, 9, 9, 9])
    )
    assert ps.associative_reduce(torch.mul, x, 0).item() == 3 * 4 * 5 * 9 * 2 * 6


# --- autograd, vmap, compile -------------------------------------------------------


def test_gradcheck_reduce_and_reverse_scan() -> None:
    w = (torch.randn(6, 3, 3, dtype=torch.float64) / 2).requires_grad_()
    assert torch.autograd.gradcheck(lambda w: ps.associative_reduce(torch.matmul, w, 0), (w,))
    assert torch.autograd.gradcheck(
        lambda w: ps.associative_scan(torch.matmul, w, 0, reverse=True), (w,)
    )


def test_vmap_and_per_sample_gradients() -> None:
    _, (a, b), _ = case("first_order_time_major", 37, seed=2)  # (37, 3, 100)
    a, b = a.movedim(1, 0), b.movedim(1, 0)  # (3, 37, 100): vmap over the 3

    def scan(a, b):
        return ps.associative_scan(first_order, (a, b), 0)[1]

    batched = torch.func.vmap(scan)(a, b)
    torch.testing.assert_close(batched, fold_scan(first_order, (a, b), 1)[1])
    per_sample = torch.func.vmap(torch.func.grad(lambda a, b: scan(a, b).square().sum()))(a, b)
    a_ = a.clone().requires_grad_()
    expected = torch.autograd.grad(fold_scan(first_order, (a_, b), 1)[1].square().sum(), a_)[0]
    torch.testing.assert_close(per_sample, expected)


def test_vmap_of_matrix_products() -> None:
    w = torch.randn(4, 70, 6, 6, dtype=torch.float64) / 2.5
    batched = torch.func.vmap(lambda w: ps.associative_scan(torch.matmul, w, 0))(w)
    torch.testing.assert_close(batched, fold_scan(torch.matmul, w, 1))
    reduced = torch.func.vmap(lambda w: ps.associative_reduce(torch.matmul, w, 0))(w)
    torch.testing.assert_close(reduced, fold(torch.matmul, w, 1))


# inductor's compilation takes 7 to 14 s: the last dim's case with the slow tests
@pytest.mark.parametrize("dim", [0, pytest.param(-1, marks=pytest.mark.slow)])
def test_compile_fullgraph(dim) -> None:
    a = torch.rand(21, 19, dtype=torch.float64)
    b = torch.randn(21, 19, dtype=torch.float64)
    compiled = torch.compile(
        lambda a, b: ps.associative_scan(first_order, (a, b), dim, reverse=True), fullgraph=True
    )
    expected = fold_scan(first_order, (a, b), dim % 2, reverse=True)
    for got, want in zip(compiled(a, b), expected, strict=True):
        torch.testing.assert_close(got, want)


# --- errors ------------------------------------------------------------------------


@pytest.mark.parametrize("reduce", [False, True])
def test_dicts_match_by_keys_not_insertion_order(reduce) -> None:
    """A combine_fn may build its dicts in any key order (JAX's pytrees sort keys):
    the leaves are matched by key. Before, a reordered dict was refused; the leaves
    must not be swapped either (a first-order recurrence, where swapping is wrong)."""
    gen = torch.Generator().manual_seed(3)
    a, b = torch.rand(7, 2, generator=gen), torch.randn(7, 2, generator=gen)

    def combine(p, q):  # returns its keys in the other order, one dict nested
        return ({"a": p[0]["a"] * q[0]["a"], "b": q[0]["a"] * p[0]["b"] + q[0]["b"]}, p[1] + q[1])

    elems = ({"b": b, "a": a}, b)
    want_x, h = [], torch.zeros(2)
    for t in range(7):
        h = a[t] * h + b[t]
        want_x.append(h)
    fn = ps.associative_reduce if reduce else ps.associative_scan
    got = fn(combine, elems, 0)
    assert list(got[0]) == ["b", "a"]
    want = torch.stack(want_x)
    torch.testing.assert_close(got[0]["b"], want[-1] if reduce else want)
    torch.testing.assert_close(got[1], b.sum(0) if reduce else b.cumsum(0))


def test_errors_name_the_function_and_what_was_received() -> None:
    x = torch.randn(5, 3)
    with pytest.raises(TypeError, match=r"parascan\.associative_scan: expected combine_fn"):
        ps.associative_scan(None, x, 0)
    with pytest.raises(ValueError, match="at least one tensor"):
        ps.associative_scan(torch.add, (), 0)
    with pytest.raises(TypeError, match="pytree of tensors, but it holds int"):
        ps.associative_scan(torch.add, (x, 3), 0)
    with pytest.raises(ValueError, match=r"size 5 along dim 0.*\(5, 3\), \(4, 3\)"):
        ps.associative_scan(torch.add, (x, x[:4]), 0)
    with pytest.raises(IndexError, match=r"dim in the range \[-2, 1\]"):
        ps.associative_scan(torch.add, x, 2)
    with pytest.raises(ValueError, match="at least one dimension"):
        ps.associative_scan(torch.add, torch.tensor(1.0), 0)
    with pytest.raises(TypeError, match="reverse to be a bool"):
        ps.associative_scan(torch.add, x, 0, reverse=1)
    with pytest.raises(TypeError, match="structure of its inputs"):
        ps.associative_scan(lambda p, q: p[0] + q[0], (x, x), 0)
    with pytest.raises(ValueError, match=r"shapes of its inputs, \(2, 3\).*shape=\(2, 1\)"):
        ps.associative_scan(lambda p, q: (p + q).sum(-1, keepdim=True), x, 0)
    with pytest.raises(ValueError, match=r"parascan\.associative_reduce: expected at least one"):
        ps.associative_reduce(torch.add, x[:0], 0)


# --- algebra (hypothesis) ----------------------------------------------------------


@st.composite
def matrix_sequences(draw):
    n = draw(st.integers(1, 80))
    d = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**31 - 1))
    return torch.randn(n, d, d, generator=_g(seed), dtype=torch.float64) / max(1.0, d**0.5)


@settings(max_examples=40, deadline=None)
@given(matrix_sequences(), st.data())
def test_scan_of_a_concatenation(w, data) -> None:
    # scan(x ++ y) == scan(x) ++ f(last(scan(x)), scan(y)): the identity of associativity.
    k = data.draw(st.integers(1, w.shape[0]))
    head, tail = w[:k], w[k:]
    whole = ps.associative_scan(torch.matmul, w, 0)
    head_scan = ps.associative_scan(torch.matmul, head, 0)
    tail_scan = ps.associative_scan(torch.matmul, tail, 0)
    torch.testing.assert_close(whole[:k], head_scan)
    torch.testing.assert_close(whole[k:], head_scan[-1] @ tail_scan)
    # the reduction is the last element of the scan, and the first of the reverse scan
    torch.testing.assert_close(ps.associative_reduce(torch.matmul, w, 0), whole[-1])
    torch.testing.assert_close(
        ps.associative_scan(torch.matmul, w, 0, reverse=True)[0],
        functools.reduce(torch.matmul, reversed(list(w))),
    )
