"""Drop-ins for ``fla.ops.hgrn``: ``h[t] = exp(g[t]) * h[t-1] + x[t]`` over ``(B, T, D)``
tensors, computed by :func:`parascan.linear_scan` along dim 1 (what differs from the
originals: :mod:`parascan.compat.fla`)."""

from __future__ import annotations

import torch
from torch import Tensor

from parascan._core import (
    check_cu_seqlens,
    check_dtype,
    check_flag,
    check_same_device,
    describe,
    tensor_hint,
)
from parascan.compat._checks import check_same_3d
from parascan.compat.fla._common import PREFIX
from parascan.first_order import linear_scan

__all__ = ["chunk_hgrn", "fused_recurrent_hgrn"]


def fused_recurrent_hgrn(
    x: Tensor,
    g: Tensor,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """``h[t] = exp(g[t]) * h[t-1] + x[t]`` along T, ``h[-1] = initial_state`` (0 by default).

    Args:
        x: inputs ``(B, T, D)``.
        g: log forget gates ``(B, T, D)``.
        initial_state: ``(N, D)``: N = B, or the number of sequences with ``cu_seqlens``.
        output_final_state: also return the last state ``(N, D)``.
        cu_seqlens: ``(N + 1,)`` integer offsets of packed sequences along T (B == 1).

    Returns:
        ``(o, final_state)``: ``o`` ``(B, T, D)`` in ``x``'s dtype, ``final_state``
        ``(N, D)`` or None.

    Example:
        >>> import torch
        >>> from parascan.compat.fla import fused_recurrent_hgrn
        >>> g = torch.full((1, 3, 1), 0.5).log()
        >>> fused_recurrent_hgrn(torch.ones(1, 3, 1), g, output_final_state=True)[1]
        tensor([[1.7500]])
    """
    return _hgrn("fused_recurrent_hgrn", x, g, initial_state, output_final_state, cu_seqlens)


def chunk_hgrn(
    x: Tensor,
    g: Tensor,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The same recurrence as :func:`fused_recurrent_hgrn` (the original's chunked
    kernel; here one computation serves both), with ``cu_seqlens`` too."""
    return _hgrn("chunk_hgrn", x, g, initial_state, output_final_state, cu_seqlens)


def _hgrn(
    function: str,
    x: Tensor,
    g: Tensor,
    initial_state: Tensor | None,
    output_final_state: bool,
    cu_seqlens: Tensor | None,
) -> tuple[Tensor, Tensor | None]:
    """Both drop-ins (``function``: the one called)."""
    fn = PREFIX + function
    output_final_state = check_flag(fn, "output_final_state", output_final_state)
    check_same_3d(fn, ("x", x), ("g", g), "(B, T, D)")
    batch, steps, width = x.shape
    n = batch
    if cu_seqlens is not None:
        if batch != 1:
            raise ValueError(
                f"{fn}: with cu_seqlens the sequences are packed into a batch of one: expected "
                f"x of shape (1, T, D), but got {tuple(x.shape)}"
            )
        n = check_cu_seqlens(fn, cu_seqlens, steps, x.device).numel() - 1
    if initial_state is not None and (
        not isinstance(initial_state, Tensor) or tuple(initial_state.shape) != (n, width)
    ):
        raise ValueError(
            f"{fn}: expected initial_state of shape (N, D) = {(n, width)} (N: the batch, or the "
            f"number of sequences with cu_seqlens), but got {describe(initial_state)}"
            f"{tensor_hint(initial_state)}"
        )
    named = [("x", x), ("g", g)] + (
        [] if initial_state is None else [("initial_state", initial_state)]
    )
    for name, t in named:
        check_dtype(fn, name, t)  # an integer x came back truncated to its dtype before
    check_same_device(fn, named)
    for name, t in named[1:]:
        if t.is_complex() and not x.is_complex():
            raise TypeError(f"{fn}: expected a real {name} with a real x, but got {describe(t)}")
    wide = torch.promote_types(x.dtype, torch.float32)
    gates = g.to(wide).exp()  # the gate's exp in (at least) float32, as the originals
    o, final = linear_scan(
        gates, x.to(wide), 1, initial=initial_state, return_final=True, cu_seqlens=cu_seqlens
    )
    return o.to(x.dtype), final.to(x.dtype) if output_final_state else None
