"""Drop-ins for ``fla.ops.gla`` (Gated Linear Attention): per step and head,
``S = Diag(exp(gk)) S Diag(exp(gv)) + k v^T``, ``o = scale * S^T q``, computed by
:func:`parascan.linear_attention_scan` (the layouts, and what differs from the
originals: :mod:`parascan.compat.fla`)."""

from __future__ import annotations

from torch import Tensor

from parascan.compat.fla._common import (
    PREFIX,
    check_gate,
    check_kwargs,
    check_same_heads,
    check_state_scan,
    check_state_v_first,
    run_linear,
    same_device,
)

__all__ = ["chunk_gla", "fused_recurrent_gla"]


def chunk_gla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cpu: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Gated Linear Attention (``fla.ops.gla.chunk_gla``): per step and head,
    ``S = Diag(exp(g)) S + k v^T``, ``o = scale * S^T q``.

    Args:
        q, k: ``(B, T, H, K)``.
        v: ``(B, T, H, V)``.
        g: ``(B, T, H, K)`` log decays (forget gates in log space, e.g. ``logsigmoid``).
        scale: the factor of ``q``; ``K ** -0.5`` by default.
        initial_state: ``(N, H, K, V)`` (``(N, H, V, K)`` with ``state_v_first``): N = B,
            or the number of sequences with ``cu_seqlens``; any float dtype (the
            original asserts float32).
        output_final_state: also return the final state, in the same layout.
        state_v_first: states in the ``(V, K)`` layout.
        cu_seqlens: ``(N + 1,)`` integer offsets of packed sequences along T (B == 1).
        cu_seqlens_cpu: a CPU copy of ``cu_seqlens`` (checked against it).

    Returns:
        ``(o, final_state)``: ``o`` ``(B, T, H, V)`` in v's dtype; ``final_state``
        float32 (float64 for a float64 v), or None.

    Example:
        >>> import torch
        >>> from parascan.compat.fla import chunk_gla
        >>> ones, half = torch.ones(1, 3, 1, 1), torch.full((1, 3, 1, 1), 0.5)
        >>> o, final = chunk_gla(ones, ones, ones, half.log(), scale=1.0,
        ...                      output_final_state=True)
        >>> o.flatten(), final
        (tensor([1.0000, 1.5000, 1.7500]), tensor([[[[1.7500]]]]))
    """
    fn = PREFIX + "chunk_gla"
    v_first = check_state_v_first(fn, state_v_first, {})
    (q, k), v = check_same_heads(fn, [("q", q), ("k", k)], v)
    g = check_gate(fn, "g", g, tuple(q.shape), "(B, T, H, K) like q")
    run = check_state_scan(
        fn, q, v, out_dtype=v.dtype, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, v_first=v_first, cu_seqlens=cu_seqlens,
        cu_seqlens_cpu=cu_seqlens_cpu,
    )  # fmt: skip
    same_device(fn, [("q", q), ("k", k), ("v", v), ("g", g), ("initial_state", run.initial_state)])
    return run_linear(run, q, k, v, g=g)


def fused_recurrent_gla(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    gk: Tensor | None = None,
    gv: Tensor | None = None,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Tensor | None = None,
    **kwargs: object,
) -> tuple[Tensor, Tensor | None]:
    """Gated Linear Attention (``fla.ops.gla.fused_recurrent_gla``): per step and head,
    ``S = Diag(exp(gk)) S Diag(exp(gv)) + k v^T``, ``o = scale * S^T q``, with optional
    log decays ``gk`` ``(B, T, H, K)`` and ``gv`` ``(B, T, H, V)`` (none: plain linear
    attention); ``reverse`` scans each sequence from its last step to its first (the
    final state is then the one after its first step). ``o`` has q's dtype.
    ``**kwargs``: the deprecated ``transpose_state_layout``; ``head_first=False``.

    Example:
        >>> import torch
        >>> from parascan.compat.fla import fused_recurrent_gla
        >>> ones, half = torch.ones(1, 3, 1, 1), torch.full((1, 3, 1, 1), 0.5)
        >>> o, _ = fused_recurrent_gla(ones, ones, ones, half.log(), scale=1.0, reverse=True)
        >>> o.flatten()
        tensor([1.7500, 1.5000, 1.0000])
    """
    fn = PREFIX + "fused_recurrent_gla"
    check_kwargs(fn, kwargs, ("transpose_state_layout",))
    v_first = check_state_v_first(fn, state_v_first, kwargs)
    (q, k), v = check_same_heads(fn, [("q", q), ("k", k)], v)
    if gk is not None:
        gk = check_gate(fn, "gk", gk, tuple(q.shape), "(B, T, H, K) like q")
    if gv is not None:
        gv = check_gate(fn, "gv", gv, tuple(v.shape), "(B, T, H, V) like v")
    run = check_state_scan(
        fn, q, v, out_dtype=q.dtype, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, reverse=reverse, v_first=v_first,
        cu_seqlens=cu_seqlens,
    )  # fmt: skip
    same_device(fn, [("q", q), ("k", k), ("v", v), ("gk", gk), ("gv", gv),
                     ("initial_state", run.initial_state)])  # fmt: skip
    return run_linear(run, q, k, v, g=gk, gv=gv)
