"""Drop-ins for ``fla.ops.rwkv7`` (RWKV-7 "Goose"): the generalized delta rule with
RWKV-7's names, per step and head ``S = (Diag(exp(w)) + b a^T) S + k v^T``,
``o = scale * S^T r`` (the RWKV-7 layer passes ``a = -kk`` and ``b = kk * a``); computed
by :func:`parascan.dplr_delta_rule_scan` (the layouts, and what differs from the
originals: :mod:`parascan.compat.fla`)."""

from __future__ import annotations

from torch import Tensor

from parascan.compat.fla._common import PREFIX
from parascan.compat.fla.generalized_delta_rule import check_chunk_options, dplr

__all__ = ["chunk_rwkv7", "fused_recurrent_rwkv7"]


def chunk_rwkv7(
    r: Tensor,
    w: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    scale: float = 1.0,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cpu: Tensor | None = None,
    safe_gate: bool = False,
    chunk_size: int | None = None,
    disable_recompute: bool = False,
    cp_context: object = None,
    lower_bound: float | None = None,
) -> tuple[Tensor, Tensor | None]:
    """RWKV-7 (``fla.ops.rwkv7.chunk_rwkv7``): per step and head,
    ``S = (Diag(exp(w)) + b a^T) S + k v^T``, ``o = scale * S^T r``: the generalized
    delta rule of :func:`~parascan.compat.fla.chunk_dplr_delta_rule` with ``q = r``,
    ``gk = w``.

    Args:
        r, k, a, b: ``(B, T, H, K)``.
        w: ``(B, T, H, K)`` log decays (the layer's ``-exp(...)``, e.g.
            ``-0.6065 * sigmoid(...)``).
        v: ``(B, T, H, V)``.
        scale: the factor of ``r``; 1.0 by default (None: ``K ** -0.5``).
        initial_state: ``(N, H, K, V)``: N = B, or the number of sequences with
            ``cu_seqlens``.
        output_final_state: also return the final state ``(N, H, K, V)``.
        cu_seqlens: ``(N + 1,)`` integer offsets of packed sequences along T (B == 1).
        cu_seqlens_cpu: a CPU copy of ``cu_seqlens`` (checked against it).
        safe_gate, chunk_size, disable_recompute, lower_bound: the original's kernel
            options, checked as :func:`~parascan.compat.fla.chunk_dplr_delta_rule`
            checks them, and ignored.
        cp_context: context parallelism: only None.

    Returns:
        ``(o, final_state)``: ``o`` ``(B, T, H, V)`` in r's dtype; ``final_state``
        float32 (float64 for a float64 v), or None.

    Example:
        >>> import torch
        >>> from parascan.compat.fla import chunk_rwkv7
        >>> ones, kk = torch.ones(1, 3, 1, 1), torch.ones(1, 3, 1, 1)
        >>> o, final = chunk_rwkv7(  # S = (1 - 0.5) S + 1 (a = -kk, b = kk * 0.5)
        ...     ones, torch.zeros(1, 3, 1, 1), ones, ones, -kk, kk * 0.5,
        ...     output_final_state=True)
        >>> o.flatten(), final
        (tensor([1.0000, 1.5000, 1.7500]), tensor([[[[1.7500]]]]))
    """
    fn = PREFIX + "chunk_rwkv7"
    check_chunk_options(fn, safe_gate, chunk_size, disable_recompute, cp_context, lower_bound)
    return dplr(
        fn, (("r", r), ("k", k), ("v", v), ("a", a), ("b", b), ("w", w)), out="q", scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, reverse=False,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
    )  # fmt: skip


def fused_recurrent_rwkv7(
    r: Tensor,
    w: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = True,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """RWKV-7 (``fla.ops.rwkv7.fused_recurrent_rwkv7``): the recurrence of
    :func:`chunk_rwkv7`, with the original's defaults ``scale=None`` (``K ** -0.5``)
    and ``output_final_state=True``. ``o`` has v's dtype. Differentiable (the original
    has no backward)."""
    fn = PREFIX + "fused_recurrent_rwkv7"
    return dplr(
        fn, (("r", r), ("k", k), ("v", v), ("a", a), ("b", b), ("w", w)), out="v", scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, reverse=False,
        cu_seqlens=cu_seqlens,
    )  # fmt: skip
