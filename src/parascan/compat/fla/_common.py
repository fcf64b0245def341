"""What the drop-ins of :mod:`parascan.compat.fla` share: their names in errors, the
checks of the options that several originals take alike (each worded once, so that the
drop-ins raise alike), and, for the delta-rule families, the options as one
:class:`DeltaOptions`, their checked form :class:`DeltaScan` and the scan itself
(:func:`run_delta`); for the linear-attention and generalized-delta-rule families, the
checked options :class:`StateScan` (:func:`check_state_scan`) and the scans
(:func:`run_linear`, :func:`run_dplr`)."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import pairwise
from typing import Literal

import torch
from torch import Tensor

from parascan._core import (
    check_cu_seqlens,
    check_flag,
    check_same_device,
    check_shape,
    check_tensor,
    describe,
    finite_float,
)
from parascan.compat._checks import errors_as, is_integer_tensor
from parascan.delta_rule import delta_rule_scan
from parascan.dplr import dplr_delta_rule_scan
from parascan.linear_attention import linear_attention_scan

PREFIX = "parascan.compat.fla."
"""The drop-ins' names in errors: ``parascan.compat.fla.<function>`` (the package
exports every drop-in), whichever module defines them."""

Opt = Tensor | None


# --- the options a drop-in passes on ------------------------------------------------


@dataclass(frozen=True)
class DeltaOptions:
    """A delta-rule drop-in's name, its kind and its options as its user passed them,
    for its family's helper: :meth:`check` checks those that every family takes alike
    (after the family has checked its operands, as the originals do); the in-kernel
    gate's (``use_gate_in_kernel``, ``A_log``, ``dt_bias``, ``lower_bound``) are the
    family's to check. Fields not given are the originals' defaults."""

    fn: str
    """The drop-in's name in errors (``PREFIX + function``)."""
    fused: bool
    """A ``fused_recurrent_*`` drop-in, whose original takes a ``beta`` per head or per
    value channel ``(B, T, HV, V)``; a ``chunk_*`` one's takes it per head only."""
    out: Literal["q", "v"]
    """Whose dtype ``o`` has, as the original returns it."""
    scale: object = None
    initial_state: object = None
    output_final_state: object = False
    use_qk_l2norm_in_kernel: object = False
    use_beta_sigmoid_in_kernel: object = False
    allow_neg_eigval: object = False
    use_gate_in_kernel: bool = False
    """Checked by the drop-in (it decides which of its arguments are read)."""
    A_log: object = None
    dt_bias: object = None
    lower_bound: float | None = None
    """Checked by the drop-in (KDA's; a finite number or None)."""
    state_v_first: bool = False
    """Checked by the drop-in (with the deprecated ``transpose_state_layout``)."""
    cu_seqlens: object = None
    cu_seqlens_cpu: object = None

    def check(self, q: Tensor, v: Tensor) -> DeltaScan:
        """The shared options checked against the checked ``q`` and ``v``, in the
        originals' order: beta's options, ``scale``, the flags, ``cu_seqlens`` (and its
        CPU copy), ``initial_state``."""
        fn = self.fn
        sigmoid, neg = beta_options(fn, self.use_beta_sigmoid_in_kernel, self.allow_neg_eigval)
        dk = q.shape[-1]
        factor = check_scale(fn, self.scale, dk)
        final = check_flag(fn, "output_final_state", self.output_final_state)
        l2norm = check_flag(fn, "use_qk_l2norm_in_kernel", self.use_qk_l2norm_in_kernel)
        cu, n = check_varlen(fn, q, self.cu_seqlens, self.cu_seqlens_cpu)
        v_first, packed = self.state_v_first, cu is not None
        initial = check_initial(fn, self.initial_state, n, v, dk, v_first, packed)
        return DeltaScan(
            fn=fn,
            scale=factor,
            initial_state=initial,
            output_final_state=final,
            qk_l2norm=l2norm,
            cu_seqlens=cu,
            v_first=v_first,
            beta_sigmoid=sigmoid,
            neg_eigval=neg,
            out_dtype=q.dtype if self.out == "q" else v.dtype,
            compute_dtype=compute_dtype(v),
        )


@dataclass(frozen=True)
class DeltaScan:
    """:class:`DeltaOptions` checked: what :func:`run_delta` scans with."""

    fn: str
    scale: float
    initial_state: Tensor | None
    """In the user's layout: ``(N, HV, K, V)``, or ``(N, HV, V, K)`` with ``v_first``."""
    output_final_state: bool
    qk_l2norm: bool
    cu_seqlens: Tensor | None
    v_first: bool
    beta_sigmoid: bool
    neg_eigval: bool
    out_dtype: torch.dtype
    compute_dtype: torch.dtype
    """ps.delta_rule_scan's state dtype, in which the in-kernel gates are computed."""

    def beta(self, beta: Tensor) -> Tensor:
        """``beta``, or ``sigmoid(beta)`` (doubled with ``allow_neg_eigval``: eigenvalues
        of the transition ``I - beta k k^T`` in (-1, 1]) with
        ``use_beta_sigmoid_in_kernel``."""
        if not self.beta_sigmoid:
            return beta
        out = torch.sigmoid(beta.to(self.compute_dtype))
        return out * 2.0 if self.neg_eigval else out


# --- checks -------------------------------------------------------------------------


def compute_dtype(v: Tensor) -> torch.dtype:
    """ps.delta_rule_scan's state dtype, in which the in-kernel gates are computed."""
    return torch.float64 if v.dtype == torch.float64 else torch.float32


def real(fn: str, name: str, value: object) -> float:
    number = finite_float(value)
    if number is not None:
        return number
    raise TypeError(f"{fn}: expected {name} to be a finite number, but got {describe(value)}")


def check_scale(fn: str, scale: object, dk: int) -> float:
    """``scale``, defaulting to ``K ** -0.5`` as the originals do."""
    if scale is None:
        return dk**-0.5 if dk else 1.0  # K == 0: delta_rule_scan raises, naming K
    return real(fn, "scale or None", scale)


def check_kwargs(fn: str, kwargs: Mapping[str, object], reads: tuple[str, ...]) -> None:
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


def check_chunk_size(fn: str, kwargs: Mapping[str, object], sizes: tuple[int, ...]) -> int:
    """The original's ``chunk_size`` option, checked as it checks it; the results do not
    depend on it (only chunk_kda's intermediate states do)."""
    size = kwargs.get("chunk_size", 64)
    if not isinstance(size, int) or isinstance(size, bool) or size not in sizes:
        raise ValueError(
            f"{fn}: expected chunk_size to be one of {', '.join(map(str, sizes))}, but got "
            f"{describe(size)}"
        )
    return size


def check_state_v_first(fn: str, state_v_first: object, kwargs: Mapping[str, object]) -> bool:
    """``state_v_first``, or its deprecated name ``transpose_state_layout`` (which
    warns, as the originals do). Call it from the drop-in itself: the warning points
    at the drop-in's caller."""
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


def check_no_cp(fn: str, cp_context: object) -> None:
    if cp_context is not None:
        raise ValueError(
            f"{fn}: context parallelism is not supported: expected cp_context=None, but got "
            f"{describe(cp_context)}"
        )


def check_qkv(fn: str, q: object, k: object, v: object) -> tuple[Tensor, Tensor, Tensor]:
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


def check_beta(fn: str, beta: object, v: Tensor, per_channel: bool) -> Tensor:
    """beta (B, T, HV), or (B, T, HV, V) where the original takes a per-channel beta."""
    heads = tuple(v.shape[:3])
    beta = check_tensor(fn, "beta", beta)
    if tuple(beta.shape) == heads or (per_channel and beta.shape == v.shape):
        return beta
    what = f" or (B, T, HV, V) = {tuple(v.shape)}" if per_channel else ""
    raise ValueError(
        f"{fn}: expected beta of shape (B, T, HV) = {heads}{what}, but got {describe(beta)}"
    )


def check_gate(fn: str, name: str, g: object, shape: tuple[int, ...], what: str) -> Tensor:
    g = check_tensor(fn, name, g)
    check_shape(fn, name, g, shape, what)
    return g


def check_param(fn: str, name: str, value: object, count: int, what: str) -> Tensor:
    """A_log or dt_bias: ``count`` elements in any shape (the kernels read them flat),
    returned flat."""
    t = check_tensor(fn, name, value)
    if t.numel() != count:
        raise ValueError(
            f"{fn}: expected {name} of {what} = {count} elements, but got {describe(t)}"
        )
    return t.reshape(count)


def check_varlen(
    fn: str, q: Tensor, cu_seqlens: object, cu_seqlens_cpu: object = None, query: str = "q"
) -> tuple[Tensor | None, int]:
    """``cu_seqlens`` checked against q's T (and ``cu_seqlens_cpu``, the originals' CPU
    copy of it, against ``cu_seqlens``); returns it and N, the number of states.
    ``query``: q's name in the drop-in (RWKV-7's ``r``)."""
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
            f"expected {query} of shape (1, T, H, K), but got {describe(q)}"
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


def check_initial(
    fn: str, initial_state: object, n: int, v: Tensor, dk: int, v_first: bool, packed: bool,
    heads_name: str = "HV",
) -> Tensor | None:  # fmt: skip
    """``initial_state`` ``(N, HV, K, V)`` (``(N, HV, V, K)`` with ``v_first``), HV named
    ``heads_name`` in the message (H where the original has one value head per q/k
    head)."""
    if initial_state is None:
        return None
    t = check_tensor(fn, "initial_state", initial_state)
    heads, dv = v.shape[2], v.shape[3]
    shape = (n, heads, dv, dk) if v_first else (n, heads, dk, dv)
    what = f"(N, {heads_name}, V, K)" if v_first else f"(N, {heads_name}, K, V)"
    count = "the number of sequences in cu_seqlens" if packed else "the batch"
    check_shape(fn, "initial_state", t, shape, f"{what} (N: {count})")
    return t


def same_device(fn: str, named: list[tuple[str, Tensor | None]]) -> None:
    check_same_device(fn, [(name, t) for name, t in named if t is not None])


def beta_options(
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


# --- the scan -----------------------------------------------------------------------


def scan(
    run: DeltaScan,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    g: Tensor | None,
    initial: Tensor | None,
    *,
    final: bool,
    cu_seqlens: Tensor | None,
) -> tuple[Tensor, Tensor | None]:
    """ps.delta_rule_scan with ``run``'s scale and l2norm, ``initial`` in its ``(K, V)``
    layout; its errors (K = 0) under the drop-in's name."""
    with errors_as(run.fn, "parascan.delta_rule_scan", {"initial": "initial_state"}):
        result = delta_rule_scan(
            q, k, v, beta, g=g, scale=run.scale, qk_l2norm=run.qk_l2norm, initial=initial,
            return_final=final, cu_seqlens=cu_seqlens,
        )  # fmt: skip
    return result if isinstance(result, tuple) else (result, None)


def run_delta(
    run: DeltaScan,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    *,
    g: Opt = None,
    gk: Opt = None,
    gv: Opt = None,
) -> tuple[Tensor, Tensor | None]:
    """The delta rule on checked operands: ``g`` (B, T, HV), ``gk`` (B, T, HV, K) and
    ``gv`` (B, T, HV, V) log decays in turn, ``beta`` (B, T, HV) or (B, T, HV, V);
    returns ``(o, final_state)`` as the drop-ins do."""
    initial = run.initial_state
    if initial is not None and run.v_first:
        initial = initial.transpose(-1, -2)  # (K, V), as ps.delta_rule_scan takes it
    final_state = run.output_final_state
    if beta.dim() == 3 and gv is None:
        decay = gk if g is None else (g if gk is None else gk + g.unsqueeze(-1))
        o, final = scan(
            run, q, k, v, beta, decay, initial, final=final_state, cu_seqlens=run.cu_seqlens
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
        o, final = scan(
            run, q, k, v.reshape(batch, steps, rows, 1), beta.reshape(batch, steps, rows),
            decay, initial, final=final_state, cu_seqlens=run.cu_seqlens,
        )  # fmt: skip
        o = o.reshape(v.shape)
        if final is not None:
            final = final.reshape(final.shape[0], heads, dv, dk).transpose(-1, -2)
    o = o.to(run.out_dtype)
    if final is None:
        return o, None
    return o, (final.transpose(-1, -2) if run.v_first else final).contiguous()


# --- the linear-attention and generalized-delta-rule families ------------------------
#
# gla, simple_gla, linear_attn, retention, lightning_attn (parascan.linear_attention_scan)
# and generalized_delta_rule, rwkv7 (parascan.dplr_delta_rule_scan): one value head per
# q/k head, as their originals take them; a state (K, V) per sequence and head.


def check_same_heads(
    fn: str, named: list[tuple[str, object]], v: object
) -> tuple[list[Tensor], Tensor]:
    """The key-side operands ``named`` (the first, q or RWKV-7's r, ``(B, T, H, K)``,
    the rest shaped like it) and v ``(B, T, H, V)``, V >= 1, one value head per q/k
    head (the originals index v by q's heads). K = 0 is left to the parascan scan."""
    first, t0 = named[0]
    q = check_tensor(fn, first, t0)
    if q.dim() != 4:
        raise ValueError(f"{fn}: expected {first} of shape (B, T, H, K), but got {describe(q)}")
    out = [q]
    for name, t in named[1:]:
        t = check_tensor(fn, name, t)
        check_shape(fn, name, t, tuple(q.shape), f"(B, T, H, K) like {first}")
        out.append(t)
    v = check_tensor(fn, "v", v)
    if v.dim() != 4 or v.shape[:3] != q.shape[:3]:
        raise ValueError(
            f"{fn}: expected v of shape (B, T, H, V) with (B, T, H) = {tuple(q.shape[:3])} "
            f"(one value head per {first}/k head, as the original), but got {describe(v)}"
        )
    if v.shape[3] < 1:
        raise ValueError(
            f"{fn}: expected v with at least one value channel (V >= 1), but got {describe(v)}"
        )
    return out, v


def check_power_of_two(fn: str, name: str, value: object, least: int = 1) -> int | None:
    """A chunk size: None, or an int power of two >= ``least`` (the originals' tiling:
    checked, and ignored, since the results do not depend on it)."""
    if value is None:
        return None
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= least
    if not ok or value & (value - 1):  # type: ignore[operator]
        raise ValueError(
            f"{fn}: expected {name} to be None or a power of two >= {least}, but got "
            f"{describe(value)}"
        )
    return value  # type: ignore[return-value]


@dataclass(frozen=True)
class StateScan:
    """The checked options of a linear-attention or DPLR drop-in: what
    :func:`run_linear` and :func:`run_dplr` scan with."""

    fn: str
    scale: float
    initial_state: Tensor | None
    """In the user's layout: ``(N, H, K, V)``, or ``(N, H, V, K)`` with ``v_first``."""
    output_final_state: bool
    reverse: bool
    v_first: bool
    cu_seqlens: Tensor | None
    out_dtype: torch.dtype
    """``o``'s dtype, as the original returns it."""
    names: Mapping[str, str]
    """The parascan scan's argument names (whole words in its errors) as the drop-in's
    user knows them: ``initial`` is ``initial_state``, RWKV-7's ``q`` is ``r``."""


def check_state_scan(
    fn: str,
    q: Tensor,
    v: Tensor,
    *,
    out_dtype: torch.dtype,
    scale: object,
    initial_state: object,
    output_final_state: object,
    reverse: object = False,
    v_first: bool = False,
    cu_seqlens: object = None,
    cu_seqlens_cpu: object = None,
    query: str = "q",
) -> StateScan:
    """The options every linear-attention and DPLR drop-in takes, checked against the
    checked q (named ``query``) and v, in the originals' order: ``scale`` (``K ** -0.5``
    by default), the flags, ``cu_seqlens`` (and its CPU copy), ``initial_state``."""
    dk = q.shape[-1]
    factor = check_scale(fn, scale, dk)
    final = check_flag(fn, "output_final_state", output_final_state)
    backward = check_flag(fn, "reverse", reverse)
    cu, n = check_varlen(fn, q, cu_seqlens, cu_seqlens_cpu, query)
    initial = check_initial(fn, initial_state, n, v, dk, v_first, cu is not None, "H")
    names = {"initial": "initial_state", "return_final": "output_final_state"}
    if query != "q":
        names["q"] = query
    return StateScan(
        fn=fn, scale=factor, initial_state=initial, output_final_state=final, reverse=backward,
        v_first=v_first, cu_seqlens=cu, out_dtype=out_dtype, names=names,
    )  # fmt: skip


def _reversal(run: StateScan, steps: int, device: torch.device) -> Tensor | None:
    """The index that reverses each sequence along T (each packed one within its
    offsets); None: the whole of T (a flip)."""
    if run.cu_seqlens is None:
        return None
    index = [t for lo, hi in pairwise(run.cu_seqlens.tolist()) for t in range(hi - 1, lo - 1, -1)]
    return torch.tensor(index, dtype=torch.int64, device=device)


def _along_t(t: Tensor, index: Tensor | None) -> Tensor:
    """``t`` with each sequence reversed along T (dim 1)."""
    return t.flip(1) if index is None else t.index_select(1, index)


def _along_t_opt(t: Opt, index: Tensor | None) -> Opt:
    return None if t is None else _along_t(t, index)


def _state_in(run: StateScan) -> Tensor | None:
    initial = run.initial_state
    return initial.transpose(-1, -2) if initial is not None and run.v_first else initial


def _state_out(run: StateScan, o: Tensor, final: Tensor | None) -> tuple[Tensor, Tensor | None]:
    o = o.to(run.out_dtype)
    if final is None or not run.output_final_state:
        return o, None
    return o, (final.transpose(-1, -2) if run.v_first else final).contiguous()


def run_linear(
    run: StateScan, q: Tensor, k: Tensor, v: Tensor, *, g: Opt = None, gv: Opt = None
) -> tuple[Tensor, Tensor | None]:
    """Linear attention on checked operands with ``run``'s options: ``g`` None, a log
    decay per head ``(B, T, H)`` or per key channel ``(B, T, H, K)``, and ``gv`` one per
    value channel ``(B, T, H, V)`` applied after it; ``reverse`` scans each sequence
    from its end. Returns ``(o, final_state)`` as the drop-ins do."""
    index = _reversal(run, q.shape[1], q.device) if run.reverse else None
    if run.reverse:
        q, k, v = (_along_t(t, index) for t in (q, k, v))
        g, gv = _along_t_opt(g, index), _along_t_opt(gv, index)
    initial = _state_in(run)
    if gv is None:
        o, final = _linear(run, q, k, v, g, initial)
    else:
        # A decay per value channel: the V columns of each state are independent
        # recurrences, so each value channel runs as a value head of its own, (K, 1)
        # state, value heads h * V .. h * V + V - 1 reading q/k head h.
        batch, steps, heads, dv = v.shape
        dk, rows = q.shape[-1], heads * dv
        cd = compute_dtype(v)
        if g is None:
            decay = gv.to(cd).reshape(batch, steps, rows)
        elif g.dim() == 3:
            decay = (g.to(cd).unsqueeze(-1) + gv.to(cd)).reshape(batch, steps, rows)
        else:
            decay = g.to(cd).unsqueeze(-2) + gv.to(cd).unsqueeze(-1)
            decay = decay.reshape(batch, steps, rows, dk)
        if initial is not None:
            initial = initial.transpose(-1, -2).reshape(initial.shape[0], rows, dk, 1)
        o, final = _linear(run, q, k, v.reshape(batch, steps, rows, 1), decay, initial)
        o = o.reshape(v.shape)
        if final is not None:
            final = final.reshape(final.shape[0], heads, dv, dk).transpose(-1, -2)
    if run.reverse:
        o = _along_t(o, index)
    return _state_out(run, o, final)


def _linear(
    run: StateScan, q: Tensor, k: Tensor, v: Tensor, g: Opt, initial: Opt
) -> tuple[Tensor, Tensor | None]:
    """ps.linear_attention_scan, its errors (K = 0) under the drop-in's name."""
    with errors_as(run.fn, "parascan.linear_attention_scan", run.names):
        result = linear_attention_scan(
            q, k, v, g=g, scale=run.scale, initial=initial, return_final=run.output_final_state,
            cu_seqlens=run.cu_seqlens,
        )  # fmt: skip
    return result if isinstance(result, tuple) else (result, None)


def run_dplr(
    run: StateScan, q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, gk: Tensor
) -> tuple[Tensor, Tensor | None]:
    """The generalized delta rule on checked operands with ``run``'s options:
    ``S = (Diag(exp(gk)) + b a^T) S + k v^T``, ``o = scale * S^T q``; ``reverse`` scans
    each sequence from its end. Returns ``(o, final_state)`` as the drop-ins do."""
    index = _reversal(run, q.shape[1], q.device) if run.reverse else None
    if run.reverse:
        q, k, v, a, b, gk = (_along_t(t, index) for t in (q, k, v, a, b, gk))
    with errors_as(run.fn, "parascan.dplr_delta_rule_scan", run.names):
        result = dplr_delta_rule_scan(
            q, k, v, a, b, g=gk, scale=run.scale, initial=_state_in(run),
            return_final=run.output_final_state, cu_seqlens=run.cu_seqlens,
        )  # fmt: skip
    o, final = result if isinstance(result, tuple) else (result, None)
    if run.reverse:
        o = _along_t(o, index)
    return _state_out(run, o, final)
