"""Drop-ins for ``fla.ops.delta_rule`` (DeltaNet): per step and head,
``u = beta * (v - S^T k)``, ``S = S + k u^T``, ``o = scale * S^T q``, computed by
:func:`parascan.delta_rule_scan` (the layouts, and what differs from the originals:
:mod:`parascan.compat.fla`)."""

from __future__ import annotations

import torch
from torch import Tensor

from parascan.compat.fla._common import (
    PREFIX,
    DeltaOptions,
    check_beta,
    check_chunk_size,
    check_kwargs,
    check_qkv,
    real,
    run_delta,
    same_device,
)

__all__ = ["chunk_delta_rule", "fused_recurrent_delta_rule"]


def chunk_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cpu: Tensor | None = None,
    **kwargs: object,
) -> tuple[Tensor, Tensor | None]:
    """DeltaNet (``fla.ops.delta_rule.chunk_delta_rule``): per step and head,
    ``u = beta * (v - S^T k)``, ``S = S + k u^T``, ``o = scale * S^T q``.

    Args:
        q, k: ``(B, T, H, K)``; q, k and v of one dtype, as the original asserts, which
            may be float32 or float64 here (the original asserts q is not float32).
        v: ``(B, T, HV, V)`` (the original: HV == H).
        beta: ``(B, T, HV)``.
        scale: the factor of ``q``; ``K ** -0.5`` by default.
        initial_state: ``(N, HV, K, V)``: N = B, or the number of sequences with
            ``cu_seqlens``.
        output_final_state: also return the final state ``(N, HV, K, V)``.
        use_qk_l2norm_in_kernel: l2-normalize q and k (eps 1e-6) first.
        cu_seqlens: ``(N + 1,)`` integer offsets of packed sequences along T (B == 1).
        cu_seqlens_cpu: a CPU copy of ``cu_seqlens`` (saves the original a sync; checked
            against it here).
        **kwargs: ``chunk_size`` (16, 32 or 64: the original's tiling, checked and
            ignored); ``head_first=False``.

    Returns:
        ``(o, final_state)``: ``o`` ``(B, T, HV, V)`` in q's dtype; ``final_state``
        float32 (float64 for a float64 v), or None.
    """
    fn = PREFIX + "chunk_delta_rule"
    check_kwargs(fn, kwargs, ("chunk_size",))
    check_chunk_size(fn, kwargs, (16, 32, 64))
    options = DeltaOptions(
        fn, fused=False, out="q", scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
    )  # fmt: skip
    return _delta_rule(q, k, v, beta, options)


def fused_recurrent_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor | None = None,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """DeltaNet (``fla.ops.delta_rule.fused_recurrent_delta_rule``): the recurrence of
    :func:`chunk_delta_rule`, with ``beta`` optional (ones) and per head ``(B, T, HV)``
    or per value channel ``(B, T, HV, V)``, ``scale`` > 0 or None (the original asserts
    it) and q, k, v of any float dtypes (as the original, which does not check them).
    ``o`` has q's dtype.

    Example:
        >>> import torch
        >>> from parascan.compat.fla import fused_recurrent_delta_rule
        >>> ones = torch.ones(1, 3, 1, 1)
        >>> o, final = fused_recurrent_delta_rule(
        ...     ones, ones, ones, torch.full((1, 3, 1), 0.5), scale=1.0,
        ...     output_final_state=True)
        >>> o.flatten(), final
        (tensor([0.5000, 0.7500, 0.8750]), tensor([[[[0.8750]]]]))
    """
    options = DeltaOptions(
        PREFIX + "fused_recurrent_delta_rule", fused=True, out="q", scale=scale,
        initial_state=initial_state, output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
    )  # fmt: skip
    return _delta_rule(q, k, v, beta, options)


def _delta_rule(
    q: Tensor, k: Tensor, v: Tensor, beta: Tensor | None, options: DeltaOptions
) -> tuple[Tensor, Tensor | None]:
    """DeltaNet's two drop-ins, each checking what its original asserts: the fused
    recurrent one (``options.fused``) takes beta optional, per head or per value
    channel, and a given scale > 0; the chunked one beta per head, and q, k and v of
    one dtype."""
    fn, fused = options.fn, options.fused
    q, k, v = check_qkv(fn, q, k, v)
    if not fused and not q.dtype == k.dtype == v.dtype:
        raise TypeError(
            f"{fn}: expected q, k and v of one dtype, as the original asserts, but got q "
            f"{q.dtype}, k {k.dtype} and v {v.dtype}"
        )
    if beta is None and fused:
        beta = torch.ones(v.shape[:3], dtype=q.dtype, device=q.device)
    beta = check_beta(fn, beta, v, fused)
    if fused and options.scale is not None and not real(fn, "scale or None", options.scale) > 0:
        raise ValueError(
            f"{fn}: expected scale > 0 (or None: K ** -0.5), as the original asserts, but "
            f"got {options.scale!r}"
        )
    run = options.check(q, v)
    same_device(
        fn, [("q", q), ("k", k), ("v", v), ("beta", beta), ("initial_state", run.initial_state)]
    )
    return run_delta(run, q, k, v, beta)
