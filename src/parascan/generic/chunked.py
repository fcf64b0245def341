"""Batched algorithms of the generic scans. They work on flat lists of tensors (a
pytree's leaves) that share a length ``n`` along ``dim``; ``combine(lhs, rhs)`` maps two
such lists, holding a batch of ``k`` elements each, to one list of ``k`` results.

Summary of the algorithms:

* ``pairwise`` (jax.lax.associative_scan's): combine neighbours, scan the ``n/2`` pair
  results recursively, then combine each odd prefix with the next even element.
  About ``2n`` element combines in ``2 log2 n`` calls. Neighbours are adjacent in
  memory, so it is the choice when an element is small (a scalar per channel along
  the last dim: slices with step 2 still read whole cache lines).
* ``chunked`` (reduce-then-scan): cut the sequence into ``m`` chunks of ``L``; scan
  inside all chunks at once, one call per step (``L`` calls of ``m`` elements); scan
  the ``m`` chunk totals recursively; combine each chunk's prefix into its elements
  (``L`` calls). Also about ``2n`` combines, but in larger batches and with fewer
  copies; the choice when an element is a block of memory (a matrix, a row of
  channels), where a slice with step ``L`` is as cheap as a contiguous one.
* ``pairwise_reduce``: a balanced tree, ``n - 1`` combines in ``ceil(log2 n)`` calls
  plus one per odd level, order preserved for non-commutative functions.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from torch import Tensor

__all__ = ["pairwise_reduce", "scan"]

Leaves = list[Tensor]
Combine = Callable[[Leaves, Leaves], Leaves]

# An element of at least this many bytes (summed over leaves) takes the chunked path.
_BLOCK_BYTES = 256
_MAX_CHUNK = 64


def _slice(x: Tensor, dim: int, start: int, stop: int, step: int = 1) -> Tensor:
    if dim == 0:
        return x[start:stop:step]
    index: list[slice] = [slice(None)] * x.dim()
    index[dim] = slice(start, stop, step)
    return x[tuple(index)]


def _element_bytes(leaves: Leaves, dim: int) -> int:
    return sum(math.prod(x.shape[dim + 1 :]) * x.element_size() for x in leaves)


def scan(combine: Combine, leaves: Leaves, dim: int) -> Leaves:
    """Inclusive scan of ``leaves`` along ``dim`` (>= 0). For n < 2 the leaves come
    back as they are."""
    n = leaves[0].shape[dim]
    if n < 2:
        return leaves
    if n >= 4 and _element_bytes(leaves, dim) >= _BLOCK_BYTES:
        return _chunked(combine, leaves, dim, n)
    return _pairwise(combine, leaves, dim, n)


def _pairwise(combine: Combine, leaves: Leaves, dim: int, n: int) -> Leaves:
    pairs = combine(
        [_slice(x, dim, 0, n - 1, 2) for x in leaves], [_slice(x, dim, 1, n, 2) for x in leaves]
    )
    odd = scan(combine, pairs, dim)  # prefixes ending at positions 1, 3, 5, ...
    # Prefixes ending at 2, 4, ...: the odd prefix before them, then the element.
    n_even = (n - 1) // 2
    even = combine(
        [_slice(o, dim, 0, n_even) for o in odd], [_slice(x, dim, 2, n, 2) for x in leaves]
    )
    # The results are written into place (the copies are the only data movement
    # beside the combines); autograd, vmap and compile all follow copy_ into views.
    # Each is made from a combine result, so under vmap it is batched when the results
    # are, and its dtype is the results' (which may have promoted the inputs').
    out = []
    for x, o, e in zip(leaves, odd, even, strict=True):
        result = o.new_empty(x.shape)
        result.narrow(dim, 0, 1).copy_(x.narrow(dim, 0, 1))
        _slice(result, dim, 1, n, 2).copy_(o)
        _slice(result, dim, 2, n, 2).copy_(e)
        out.append(result)
    return out


def _chunked(combine: Combine, leaves: Leaves, dim: int, n: int) -> Leaves:
    length = max(2, min(_MAX_CHUNK, math.isqrt(n)))
    m = n // length
    main = m * length
    blocks = [x.narrow(dim, 0, main).unflatten(dim, (m, length)) for x in leaves]
    # Scan inside every chunk at once: column j holds element j of each chunk.
    columns = [[b.select(dim + 1, 0) for b in blocks]]
    for j in range(1, length):
        columns.append(combine(columns[-1], [b.select(dim + 1, j) for b in blocks]))
    # The prefix before chunks 1 .. m-1: the inclusive scan of the totals of 0 .. m-2.
    prefix = scan(combine, [t.narrow(dim, 0, m - 1) for t in columns[-1]], dim) if m > 1 else []
    out = [c.new_empty(x.shape) for c, x in zip(columns[-1], leaves, strict=True)]  # see _pairwise
    out_blocks = [o.narrow(dim, 0, main).unflatten(dim, (m, length)) for o in out]
    last = columns[-1]  # after the loop: the prefix through element main - 1, at m - 1
    for j, column in enumerate(columns):
        # Each column goes to its place while it is still in cache.
        targets = [b.select(dim + 1, j) for b in out_blocks]
        for target, c in zip(targets, column, strict=True):
            target.narrow(dim, 0, 1).copy_(c.narrow(dim, 0, 1))
        if m > 1:
            last = combine(prefix, [c.narrow(dim, 1, m - 1) for c in column])
            for target, f in zip(targets, last, strict=True):
                target.narrow(dim, 1, m - 1).copy_(f)
    rest = n - main
    if rest:
        # The last partial chunk: its own scan, then the prefix of everything before it
        # (read from the combine result, not from ``out``, which is written in place).
        tail = scan(combine, [x.narrow(dim, main, rest) for x in leaves], dim)
        before = [
            p.narrow(dim, p.shape[dim] - 1, 1).expand_as(t) for p, t in zip(last, tail, strict=True)
        ]
        for o, t in zip(out, combine(before, tail), strict=True):
            o.narrow(dim, main, rest).copy_(t)
    return out


def pairwise_reduce(combine: Combine, leaves: Leaves, dim: int) -> Leaves:
    """The combination of all ``n >= 1`` elements, keeping ``dim`` with size 1."""
    # An odd element out at a level sits right of everything combined later, and
    # left of the odd elements out of earlier levels.
    left_over: list[Leaves] = []
    n = leaves[0].shape[dim]
    while n > 1:
        if n % 2:
            left_over.append([x.narrow(dim, n - 1, 1) for x in leaves])
            n -= 1
        leaves = combine(
            [_slice(x, dim, 0, n, 2) for x in leaves], [_slice(x, dim, 1, n, 2) for x in leaves]
        )
        n //= 2
    for right in reversed(left_over):
        leaves = combine(leaves, right)
    return leaves
