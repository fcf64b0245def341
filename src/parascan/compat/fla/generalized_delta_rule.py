"""Drop-ins for ``fla.ops.generalized_delta_rule`` (its ``dplr`` ops: the delta rule
with a diagonal-plus-low-rank transition): per step and head,
``S = (Diag(exp(gk)) + b a^T) S + k v^T``, ``o = scale * S^T q``, computed by
:func:`parascan.dplr_delta_rule_scan` (the layouts, and what differs from the
originals: :mod:`parascan.compat.fla`)."""

from __future__ import annotations

from torch import Tensor

from parascan._core import check_flag
from parascan.compat.fla._common import (
    PREFIX,
    check_gate,
    check_kwargs,
    check_no_cp,
    check_power_of_two,
    check_same_heads,
    check_state_scan,
    real,
    run_dplr,
    same_device,
)

__all__ = ["chunk_dplr_delta_rule", "fused_recurrent_dplr_delta_rule"]


def chunk_dplr_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    gk: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cpu: Tensor | None = None,
    safe_gate: bool = False,
    chunk_size: int | None = None,
    disable_recompute: bool = False,
    cp_context: object = None,
    lower_bound: float | None = None,
    **kwargs: object,
) -> tuple[Tensor, Tensor | None]:
    """The generalized delta rule
    (``fla.ops.generalized_delta_rule.chunk_dplr_delta_rule``): per step and head,
    ``S = (Diag(exp(gk)) + b a^T) S + k v^T``, ``o = scale * S^T q``.

    Args:
        q, k, a, b: ``(B, T, H, K)``.
        v: ``(B, T, H, V)``.
        gk: ``(B, T, H, K)`` log decays.
        scale: the factor of ``q``; ``K ** -0.5`` by default.
        initial_state: ``(N, H, K, V)``: N = B, or the number of sequences with
            ``cu_seqlens``.
        output_final_state: also return the final state ``(N, H, K, V)``.
        cu_seqlens: ``(N + 1,)`` integer offsets of packed sequences along T (B == 1).
        cu_seqlens_cpu: a CPU copy of ``cu_seqlens`` (checked against it).
        safe_gate: the original's faster kernels for ``gk`` in about ``[-5, 0)``:
            checked, and ignored (the results are the same).
        chunk_size: the original's tiling: None or a power of two >= 16, ignored.
        disable_recompute: the original's memory/speed trade-off: ignored.
        cp_context: context parallelism: only None.
        lower_bound: None, or a number < 0 that the caller promises ``gk`` stays at or
            above (the original's kernels rely on it; unchecked against ``gk`` here,
            and not needed).
        **kwargs: ``head_first=False``.

    Returns:
        ``(o, final_state)``: ``o`` ``(B, T, H, V)`` in q's dtype; ``final_state``
        float32 (float64 for a float64 v), or None.

    Example:
        >>> import torch
        >>> from parascan.compat.fla import chunk_dplr_delta_rule
        >>> ones, half = torch.ones(1, 3, 1, 1), torch.full((1, 3, 1, 1), 0.5)
        >>> o, final = chunk_dplr_delta_rule(  # S = (1 - 0.5) S + 1
        ...     ones, ones, ones, -half, ones, torch.zeros(1, 3, 1, 1), scale=1.0)
        >>> o.flatten()
        tensor([1.0000, 1.5000, 1.7500])
    """
    fn = PREFIX + "chunk_dplr_delta_rule"
    check_kwargs(fn, kwargs, ())
    check_chunk_options(fn, safe_gate, chunk_size, disable_recompute, cp_context, lower_bound)
    return dplr(
        fn, (("q", q), ("k", k), ("v", v), ("a", a), ("b", b), ("gk", gk)), out="q", scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, reverse=False,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
    )  # fmt: skip


def fused_recurrent_dplr_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    gk: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The generalized delta rule
    (``fla.ops.generalized_delta_rule.fused_recurrent_dplr_delta_rule``): the recurrence
    of :func:`chunk_dplr_delta_rule`; ``reverse`` scans each sequence from its last
    step to its first. ``o`` has v's dtype. Differentiable (the original has no
    backward)."""
    fn = PREFIX + "fused_recurrent_dplr_delta_rule"
    return dplr(
        fn, (("q", q), ("k", k), ("v", v), ("a", a), ("b", b), ("gk", gk)), out="v", scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, reverse=reverse,
        cu_seqlens=cu_seqlens,
    )  # fmt: skip


def check_chunk_options(
    fn: str, safe_gate: object, chunk_size: object, disable_recompute: object,
    cp_context: object, lower_bound: object,
) -> None:  # fmt: skip
    """The chunked originals' kernel options (the results do not depend on them),
    checked as they check them: ``lower_bound`` must be negative."""
    check_flag(fn, "safe_gate", safe_gate)
    check_power_of_two(fn, "chunk_size", chunk_size, 16)
    check_flag(fn, "disable_recompute", disable_recompute)
    check_no_cp(fn, cp_context)
    if lower_bound is not None and not real(fn, "lower_bound or None", lower_bound) < 0:
        raise ValueError(
            f"{fn}: lower_bound bounds a log decay (< 0) from below: expected a negative "
            f"lower_bound, as the original, but got {lower_bound!r}"
        )


def dplr(
    fn: str,
    operands: tuple[tuple[str, object], ...],
    *,
    out: str,
    scale: object,
    initial_state: object,
    output_final_state: object,
    reverse: object,
    cu_seqlens: object,
    cu_seqlens_cpu: object = None,
) -> tuple[Tensor, Tensor | None]:
    """The DPLR drop-ins (and RWKV-7's): ``operands`` the (name, value) pairs of q, k,
    v, a, b and the log decay, as the drop-in names them; ``out``: ``"q"`` or ``"v"``,
    whose dtype ``o`` has."""
    (qn, q), (kn, k), (_, v), (an, a), (bn, b), (gn, g) = operands
    (q_t, k_t, a_t, b_t), v_t = check_same_heads(fn, [(qn, q), (kn, k), (an, a), (bn, b)], v)
    g_t = check_gate(fn, gn, g, tuple(q_t.shape), f"(B, T, H, K) like {qn}")
    run = check_state_scan(
        fn, q_t, v_t, out_dtype=q_t.dtype if out == "q" else v_t.dtype, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, reverse=reverse,
        cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu, query=qn,
    )  # fmt: skip
    same_device(fn, [(qn, q_t), (kn, k_t), ("v", v_t), (an, a_t), (bn, b_t), (gn, g_t),
                     ("initial_state", run.initial_state)])  # fmt: skip
    return run_dplr(run, q_t, k_t, v_t, a_t, b_t, g_t)
