"""Drop-in for accelerated-scan's ``scan(gates, tokens)`` (its ``warp``, ``scalar`` and
``ref`` modules share that signature)::

    from parascan.compat.accelerated_scan import scan

The same result, ``x[:, :, t] = gates[:, :, t] * x[:, :, t-1] + tokens[:, :, t]`` over
``(B, C, T)`` tensors, computed by :func:`parascan.linear_scan` along the last dim:
any T (the CUDA kernel takes powers of two from 32 to 65536), any device, any float
dtype, and differentiable in both inputs.
"""

from __future__ import annotations

from torch import Tensor

from parascan._core import check_dtype
from parascan.compat._checks import check_same_3d, errors_as
from parascan.first_order import linear_scan

__all__ = ["scan"]


def scan(gates: Tensor, tokens: Tensor) -> Tensor:
    """``x[..., t] = gates[..., t] * x[..., t-1] + tokens[..., t]``, ``x[..., -1] = 0``.

    Args:
        gates, tokens: ``(B, C, T)`` tensors of one shape.

    Returns:
        ``x``, ``(B, C, T)``.

    Example:
        >>> import torch
        >>> from parascan.compat.accelerated_scan import scan
        >>> scan(torch.full((1, 1, 3), 0.5), torch.ones(1, 1, 3))
        tensor([[[1.0000, 1.5000, 1.7500]]])
    """
    fn = "parascan.compat.accelerated_scan.scan"
    check_same_3d(fn, ("gates", gates), ("tokens", tokens), "(B, C, T)")
    check_dtype(fn, "gates", gates)
    check_dtype(fn, "tokens", tokens)
    with errors_as(fn, "parascan.linear_scan"):
        return linear_scan(gates, tokens, -1)
