"""``parascan.log_linear_scan``: the first-order recurrence in log space (the log
semiring)."""

from __future__ import annotations

from typing import Literal, overload

import torch
from torch import Tensor

from parascan.first_order import varlen
from parascan.first_order.arguments import cpu_fast_path, prepare, with_final
from parascan.first_order.autograd import apply
from parascan.first_order.semiring import LOG

__all__ = ["log_linear_scan"]


@overload
def log_linear_scan(
    log_gates: Tensor | float,
    log_tokens: Tensor,
    dim: int,
    *,
    initial: Tensor | float | None = ...,
    reverse: bool = ...,
    return_final: Literal[False] = ...,
    backend: str = ...,
    cu_seqlens: Tensor | None = ...,
) -> Tensor: ...
@overload
def log_linear_scan(
    log_gates: Tensor | float,
    log_tokens: Tensor,
    dim: int,
    *,
    initial: Tensor | float | None = ...,
    reverse: bool = ...,
    return_final: Literal[True],
    backend: str = ...,
    cu_seqlens: Tensor | None = ...,
) -> tuple[Tensor, Tensor]: ...


def log_linear_scan(
    log_gates: Tensor | float,
    log_tokens: Tensor,
    dim: int,
    *,
    initial: Tensor | float | None = None,
    reverse: bool = False,
    return_final: bool = False,
    backend: str = "auto",
    cu_seqlens: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    r"""First-order linear recurrence computed in log space, returning ``log x``.

    .. math:: h_t = \operatorname{logaddexp}(\log a_t + h_{t-1}, \log b_t), \qquad
              h_{-1} = \text{initial} \ (\text{default } -\infty)

    so ``h = log x`` for ``x[t] = a[t] x[t-1] + b[t]``, without ever leaving log
    space: no overflow for huge values, no cancellation of a running cumsum (it
    stays accurate at any length), and exact, finite gradients where a gate or a
    token is zero (``-inf``). ``reverse=True`` walks time backwards.

    Args:
        log_gates: ``log a``; a tensor or a Python number, broadcast with
            ``log_tokens``.
        log_tokens: ``log b``.
        dim: the time dimension of the broadcast result (negative counts from the end).
        initial: ``log x[-1]``, broadcastable to the result's shape without ``dim``.
        reverse: run time backwards.
        return_final: also return the last state (``-inf`` or ``initial`` when T == 0).
        backend: ``"auto"``, ``"cpu"``, ``"torch"`` or ``"loop"``; see
            :func:`parascan.backends`.
        cu_seqlens: packed sequences, as for :func:`parascan.linear_scan` (``initial``
            and ``final`` per sequence, log 0 for an empty one without ``initial``).

    Returns:
        ``h`` (contiguous, broadcast shape, dtype ``torch.result_type``), or
        ``(h, final)``. Real inputs give a real result. Complex inputs give the
        principal complex log (imaginary part in [-pi, pi)): for real recurrences
        with negative numbers pass ``torch.log(v.to(torch.complex64))`` and read
        ``torch.exp(h).real``. Half types compute in float32. Differentiable in
        every input (where the result is log 0 the gradient is 0), under vmap,
        torch.func and torch.compile.

    Example:
        >>> import torch, parascan as ps
        >>> a, b = torch.tensor([0.5, 0.5, 0.5]), torch.tensor([1.0, 2.0, 0.0])
        >>> ps.log_linear_scan(a.log(), b.log(), 0).exp()
        tensor([1.0000, 2.5000, 1.2500])
        >>> neg = torch.tensor([1.0, -3.0]).to(torch.complex64).log()
        >>> ps.log_linear_scan(torch.zeros(2), neg, 0).exp().real
        tensor([ 1., -2.])
    """
    if cu_seqlens is not None:
        return varlen.scan(
            LOG, log_gates, log_tokens, dim, initial, reverse, return_final, backend, cu_seqlens
        )
    if not torch.compiler.is_compiling():
        fast = cpu_fast_path(
            LOG, log_gates, log_tokens, dim, initial, reverse, return_final, backend
        )
        if fast is not None:
            return fast
    p = prepare(LOG, log_gates, log_tokens, dim, initial, reverse, return_final, backend)
    out = apply(LOG.name, p.gates, p.tokens, p.initial, p.dim, reverse, p.backend)
    return with_final(out, p, reverse, return_final, LOG.zero)
