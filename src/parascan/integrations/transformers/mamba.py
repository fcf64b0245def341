"""Mamba-1 (mamba, falcon_mamba, jamba, zamba): the selective scan, its decoding step, and
the fused training path declined.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from parascan.compat import mamba_ssm
from parascan.integrations.transformers._common import (
    _reject_extras,
)


def selective_scan(
    hidden_states: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    delta_bias: Tensor | None = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
    use_mambapy: bool = False,
    use_associative_scan: bool = False,
    **kwargs: Any,
) -> Tensor | tuple[Tensor, Tensor]:
    """Replaces transformers' ``mamba_selective_scan`` (same parameters): the scan by
    :func:`parascan.compat.mamba_ssm.selective_scan_fn`. ``use_mambapy`` and
    ``use_associative_scan`` choose among transformers' own loops; they change nothing
    here."""
    _reject_extras("mamba_selective_scan", kwargs)
    return mamba_ssm.selective_scan_fn(
        hidden_states, dt, A, B, C, D, z, delta_bias, delta_softplus, return_last_state
    )


def selective_state_update(
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
    """Replaces transformers' ``mamba_selective_state_update`` (same parameters, which
    differ in order from mamba_ssm's): one decoding step by
    :func:`parascan.compat.mamba_ssm.selective_state_update`, ``state`` updated in place."""
    _reject_extras("mamba_selective_state_update", kwargs)
    return mamba_ssm.selective_state_update(
        state, hidden_states, dt, A, B, C, D, z, dt_bias, dt_softplus
    )


def no_fused_inner(*args: Any, **kwargs: Any) -> None:
    """Replaces transformers' ``mamba_inner_fn``: returning None sends training through
    the mixer's unfused path (projections, convolution, then the patched scan), as it
    goes whenever mamba_ssm is not installed."""
    return None
