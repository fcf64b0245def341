"""``parascan.linear_scan``: the first-order linear recurrence (the linear semiring)."""

from __future__ import annotations

from typing import Literal, overload

import torch
from torch import Tensor

from parascan.first_order import varlen
from parascan.first_order.arguments import cpu_fast_path, prepare, with_final
from parascan.first_order.autograd import apply
from parascan.first_order.semiring import LINEAR

__all__ = ["linear_scan"]


@overload
def linear_scan(
    gates: Tensor | float,
    tokens: Tensor,
    dim: int,
    *,
    initial: Tensor | float | None = ...,
    reverse: bool = ...,
    return_final: Literal[False] = ...,
    backend: str = ...,
    cu_seqlens: Tensor | None = ...,
) -> Tensor: ...
@overload
def linear_scan(
    gates: Tensor | float,
    tokens: Tensor,
    dim: int,
    *,
    initial: Tensor | float | None = ...,
    reverse: bool = ...,
    return_final: Literal[True],
    backend: str = ...,
    cu_seqlens: Tensor | None = ...,
) -> tuple[Tensor, Tensor]: ...


def linear_scan(
    gates: Tensor | float,
    tokens: Tensor,
    dim: int,
    *,
    initial: Tensor | float | None = None,
    reverse: bool = False,
    return_final: bool = False,
    backend: str = "auto",
    cu_seqlens: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    r"""First-order linear recurrence along ``dim``.

    .. math:: x_t = a_t \, x_{t-1} + b_t, \qquad x_{-1} = \text{initial} \ (\text{default } 0)

    Semantics given by this loop (``reverse=True`` walks ``t`` from T-1 down to 0 and
    reads ``x[t+1]``, with ``x[T] = initial``)::

        x = initial
        for t in range(T):
            x = gates[t] * x + tokens[t]
            out[t] = x

    Args:
        gates: the multipliers ``a``; a tensor or a Python number, broadcast with
            ``tokens``.
        tokens: the inputs ``b``.
        dim: the time dimension of the broadcast result (negative counts from the end).
        initial: the state before the first step, broadcastable to the result's shape
            without ``dim``.
        reverse: run time backwards.
        return_final: also return the last state (``out[T-1]``, or ``out[0]`` when
            reversed; ``initial`` or zeros when T == 0).
        backend: ``"auto"``, ``"cpu"``, ``"triton"``, ``"torch"`` or ``"loop"``; see
            :func:`parascan.backends`.
        cu_seqlens: packed variable-length sequences: an int32/int64 tensor of
            ``num_seqs + 1`` offsets along ``dim`` (0 first, the length last,
            non-decreasing). Each sequence ``cu_seqlens[s] .. cu_seqlens[s+1] - 1`` is
            scanned as if alone (``reverse`` within it; no state or gradient crosses a
            boundary). ``initial`` and ``final`` then hold one state per sequence, with a
            leading ``num_seqs`` dim in place of the batch: the result's leading dim must
            be 1 (or ``dim`` 0), e.g. ``(1, T, D)`` along dim 1 takes and returns
            ``(num_seqs, D)`` states. An empty sequence's final state is its initial one.

    Returns:
        ``out``, contiguous, with the broadcast shape and dtype
        ``torch.result_type(gates, tokens)``; or ``(out, final)``. float16 and bfloat16
        accumulate in float32. Differentiable in gates, tokens and initial (gradients
        are reduced to each input's shape), under vmap, torch.func and torch.compile.

    Example:
        >>> import torch, parascan as ps
        >>> ps.linear_scan(torch.tensor([1.0, 0.5, 2.0]), torch.tensor([1.0, 1.0, 1.0]), 0)
        tensor([1.0000, 1.5000, 4.0000])
        >>> ps.linear_scan(0.5, torch.ones(3), 0, reverse=True)
        tensor([1.7500, 1.5000, 1.0000])
        >>> out, final = ps.linear_scan(0.5, torch.ones(2, 3), 1, initial=torch.tensor([0.0, 4.0]),
        ...                             return_final=True)
        >>> out
        tensor([[1.0000, 1.5000, 1.7500],
                [3.0000, 2.5000, 2.2500]])
        >>> final
        tensor([1.7500, 2.2500])
        >>> ps.linear_scan(0.5, torch.ones(1, 5), 1, cu_seqlens=torch.tensor([0, 2, 5]))
        tensor([[1.0000, 1.5000, 1.0000, 1.5000, 1.7500]])
    """
    if cu_seqlens is not None:
        return varlen.scan(
            LINEAR, gates, tokens, dim, initial, reverse, return_final, backend, cu_seqlens
        )
    if not torch.compiler.is_compiling():
        fast = cpu_fast_path(LINEAR, gates, tokens, dim, initial, reverse, return_final, backend)
        if fast is not None:
            return fast
    p = prepare(LINEAR, gates, tokens, dim, initial, reverse, return_final, backend)
    out = apply(LINEAR.name, p.gates, p.tokens, p.initial, p.dim, reverse, p.backend)
    return with_final(out, p, reverse, return_final, LINEAR.zero)
