"""Drop-ins for ``fla.ops.kda`` (Kimi Delta Attention): per step and value head,
``S = Diag(exp(g)) S`` (one log decay per key channel), ``u = beta * (v - S^T k)``,
``S = S + k u^T``, ``o = scale * S^T q``, computed by :func:`parascan.delta_rule_scan`
(the layouts, and what differs from the originals: :mod:`parascan.compat.fla`)."""

from __future__ import annotations

from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import Tensor

from parascan._core import check_flag, describe
from parascan.compat.fla._common import (
    PREFIX,
    DeltaOptions,
    DeltaScan,
    check_beta,
    check_chunk_size,
    check_gate,
    check_kwargs,
    check_no_cp,
    check_param,
    check_qkv,
    check_state_v_first,
    real,
    run_delta,
    same_device,
    scan,
)

__all__ = ["chunk_kda", "fused_recurrent_kda"]


def chunk_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    safe_gate: bool = False,
    lower_bound: float | None = None,
    disable_recompute: bool = False,
    return_intermediate_states: bool = False,
    state_v_first: bool = False,
    cu_seqlens: Tensor | None = None,
    cu_seqlens_cpu: Tensor | None = None,
    cp_context: object = None,
    use_graph: bool = False,
    max_num_seqs: int | None = None,
    **kwargs: object,
) -> tuple[Tensor, Tensor | None] | tuple[Tensor, Tensor | None, Tensor]:
    """Kimi Delta Attention (``fla.ops.kda.chunk_kda``): per step and value head,
    ``S = Diag(exp(g)) S`` (one log decay per key channel), ``u = beta * (v - S^T k)``,
    ``S = S + k u^T``, ``o = scale * S^T q``.

    Args:
        q, k: ``(B, T, H, K)``.
        v: ``(B, T, HV, V)``, HV a multiple of H.
        g: ``(B, T, HV, K)`` log decays; with ``use_gate_in_kernel`` the raw input of
            ``-exp(A_log) * softplus(g + dt_bias)`` (or of
            ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` when ``lower_bound``
            is set; ``A_log`` optional then).
        beta: ``(B, T, HV)``; logits with ``use_beta_sigmoid_in_kernel``.
        scale: the factor of ``q``; ``K ** -0.5`` by default.
        initial_state: ``(N, HV, K, V)`` (``(N, HV, V, K)`` with ``state_v_first``),
            any float dtype (the original asserts float32).
        output_final_state: also return the final state, in the same layout.
        use_qk_l2norm_in_kernel: l2-normalize q and k (eps 1e-6) first.
        use_gate_in_kernel: compute ``g`` from its raw input (above).
        use_beta_sigmoid_in_kernel: ``beta = sigmoid(beta)``.
        allow_neg_eigval: ``beta = 2 * sigmoid(beta)`` (needs
            ``use_beta_sigmoid_in_kernel``).
        safe_gate: the original's faster kernels for gates in ``[lower_bound, 0)``;
            with ``use_gate_in_kernel`` it needs ``lower_bound`` in ``[-5, 0)``, as
            there; otherwise ignored.
        lower_bound: the lower bound of the in-kernel gate (above).
        disable_recompute: the original's memory/speed trade-off: ignored.
        return_intermediate_states: under ``torch.inference_mode()``, also return the
            state entering each chunk of ``chunk_size`` steps of each sequence,
            ``(B, NT, HV, K, V)`` (or ``(B, NT, HV, V, K)``) in k's dtype, as the
            original (NT: chunks per sequence, or in all sequences with ``cu_seqlens``).
        state_v_first: states in the ``(V, K)`` layout.
        cu_seqlens: ``(N + 1,)`` integer offsets of packed sequences along T (B == 1).
        cu_seqlens_cpu: a CPU copy of ``cu_seqlens`` (checked against it).
        cp_context: context parallelism: only None.
        use_graph: the original's static tiling for graph capture (Ascend NPUs):
            checked and otherwise ignored.
        max_num_seqs: with ``use_graph`` and ``cu_seqlens``, the number of sequences
            that ``cu_seqlens`` must hold (padded with empty ones), as the original
            asserts; None: any.
        **kwargs: ``A_log`` (HV elements) and ``dt_bias`` (HV * K elements), read
            with ``use_gate_in_kernel`` as the original reads them; ``chunk_size`` (32
            or 64); the deprecated ``transpose_state_layout``; ``head_first=False``.

    Returns:
        ``(o, final_state)`` (and ``h`` with ``return_intermediate_states``): ``o``
        ``(B, T, HV, V)`` in q's dtype; ``final_state`` float32 (float64 for a float64
        v), or None.

    Example:
        >>> import torch
        >>> from parascan.compat.fla import chunk_kda
        >>> ones, half = torch.ones(1, 3, 1, 1), torch.full((1, 3, 1, 1), 0.5)
        >>> o, final = chunk_kda(
        ...     ones, ones, ones, half.log(), half[..., 0], scale=1.0,
        ...     output_final_state=True)
        >>> o.flatten(), final.dtype
        (tensor([0.5000, 0.6250, 0.6562]), torch.float32)
    """
    fn = PREFIX + "chunk_kda"
    check_kwargs(fn, kwargs, ("A_log", "dt_bias", "chunk_size", "transpose_state_layout"))
    v_first = check_state_v_first(fn, state_v_first, kwargs)
    chunk = check_chunk_size(fn, kwargs, (32, 64))
    check_no_cp(fn, cp_context)
    _check_graph(fn, use_graph, max_num_seqs, cu_seqlens)
    use_gate = check_flag(fn, "use_gate_in_kernel", use_gate_in_kernel)
    safe = check_flag(fn, "safe_gate", safe_gate)
    check_flag(fn, "disable_recompute", disable_recompute)
    states = check_flag(fn, "return_intermediate_states", return_intermediate_states)
    bound = None if lower_bound is None else real(fn, "lower_bound or None", lower_bound)
    if safe and use_gate and (bound is None or not -5 <= bound < 0):
        raise ValueError(
            f"{fn}: safe_gate=True with use_gate_in_kernel=True clamps the gate to "
            f"[lower_bound, 0): expected lower_bound in [-5, 0), but got {lower_bound!r}"
        )
    if states:
        if not torch.is_inference_mode_enabled():
            raise ValueError(
                f"{fn}: return_intermediate_states=True is for inference, as in the "
                "original: expected a call under torch.inference_mode(), but got none"
            )
        if disable_recompute:
            raise ValueError(
                f"{fn}: expected return_intermediate_states=True with "
                "disable_recompute=False, as the original, but got disable_recompute=True"
            )
    a_log, dt_bias = (kwargs.get("A_log"), kwargs.get("dt_bias")) if use_gate else (None, None)
    options = DeltaOptions(
        fn, fused=False, out="q", scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        use_gate_in_kernel=use_gate, A_log=a_log, dt_bias=dt_bias, lower_bound=bound,
        state_v_first=v_first, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu,
    )  # fmt: skip
    return _kda(q, k, v, g, beta, options, states=chunk if states else None)


def fused_recurrent_kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    A_log: Tensor | None = None,
    dt_bias: Tensor | None = None,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    use_gate_in_kernel: bool = False,
    use_beta_sigmoid_in_kernel: bool = False,
    allow_neg_eigval: bool = False,
    lower_bound: float | None = None,
    state_v_first: bool = False,
    cu_seqlens: Tensor | None = None,
    **kwargs: object,
) -> tuple[Tensor, Tensor | None]:
    """Kimi Delta Attention (``fla.ops.kda.fused_recurrent_kda``): the recurrence of
    :func:`chunk_kda`, with ``A_log`` (HV elements) and ``dt_bias`` (HV * K elements,
    as the original's kernel reads it) as parameters 6 and 7 (before ``scale``), used
    only with ``use_gate_in_kernel`` (``A_log`` is needed there unless ``lower_bound``
    is set: the original's kernel would then take ``A_log`` as 1), and ``beta`` per
    head or per value channel ``(B, T, HV, V)``. ``o`` has v's dtype. ``**kwargs``:
    the deprecated ``transpose_state_layout``; ``head_first=False``."""
    fn = PREFIX + "fused_recurrent_kda"
    check_kwargs(fn, kwargs, ("transpose_state_layout",))
    v_first = check_state_v_first(fn, state_v_first, kwargs)
    use_gate = check_flag(fn, "use_gate_in_kernel", use_gate_in_kernel)
    bound = None if lower_bound is None else real(fn, "lower_bound or None", lower_bound)
    options = DeltaOptions(
        fn, fused=True, out="v", scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
        use_beta_sigmoid_in_kernel=use_beta_sigmoid_in_kernel, allow_neg_eigval=allow_neg_eigval,
        use_gate_in_kernel=use_gate, A_log=A_log if use_gate else None,
        dt_bias=dt_bias if use_gate else None, lower_bound=bound, state_v_first=v_first,
        cu_seqlens=cu_seqlens,
    )  # fmt: skip
    result = _kda(q, k, v, g, beta, options, states=None)
    return result[0], result[1]


def _check_graph(fn: str, use_graph: object, max_num_seqs: object, cu_seqlens: object) -> None:
    """chunk_kda's ``use_graph`` (its static tiling: the results do not depend on it)
    and ``max_num_seqs``, the number of sequences its ``cu_seqlens`` must then hold."""
    graph = check_flag(fn, "use_graph", use_graph)
    if max_num_seqs is not None and (
        not isinstance(max_num_seqs, int) or isinstance(max_num_seqs, bool)
    ):
        raise TypeError(
            f"{fn}: expected max_num_seqs to be an int or None, but got {describe(max_num_seqs)}"
        )
    if not graph or max_num_seqs is None or not isinstance(cu_seqlens, Tensor):
        return
    count = cu_seqlens.numel() - 1  # a malformed cu_seqlens: checked with the operands
    if cu_seqlens.dim() == 1 and count != max_num_seqs:
        raise ValueError(
            f"{fn}: use_graph=True takes cu_seqlens padded with empty sequences to "
            f"max_num_seqs + 1 offsets, as the original asserts: expected {max_num_seqs} "
            f"sequences, but got cu_seqlens with {count}"
        )


def _kda(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: object,
    beta: object,
    options: DeltaOptions,
    *,
    states: int | None,
) -> tuple[Tensor, Tensor | None] | tuple[Tensor, Tensor | None, Tensor]:
    """KDA's two drop-ins: the fused recurrent one (``options.fused``) takes beta per
    head or per value channel; ``states``: the chunk size of chunk_kda's intermediate
    states, when asked for."""
    fn = options.fn
    q, k, v = check_qkv(fn, q, k, v)
    batch, steps, heads, _ = v.shape
    dk = q.shape[-1]
    beta_t = check_beta(fn, beta, v, options.fused)
    g_t = check_gate(fn, "g", g, (batch, steps, heads, dk), "(B, T, HV, K)")
    a, bias = None, None
    if options.use_gate_in_kernel:
        if options.A_log is None and options.lower_bound is None:
            raise ValueError(
                f"{fn}: use_gate_in_kernel=True computes g = -exp(A_log) * softplus(g + "
                "dt_bias): expected A_log (HV elements), or lower_bound for "
                "lower_bound * sigmoid(g + dt_bias), but got neither"
            )
        if options.A_log is not None:
            a = check_param(fn, "A_log", options.A_log, heads, "HV")
        if options.dt_bias is not None:
            bias = check_param(fn, "dt_bias", options.dt_bias, heads * dk, "HV * K")
    run = options.check(q, v)
    h0 = run.initial_state
    same_device(fn, [("q", q), ("k", k), ("v", v), ("g", g_t), ("beta", beta_t),
                     ("A_log", a), ("dt_bias", bias), ("initial_state", h0)])  # fmt: skip
    if options.use_gate_in_kernel:
        g_t = _gate(g_t, a, bias, options.lower_bound, run.compute_dtype)
    beta_t = run.beta(beta_t)
    if states is not None:
        return _chunk_states(run, q, k, v, beta_t, g_t, states)
    return run_delta(run, q, k, v, beta_t, gk=g_t)


def _gate(
    g: Tensor, a_log: Tensor | None, dt_bias: Tensor | None, lower_bound: float | None,
    cd: torch.dtype,
) -> Tensor:  # fmt: skip
    """KDA's in-kernel gate per value head and key channel: ``-exp(A_log) *
    softplus(g + dt_bias)``, or ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``
    (``A_log`` optional then) when ``lower_bound`` is set."""
    heads, dk = g.shape[-2:]
    x = g.to(cd) if dt_bias is None else g.to(cd) + dt_bias.to(cd).reshape(heads, dk)
    if lower_bound is None:
        assert a_log is not None  # checked by _kda
        return -a_log.to(cd).exp().unsqueeze(-1) * F.softplus(x)
    if a_log is not None:
        x = a_log.to(cd).exp().unsqueeze(-1) * x
    return lower_bound * torch.sigmoid(x)


def _chunk_states(
    run: DeltaScan, q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor, chunk: int
) -> tuple[Tensor, Tensor | None, Tensor]:
    """chunk_kda with ``return_intermediate_states``: the scan a chunk at a time along
    each sequence, keeping the state that enters each chunk, as the original's ``h``."""
    batch, steps, heads, dv = v.shape
    dk = q.shape[-1]
    initial = run.initial_state
    if initial is not None and run.v_first:
        initial = initial.transpose(-1, -2)
    if run.cu_seqlens is None:
        spans = [(0, steps)]
        starts = [initial]
    else:
        cu = run.cu_seqlens.tolist()
        spans = list(pairwise(cu))
        starts = [None if initial is None else initial[i : i + 1] for i in range(len(spans))]
    rows = batch if run.cu_seqlens is None else 1
    zeros = torch.zeros(rows, heads, dk, dv, dtype=run.compute_dtype, device=v.device)
    outs, finals, entering = [], [], []
    for (lo, hi), start in zip(spans, starts, strict=True):
        state = zeros if start is None else start
        for t in range(lo, hi, chunk):
            part = slice(t, min(t + chunk, hi))
            entering.append(state)
            o, last = scan(
                run, q[:, part], k[:, part], v[:, part], beta[:, part], g[:, part], state,
                final=True, cu_seqlens=None,
            )  # fmt: skip
            assert last is not None
            outs.append(o)
            state = last
        finals.append(state)
    o = torch.cat(outs, 1) if outs else torch.empty_like(v)
    h = (torch.stack(entering, 1) if entering else zeros.new_empty(rows, 0, heads, dk, dv)).to(
        k.dtype
    )
    final = torch.cat(finals, 0).to(zeros.dtype) if run.output_final_state else None
    if run.v_first:
        h = h.transpose(-1, -2)
        final = None if final is None else final.transpose(-1, -2)
    return (
        o.to(run.out_dtype),
        None if final is None else final.contiguous(),
        h.contiguous(),
    )
