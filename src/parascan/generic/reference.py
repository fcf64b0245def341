"""Sequential folds: the reference of the generic scans (``parascan check`` compares
the batched algorithms with it; the tests have their own). One combine call per
element, written with nothing but indexing, so it shares no code with chunked.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["fold", "scan"]


def _at(elems: Any, dim: int, t: int) -> Any:
    return pytree.tree_map(lambda x: x.narrow(dim, t, 1), elems)


def scan(combine_fn: Callable[[Any, Any], Any], elems: Any, dim: int, reverse: bool = False) -> Any:
    """``[e0, f(e0, e1), f(f(e0, e1), e2), ...]`` one step at a time (``dim`` >= 0)."""
    leaves, spec = pytree.tree_flatten(elems)
    n = leaves[0].shape[dim]
    order = range(n - 1, -1, -1) if reverse else range(n)
    results: list[list[Any]] = []
    acc = None
    for t in order:
        acc = _at(elems, dim, t) if acc is None else combine_fn(acc, _at(elems, dim, t))
        results.append(pytree.tree_leaves(acc))  # a list may come back as a tuple
    if reverse:
        results.reverse()
    if not results:
        return pytree.tree_unflatten([x.clone() for x in leaves], spec)
    return pytree.tree_unflatten([torch.cat(xs, dim) for xs in zip(*results, strict=True)], spec)


def fold(combine_fn: Callable[[Any, Any], Any], elems: Any, dim: int) -> Any:
    """``f(...f(f(e0, e1), e2)..., e_{T-1})`` with ``dim`` removed (``dim`` >= 0)."""
    leaves, spec = pytree.tree_flatten(elems)
    acc = _at(elems, dim, 0)
    for t in range(1, leaves[0].shape[dim]):
        acc = combine_fn(acc, _at(elems, dim, t))
    return pytree.tree_unflatten([x.squeeze(dim) for x in pytree.tree_leaves(acc)], spec)
