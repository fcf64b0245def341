"""Drop-ins for ``fla.ops.gated_delta_rule`` (Gated DeltaNet): per step and value head,
``S = exp(g) S``, ``u = beta * (v - S^T k)``, ``S = S + k u^T``, ``o = scale * S^T q``,
computed by :func:`parascan.delta_rule_scan` (the layouts, and what differs from the
originals: :mod:`parascan.compat.fla`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from parascan._core import check_flag, describe
from parascan.compat.fla._common import (
    PREFIX,
    DeltaOptions,
    check_beta,
    check_chunk_size,
    check_gate,
    check_kwargs,
    check_no_cp,
    check_param,
    check_qkv,
    check_state_v_first,
    run_delta,
    same_device,
)

__all__ = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"]


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cpu: Tensor | None = None,
    chunk_indices: Tensor | None = None,
    cp_context: object = None,
    **kwargs: object,
) -> tuple[Tensor, Tensor | None]:
    """Gated DeltaNet (``fla.ops.gated_delta_rule.chunk_gated_delta_rule``): per step and
    value head, ``S = exp(g) S``, ``u = beta * (v - S^T k)``, ``S = S + k u^T``,
    ``o = scale * S^T q``.

    Args:
        q, k: ``(B, T, H, K)``.
        v: ``(B, T, HV, V)``, HV a multiple of H.
        g: ``(B, T, HV)`` log decays; with ``use_gate_in_kernel`` the raw input of
            ``-exp(A_log) * softplus(g + dt_bias)``.
        beta: ``(B, T, HV)``; logits with ``use_beta_sigmoid_in_kernel``.
        scale: the factor of ``q``; ``K ** -0.5`` by default.
        initial_state: ``(N, HV, K, V)`` (``(N, HV, V, K)`` with ``state_v_first``).
        output_final_state: also return the final state, in the same layout.
        use_qk_l2norm_in_kernel: l2-normalize q and k (eps 1e-6) first.
        use_beta_sigmoid_in_kernel: ``beta = sigmoid(beta)``.
        allow_neg_eigval: ``beta = 2 * sigmoid(beta)`` (needs
            ``use_beta_sigmoid_in_kernel``).
        state_v_first: states in the ``(V, K)`` layout.
        cu_seqlens: ``(N + 1,)`` integer offsets of packed sequences along T (B == 1).
        cu_seqlens_cpu: a CPU copy of ``cu_seqlens`` (checked against it).
        chunk_indices: the original's precomputed tiling of ``cu_seqlens``: ignored.
        cp_context: context parallelism: only None.
        **kwargs: ``use_gate_in_kernel``, ``A_log`` ``(HV,)``, ``dt_bias`` ``(HV,)``
            (as the original reads them); ``chunk_size`` (16, 32 or 64, ignored);
            the deprecated ``transpose_state_layout``; ``head_first=False``.

    Returns:
        ``(o, final_state)``: ``o`` ``(B, T, HV, V)`` in q's dtype; ``final_state``
        float32 (float64 for a float64 v), or None.

    Example:
        >>> import torch
        >>> from parascan.compat.fla import chunk_gated_delta_rule
        >>> ones, half = torch.ones(1, 3, 1, 1), torch.full((1, 3, 1), 0.5)
        >>> o, final = chunk_gated_delta_rule(
        ...     ones, ones, ones, half.log(), half, scale=1.0, output_final_state=True)
        >>> o.flatten()
        tensor([0.5000, 0.6250, 0.6562])
    """
    fn = PREFIX + "chunk_gated_delta_rule"
    check_kwargs(fn, kwargs, ("use_gate_in_kernel", "A_log", "dt_bias", "chunk_size",
                              "transpose_state_layout"))  # fmt: skip
    v_first = check_state_v_first(fn, state_v_first, kwargs)
    check_chunk_size(fn, kwargs, (16, 32, 64))
    check_no_cp(fn, cp_context)
    if chunk_indices is not None and not isinstance(chunk_indices, Tensor):
        raise TypeError(
            f"{fn}: expected chunk_indices to be a Tensor or None, but got "
            f"{describe(chunk_indices)}"
        )
    use_gate = check_flag(fn, "use_gate_in_kernel", kwargs.get("use_gate_in_kernel", False))
    options = DeltaOptions(
        fn, fused=False, out="q", scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        use_gate_in_kernel=use_gate, A_log=kwargs.get("A_log"), dt_bias=kwargs.get("dt_bias"),
        state_v_first=v_first, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
    )  # fmt: skip
    return _gated_delta_rule(q, k, v, g, None, None, beta, options)


def fused_recurrent_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor | None = None,
    gk: Tensor | None = None,
    gv: Tensor | None = None,
    beta: Tensor | None = None,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Tensor | None = None,
    **kwargs: object,
) -> tuple[Tensor, Tensor | None]:
    """Gated DeltaNet (``fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule``):
    the recurrence of :func:`chunk_gated_delta_rule`, with optional decays ``g``
    ``(B, T, HV)``, ``gk`` ``(B, T, HV, K)`` and ``gv`` ``(B, T, HV, V)`` (log space,
    applied in that order; note ``gk, gv`` come before ``beta``: pass ``beta`` by
    keyword), ``beta`` optional (ones, then the sigmoid if asked) and per head or per
    value channel ``(B, T, HV, V)``, ``use_gate_in_kernel`` with ``A_log`` and
    ``dt_bias`` ``(HV,)`` as parameters (ignored without it, as in the original; the
    gate applies to ``g``). ``o`` has v's dtype. ``**kwargs``: the deprecated
    ``transpose_state_layout``; ``head_first=False``."""
    fn = PREFIX + "fused_recurrent_gated_delta_rule"
    check_kwargs(fn, kwargs, ("transpose_state_layout",))
    v_first = check_state_v_first(fn, state_v_first, kwargs)
    use_gate = check_flag(fn, "use_gate_in_kernel", use_gate_in_kernel)
    options = DeltaOptions(
        fn, fused=True, out="v", scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        use_gate_in_kernel=use_gate, A_log=A_log, dt_bias=dt_bias, state_v_first=v_first,
        cu_seqlens=cu_seqlens,
    )  # fmt: skip
    return _gated_delta_rule(q, k, v, g, gk, gv, beta, options)


def _gated_delta_rule(
    q: Tensor, k: Tensor, v: Tensor, g: object, gk: object, gv: object, beta: object,
    options: DeltaOptions,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """The gated delta rule's two drop-ins: the fused recurrent one (``options.fused``)
    takes g, gk and gv optional, and beta optional and per head or per value channel."""
    fn, fused = options.fn, options.fused
    q, k, v = check_qkv(fn, q, k, v)
    batch, steps, heads, dv = v.shape
    dk = q.shape[-1]
    if fused and beta is None:
        beta = torch.ones(v.shape[:3], dtype=q.dtype, device=q.device)
    beta = check_beta(fn, beta, v, fused)
    if g is not None or not fused:
        g = check_gate(fn, "g", g, (batch, steps, heads), "(B, T, HV)")
    if gk is not None:
        gk = check_gate(fn, "gk", gk, (batch, steps, heads, dk), "(B, T, HV, K)")
    if gv is not None:
        gv = check_gate(fn, "gv", gv, (batch, steps, heads, dv), "(B, T, HV, V)")
    a, bias = None, None
    if options.use_gate_in_kernel:
        if options.A_log is None:
            raise ValueError(
                f"{fn}: use_gate_in_kernel=True computes g = -exp(A_log) * softplus(g + "
                "dt_bias): expected A_log (HV,), but got None"
            )
        if g is None:
            raise ValueError(
                f"{fn}: use_gate_in_kernel=True computes g from its raw input: expected g "
                "(B, T, HV), but got None"
            )
        a = check_param(fn, "A_log", options.A_log, heads, "HV")
        if options.dt_bias is not None:
            bias = check_param(fn, "dt_bias", options.dt_bias, heads, "HV")
    run = options.check(q, v)
    gates: list[tuple[str, Tensor | None]] = [
        ("g", g), ("gk", gk), ("gv", gv), ("A_log", a), ("dt_bias", bias)
    ]  # fmt: skip
    h0 = run.initial_state
    same_device(fn, [("q", q), ("k", k), ("v", v), ("beta", beta), *gates, ("initial_state", h0)])
    if options.use_gate_in_kernel:
        assert isinstance(g, Tensor) and a is not None
        g = _gate(g, a, bias, run.compute_dtype)
    return run_delta(run, q, k, v, run.beta(beta), g=g, gk=gk, gv=gv)


def _gate(g: Tensor, a_log: Tensor, dt_bias: Tensor | None, cd: torch.dtype) -> Tensor:
    """The gated delta rule's in-kernel gate: ``-exp(A_log) * softplus(g + dt_bias)``
    per value head."""
    x = g.to(cd) if dt_bias is None else g.to(cd) + dt_bias.to(cd)
    return -a_log.to(cd).exp() * F.softplus(x)
