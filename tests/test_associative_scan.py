"""associative_scan and associative_reduce against sequential folds written here.

Every combine function of the issue: add, max, logaddexp, matmul over operand dims,
affine pairs (W, b), quaternion products, the first-order pair; forward and reverse,
pytrees, odd and prime lengths, T = 0 and 1, gradients, vmap, compile, errors.
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils import _pytree as pytree

import parascan as ps

LENGTHS = [0, 1, 2, 3, 5, 16, 17, 63, 64, 65, 97, 257]


def fold_scan(f, elems, dim, reverse=False):
    """out[t] = f(out[t-1], e[t]) (or f(out[t+1], e[t]) reversed), one step at a time."""
    leaves, spec = pytree.tree_flatten(elems)
    n = leaves[0].shape[dim]
    steps = range(n - 1, -1, -1) if reverse else range(n)
    out = [None] * n
    acc = None
    for t in steps:
        e = pytree.tree_map(lambda x, t=t: x.narrow(dim, t, 1), elems)
        acc = e if acc is None else f(acc, e)
        out[t] = pytree.tree_leaves(acc)
    if n == 0:
        return elems
    return pytree.tree_unflatten([torch.cat(xs, dim) for xs in zip(*out, strict=True)], spec)


def fold(f, elems, dim):
    leaves, spec = pytree.tree_flatten(elems)
    acc = pytree.tree_map(lambda x: x.narrow(dim, 0, 1), elems)
    for t in range(1, leaves[0].shape[dim]):
        acc = f(acc, pytree.tree_map(lambda x, t=t: x.narrow(dim, t, 1), elems))
    return pytree.tree_unflatten([x.squeeze(dim) for x in pytree.tree_leaves(acc)], spec)


# --- combine functions (all associative) -------------------------------------------


def first_order(x, y):
    """(a, b) pairs of x[t] = a[t] x[t-1] + b[t]."""
    return x[0] * y[0], y[0] * x[1] + y[1]


def affine(x, y):
    """(W, b) pairs of x[t] = W[t] x[t-1] + b[t]: apply x, then y."""
    (w1, b1), (w2, b2) = x, y
    return w2 @ w1, (w2 @ b1.unsqueeze(-1)).squeeze(-1) + b2


def quaternion(p, q):
    """Hamilton product over the last dim (w, x, y, z): associative, not commutative."""
    a1, b1, c1, d1 = p.unbind(-1)
    a2, b2, c2, d2 = q.unbind(-1)
    return torch.stack(
        [
            a1 * a2 - b1 * b2 - c1 * c2 - d1 * d2,
            a1 * b2 + b1 * a2 + c1 * d2 - d1 * c2,
            a1 * c2 - b1 * d2 + c1 * a2 + d1 * b2,
            a1 * d2 + b1 * c2 - c1 * b2 + d1 * a2,
        ],
        -1,
    )


def first_order_dict(x, y):
    a, b = first_order((x["gate"], x["state"][0]), (y["gate"], y["state"][0]))
    return {"gate": a, "state": [b]}


def _g(seed):
    return torch.Generator().manual_seed(seed)


def case(name, n, seed=0):
    """(combine, elems, dim) for a named combine at length n, float64."""
    g = _g(seed)
    f64 = torch.float64
    if name == "add":
        return torch.add, torch.randn(3, n, 2, generator=g, dtype=f64), 1
    if name == "max":
        return torch.maximum, torch.randn(4, n, generator=g, dtype=f64), -1
    if name == "logaddexp":
        return torch.logaddexp, torch.randn(n, 300, generator=g, dtype=f64), 0
    if name == "matmul":
        return torch.matmul, torch.randn(n, 5, 5, generator=g, dtype=f64) / 2.2, 0
    if name == "matmul_batched":
        return torch.matmul, torch.randn(2, n, 9, 9, generator=g, dtype=f64) / 3, 1
    if name == "affine":
        w = torch.randn(2, n, 4, 4, generator=g, dtype=f64) / 2
        return affine, (w, torch.randn(2, n, 4, generator=g, dtype=f64)), 1
    if name == "quaternion":
        q = torch.randn(n, 4, generator=g, dtype=f64)
        return quaternion, q / q.norm(dim=-1, keepdim=True), 0
    if name == "first_order":
        a = torch.rand(3, 2, n, generator=g, dtype=f64) * 1.8 - 0.9
        return first_order, (a, torch.randn(3, 2, n, generator=g, dtype=f64)), -1
    if name == "first_order_time_major":
        a = torch.rand(n, 3, 100, generator=g, dtype=f64) * 1.8 - 0.9
        return first_order, [a, torch.randn(n, 3, 100, generator=g, dtype=f64)], 0
    if name == "pytree_dict":
        a = torch.rand(2, n, generator=g, dtype=f64)
        b = torch.randn(2, n, generator=g, dtype=f64)
        return first_order_dict, {"gate": a, "state": [b]}, 1
    raise AssertionError(name)


COMBINES = [
    "add",
    "max",
    "logaddexp",
    "matmul",
    "matmul_batched",
    "affine",
    "quaternion",
    "first_order",
    "first_order_time_major",
    "pytree_dict",
]


def assert_tree_close(actual, expected):
    assert pytree.tree_structure(actual) == pytree.tree_structure(expected)
    for a, e in zip(pytree.tree_leaves(actual), pytree.tree_leaves(expected), strict=True):
        assert a.shape == e.shape
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("n", LENGTHS)
@pytest.mark.parametrize("name", COMBINES)
def test_scan_matches_sequential_fold(name, n, reverse) -> None:
    f, elems, dim = case(name, n)
    before = pytree.tree_map(torch.clone, elems)
    out = ps.associative_scan(f, elems, dim, reverse=reverse)
    assert_tree_close(out, fold_scan(f, elems, dim, reverse))
    assert_tree_close(elems, before)  # inputs untouched


@pytest.mark.parametrize("n", [n for n in LENGTHS if n > 0])
@pytest.mark.parametrize("name", COMBINES)
def test_reduce_matches_sequential_fold(name, n) -> None:
    f, elems, dim = case(name, n)
    assert_tree_close(ps.associative_reduce(f, elems, dim), fold(f, elems, dim))


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


@pytest.mark.parametrize("n", [1, 2, 17, 65])
@pytest.mark.parametrize("name", ["first_order", "first_order_time_major", "matmul", "affine"])
def test_gradients_match_the_fold(name, n) -> None:
    f, elems, dim = case(name, n, seed=7)
    leaves, spec = pytree.tree_flatten(elems)
    weights = [torch.randn(x.shape, generator=_g(11), dtype=x.dtype) for x in leaves]

    def loss(scan, *xs):
        out = pytree.tree_leaves(scan(f, pytree.tree_unflatten(list(xs), spec), dim))
        return sum((o * w).sum() for o, w in zip(out, weights, strict=True))

    inputs = [x.clone().requires_grad_() for x in leaves]
    got = torch.autograd.grad(loss(ps.associative_scan, *inputs), inputs)
    want = torch.autograd.grad(loss(fold_scan, *inputs), inputs)
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)


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


@pytest.mark.parametrize("dim", [0, -1])
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
