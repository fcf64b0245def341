"""``parascan.associative_scan`` and ``parascan.associative_reduce``: any associative
function over tensors or pytrees of tensors, with jax.lax.associative_scan's semantics."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor
from torch.utils import _pytree as pytree

from parascan._core import check_flag, check_layout, describe, normalize_dim, tensor_hint
from parascan.generic import chunked
from parascan.generic.cpu import matrix_product_fast_path

__all__ = ["associative_reduce", "associative_scan"]


class _Combine:
    """``combine_fn`` on flat leaf lists, checking that what it returns has the
    structure and shapes of its inputs (a clear error instead of a wrong scan)."""

    def __init__(self, fn: str, combine_fn: Callable[[Any, Any], Any], spec: Any) -> None:
        self.fn, self.combine_fn, self.spec = fn, combine_fn, spec

    def __call__(self, lhs: list[Tensor], rhs: list[Tensor]) -> list[Tensor]:
        if self.spec.is_leaf():  # a single tensor: no pytree round trip (small calls)
            leaves = [self.combine_fn(lhs[0], rhs[0])]
        else:
            like = pytree.tree_unflatten(lhs, self.spec)
            out = self.combine_fn(like, pytree.tree_unflatten(rhs, self.spec))
            leaves, spec = pytree.tree_flatten(_keys_in_order_of(out, like))
            if spec != self.spec and _loose_spec(spec) != _loose_spec(self.spec):
                raise TypeError(
                    f"{self.fn}: expected combine_fn to return the structure of its inputs "
                    f"({self.spec}), but got {spec}"
                )
        for leaf, like in zip(leaves, rhs, strict=True):
            if not isinstance(leaf, Tensor) or leaf.shape != like.shape:
                raise ValueError(
                    f"{self.fn}: expected combine_fn to return tensors of the shapes of its "
                    f"inputs, {tuple(like.shape)} for this leaf, but got {describe(leaf)}"
                )
        return leaves


def _keys_in_order_of(tree: Any, like: Any) -> Any:
    """``tree`` with each dict's keys in the order of ``like``'s matching dict: dicts are
    matched by keys, not insertion order (as JAX's pytrees, which sort them), so a
    combine_fn may build its result's dicts in any order."""
    if isinstance(tree, dict) and isinstance(like, dict) and tree.keys() == like.keys():
        return {k: _keys_in_order_of(tree[k], like[k]) for k in like}
    sequence = (list, tuple)
    if isinstance(tree, sequence) and isinstance(like, sequence) and len(tree) == len(like):
        items = [_keys_in_order_of(t, u) for t, u in zip(tree, like, strict=True)]
        if type(tree) is list:
            return items
        # a tuple of tree's type holding items (a namedtuple takes its fields)
        return type(tree)(*items) if hasattr(tree, "_fields") else type(tree)(items)
    return tree


def _as_tuples(tree: Any) -> Any:
    if isinstance(tree, (list, tuple)):
        return tuple(_as_tuples(x) for x in tree)
    if isinstance(tree, dict):
        return {k: _as_tuples(v) for k, v in tree.items()}
    return tree


def _loose_spec(spec: Any) -> Any:
    """The structure with lists read as tuples: a combine_fn may return a tuple for
    list elems (the results take the structure of elems)."""
    return pytree.tree_structure(_as_tuples(pytree.tree_unflatten([0] * spec.num_leaves, spec)))


def _flatten(
    fn: str, combine_fn: object, elems: object, dim: object
) -> tuple[list[Tensor], Any, int, int]:
    """The leaves, their structure, ``dim`` made non-negative and the common length,
    once ``combine_fn`` is checked callable."""
    if not callable(combine_fn):
        raise TypeError(f"{fn}: expected combine_fn to be callable, but got {describe(combine_fn)}")
    leaves, spec = pytree.tree_flatten(elems)
    if not leaves:
        raise ValueError(
            f"{fn}: expected elems to hold at least one tensor, but got {describe(elems)}"
        )
    for leaf in leaves:
        if not isinstance(leaf, Tensor):
            raise TypeError(
                f"{fn}: expected elems to be a tensor or a pytree of tensors, but it holds "
                f"{describe(leaf)}{tensor_hint(leaf)}"
            )
        check_layout(fn, "every tensor in elems", leaf)
    # As jax: a negative dim counts from the end of the first leaf, and the same
    # position is the scan dim of every leaf (operand dims may differ after it).
    first = leaves[0]
    if first.dim() == 0:
        raise ValueError(
            f"{fn}: expected tensors with at least one dimension, but got a 0-d tensor"
        )
    d = normalize_dim(fn, dim, first.dim())
    n = first.shape[d]
    for leaf in leaves[1:]:
        if leaf.dim() <= d or leaf.shape[d] != n:
            received = ", ".join(str(tuple(x.shape)) for x in leaves)
            raise ValueError(
                f"{fn}: expected every tensor in elems to have size {n} along dim {d}, as the "
                f"first one does, but got shapes {received}"
            )
    return leaves, spec, d, n


def associative_scan(
    combine_fn: Callable[[Any, Any], Any], elems: Any, dim: int, *, reverse: bool = False
) -> Any:
    r"""Inclusive scan of ``elems`` along ``dim`` with an associative ``combine_fn``.

    Semantics given roughly by this loop (``f = combine_fn``, ``e[t]`` the elements)::

        out[0] = e[0]
        for t in range(1, T):
            out[t] = f(out[t - 1], e[t])

    ``reverse=True`` is ``flip(associative_scan(f, flip(elems)))``, also for functions
    that do not commute: ``out[t] = f(out[t + 1], e[t])``.

    Args:
        combine_fn: ``f(a, b)`` for two pytrees of the structure of ``elems`` whose
            leaves hold a batch of ``k`` elements along ``dim``; returns one pytree of
            that structure and those shapes (``k`` results). It must be associative,
            ``f(f(a, b), c) == f(a, f(b, c))``; it is called on batches, so it should
            be vectorized (elementwise ops, ``torch.matmul`` over operand dims).
        elems: a tensor or a pytree (tuple, list, dict, nested) of tensors, all of one
            size ``T`` along ``dim``. Dims after ``dim`` are operand dims (e.g. the
            ``(d, d)`` of a sequence of matrices), dims before it are batch dims.
        dim: the scan dim; a negative value counts from the end of the first leaf, and
            that position is the scan dim of every leaf (as in jax).
        reverse: scan from the last element to the first.

    Returns:
        A pytree of the structure of ``elems``, each leaf of its input's shape. The
        computation is about ``2T`` combines in ``O(log T)`` batched calls; it is
        differentiable through ``combine_fn``, and works under vmap, torch.func and
        torch.compile.

    Example:
        >>> import torch, parascan as ps
        >>> ps.associative_scan(torch.add, torch.arange(1.0, 6.0), 0)
        tensor([ 1.,  3.,  6., 10., 15.])
        >>> def first_order(x, y):  # (a, b) pairs of x[t] = a[t] x[t-1] + b[t]
        ...     return x[0] * y[0], y[0] * x[1] + y[1]
        >>> ps.associative_scan(first_order, (torch.full((3,), 0.5), torch.ones(3)), 0)[1]
        tensor([1.0000, 1.5000, 1.7500])
        >>> m = torch.tensor([[[1.0, 1.0], [0.0, 1.0]], [[2.0, 0.0], [0.0, 1.0]]])
        >>> ps.associative_scan(torch.matmul, m, 0, reverse=True)[0]  # m[1] @ m[0]
        tensor([[2., 2.],
                [0., 1.]])
    """
    fn = "parascan.associative_scan"
    leaves, spec, d, n = _flatten(fn, combine_fn, elems, dim)
    reverse = check_flag(fn, "reverse", reverse)
    if n < 2:
        return pytree.tree_unflatten([x.clone() for x in leaves], spec)
    combine = _Combine(fn, combine_fn, spec)
    if reverse:
        leaves = [x.flip(d) for x in leaves]
    out = chunked.scan(combine, leaves, d)
    if reverse:
        out = [x.flip(d) for x in out]
    return pytree.tree_unflatten(out, spec)


def associative_reduce(combine_fn: Callable[[Any, Any], Any], elems: Any, dim: int) -> Any:
    r"""``f(...f(f(e[0], e[1]), e[2])..., e[T-1])`` along ``dim``, which is removed.

    The combination of all elements in order, for an associative ``f = combine_fn``
    (the same contract as in :func:`associative_scan`), computed as a balanced tree:
    ``T - 1`` combines in ``O(log T)`` batched calls. ``T`` must be at least 1.

    ``torch.matmul`` (or ``operator.matmul``) over the last two dims of one float32 or
    float64 CPU tensor that needs no gradient, matrices up to 256 x 256, runs a C
    kernel instead: each sequence multiplied left to right in cache, in segments on
    torch's threads. It gives the same product up to rounding, the same bits with
    any number of threads, in one call and one pass over the input.

    Example:
        >>> import torch, parascan as ps
        >>> x = torch.tensor([[3.0, 1.0, 4.0], [1.0, 5.0, 9.0]])
        >>> ps.associative_reduce(torch.maximum, x, 1)
        tensor([4., 9.])
        >>> m = torch.tensor([[[1.0, 1.0], [0.0, 1.0]], [[2.0, 0.0], [0.0, 1.0]]])
        >>> ps.associative_reduce(torch.matmul, m, 0)  # m[0] @ m[1]
        tensor([[2., 1.],
                [0., 1.]])
    """
    fn = "parascan.associative_reduce"
    leaves, spec, d, n = _flatten(fn, combine_fn, elems, dim)
    if n == 0:
        raise ValueError(
            f"{fn}: expected at least one element along dim {d} (a reduction of nothing has "
            f"no value without an identity), but got size 0"
        )
    if isinstance(elems, Tensor):
        fast = matrix_product_fast_path(combine_fn, elems, d)
        if fast is not None:
            return fast
    if n == 1:
        out = [x.select(d, 0).clone() for x in leaves]
    else:
        combine = _Combine(fn, combine_fn, spec)
        out = [x.squeeze(d) for x in chunked.pairwise_reduce(combine, leaves, d)]
    return pytree.tree_unflatten(out, spec)
