"""Griffin's RG-LRU (RecurrentGemma)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from parascan.first_order.api import linear_scan as ps_linear_scan
from parascan.integrations.transformers._common import (
    _original,
)


def rg_lru_scan(
    self: Any,
    hidden_states: Tensor,
    recurrent_gate: Tensor,
    reset: Tensor,
    recurrent_states: Tensor | None,
    acc_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """Replaces transformers' ``RecurrentGemmaRglru._rnn_scan`` (same parameters and
    results): ``x[t] = a[t] x[t-1] + b[t]`` along the tokens (dim 1) of ``hidden_states``
    (batch, L, width), ``a`` the ``recurrent_gate`` zeroed where ``reset`` (batch, L, 1)
    marks a document's first token, from ``recurrent_states`` (batch, width; zeros when
    None), accumulated in ``acc_dtype``: the outputs in the input's dtype and the last
    state in ``acc_dtype``, by :func:`parascan.linear_scan` instead of a Python loop over
    the tokens. The decoding step (one token) is the original's: a single step, which
    no scan makes faster (the scan's dispatch costs more than the step)."""
    if hidden_states.shape[1] == 1:
        step = _original("RecurrentGemmaRglru._rnn_scan", self)
        result: tuple[Tensor, Tensor] = step(
            self, hidden_states, recurrent_gate, reset, recurrent_states, acc_dtype
        )
        return result
    gates = (recurrent_gate * ~reset).to(acc_dtype)
    initial = None if recurrent_states is None else recurrent_states.to(gates.device, acc_dtype)
    out, final = ps_linear_scan(
        gates, hidden_states.to(acc_dtype), 1, initial=initial, return_final=True
    )
    return out.to(hidden_states.dtype), final
