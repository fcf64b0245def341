"""Drop-ins for flash-linear-attention's HGRN recurrences (``fla.ops.hgrn``) and its
delta-rule ops (``fla.ops.delta_rule``, ``fla.ops.gated_delta_rule``, ``fla.ops.kda``)::

    from parascan.compat.fla import chunk_hgrn, fused_recurrent_hgrn
    from parascan.compat.fla import (
        chunk_delta_rule, chunk_gated_delta_rule, chunk_kda,
        fused_recurrent_delta_rule, fused_recurrent_gated_delta_rule, fused_recurrent_kda,
    )

**HGRN.** The same signatures and results, ``h[t] = exp(g[t]) * h[t-1] + x[t]`` over
``(B, T, D)`` tensors (``g`` the log of the forget gate, e.g. ``logsigmoid``), returning
``(o, final)`` with ``o[t] = h[t]``; computed by :func:`parascan.linear_scan` along dim 1,
on any device and dtype (half types accumulate in float32, with the gate's exp taken in
float32, as the originals do). Packed variable-length batches take ``cu_seqlens``
(B == 1, one initial and final state per sequence) in both functions; in the originals
only ``fused_recurrent_hgrn`` does. Differentiable in ``x``, ``g`` and ``initial_state``
(``chunk_hgrn``'s original returns no gradient for the initial state).

**Delta rule** (DeltaNet, Gated DeltaNet, Kimi Delta Attention): ``chunk_delta_rule``,
``fused_recurrent_delta_rule``, ``chunk_gated_delta_rule``,
``fused_recurrent_gated_delta_rule``, ``chunk_kda`` and ``fused_recurrent_kda`` with the
signatures (parameter names, order, defaults, the options read from ``**kwargs``),
layouts and results of flash-linear-attention 0.6's, computed by
:func:`parascan.delta_rule_scan` on any device. ``q``, ``k``: ``(B, T, H, K)``; ``v``:
``(B, T, HV, V)`` with HV a multiple of H (value head ``i`` reads q/k head
``i // (HV // H)``); the state of each sequence and value head is a ``(K, V)`` matrix::

    q, k = l2norm(q), l2norm(k)              with use_qk_l2norm_in_kernel (eps 1e-6)
    S = Diag(exp(g)) S                       S: initial_state, or zeros
    u = beta * (v - S^T k);  S = S + k u^T   beta per head, or per value channel
    o = scale * S^T q                        scale defaults to K ** -0.5

``g`` is absent (delta rule), one log decay per head (gated delta rule) or per key
channel (KDA); ``fused_recurrent_gated_delta_rule`` also takes ``gk`` (per key channel)
and ``gv`` (per value channel), applied in turn. The options that the originals fuse
into their kernels are computed here with torch ops before the scan, so they are
differentiable: ``use_gate_in_kernel`` (the gated delta rule's
``g = -exp(A_log) * softplus(g + dt_bias)``; KDA's, per key channel with ``dt_bias`` of
HV * K elements, or ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` when
``lower_bound`` is set), ``use_beta_sigmoid_in_kernel`` (``beta = sigmoid(beta)``, times 2
with ``allow_neg_eigval``), in float32 (float64 for a float64 ``v``), softplus linear
above 20 as the kernels' is.

States: ``initial_state`` and the final state ``(N, HV, K, V)``, ``(N, HV, V, K)`` with
``state_v_first=True`` (or the deprecated ``transpose_state_layout``), N the batch or the
number of ``cu_seqlens`` sequences (packed along T of a batch of one); the final state is
float32 (float64 for a float64 ``v``). ``o``: ``(B, T, HV, V)`` in ``q``'s dtype
(``chunk_*``, ``fused_recurrent_delta_rule``) or ``v``'s (``fused_recurrent_gated_delta_rule``,
``fused_recurrent_kda``), as the originals return it.

How they differ from the originals:

- All six are differentiable in every tensor argument (``A_log``, ``dt_bias`` and the
  initial state included), and through the final state; the originals'
  ``fused_recurrent_gated_delta_rule`` and ``fused_recurrent_kda`` have no backward.
- Accepted where the originals assert or fail: any real float dtype and device, any T
  (0 included), any K >= 1 (the chunked originals assert K <= 256; K = 0 raises, as
  ``ps.delta_rule_scan`` does); a float32 ``chunk_delta_rule`` (its original asserts q is
  not float32); grouped value heads in the DeltaNet pair (their originals have none), and
  a default ``beta`` of one per value head (``fused_recurrent_gated_delta_rule``'s
  original makes one per q/k head); ``initial_state`` of any float dtype (``chunk_kda``'s
  original asserts float32). q, k and v of different dtypes are taken by all but
  ``chunk_delta_rule``, as by their originals, which do not check them. An empty packed
  sequence's final state is its initial state (``fused_recurrent_kda``'s original leaves
  it unwritten).
- Options that only steer the originals' kernels are checked as the originals check them
  and otherwise ignored, since the results do not depend on them: ``chunk_size``,
  ``cu_seqlens_cpu`` (it must hold ``cu_seqlens``' offsets), ``chunk_indices``,
  ``safe_gate``, ``disable_recompute``, ``use_graph`` (``chunk_kda``'s; with it a
  ``max_num_seqs`` must be ``cu_seqlens``' count); ``head_first=False`` is accepted.
- Refused as the originals assert, with an error naming the function (a ValueError or
  TypeError, where the original's is an AssertionError): ``fused_recurrent_delta_rule``'s
  ``scale <= 0``, ``chunk_delta_rule``'s q, k and v of different dtypes, a beta other
  than ``(B, T, HV)`` where the original takes no per-channel beta, KDA's g and beta
  shapes, ``return_intermediate_states`` outside inference mode or with
  ``disable_recompute``, ``use_gate_in_kernel`` without ``A_log`` in
  ``chunk_gated_delta_rule``.
- Refused, with an error naming the function: ``head_first=True`` (the originals raise
  too), ``cp_context`` (context parallelism), keyword arguments the original does not
  read (it ignores them silently), ``use_gate_in_kernel`` without ``A_log`` and without
  ``lower_bound`` in ``fused_recurrent_kda`` (the original's kernel then uses a gate
  of ``-e * softplus(g + dt_bias)``, as if ``A_log`` were 1).
- A per-value-channel ``beta`` ``(B, T, HV, V)`` or a ``gv`` runs each value channel as a
  value head of its own, with the decays repeated per channel: ``(B, T, HV * V, K)``
  numbers when per key channel decays (``gk``, KDA's ``g``) come with them.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import Tensor

from parascan._core import (
    check_cu_seqlens,
    check_dtype,
    check_flag,
    check_same_device,
    check_shape,
    check_tensor,
    describe,
    finite_float,
    tensor_hint,
)
from parascan.compat._checks import check_same_3d, errors_as, is_integer_tensor
from parascan.delta_rule import delta_rule_scan
from parascan.first_order import linear_scan

__all__ = [
    "chunk_delta_rule",
    "chunk_gated_delta_rule",
    "chunk_hgrn",
    "chunk_kda",
    "fused_recurrent_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "fused_recurrent_hgrn",
    "fused_recurrent_kda",
]


def _hgrn(
    function: str,
    x: Tensor,
    g: Tensor,
    initial_state: Tensor | None,
    output_final_state: bool,
    cu_seqlens: Tensor | None,
) -> tuple[Tensor, Tensor | None]:
    fn = f"parascan.compat.fla.{function}"
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


# --- the delta rule: DeltaNet, Gated DeltaNet, KDA ----------------------------------

_PREFIX = "parascan.compat.fla."
Opt = Tensor | None


def _compute_dtype(v: Tensor) -> torch.dtype:
    """ps.delta_rule_scan's state dtype, in which the in-kernel gates are computed."""
    return torch.float64 if v.dtype == torch.float64 else torch.float32


def _real(fn: str, name: str, value: object) -> float:
    number = finite_float(value)
    if number is not None:
        return number
    raise TypeError(f"{fn}: expected {name} to be a finite number, but got {describe(value)}")


def _scale(fn: str, scale: object, dk: int) -> float:
    """``scale``, defaulting to ``K ** -0.5`` as the originals do."""
    if scale is None:
        return dk**-0.5 if dk else 1.0  # K == 0: delta_rule_scan raises, naming K
    return _real(fn, "scale or None", scale)


def _kwargs(fn: str, kwargs: Mapping[str, object], reads: tuple[str, ...]) -> None:
    """The original reads ``reads`` from its ``**kwargs`` and ignores the rest; here the
    rest raise (a misspelt option would otherwise be silently dropped). ``head_first``
    is accepted as False: the only layout, (B, T, H, ...)."""
    unknown = sorted(set(kwargs) - set(reads) - {"head_first"})
    if unknown:
        what = ", ".join(reads) if reads else "nothing"
        raise TypeError(
            f"{fn}: got unexpected keyword argument(s) {', '.join(unknown)}: expected only "
            f"the options the original reads from **kwargs ({what}) or head_first=False"
        )
    if "head_first" in kwargs and check_flag(fn, "head_first", kwargs["head_first"]):
        raise ValueError(
            f"{fn}: expected inputs in the (B, T, H, ...) layout (head_first=False; "
            "flash-linear-attention removed head_first=True), but got head_first=True"
        )


def _chunk_size(fn: str, kwargs: Mapping[str, object], sizes: tuple[int, ...]) -> int:
    """The original's ``chunk_size`` option, checked as it checks it; the results do not
    depend on it (only chunk_kda's intermediate states do)."""
    size = kwargs.get("chunk_size", 64)
    if not isinstance(size, int) or isinstance(size, bool) or size not in sizes:
        raise ValueError(
            f"{fn}: expected chunk_size to be one of {', '.join(map(str, sizes))}, but got "
            f"{describe(size)}"
        )
    return size


def _state_v_first(fn: str, state_v_first: object, kwargs: Mapping[str, object]) -> bool:
    """``state_v_first``, or its deprecated name ``transpose_state_layout`` (which
    warns, as the originals do)."""
    v_first = check_flag(fn, "state_v_first", state_v_first)
    if "transpose_state_layout" in kwargs:
        if v_first:
            raise ValueError(
                f"{fn}: expected state_v_first or the deprecated transpose_state_layout, "
                "but got both"
            )
        warnings.warn(
            f"{fn}: transpose_state_layout is deprecated and renamed to state_v_first",
            DeprecationWarning,
            stacklevel=3,
        )
        v_first = check_flag(fn, "transpose_state_layout", kwargs["transpose_state_layout"])
    return v_first


def _no_cp(fn: str, cp_context: object) -> None:
    if cp_context is not None:
        raise ValueError(
            f"{fn}: context parallelism is not supported: expected cp_context=None, but got "
            f"{describe(cp_context)}"
        )


def _check_qkv(fn: str, q: object, k: object, v: object) -> tuple[Tensor, Tensor, Tensor]:
    q = check_tensor(fn, "q", q)
    if q.dim() != 4:
        raise ValueError(f"{fn}: expected q of shape (B, T, H, K), but got {describe(q)}")
    batch, steps, heads, dk = q.shape
    k = check_tensor(fn, "k", k)
    check_shape(fn, "k", k, (batch, steps, heads, dk), "(B, T, H, K) like q")
    v = check_tensor(fn, "v", v)
    if v.dim() != 4 or v.shape[:2] != (batch, steps):
        raise ValueError(
            f"{fn}: expected v of shape (B, T, HV, V) with (B, T) = {(batch, steps)}, but got "
            f"{describe(v)}"
        )
    if heads < 1 or v.shape[2] % heads:
        raise ValueError(
            f"{fn}: expected v's head count HV to be a multiple of q and k's H = {heads}, but "
            f"got {describe(v)}"
        )
    return q, k, v


def _check_beta(fn: str, beta: object, v: Tensor, per_channel: bool) -> Tensor:
    """beta (B, T, HV), or (B, T, HV, V) where the original takes a per-channel beta."""
    heads = tuple(v.shape[:3])
    beta = check_tensor(fn, "beta", beta)
    if tuple(beta.shape) == heads or (per_channel and beta.shape == v.shape):
        return beta
    what = f" or (B, T, HV, V) = {tuple(v.shape)}" if per_channel else ""
    raise ValueError(
        f"{fn}: expected beta of shape (B, T, HV) = {heads}{what}, but got {describe(beta)}"
    )


def _check_gate(fn: str, name: str, g: object, shape: tuple[int, ...], what: str) -> Tensor:
    g = check_tensor(fn, name, g)
    check_shape(fn, name, g, shape, what)
    return g


def _check_param(fn: str, name: str, value: object, count: int, what: str) -> Tensor:
    """A_log or dt_bias: ``count`` elements in any shape (the kernels read them flat),
    returned flat."""
    t = check_tensor(fn, name, value)
    if t.numel() != count:
        raise ValueError(
            f"{fn}: expected {name} of {what} = {count} elements, but got {describe(t)}"
        )
    return t.reshape(count)


def _check_varlen(
    fn: str, q: Tensor, cu_seqlens: object, cu_seqlens_cpu: object = None
) -> tuple[Tensor | None, int]:
    """``cu_seqlens`` checked against q's T (and ``cu_seqlens_cpu``, the originals' CPU
    copy of it, against ``cu_seqlens``); returns it and N, the number of states."""
    if cu_seqlens is None:
        if cu_seqlens_cpu is not None:
            raise ValueError(
                f"{fn}: cu_seqlens_cpu is a CPU copy of cu_seqlens: expected it only with "
                f"cu_seqlens, but got cu_seqlens=None and cu_seqlens_cpu "
                f"{describe(cu_seqlens_cpu)}"
            )
        return None, q.shape[0]
    cu = check_cu_seqlens(fn, cu_seqlens, q.shape[1], q.device)
    if q.shape[0] != 1:
        raise ValueError(
            f"{fn}: with cu_seqlens the sequences are packed along T of a batch of one: "
            f"expected q of shape (1, T, H, K), but got {describe(q)}"
        )
    if cu_seqlens_cpu is not None:
        same = (
            is_integer_tensor(cu_seqlens_cpu)
            and cu_seqlens_cpu.dim() == 1
            and cu_seqlens_cpu.tolist() == cu.tolist()
        )
        if not same:
            raise ValueError(
                f"{fn}: expected cu_seqlens_cpu to hold cu_seqlens' offsets {cu.tolist()}, "
                f"but got {describe(cu_seqlens_cpu)}"
            )
    return cu, cu.numel() - 1


def _check_initial(
    fn: str, initial_state: object, n: int, v: Tensor, dk: int, v_first: bool, packed: bool
) -> Tensor | None:
    if initial_state is None:
        return None
    t = check_tensor(fn, "initial_state", initial_state)
    heads, dv = v.shape[2], v.shape[3]
    shape = (n, heads, dv, dk) if v_first else (n, heads, dk, dv)
    what = "(N, HV, V, K)" if v_first else "(N, HV, K, V)"
    count = "the number of sequences in cu_seqlens" if packed else "the batch"
    check_shape(fn, "initial_state", t, shape, f"{what} (N: {count})")
    return t


def _same_device(fn: str, named: list[tuple[str, Tensor | None]]) -> None:
    check_same_device(fn, [(name, t) for name, t in named if t is not None])


def _beta_sigmoid(beta: Tensor, neg_eigval: bool, cd: torch.dtype) -> Tensor:
    """``sigmoid(beta)``, doubled with ``allow_neg_eigval``: eigenvalues of the
    transition ``I - beta k k^T`` in (-1, 1]."""
    out = torch.sigmoid(beta.to(cd))
    return out * 2.0 if neg_eigval else out


def _gdn_gate(g: Tensor, a_log: Tensor, dt_bias: Tensor | None, cd: torch.dtype) -> Tensor:
    """The gated delta rule's in-kernel gate: ``-exp(A_log) * softplus(g + dt_bias)``
    per value head."""
    x = g.to(cd) if dt_bias is None else g.to(cd) + dt_bias.to(cd)
    return -a_log.to(cd).exp() * F.softplus(x)


def _kda_gate(
    g: Tensor, a_log: Tensor | None, dt_bias: Tensor | None, lower_bound: float | None,
    cd: torch.dtype,
) -> Tensor:  # fmt: skip
    """KDA's in-kernel gate per value head and key channel: ``-exp(A_log) *
    softplus(g + dt_bias)``, or ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))``
    (``A_log`` optional then) when ``lower_bound`` is set."""
    heads, dk = g.shape[-2:]
    x = g.to(cd) if dt_bias is None else g.to(cd) + dt_bias.to(cd).reshape(heads, dk)
    if lower_bound is None:
        assert a_log is not None  # checked by the callers
        return -a_log.to(cd).exp().unsqueeze(-1) * F.softplus(x)
    if a_log is not None:
        x = a_log.to(cd).exp().unsqueeze(-1) * x
    return lower_bound * torch.sigmoid(x)


def _scan(
    fn: str, q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor | None, scale: float,
    qk_l2norm: bool, initial: Tensor | None, final: bool, cu_seqlens: Tensor | None,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """ps.delta_rule_scan, its errors (K = 0) under the drop-in's name ``fn``."""
    with errors_as(fn, "parascan.delta_rule_scan", {"initial": "initial_state"}):
        result = delta_rule_scan(
            q, k, v, beta, g=g, scale=scale, qk_l2norm=qk_l2norm, initial=initial,
            return_final=final, cu_seqlens=cu_seqlens,
        )  # fmt: skip
    return result if isinstance(result, tuple) else (result, None)


def _delta(
    fn: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    *,
    g: Opt = None,
    gk: Opt = None,
    gv: Opt = None,
    scale: float,
    initial_state: Opt,
    output_final_state: bool,
    qk_l2norm: bool,
    cu_seqlens: Opt,
    v_first: bool,
    out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor | None]:
    """The delta rule on checked operands: ``g`` (B, T, HV), ``gk`` (B, T, HV, K) and
    ``gv`` (B, T, HV, V) log decays in turn, ``beta`` (B, T, HV) or (B, T, HV, V)."""
    initial = initial_state
    if initial is not None and v_first:
        initial = initial.transpose(-1, -2)  # (K, V), as ps.delta_rule_scan takes it
    if beta.dim() == 3 and gv is None:
        decay = gk if g is None else (g if gk is None else gk + g.unsqueeze(-1))
        o, final = _scan(
            fn, q, k, v, beta, decay, scale, qk_l2norm, initial, output_final_state, cu_seqlens
        )
    else:
        # A per-channel beta or decay: the V columns of each state are independent
        # recurrences, so each value channel runs as a value head of its own, (K, 1)
        # state, the consecutive heads hv * V .. hv * V + V - 1 reading q/k head
        # hv // (HV // H) as grouped value heads do.
        batch, steps, heads, dv = v.shape
        dk = q.shape[-1]
        rows = heads * dv
        beta = beta if beta.dim() == 4 else beta.unsqueeze(-1).expand(v.shape)
        if gk is None:
            parts = [t for t in (None if g is None else g.unsqueeze(-1), gv) if t is not None]
            decay = None
            if parts:
                decay = (parts[0] if len(parts) == 1 else parts[0] + parts[1]).expand(v.shape)
                decay = decay.reshape(batch, steps, rows)
        else:
            decay = gk.unsqueeze(-2)
            if g is not None:
                decay = decay + g[..., None, None]
            if gv is not None:
                decay = decay + gv.unsqueeze(-1)
            decay = decay.expand(batch, steps, heads, dv, dk).reshape(batch, steps, rows, dk)
        if initial is not None:
            initial = initial.transpose(-1, -2).reshape(initial.shape[0], rows, dk, 1)
        o, final = _scan(
            fn, q, k, v.reshape(batch, steps, rows, 1), beta.reshape(batch, steps, rows), decay,
            scale, qk_l2norm, initial, output_final_state, cu_seqlens,
        )  # fmt: skip
        o = o.reshape(v.shape)
        if final is not None:
            final = final.reshape(final.shape[0], heads, dv, dk).transpose(-1, -2)
    o = o.to(out_dtype)
    if final is None:
        return o, None
    return o, (final.transpose(-1, -2) if v_first else final).contiguous()


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
    fn = _PREFIX + "chunk_delta_rule"
    _kwargs(fn, kwargs, ("chunk_size",))
    _chunk_size(fn, kwargs, (16, 32, 64))
    return _plain_delta(
        fn, q, k, v, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
        cu_seqlens, cu_seqlens_cpu, fused=False,
    )  # fmt: skip


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
    fn = _PREFIX + "fused_recurrent_delta_rule"
    return _plain_delta(
        fn, q, k, v, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel,
        cu_seqlens, None, fused=True,
    )  # fmt: skip


def _plain_delta(
    fn: str, q: Tensor, k: Tensor, v: Tensor, beta: Tensor | None, scale: object,
    initial_state: object, output_final_state: object, use_qk_l2norm_in_kernel: object,
    cu_seqlens: object, cu_seqlens_cpu: object, *, fused: bool,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """DeltaNet's two drop-ins, each checking what its original asserts: ``fused`` is
    fused_recurrent_delta_rule (beta optional, per head or per value channel; a given
    scale > 0), else chunk_delta_rule (beta per head; q, k and v of one dtype)."""
    q, k, v = _check_qkv(fn, q, k, v)
    if not fused and not q.dtype == k.dtype == v.dtype:
        raise TypeError(
            f"{fn}: expected q, k and v of one dtype, as the original asserts, but got q "
            f"{q.dtype}, k {k.dtype} and v {v.dtype}"
        )
    if beta is None and fused:
        beta = torch.ones(v.shape[:3], dtype=q.dtype, device=q.device)
    beta = _check_beta(fn, beta, v, fused)
    factor = _scale(fn, scale, q.shape[-1])
    if fused and scale is not None and not factor > 0:
        raise ValueError(
            f"{fn}: expected scale > 0 (or None: K ** -0.5), as the original asserts, but "
            f"got {scale!r}"
        )
    final = check_flag(fn, "output_final_state", output_final_state)
    l2norm = check_flag(fn, "use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    cu, n = _check_varlen(fn, q, cu_seqlens, cu_seqlens_cpu)
    h0 = _check_initial(fn, initial_state, n, v, q.shape[-1], False, cu is not None)
    _same_device(fn, [("q", q), ("k", k), ("v", v), ("beta", beta), ("initial_state", h0)])
    return _delta(
        fn, q, k, v, beta, scale=factor, initial_state=h0, output_final_state=final,
        qk_l2norm=l2norm, cu_seqlens=cu, v_first=False, out_dtype=q.dtype,
    )  # fmt: skip


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
    fn = _PREFIX + "chunk_gated_delta_rule"
    _kwargs(fn, kwargs, ("use_gate_in_kernel", "A_log", "dt_bias", "chunk_size",
                         "transpose_state_layout"))  # fmt: skip
    v_first = _state_v_first(fn, state_v_first, kwargs)
    _chunk_size(fn, kwargs, (16, 32, 64))
    _no_cp(fn, cp_context)
    if chunk_indices is not None and not isinstance(chunk_indices, Tensor):
        raise TypeError(
            f"{fn}: expected chunk_indices to be a Tensor or None, but got "
            f"{describe(chunk_indices)}"
        )
    use_gate = check_flag(fn, "use_gate_in_kernel", kwargs.get("use_gate_in_kernel", False))
    return _gated(
        fn, q, k, v, g, None, None, beta, scale, initial_state, output_final_state,
        use_qk_l2norm_in_kernel, use_gate, kwargs.get("A_log"), kwargs.get("dt_bias"),
        use_beta_sigmoid_in_kernel, allow_neg_eigval, v_first, cu_seqlens, cu_seqlens_cpu,
        per_channel=False, out="q",
    )  # fmt: skip


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
    fn = _PREFIX + "fused_recurrent_gated_delta_rule"
    _kwargs(fn, kwargs, ("transpose_state_layout",))
    v_first = _state_v_first(fn, state_v_first, kwargs)
    use_gate = check_flag(fn, "use_gate_in_kernel", use_gate_in_kernel)
    return _gated(
        fn, q, k, v, g, gk, gv, beta, scale, initial_state, output_final_state,
        use_qk_l2norm_in_kernel, use_gate, A_log, dt_bias, use_beta_sigmoid_in_kernel,
        allow_neg_eigval, v_first, cu_seqlens, None, per_channel=True, out="v",
    )  # fmt: skip


def _beta_options(
    fn: str, use_beta_sigmoid_in_kernel: object, allow_neg_eigval: object
) -> tuple[bool, bool]:
    sigmoid = check_flag(fn, "use_beta_sigmoid_in_kernel", use_beta_sigmoid_in_kernel)
    neg = check_flag(fn, "allow_neg_eigval", allow_neg_eigval)
    if neg and not sigmoid:
        raise ValueError(
            f"{fn}: allow_neg_eigval=True doubles sigmoid(beta): expected it with "
            "use_beta_sigmoid_in_kernel=True, but got use_beta_sigmoid_in_kernel=False"
        )
    return sigmoid, neg


def _gated(
    fn: str, q: Tensor, k: Tensor, v: Tensor, g: object, gk: object, gv: object,
    beta: object, scale: object, initial_state: object, output_final_state: object,
    use_qk_l2norm_in_kernel: object, use_gate: bool, a_log: object, dt_bias: object,
    use_beta_sigmoid_in_kernel: object, allow_neg_eigval: object, v_first: bool,
    cu_seqlens: object, cu_seqlens_cpu: object, *, per_channel: bool, out: str,
) -> tuple[Tensor, Tensor | None]:  # fmt: skip
    """The gated delta rule's two drop-ins: ``per_channel`` is the fused recurrent one
    (optional g, gk, gv; beta optional and per channel allowed)."""
    q, k, v = _check_qkv(fn, q, k, v)
    batch, steps, heads, dv = v.shape
    dk = q.shape[-1]
    if per_channel and beta is None:
        beta = torch.ones(v.shape[:3], dtype=q.dtype, device=q.device)
    beta = _check_beta(fn, beta, v, per_channel)
    if g is not None or not per_channel:
        g = _check_gate(fn, "g", g, (batch, steps, heads), "(B, T, HV)")
    if gk is not None:
        gk = _check_gate(fn, "gk", gk, (batch, steps, heads, dk), "(B, T, HV, K)")
    if gv is not None:
        gv = _check_gate(fn, "gv", gv, (batch, steps, heads, dv), "(B, T, HV, V)")
    a, bias = None, None
    if use_gate:
        if a_log is None:
            raise ValueError(
                f"{fn}: use_gate_in_kernel=True computes g = -exp(A_log) * softplus(g + "
                "dt_bias): expected A_log (HV,), but got None"
            )
        if g is None:
            raise ValueError(
                f"{fn}: use_gate_in_kernel=True computes g from its raw input: expected g "
                "(B, T, HV), but got None"
            )
        a = _check_param(fn, "A_log", a_log, heads, "HV")
        if dt_bias is not None:
            bias = _check_param(fn, "dt_bias", dt_bias, heads, "HV")
    sigmoid, neg = _beta_options(fn, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    factor = _scale(fn, scale, dk)
    final = check_flag(fn, "output_final_state", output_final_state)
    l2norm = check_flag(fn, "use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    cu, n = _check_varlen(fn, q, cu_seqlens, cu_seqlens_cpu)
    h0 = _check_initial(fn, initial_state, n, v, dk, v_first, cu is not None)
    gates: list[tuple[str, Tensor | None]] = [
        ("g", g), ("gk", gk), ("gv", gv), ("A_log", a), ("dt_bias", bias)
    ]  # fmt: skip
    _same_device(fn, [("q", q), ("k", k), ("v", v), ("beta", beta), *gates, ("initial_state", h0)])
    cd = _compute_dtype(v)
    if use_gate:
        assert isinstance(g, Tensor) and a is not None
        g = _gdn_gate(g, a, bias, cd)
    if sigmoid:
        beta = _beta_sigmoid(beta, neg, cd)
    return _delta(
        fn, q, k, v, beta, g=g, gk=gk, gv=gv, scale=factor, initial_state=h0,
        output_final_state=final, qk_l2norm=l2norm, cu_seqlens=cu, v_first=v_first,
        out_dtype=q.dtype if out == "q" else v.dtype,
    )  # fmt: skip


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
    fn = _PREFIX + "chunk_kda"
    _kwargs(fn, kwargs, ("A_log", "dt_bias", "chunk_size", "transpose_state_layout"))
    v_first = _state_v_first(fn, state_v_first, kwargs)
    chunk = _chunk_size(fn, kwargs, (32, 64))
    _no_cp(fn, cp_context)
    _graph(fn, use_graph, max_num_seqs, cu_seqlens)
    use_gate = check_flag(fn, "use_gate_in_kernel", use_gate_in_kernel)
    safe = check_flag(fn, "safe_gate", safe_gate)
    check_flag(fn, "disable_recompute", disable_recompute)
    states = check_flag(fn, "return_intermediate_states", return_intermediate_states)
    bound = None if lower_bound is None else _real(fn, "lower_bound or None", lower_bound)
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
    return _kda(
        fn, q, k, v, g, beta, a_log, dt_bias, scale, initial_state, output_final_state,
        use_qk_l2norm_in_kernel, use_gate, use_beta_sigmoid_in_kernel, allow_neg_eigval,
        bound, v_first, cu_seqlens, cu_seqlens_cpu, per_channel=False, out="q",
        states=chunk if states else None,
    )  # fmt: skip


def _graph(fn: str, use_graph: object, max_num_seqs: object, cu_seqlens: object) -> None:
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
    fn = _PREFIX + "fused_recurrent_kda"
    _kwargs(fn, kwargs, ("transpose_state_layout",))
    v_first = _state_v_first(fn, state_v_first, kwargs)
    use_gate = check_flag(fn, "use_gate_in_kernel", use_gate_in_kernel)
    bound = None if lower_bound is None else _real(fn, "lower_bound or None", lower_bound)
    a_log, bias = (A_log, dt_bias) if use_gate else (None, None)
    result = _kda(
        fn, q, k, v, g, beta, a_log, bias, scale, initial_state, output_final_state,
        use_qk_l2norm_in_kernel, use_gate, use_beta_sigmoid_in_kernel, allow_neg_eigval,
        bound, v_first, cu_seqlens, None, per_channel=True, out="v", states=None,
    )  # fmt: skip
    return result[0], result[1]


def _kda(
    fn: str, q: Tensor, k: Tensor, v: Tensor, g: object, beta: object, a_log: object,
    dt_bias: object, scale: object, initial_state: object, output_final_state: object,
    use_qk_l2norm_in_kernel: object, use_gate: bool, use_beta_sigmoid_in_kernel: object,
    allow_neg_eigval: object, bound: float | None, v_first: bool, cu_seqlens: object,
    cu_seqlens_cpu: object, *, per_channel: bool, out: str, states: int | None,
) -> tuple[Tensor, Tensor | None] | tuple[Tensor, Tensor | None, Tensor]:  # fmt: skip
    """KDA's two drop-ins; ``states``: the chunk size of chunk_kda's intermediate
    states, when asked for."""
    q, k, v = _check_qkv(fn, q, k, v)
    batch, steps, heads, _ = v.shape
    dk = q.shape[-1]
    beta_t = _check_beta(fn, beta, v, per_channel)
    g_t = _check_gate(fn, "g", g, (batch, steps, heads, dk), "(B, T, HV, K)")
    a, bias = None, None
    if use_gate:
        if a_log is None and bound is None:
            raise ValueError(
                f"{fn}: use_gate_in_kernel=True computes g = -exp(A_log) * softplus(g + "
                "dt_bias): expected A_log (HV elements), or lower_bound for "
                "lower_bound * sigmoid(g + dt_bias), but got neither"
            )
        if a_log is not None:
            a = _check_param(fn, "A_log", a_log, heads, "HV")
        if dt_bias is not None:
            bias = _check_param(fn, "dt_bias", dt_bias, heads * dk, "HV * K")
    sigmoid, neg = _beta_options(fn, use_beta_sigmoid_in_kernel, allow_neg_eigval)
    factor = _scale(fn, scale, dk)
    final = check_flag(fn, "output_final_state", output_final_state)
    l2norm = check_flag(fn, "use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel)
    cu, n = _check_varlen(fn, q, cu_seqlens, cu_seqlens_cpu)
    h0 = _check_initial(fn, initial_state, n, v, dk, v_first, cu is not None)
    _same_device(fn, [("q", q), ("k", k), ("v", v), ("g", g_t), ("beta", beta_t),
                      ("A_log", a), ("dt_bias", bias), ("initial_state", h0)])  # fmt: skip
    cd = _compute_dtype(v)
    if use_gate:
        g_t = _kda_gate(g_t, a, bias, bound, cd)
    if sigmoid:
        beta_t = _beta_sigmoid(beta_t, neg, cd)
    out_dtype = q.dtype if out == "q" else v.dtype
    if states is not None:
        return _chunk_states(
            fn, q, k, v, beta_t, g_t, factor, h0, final, l2norm, cu, v_first, out_dtype, states
        )
    return _delta(
        fn, q, k, v, beta_t, gk=g_t, scale=factor, initial_state=h0, output_final_state=final,
        qk_l2norm=l2norm, cu_seqlens=cu, v_first=v_first, out_dtype=out_dtype,
    )  # fmt: skip


def _chunk_states(
    fn: str, q: Tensor, k: Tensor, v: Tensor, beta: Tensor, g: Tensor, scale: float,
    initial_state: Tensor | None, output_final_state: bool, qk_l2norm: bool,
    cu_seqlens: Tensor | None, v_first: bool, out_dtype: torch.dtype, chunk: int,
) -> tuple[Tensor, Tensor | None, Tensor]:  # fmt: skip
    """chunk_kda with ``return_intermediate_states``: the scan a chunk at a time along
    each sequence, keeping the state that enters each chunk, as the original's ``h``."""
    batch, steps, heads, dv = v.shape
    dk = q.shape[-1]
    initial = initial_state
    if initial is not None and v_first:
        initial = initial.transpose(-1, -2)
    if cu_seqlens is None:
        spans = [(0, steps)]
        starts = [initial]
    else:
        cu = cu_seqlens.tolist()
        spans = list(pairwise(cu))
        starts = [None if initial is None else initial[i : i + 1] for i in range(len(spans))]
    rows = batch if cu_seqlens is None else 1
    zeros = torch.zeros(rows, heads, dk, dv, dtype=_compute_dtype(v), device=v.device)
    outs, finals, entering = [], [], []
    for (lo, hi), start in zip(spans, starts, strict=True):
        state = zeros if start is None else start
        for t in range(lo, hi, chunk):
            part = slice(t, min(t + chunk, hi))
            entering.append(state)
            o, last = _scan(
                fn, q[:, part], k[:, part], v[:, part], beta[:, part], g[:, part], scale,
                qk_l2norm, state, True, None,
            )  # fmt: skip
            assert last is not None
            outs.append(o)
            state = last
        finals.append(state)
    o = torch.cat(outs, 1) if outs else torch.empty_like(v)
    h = (torch.stack(entering, 1) if entering else zeros.new_empty(rows, 0, heads, dk, dv)).to(
        k.dtype
    )
    final = torch.cat(finals, 0).to(zeros.dtype) if output_final_state else None
    if v_first:
        h = h.transpose(-1, -2)
        final = None if final is None else final.transpose(-1, -2)
    return (
        o.to(out_dtype),
        None if final is None else final.contiguous(),
        h.contiguous(),
    )
