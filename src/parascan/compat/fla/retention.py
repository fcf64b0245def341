"""Drop-ins for ``fla.ops.retention`` (RetNet's multi-scale retention): per step and
head ``h``, ``S = gamma_h S + k v^T``, ``o = scale * S^T q``, with the fixed decays
``gamma_h = 1 - 2 ** (-5 - h)``; computed by :func:`parascan.linear_attention_scan`
(the layouts, and what differs from the originals: :mod:`parascan.compat.fla`)."""

from __future__ import annotations

import torch
from torch import Tensor

from parascan.compat.fla._common import (
    PREFIX,
    check_kwargs,
    check_power_of_two,
    check_same_heads,
    check_state_scan,
    check_state_v_first,
    compute_dtype,
    same_device,
)
from parascan.compat.fla.simple_gla import run_head_decay

__all__ = ["chunk_retention", "fused_recurrent_retention"]


def chunk_retention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    **kwargs: object,
) -> tuple[Tensor, Tensor | None]:
    """Retention (``fla.ops.retention.chunk_retention``): per step and head ``h``,
    ``S = gamma_h S + k v^T``, ``o = scale * S^T q``, ``gamma_h = 1 - 2 ** (-5 - h)``
    (its log computed in float32, float64 for a float64 v).

    Args:
        q, k: ``(B, T, H, K)``.
        v: ``(B, T, H, V)``.
        scale: the factor of ``q``; ``K ** -0.5`` by default.
        initial_state: ``(N, H, K, V)``: N = B, or the number of sequences with
            ``cu_seqlens``.
        output_final_state: also return the final state ``(N, H, K, V)``.
        cu_seqlens: ``(N + 1,)`` integer offsets of packed sequences along T (B == 1).
        **kwargs: ``chunk_size`` (None or a power of two, as the original checks it;
            ignored); ``head_first=False``.

    Returns:
        ``(o, final_state)``: ``o`` ``(B, T, H, V)`` in q's dtype; ``final_state``
        float32 (float64 for a float64 v), or None.

    Example:
        >>> import torch
        >>> from parascan.compat.fla import chunk_retention
        >>> ones = torch.ones(1, 2, 1, 1)
        >>> chunk_retention(ones, ones, ones, output_final_state=True)[1]  # 1 + 31/32
        tensor([[[[1.9688]]]])
    """
    fn = PREFIX + "chunk_retention"
    check_kwargs(fn, kwargs, ("chunk_size",))
    check_power_of_two(fn, "chunk_size", kwargs.get("chunk_size"))
    return _retention(fn, q, k, v, scale, initial_state, output_final_state, False, False,
                      cu_seqlens)  # fmt: skip


def fused_recurrent_retention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Tensor | None = None,
    **kwargs: object,
) -> tuple[Tensor, Tensor | None]:
    """Retention (``fla.ops.retention.fused_recurrent_retention``): the recurrence of
    :func:`chunk_retention`; ``reverse`` scans each sequence from its last step to its
    first; ``state_v_first``: states in the ``(V, K)`` layout. ``o`` has q's dtype.
    ``**kwargs``: the deprecated ``transpose_state_layout``; ``head_first=False``."""
    fn = PREFIX + "fused_recurrent_retention"
    check_kwargs(fn, kwargs, ("transpose_state_layout",))
    v_first = check_state_v_first(fn, state_v_first, kwargs)
    return _retention(fn, q, k, v, scale, initial_state, output_final_state, reverse, v_first,
                      cu_seqlens)  # fmt: skip


def _retention(
    fn: str, q: object, k: object, v: object, scale: object, initial_state: object,
    output_final_state: object, reverse: object, v_first: bool, cu_seqlens: object,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    (q_t, k_t), v_t = check_same_heads(fn, [("q", q), ("k", k)], v)
    run = check_state_scan(
        fn, q_t, v_t, out_dtype=q_t.dtype, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, reverse=reverse, v_first=v_first,
        cu_seqlens=cu_seqlens,
    )  # fmt: skip
    same_device(fn, [("q", q_t), ("k", k_t), ("v", v_t), ("initial_state", run.initial_state)])
    heads = q_t.shape[2]
    exponent = -5.0 - torch.arange(heads, dtype=compute_dtype(v_t), device=q_t.device)
    gamma = torch.log1p(-torch.exp2(exponent))
    return run_head_decay(run, q_t, k_t, v_t, None, gamma)
