"""Drop-ins for ``fla.ops.simple_gla`` (GLA with one decay per head): per step and head,
``S = exp(g + g_gamma) S + k v^T``, ``o = scale * S^T q``, computed by
:func:`parascan.linear_attention_scan` (the layouts, and what differs from the
originals: :mod:`parascan.compat.fla`)."""

from __future__ import annotations

from torch import Tensor

from parascan.compat.fla._common import (
    PREFIX,
    StateScan,
    check_gate,
    check_kwargs,
    check_power_of_two,
    check_same_heads,
    check_state_scan,
    check_state_v_first,
    compute_dtype,
    run_linear,
    same_device,
)

__all__ = ["chunk_simple_gla", "fused_recurrent_simple_gla"]


def chunk_simple_gla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None = None,
    g_gamma: Tensor | None = None,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cpu: Tensor | None = None,
    **kwargs: object,
) -> tuple[Tensor, Tensor | None]:
    """Simple GLA (``fla.ops.simple_gla.chunk_simple_gla``): per step and head,
    ``S = exp(g + g_gamma) S + k v^T``, ``o = scale * S^T q``.

    Args:
        q, k: ``(B, T, H, K)``.
        v: ``(B, T, H, V)``.
        g: ``(B, T, H)`` log decays, or None.
        g_gamma: ``(H,)`` log decays, the same at every step, or None (the original
            documents one of ``g`` and ``g_gamma``; both: their sum, as its fused
            recurrent kernel applies them; neither: no decay).
        scale: the factor of ``q``; ``K ** -0.5`` by default.
        initial_state: ``(N, H, K, V)`` (``(N, H, V, K)`` with ``state_v_first``): N = B,
            or the number of sequences with ``cu_seqlens``.
        output_final_state: also return the final state, in the same layout.
        state_v_first: states in the ``(V, K)`` layout.
        cu_seqlens: ``(N + 1,)`` integer offsets of packed sequences along T (B == 1).
        cu_seqlens_cpu: a CPU copy of ``cu_seqlens`` (checked against it).
        **kwargs: ``chunk_size`` (None or a power of two, as the original checks it;
            ignored); ``head_first=False``.

    Returns:
        ``(o, final_state)``: ``o`` ``(B, T, H, V)`` in q's dtype; ``final_state``
        float32 (float64 for a float64 v), or None.

    Example:
        >>> import torch
        >>> from parascan.compat.fla import chunk_simple_gla
        >>> ones = torch.ones(1, 3, 1, 1)
        >>> o, _ = chunk_simple_gla(ones, ones, ones, g_gamma=torch.tensor([0.5]).log(),
        ...                         scale=1.0)
        >>> o.flatten()
        tensor([1.0000, 1.5000, 1.7500])
    """
    fn = PREFIX + "chunk_simple_gla"
    check_kwargs(fn, kwargs, ("chunk_size",))
    check_power_of_two(fn, "chunk_size", kwargs.get("chunk_size"))
    v_first = check_state_v_first(fn, state_v_first, {})
    return simple_gla(
        fn, q, k, v, g, g_gamma, out="q", scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, reverse=False, v_first=v_first,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
    )  # fmt: skip


def fused_recurrent_simple_gla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None = None,
    g_gamma: Tensor | None = None,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Tensor | None = None,
    **kwargs: object,
) -> tuple[Tensor, Tensor | None]:
    """Simple GLA (``fla.ops.simple_gla.fused_recurrent_simple_gla``): the recurrence of
    :func:`chunk_simple_gla`; ``reverse`` scans each sequence from its last step to its
    first. ``o`` has q's dtype. ``**kwargs``: the deprecated ``transpose_state_layout``;
    ``head_first=False``."""
    fn = PREFIX + "fused_recurrent_simple_gla"
    check_kwargs(fn, kwargs, ("transpose_state_layout",))
    v_first = check_state_v_first(fn, state_v_first, kwargs)
    return simple_gla(
        fn, q, k, v, g, g_gamma, out="q", scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, reverse=reverse, v_first=v_first,
        cu_seqlens=cu_seqlens,
    )  # fmt: skip


def simple_gla(
    fn: str,
    q: object,
    k: object,
    v: object,
    g: object,
    g_gamma: object,
    *,
    out: str,
    scale: object,
    initial_state: object,
    output_final_state: object,
    reverse: object,
    v_first: bool,
    cu_seqlens: object,
    cu_seqlens_cpu: object = None,
) -> tuple[Tensor, Tensor | None]:
    """The simple-GLA drop-ins (and linear attention's, without decays): ``out`` names
    the operand whose dtype ``o`` has, as the original returns it."""
    (q_t, k_t), v_t = check_same_heads(fn, [("q", q), ("k", k)], v)
    batch, steps, heads, _ = q_t.shape
    g_t = None if g is None else check_gate(fn, "g", g, (batch, steps, heads), "(B, T, H)")
    gamma = None if g_gamma is None else check_gate(fn, "g_gamma", g_gamma, (heads,), "(H,)")
    run = check_state_scan(
        fn, q_t, v_t, out_dtype=q_t.dtype if out == "q" else v_t.dtype, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, reverse=reverse,
        v_first=v_first, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
    )  # fmt: skip
    same_device(fn, [("q", q_t), ("k", k_t), ("v", v_t), ("g", g_t), ("g_gamma", gamma),
                     ("initial_state", run.initial_state)])  # fmt: skip
    return run_head_decay(run, q_t, k_t, v_t, g_t, gamma)


def run_head_decay(
    run: StateScan, q: Tensor, k: Tensor, v: Tensor, g: Tensor | None, gamma: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    """Linear attention with the log decays ``g`` ``(B, T, H)`` and ``gamma`` ``(H,)``
    (the same at every step), either or both, on checked operands."""
    if gamma is not None:
        cd = compute_dtype(v)
        fixed = gamma.to(cd).expand(q.shape[:3])
        g = fixed if g is None else g.to(cd) + fixed
    return run_linear(run, q, k, v, g=g)
