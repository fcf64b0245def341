"""MiniMax's lightning attention."""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import Tensor

from parascan.integrations.transformers._common import (
    _original,
    _refuse_packed_cache,
)
from parascan.ssd.api import ssd_scan as ps_ssd_scan


def lightning_attention_forward(
    self: Any,
    hidden_states: Tensor,
    position_embeddings: tuple[Tensor, Tensor],
    attention_mask: Tensor | None,
    cache: Any = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """Replaces transformers' ``MiniMaxLightningAttention.forward`` (same parameters and
    results): the layer's own projections, activation, padding mask, norm, output gate
    and cache, with its recurrence ``S[t] = exp(-slope) S[t-1] + k[t]^T v[t]``, ``o[t] =
    q[t] S[t]`` per head by :func:`parascan.ssd_scan` (the state transposed: transformers
    keeps ``K^T V``, the scan ``V^T K``). The original's blocks compute the same sums,
    within a block as a masked (block, block) product. Packed sequences
    (``cu_seq_lens_q`` among the keywords, batch 1, no cache) restart their state at
    each boundary; the returned state is then the last sequence's. With a cache, more
    than one packed sequence raises at once, as in :func:`chunk_gated_delta_rule` (the
    cache's one state per batch row cannot hold them; the original runs them as one
    sequence). A step of one token (not packed) is the original forward's (with a
    cached state, a single step, which no scan makes faster: the scan's dispatch costs
    more)."""
    if hidden_states.shape[1] == 1 and kwargs.get("cu_seq_lens_q") is None:
        forward = _original("MiniMaxLightningAttention.forward", self)
        given = () if cache is None else (cache,)  # past_key_values, if so, is in kwargs
        result: tuple[Tensor, Tensor] = forward(
            self, hidden_states, position_embeddings, attention_mask, *given, **kwargs
        )
        return result
    if cache is None:  # its name before transformers 5.24 (an alias until 5.40)
        cache = kwargs.get("past_key_values")
    batch, length, _ = hidden_states.shape
    packed = kwargs.get("cu_seq_lens_q")
    if cache is not None and packed is not None and batch == 1:
        _refuse_packed_cache("MiniMaxLightningAttention.forward", packed, "a cache")
    heads, dim = self.num_attention_heads, self.head_dim
    # the modeling module of the patched class (self may be of a subclass defined elsewhere)
    own = next(
        sys.modules[c.__module__]
        for c in type(self).__mro__
        if hasattr(sys.modules.get(c.__module__), "apply_mask_to_padding_states")
    )
    qkv = self.act_fn(self.qkv_proj(hidden_states))
    qkv = own.apply_mask_to_padding_states(qkv, attention_mask)
    q, k, v = torch.split(qkv.reshape(batch, length, heads, 3 * dim), dim, dim=3)
    state = None if cache is None else cache.get_linear_cache(self.layer_idx)
    cu = kwargs.get("cu_seq_lens_q") if state is None and batch == 1 else None
    step = torch.ones(batch, length, heads, device=v.device, dtype=v.dtype)
    out, final = ps_ssd_scan(
        v, step, -self.slope_rate.reshape(heads), k, q,
        initial=None if state is None else state.transpose(-1, -2),
        return_final=True, cu_seqlens=cu,
    )  # fmt: skip
    last = final if cu is None else final[-1:]  # packed: the last sequence's state
    inter = last.transpose(-1, -2).to(v.dtype).contiguous()  # the steps after read it
    out = self.norm(out.reshape(batch, length, heads * dim))
    out = self.out_proj(torch.sigmoid(self.output_gate(hidden_states)) * out)
    if cache is not None:
        cache.set_linear_cache(self.layer_idx, inter)
    return out, inter
