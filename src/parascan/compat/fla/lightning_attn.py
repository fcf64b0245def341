"""Drop-ins for ``fla.ops.lightning_attn`` (Lightning Attention, MiniMax-01): per step
and head ``h``, ``S = exp(-s * h) S + k v^T``, ``o = scale * S^T q``, with the slope
``s = 8 / H * (1 - layer_idx / num_layers)``; computed by
:func:`parascan.linear_attention_scan` (the layouts, and what differs from the
originals: :mod:`parascan.compat.fla`)."""

from __future__ import annotations

import torch
from torch import Tensor

from parascan._core import describe
from parascan.compat.fla._common import (
    PREFIX,
    check_kwargs,
    check_power_of_two,
    check_same_heads,
    check_state_scan,
    compute_dtype,
    same_device,
)
from parascan.compat.fla.simple_gla import run_head_decay

__all__ = ["chunk_lightning_attn", "fused_recurrent_lightning_attn"]


def chunk_lightning_attn(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layer_idx: int,
    num_layers: int,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    **kwargs: object,
) -> tuple[Tensor, Tensor | None]:
    """Lightning Attention (``fla.ops.lightning_attn.chunk_lightning_attn``): per step
    and head ``h``, ``S = exp(-s * h) S + k v^T``, ``o = scale * S^T q``, the slope
    ``s = 8 / H * (1 - layer_idx / num_layers)`` (the log decays computed in float32,
    float64 for a float64 v).

    Args:
        q, k: ``(B, T, H, K)``.
        v: ``(B, T, H, V)``.
        layer_idx: the layer's index (an int).
        num_layers: the number of layers (an int >= 1).
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
        >>> from parascan.compat.fla import chunk_lightning_attn
        >>> ones = torch.ones(1, 2, 2, 1)
        >>> final = chunk_lightning_attn(ones, ones, ones, 0, 4, output_final_state=True)[1]
        >>> final.flatten()  # head 0 keeps all (1 + 1), head 1 keeps exp(-4)
        tensor([2.0000, 1.0183])
    """
    fn = PREFIX + "chunk_lightning_attn"
    check_kwargs(fn, kwargs, ("chunk_size",))
    check_power_of_two(fn, "chunk_size", kwargs.get("chunk_size"))
    return _lightning(fn, q, k, v, layer_idx, num_layers, scale, initial_state,
                      output_final_state, False, cu_seqlens)  # fmt: skip


def fused_recurrent_lightning_attn(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    layer_idx: int,
    num_layers: int,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Lightning Attention (``fla.ops.lightning_attn.fused_recurrent_lightning_attn``):
    the recurrence of :func:`chunk_lightning_attn`; ``reverse`` scans each sequence
    from its last step to its first. ``o`` has q's dtype."""
    fn = PREFIX + "fused_recurrent_lightning_attn"
    return _lightning(fn, q, k, v, layer_idx, num_layers, scale, initial_state,
                      output_final_state, reverse, cu_seqlens)  # fmt: skip


def _lightning(
    fn: str, q: object, k: object, v: object, layer_idx: object, num_layers: object,
    scale: object, initial_state: object, output_final_state: object, reverse: object,
    cu_seqlens: object,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    for name, value in (("layer_idx", layer_idx), ("num_layers", num_layers)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{fn}: expected {name} to be an int, but got {describe(value)}")
    assert isinstance(layer_idx, int) and isinstance(num_layers, int)
    if num_layers < 1:
        raise ValueError(
            f"{fn}: the decays' slope is 8 / H * (1 - layer_idx / num_layers): expected "
            f"num_layers >= 1, but got {num_layers}"
        )
    (q_t, k_t), v_t = check_same_heads(fn, [("q", q), ("k", k)], v)
    run = check_state_scan(
        fn, q_t, v_t, out_dtype=q_t.dtype, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, reverse=reverse, cu_seqlens=cu_seqlens,
    )  # fmt: skip
    same_device(fn, [("q", q_t), ("k", k_t), ("v", v_t), ("initial_state", run.initial_state)])
    heads = q_t.shape[2]
    slope = (8 / heads if heads else 0.0) * (1 - layer_idx / num_layers)  # H = 0: the scan raises
    gamma = -slope * torch.arange(heads, dtype=compute_dtype(v_t), device=q_t.device)
    return run_head_decay(run, q_t, k_t, v_t, None, gamma)
