"""RWKV-4's WKV."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from parascan.first_order.api import linear_scan as ps_linear_scan
from parascan.first_order.api import log_linear_scan as ps_log_linear_scan
from parascan.integrations.transformers._common import (
    _original,
)


def rwkv_linear_attention(
    time_decay: Tensor,
    time_first: Tensor,
    key: Tensor,
    value: Tensor,
    state: list[Tensor] | tuple[Tensor, ...] | None = None,
    return_state: bool = False,
) -> tuple[Tensor, list[Tensor] | None]:
    """Replaces transformers' ``rwkv_linear_attention_cpu`` (same parameters and
    results). With ``w = -exp(time_decay)`` and ``u = time_first`` (channels), RWKV-4's
    attention over ``key`` and ``value`` (batch, L, channels) is::

        A[t] = exp(w) A[t-1] + exp(k[t]) v[t],   B[t] = exp(w) B[t-1] + exp(k[t])
        out[t] = (A[t-1] + exp(u + k[t]) v[t]) / (B[t-1] + exp(u + k[t]))

    computed as two first-order scans, in float32 (the decay exponentiated in the
    parameter's dtype first, as the original; a float64 model's scans are float32 too,
    where the original mixes float64 values in): ``log B`` by
    :func:`parascan.log_linear_scan` (B is positive), then the weighted mean ``y = A / B``,
    ``y[t] = alpha[t] y[t-1] + exp(k[t] - log B[t]) v[t]`` with ``alpha[t] = exp(w +
    log B[t-1] - log B[t])`` in [0, 1], by :func:`parascan.linear_scan`; ``out[t]`` is
    the mean of ``y[t-1]`` and ``v[t]`` weighted ``B[t-1]`` and ``exp(u + k[t])``. No
    running maximum is needed: nothing is exponentiated that can overflow. ``state``,
    transformers' ``[num, den, max]`` (``A = num exp(max)``, ``B = den exp(max)``), is
    read and returned (when given, or ``return_state``) in that layout, as ``[y, 1, log
    B]``. The decoding step (one token) is the original's: a single step, which no
    scan makes faster (the scans' dispatch costs more than the step); it reads that
    state as it reads its own."""
    if key.shape[1] == 1:
        step = _original("rwkv_linear_attention_cpu")
        result: tuple[Tensor, list[Tensor] | None] = step(
            time_decay, time_first, key, value, state=state, return_state=return_state
        )
        return result
    w = -torch.exp(time_decay).float()
    k, v, u = key.float(), value.float(), time_first.float()
    batch, _, channels = k.shape
    if state is None:
        log_b0 = y0 = None
        before = torch.full((batch, 1, channels), -math.inf, device=k.device, dtype=k.dtype)
        y_before = torch.zeros(batch, 1, channels, device=k.device, dtype=k.dtype)
    else:
        num, den, top = (t.float() for t in state)
        seen = den > 0  # where den is 0 (nothing seen yet): log B = -inf, y = 0
        safe = torch.where(seen, den, torch.ones_like(den))  # no log(0) to differentiate
        log_b0 = torch.where(seen, torch.log(safe) + top, torch.full_like(den, -math.inf))
        y0 = torch.where(seen, num / safe, torch.zeros_like(num))
        before, y_before = log_b0[:, None], y0[:, None]
    log_b = ps_log_linear_scan(w, k, 1, initial=log_b0)
    log_prev = torch.cat([before, log_b[:, :-1]], dim=1)
    alpha = torch.exp(w + log_prev - log_b)
    y = ps_linear_scan(alpha, torch.exp(k - log_b) * v, 1, initial=y0)
    y_prev = torch.cat([y_before, y[:, :-1]], dim=1)
    out = torch.lerp(v, y_prev, torch.sigmoid(log_prev - u - k))
    if return_state or state is not None:
        return out.to(key.dtype), [y[:, -1], torch.ones_like(y[:, -1]), log_b[:, -1]]
    return out.to(key.dtype), None
