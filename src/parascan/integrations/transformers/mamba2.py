"""Mamba-2 (mamba2 and the hybrids that reuse its mixer): the SSD scan, the fused training
path, the padding mask and the decoding step.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import torch
from torch import Tensor

from parascan.compat import mamba_ssm
from parascan.integrations.transformers._common import (
    _packed_ids,
    _transformers_own,
)


def chunk_scan(
    hidden_states: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    D: Tensor | None = None,
    dt_bias: Tensor | None = None,
    initial_states: Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    return_final_states: bool = False,
    **kwargs: Any,
) -> Tensor | tuple[Tensor, ...]:
    """Replaces transformers' ``mamba2_chunk_scan`` (same parameters): the scan by
    :func:`parascan.compat.mamba_ssm.mamba_chunk_scan_combined`, the final state in
    float32 (float64 for a float64 model) as the original returns it.

    Of the other keyword arguments the mixers pass down, ``z`` gates the output and
    ``seq_idx`` (batch, L) or ``cu_seqlens`` (batch 1) mark packed sequences, whose
    states restart at each boundary; the rest (the model's attention keywords) are
    not the scan's and are dropped, as transformers' kernel dispatch drops them."""
    seq_idx = _packed_ids("mamba2_chunk_scan", kwargs, hidden_states)
    return mamba_ssm.mamba_chunk_scan_combined(
        hidden_states, dt, A, B, C, chunk_size, D=D, z=kwargs.get("z"), dt_bias=dt_bias,
        initial_states=initial_states, seq_idx=seq_idx, dt_softplus=dt_softplus,
        dt_limit=dt_limit, return_final_states=return_final_states,
        state_dtype=torch.float64 if hidden_states.dtype == torch.float64 else torch.float32,
    )  # fmt: skip


def split_conv_scan(
    zxbcdt: Tensor,
    conv1d_weight: Tensor,
    conv1d_bias: Tensor | None,
    dt_bias: Tensor,
    A: Tensor,
    D: Tensor,
    chunk_size: int,
    initial_states: Tensor | None = None,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    return_final_states: bool = False,
    activation: str | None = "silu",
    rmsnorm_weight: Tensor | None = None,
    rmsnorm_eps: float | None = 1e-6,
    outproj_weight: Tensor | None = None,
    outproj_bias: Tensor | None = None,
    headdim: int | None = None,
    ngroups: int = 1,
    norm_before_gate: bool = True,
    **kwargs: Any,
) -> Tensor | tuple[Tensor, Tensor]:
    """Replaces transformers' ``mamba2_split_conv1d_scan_combined`` (same parameters):
    the mixer's whole training path after its input projection (convolution, scan,
    gated norm, output projection) by
    :func:`parascan.compat.mamba_ssm.mamba_split_conv1d_scan_combined`.

    ``seq_idx`` (batch, L) or ``cu_seqlens`` (batch 1) among the other keywords mark
    packed sequences (neither the convolution nor the scan crosses a boundary); the
    rest (the model's attention keywords) are dropped. ``rmsnorm_eps`` None (a mixer
    without the norm) is not read.

    After a padded attention mask (see :func:`mask_padding`) it declines (returns None),
    and the mixer runs its unfused path, patched: that path zeroes the convolution's
    output at the padded steps again before the scan, which this fused path, as
    mamba_ssm's kernel, does not (with a convolution bias, left padding then reaches
    the scan's state and the real tokens' outputs)."""
    if _take_padded(zxbcdt):
        return None  # type: ignore[return-value]
    seq_idx = _packed_ids("mamba2_split_conv1d_scan_combined", kwargs, zxbcdt)
    return mamba_ssm.mamba_split_conv1d_scan_combined(
        zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
        initial_states=initial_states, seq_idx=seq_idx, dt_limit=dt_limit,
        return_final_states=return_final_states, activation=activation,
        rmsnorm_weight=rmsnorm_weight, rmsnorm_eps=1e-6 if rmsnorm_eps is None else rmsnorm_eps,
        outproj_weight=outproj_weight, outproj_bias=outproj_bias, headdim=headdim,
        ngroups=ngroups, norm_before_gate=norm_before_gate,
    )  # fmt: skip


_PADDING = threading.local()


def _take_padded(zxbcdt: Tensor) -> bool:
    """Whether the attention mask of this thread's last :func:`mask_padding` call pads a
    step of the batch ``zxbcdt`` (batch, L, ...) is for; read once. Only here is the
    mask read (a device sync; under torch.compile any mask counts as padded, a value
    the graph cannot depend on), so evaluation and decoding never pay for it."""
    mask = getattr(_PADDING, "mask", None)
    _PADDING.mask = None
    if mask is None or tuple(mask.shape) != tuple(zxbcdt.shape[:2]):
        return False
    return torch.compiler.is_compiling() or not bool(mask.all())


def mask_padding(hidden_states: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """Replaces transformers' ``apply_mask_to_padding_states`` (same parameters and
    result: the original's), keeping the mask for :func:`split_conv_scan`: the Mamba-2
    mixers call this on their input just before their fused training path, which
    declines when the mask pads a step."""
    _PADDING.mask = attention_mask if isinstance(attention_mask, Tensor) else None
    return _transformers_own("apply_mask_to_padding_states", hidden_states, attention_mask)


def multihead_state_update(
    state: Tensor,
    hidden_states: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = False,
    z: Tensor | None = None,
    **kwargs: Any,
) -> Tensor:
    """Replaces transformers' ``mamba2_selective_state_update`` (same parameters): one
    decoding step in the multi-head layout by
    :func:`parascan.compat.mamba_ssm.selective_state_update`, ``state`` (batch, heads,
    headdim, N) updated in place. ``state_batch_indices`` is honoured; the mixers' other
    keywords are dropped, as transformers' kernel dispatch drops them."""
    return mamba_ssm.selective_state_update(
        state, hidden_states, dt, A, B, C, D, z, dt_bias, dt_softplus,
        state_batch_indices=kwargs.get("state_batch_indices"),
    )  # fmt: skip
