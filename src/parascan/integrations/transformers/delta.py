"""The gated delta rule (Qwen3-Next, Qwen3.5, OLMo-Hybrid, ...) and Kimi Delta Attention
(Kimi Linear, GLM-5-Next, Bailing hybrid).
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from parascan._core import describe
from parascan.delta_rule.api import delta_rule_scan as ps_delta_rule_scan
from parascan.integrations.transformers._common import (
    _refuse_packed_cache,
)

# --- the gated delta rule (Qwen3-Next, Qwen3.5, OLMo-Hybrid, ...) ---------------------------


def _gated_delta(
    fn: str,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
    kwargs: dict[str, Any],
) -> tuple[Tensor, Tensor | None]:
    cu_seqlens = kwargs.get("cu_seqlens")
    if cu_seqlens is not None and (not isinstance(cu_seqlens, Tensor) or query.shape[0] != 1):
        raise ValueError(
            f"{fn}: parascan's replacement reads cu_seqlens as (num_seqs + 1,) offsets along L "
            f"of a batch of one, but got cu_seqlens {describe(cu_seqlens)} with a query of "
            f"shape {tuple(query.shape)}"
        )
    if cu_seqlens is not None and (output_final_state or initial_state is not None):
        # The layers read and write their cache's state through these two arguments.
        state = "output_final_state=True" if output_final_state else "an initial_state"
        _refuse_packed_cache(fn, cu_seqlens, f"{state}, which the layers pass with a cache")
    out, final = ps_delta_rule_scan(
        query, key, value, beta, g=g, qk_l2norm=bool(use_qk_l2norm_in_kernel),
        initial=None if initial_state is None else initial_state.float(),
        return_final=True, cu_seqlens=cu_seqlens,
    )  # fmt: skip
    return out.to(query.dtype), final.float() if output_final_state else None


def chunk_gated_delta_rule(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    chunk_size: int = 64,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """Replaces transformers' ``torch_chunk_gated_delta_rule`` (same parameters and
    results: the output (batch, L, Hv, V) in ``query``'s dtype, the final state
    (batch, Hv, K, V) in float32 or None): the gated delta rule by
    :func:`parascan.delta_rule_scan`, scale K ** -0.5. ``chunk_size`` changes nothing.
    ``cu_seqlens`` among the keywords (the layers pass ``cu_seq_lens_q`` under that
    name) packs sequences along L of a batch of one, each restarting from a zero state,
    which the torch fallback refuses; the other keywords (the model's attention
    keywords) are dropped.

    Packed sequences (more than one) with a state, ``initial_state`` or
    ``output_final_state=True`` (the layers pass them when the model runs with a cache:
    ``use_cache=True``, ``generate``), raise at once: the cache keeps one state per
    batch row, and this function's final state is (batch, Hv, K, V), so the next
    decoding step could not continue num_seqs sequences from it. Packed training and
    prefill run with ``use_cache=False``; :func:`parascan.delta_rule_scan` (or
    :func:`parascan.compat.fla.chunk_gated_delta_rule`) returns one state per packed
    sequence."""
    return _gated_delta(
        "torch_chunk_gated_delta_rule", query, key, value, g, beta, initial_state,
        output_final_state, use_qk_l2norm_in_kernel, kwargs,
    )  # fmt: skip


def recurrent_gated_delta_rule(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """Replaces transformers' ``torch_recurrent_gated_delta_rule`` (same parameters and
    results), the decoding step from a cached state: as :func:`chunk_gated_delta_rule`."""
    return _gated_delta(
        "torch_recurrent_gated_delta_rule", query, key, value, g, beta, initial_state,
        output_final_state, use_qk_l2norm_in_kernel, kwargs,
    )  # fmt: skip


# --- Kimi Delta Attention (Kimi Linear, GLM-5-Next, Bailing hybrid) -----------------------


def _kda_cu_seqlens(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keywords :func:`_gated_delta` reads: ``cu_seqlens``, or else the layers'
    ``cu_seq_lens_q`` (the KDA layers pass their attention keywords down unchanged)."""
    cu_seqlens = kwargs.get("cu_seqlens")
    return {"cu_seqlens": kwargs.get("cu_seq_lens_q") if cu_seqlens is None else cu_seqlens}


def chunk_kimi_delta_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    chunk_size: int = 64,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """Replaces transformers' ``chunk_kimi_delta_attention`` (same parameters and
    results: the output (batch, L, H, V) in ``query``'s dtype, the final state
    (batch, H, K, V) in float32 or None): Kimi Delta Attention, the delta rule with
    ``g`` (batch, L, H, K) a log decay per key channel, by
    :func:`parascan.delta_rule_scan`, scale K ** -0.5. ``chunk_size`` changes nothing.
    ``cu_seq_lens_q`` (or ``cu_seqlens``) among the keywords packs sequences along L
    of a batch of one, each restarting from a zero state: the layers pass it down
    unchanged, and the torch fallback runs the packed sequences as one; the other
    keywords are dropped. Packed sequences (more than one) with a state (a cache)
    raise at once, as in :func:`chunk_gated_delta_rule` (:func:`parascan.compat.fla.chunk_kda`
    returns one state per packed sequence)."""
    return _gated_delta(
        "chunk_kimi_delta_attention", query, key, value, g, beta, initial_state,
        output_final_state, use_qk_l2norm_in_kernel, _kda_cu_seqlens(kwargs),
    )  # fmt: skip


def recurrent_kimi_delta_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """Replaces transformers' ``recurrent_kimi_delta_attention`` (same parameters and
    results), the decoding step from a cached state: as
    :func:`chunk_kimi_delta_attention`."""
    return _gated_delta(
        "recurrent_kimi_delta_attention", query, key, value, g, beta, initial_state,
        output_final_state, use_qk_l2norm_in_kernel, _kda_cu_seqlens(kwargs),
    )  # fmt: skip
