"""Drop-ins for torch_parallel_scan's ``prefix_scan`` and ``reduce_scan``::

    from parascan.compat import torch_parallel_scan as tps

Same arguments and results, computed by :func:`parascan.associative_scan` and
:func:`parascan.associative_reduce`: work-efficient (about 2n combines for a scan
instead of n log n), no padding to a power of two, and any ``dim``, positive or
negative (the original fails for ``dim=0`` when there are operand dims after it).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from parascan._core import describe, tensor_hint
from parascan.compat._checks import errors_as
from parascan.generic import associative_reduce, associative_scan

__all__ = ["prefix_scan", "reduce_scan"]


def _check(fn: str, x: object, func: object) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{fn}: expected x to be a Tensor, but got {describe(x)}{tensor_hint(x)}")
    if not callable(func):
        raise TypeError(f"{fn}: expected a callable binary function, but got {describe(func)}")


def prefix_scan(
    x: Tensor, prefix_func: Callable[[Tensor, Tensor], Tensor], dim: int, pad_value: float = 0
) -> Tensor:
    """Cumulative ``prefix_func`` over ``dim``, left to right: ``y[t] = f(y[t-1], x[t])``.

    ``x`` is ``[*preceding_dims, seq_len, *operand_dims]``; ``prefix_func`` is an
    associative binary function over batches of operands (e.g. ``torch.matmul``).
    ``pad_value`` is accepted for compatibility and unused: nothing is padded.

    Example:
        >>> import torch
        >>> from parascan.compat.torch_parallel_scan import prefix_scan
        >>> prefix_scan(torch.tensor([[1.0, 2.0, 3.0]]), torch.add, dim=-1)
        tensor([[1., 3., 6.]])
    """
    fn = "parascan.compat.torch_parallel_scan.prefix_scan"
    _check(fn, x, prefix_func)
    with errors_as(fn, "parascan.associative_scan", {"combine_fn": "prefix_func", "elems": "x"}):
        out: Tensor = associative_scan(prefix_func, x, dim)
    return out


def reduce_scan(x: Tensor, reduce_func: Callable[[Tensor, Tensor], Tensor], dim: int) -> Tensor:
    """``f(...f(f(x[0], x[1]), x[2])..., x[n-1])`` over ``dim``, which is removed.

    Example:
        >>> import torch
        >>> from parascan.compat.torch_parallel_scan import reduce_scan
        >>> reduce_scan(torch.tensor([[1.0, 2.0, 3.0]]), torch.mul, dim=1)
        tensor([6.])
    """
    fn = "parascan.compat.torch_parallel_scan.reduce_scan"
    _check(fn, x, reduce_func)
    with errors_as(fn, "parascan.associative_reduce", {"combine_fn": "reduce_func", "elems": "x"}):
        out: Tensor = associative_reduce(reduce_func, x, dim)
    return out
