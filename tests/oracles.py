"""The suite's oracles: every sequential loop the tests compare parascan against.

Each one walks the recurrence (or fold) one step at a time, the way its definition
reads, and is written here independently of parascan: nothing in this file calls
parascan. Call them with float64 / complex128 tensors (``oracle_dtype`` in
conftest.py): they compute in the dtype they are given. The torch-tensor loops are
differentiable by ordinary autograd, so they are the gradient oracles too (and,
through ``torch.func``, the oracles of vmap, jacrev and jvp). The ``python_*`` loops
run on Python numbers, fast enough for sequences of 10^5 steps.
"""

from __future__ import annotations

import cmath
import math
from collections.abc import Callable, Sequence
from itertools import pairwise
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = [
    "causal_conv_loop",
    "delta_rule_loop",
    "dplr_delta_rule_loop",
    "fold",
    "fold_scan",
    "gated_rms_norm_loop",
    "heinsen_loop",
    "linear_attention_loop",
    "linear_loop",
    "log_loop",
    "matmul_fold",
    "matrix_loop",
    "packed_loop",
    "python_linear_loop",
    "python_log_loop",
    "selective_loop",
    "ssd_loop",
]


# --- first-order recurrences ---------------------------------------------------------


def linear_loop(
    gates: torch.Tensor | complex,
    tokens: torch.Tensor,
    dim: int,
    initial: torch.Tensor | complex | None = None,
    reverse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x[t] = gates[t] * x[t-1] + tokens[t] along ``dim``, x[-1] = initial (0 by
    default); reversed, x[t] = gates[t] * x[t+1] + tokens[t]. Inputs broadcast.
    Returns (x, final): final is the last state computed (the initial state when T is 0)."""
    if not isinstance(gates, torch.Tensor):
        gates = torch.tensor(gates, dtype=tokens.dtype, device=tokens.device)
    a, b = torch.broadcast_tensors(gates, tokens)
    a, b = a.movedim(dim, 0), b.movedim(dim, 0)
    steps = b.shape[0]
    zero = torch.zeros_like(b.sum(0))  # the state's shape and the result dtype
    state = zero if initial is None else zero + initial
    out: list[torch.Tensor] = [state] * steps
    a_t, b_t = a.unbind(0), b.unbind(0)  # one backward node each, not T (see _steps)
    for t in reversed(range(steps)) if reverse else range(steps):
        state = a_t[t] * state + b_t[t]
        out[t] = state
    x = torch.stack(out).movedim(0, dim) if steps else (a * b).movedim(0, dim)
    return x, state


def log_loop(
    log_gates: torch.Tensor | float,
    log_tokens: torch.Tensor,
    dim: int,
    initial: torch.Tensor | float | None = None,
    reverse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """h[t] = logaddexp(log_gates[t] + h[t-1], log_tokens[t]) along ``dim``,
    h[-1] = initial (-inf, log 0, by default), with torch.logaddexp (real inputs).
    Returns (h, final). Its gradients are NaN where a step adds -inf to -inf: there,
    compare exp(h) with ``linear_loop`` of the exponentials instead."""
    if not isinstance(log_gates, torch.Tensor):
        log_gates = torch.tensor(log_gates, dtype=log_tokens.dtype, device=log_tokens.device)
    a, b = torch.broadcast_tensors(log_gates, log_tokens)
    a, b = a.movedim(dim, 0), b.movedim(dim, 0)
    steps = b.shape[0]
    empty = torch.full_like(b.sum(0), -math.inf)
    state = empty if initial is None else torch.zeros_like(empty) + initial
    out: list[torch.Tensor] = [state] * steps
    a_t, b_t = a.unbind(0), b.unbind(0)
    for t in reversed(range(steps)) if reverse else range(steps):
        state = torch.logaddexp(a_t[t] + state, b_t[t])
        out[t] = state
    h = torch.stack(out).movedim(0, dim) if steps else (a + b).movedim(0, dim)
    return h, state


def packed_loop(
    loop: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    gates: torch.Tensor,
    tokens: torch.Tensor,
    dim: int,
    cu_seqlens: Sequence[int],
    initials: Sequence[torch.Tensor] | None = None,
    reverse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed sequences: each ``cu_seqlens[s] .. cu_seqlens[s+1] - 1`` along ``dim``
    scanned alone by ``loop`` (linear_loop or log_loop) from ``initials[s]`` (a state:
    the shape without ``dim``). Returns (x, the final states stacked along a new dim 0)."""
    a, b = torch.broadcast_tensors(gates, tokens)
    pieces, finals = [], []
    for s in range(len(cu_seqlens) - 1):
        lo, hi = cu_seqlens[s], cu_seqlens[s + 1]
        h = None if initials is None else initials[s]
        x, final = loop(a.narrow(dim, lo, hi - lo), b.narrow(dim, lo, hi - lo), dim, h, reverse)
        pieces.append(x)
        finals.append(final)
    return torch.cat(pieces, dim), torch.stack(finals)


def python_linear_loop(
    gates: Sequence[complex], tokens: Sequence[complex], initial: complex, reverse: bool
) -> list[complex]:
    """``linear_loop`` of one row, in Python floats (float64) or complex numbers
    (complex128)."""
    h = initial
    out = [h] * len(gates)
    for t in range(len(gates) - 1, -1, -1) if reverse else range(len(gates)):
        h = gates[t] * h + tokens[t]
        out[t] = h
    return out


def python_log_loop(
    log_gates: Sequence[complex], log_tokens: Sequence[complex], initial: complex, reverse: bool
) -> list[complex]:
    """``log_loop`` of one row in Python complex numbers (real inputs give a zero
    imaginary part); logaddexp written out: max + log(1 + exp(min - max))."""
    h = initial
    out = [0j] * len(log_gates)
    for t in range(len(log_gates) - 1, -1, -1) if reverse else range(len(log_gates)):
        u, v = log_gates[t] + h, log_tokens[t]
        hi, lo = (u, v) if u.real >= v.real else (v, u)
        h = hi if lo.real == -math.inf else hi + cmath.log(1 + cmath.exp(lo - hi))
        out[t] = h
    return out


def heinsen_loop(coeffs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """x[0] = values[0], x[t] = coeffs[t-1] * x[t-1] + values[t] along the last dim:
    the sequence of Heinsen's paper, x0 included (one longer than ``coeffs``)."""
    x = [values[..., 0]]
    for t in range(coeffs.shape[-1]):
        x.append(coeffs[..., t] * x[-1] + values[..., t + 1])
    return torch.stack(x, -1)


# --- matrix recurrences ----------------------------------------------------------------


def matrix_loop(
    weights: torch.Tensor,
    biases: torch.Tensor,
    initial: torch.Tensor | None = None,
    reverse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x[t] = weights[t] @ x[t-1] + biases[t] with weights (*batch, T, d, d), biases
    (*batch, T, d), initial (*batch, d), batch dims broadcast; reversed, x[t+1] on
    the right. Returns (x, final) with x of the broadcast batch shape."""
    steps, d = biases.shape[-2], biases.shape[-1]
    batch = torch.broadcast_shapes(
        weights.shape[:-3], biases.shape[:-2], () if initial is None else initial.shape[:-1]
    )
    dtype = torch.promote_types(weights.dtype, biases.dtype)
    state = torch.zeros((*batch, d), dtype=dtype, device=biases.device)
    if initial is not None:
        state = state + initial
    out: list[torch.Tensor] = [state] * steps
    w_t, b_t = weights.unbind(-3), biases.unbind(-2)
    for t in range(steps - 1, -1, -1) if reverse else range(steps):
        state = (w_t[t] @ state.unsqueeze(-1)).squeeze(-1) + b_t[t]
        out[t] = state
    if not steps:
        return torch.zeros((*batch, 0, d), dtype=dtype, device=biases.device), state
    return torch.stack(out, -2).expand(*batch, steps, d), state.expand(*batch, d)


# --- folds of any associative combine function ----------------------------------------


def fold_scan(f: Callable[[Any, Any], Any], elems: Any, dim: int, reverse: bool = False) -> Any:
    """out[t] = f(out[t-1], e[t]) (reversed: f(out[t+1], e[t])), one element at a time,
    over a pytree of tensors whose leaves share their length along ``dim``."""
    leaves, spec = pytree.tree_flatten(elems)
    n = leaves[0].shape[dim]
    if n == 0:
        return elems
    steps = _steps(leaves, dim)
    out: list[list[torch.Tensor]] = [[] for _ in range(n)]
    acc = None
    for t in range(n - 1, -1, -1) if reverse else range(n):
        e = pytree.tree_unflatten(steps[t], spec)
        acc = e if acc is None else f(acc, e)
        out[t] = pytree.tree_leaves(acc)
    return pytree.tree_unflatten([torch.cat(xs, dim) for xs in zip(*out, strict=True)], spec)


def fold(f: Callable[[Any, Any], Any], elems: Any, dim: int) -> Any:
    """f(...f(f(e[0], e[1]), e[2])..., e[T-1]), with ``dim`` removed (T >= 1)."""
    leaves, spec = pytree.tree_flatten(elems)
    steps = _steps(leaves, dim)
    acc = pytree.tree_unflatten(steps[0], spec)
    for t in range(1, len(steps)):
        acc = f(acc, pytree.tree_unflatten(steps[t], spec))
    return pytree.tree_unflatten([x.squeeze(dim) for x in pytree.tree_leaves(acc)], spec)


def _steps(leaves: list[torch.Tensor], dim: int) -> list[list[torch.Tensor]]:
    """The leaves cut into their T elements along ``dim`` (size 1 kept), all at once.
    One split per leaf, not one narrow per step: the backward of each narrow would
    write a full-size tensor of zeros, T of them, which is O(T^2)."""
    per_leaf = [x.split(1, dim) for x in leaves]
    return [list(parts) for parts in zip(*per_leaf, strict=True)]


def matmul_fold(x: torch.Tensor, dim: int) -> torch.Tensor:
    """x[0] @ x[1] @ ... along ``dim``, one product at a time, in float64."""
    matrices = x.double().movedim(dim, 0).unbind(0)
    acc = matrices[0]
    for m in matrices[1:]:
        acc = acc @ m
    return acc


# --- state-space scans -------------------------------------------------------------------


def selective_loop(
    u: torch.Tensor,
    delta: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    delta_bias: torch.Tensor | None = None,
    delta_softplus: bool = False,
    initial: torch.Tensor | None = None,
    return_states: bool = False,
) -> Any:
    """Mamba-1's selective scan, one step at a time, as API.md writes it::

        dt = delta + delta_bias, then log1p(exp(.)) where <= 20 if delta_softplus
        h  = exp(dt A) h + dt u B[t];  y = sum_n C[t] h;  out = (y + D u) silu(z)

    u, delta, z (batch, dim, L); A (dim, N); ``B``/``C``: (dim, N), (batch, N, L) or
    (batch, G, N, L), channel d reading group d // (dim / G); D, delta_bias (dim,);
    initial (batch, dim, N). Complex A makes the state complex and ``y = 2 Re(sum_n C
    h)``. Computes in the dtype it is given. Returns (out, last state), and with
    ``return_states`` the states too, (batch, dim, L + 1, N): the initial one, then the
    state after each step (the one entering step t is at t: a checkpoint every K steps
    is ``states[:, :, 0:L:K]``)."""
    batch, dim, length = u.shape
    n = A.shape[-1]
    state = A.dtype if A.is_complex() else u.dtype

    def per_step(m: torch.Tensor) -> list[torch.Tensor]:
        """B or C at each step as every (batch, channel) reads it: (batch or 1, dim, N).
        One unbind, not one index per step (whose backwards are O(L^2): see _steps)."""
        if m.dim() == 2:
            return [m.unsqueeze(0)] * length
        if m.dim() == 3:
            m = m.unsqueeze(1)
        groups = m.shape[1]
        return list(m.repeat_interleave(dim // groups, dim=1).unbind(-1))

    dt = delta if delta_bias is None else delta + delta_bias[:, None]
    if delta_softplus:  # clamped inside: exp of the unused branch would be inf (NaN grads)
        dt = torch.where(dt > 20, dt, torch.log1p(torch.exp(dt.clamp(max=20))))
    h = torch.zeros(batch, dim, n, dtype=state) if initial is None else initial.to(state)
    bs, cs = per_step(B), per_step(C)
    dts, us = dt.unbind(-1), u.unbind(-1)
    ys, states = [], [h]
    for t in range(length):
        h = torch.exp(dts[t][..., None] * A) * h + (dts[t] * us[t])[..., None] * bs[t]
        y = (cs[t] * h).sum(-1)
        ys.append(2 * y.real if y.is_complex() else y)
        states.append(h)
    out = torch.stack(ys, dim=-1) if ys else u * 0  # in the graph of u even without steps
    if D is not None:
        out = out + D[:, None] * u
    if z is not None:
        out = out * z * torch.sigmoid(z)
    if return_states:
        return out, h, torch.stack(states, 2)
    return out, h


def ssd_loop(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor | None = None,
    z: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    initial: torch.Tensor | None = None,
    cu_seqlens: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-2's SSD scan, one step and one head at a time, in the dtype it is given:
    x, z (batch, L, heads, headdim); dt (batch, L, heads); A, dt_bias (heads,); B, C
    (batch, L, groups, N), head h reading group h // (heads // groups); D (heads,
    headdim) or (heads,); initial (states, heads, headdim, N)::

        dt'  = dt + dt_bias, then log1p(exp(.)) where <= 20 if dt_softplus, then
               clamped to dt_limit unless it is (0, inf)
        h    = exp(dt' A) h + dt' x (outer) B;  y = h @ C + D x;  out = y * silu(z)

    ``cu_seqlens`` (a list of offsets, batch 1): the state restarts at each offset
    from that sequence's row of ``initial`` (zeros by default). Returns (out, the
    final states: one per batch row, or one per packed sequence)."""
    batch, length, heads, headdim = x.shape
    groups, n = B.shape[2], B.shape[3]
    step = dt if dt_bias is None else dt + dt_bias
    if dt_softplus:  # clamped inside: exp of the unused branch would be inf (NaN grads)
        step = torch.where(step <= 20, torch.log1p(torch.exp(step.clamp(max=20))), step)
    if tuple(dt_limit) != (0.0, math.inf):
        step = torch.clamp(step, dt_limit[0], dt_limit[1])
    bounds = [0, length] if cu_seqlens is None else list(cu_seqlens)
    b_heads = B.repeat_interleave(heads // groups, dim=2)  # head h reads group h // (H / G)
    c_heads = C.repeat_interleave(heads // groups, dim=2)
    # each input's steps cut at once (one backward node each, not L: see _steps)
    steps, xs, bs, cs = step.unbind(1), x.unbind(1), b_heads.unbind(1), c_heads.unbind(1)
    ys: list[torch.Tensor] = []
    finals = []
    for s in range(len(bounds) - 1):
        rows = slice(None) if cu_seqlens is None else slice(s, s + 1)
        zero = torch.zeros(x.shape[0], heads, headdim, n, dtype=x.dtype)
        state = zero if initial is None else initial[rows]
        for t in range(bounds[s], bounds[s + 1]):
            decay = torch.exp(steps[t] * A)[:, :, None, None]
            inp = (steps[t][:, :, None] * xs[t])[..., None] * bs[t][:, :, None, :]
            state = decay * state + inp
            ys.append((state * cs[t][:, :, None, :]).sum(-1))
        finals.append(state)
    out = torch.stack(ys, 1) if ys else x.new_zeros(batch, 0, heads, headdim)
    if D is not None:
        out = out + D.reshape(heads, -1) * x
    if z is not None:
        out = out * z * torch.sigmoid(z)
    final = torch.cat(finals) if finals else x.new_zeros(0, heads, headdim, n)
    return out, final


def _per_value_head(x: torch.Tensor, hv: int) -> torch.Tensor:
    """``x`` (batch, L, heads, ...) with each head repeated for the value heads that
    read it: value head h reads head h // (hv // heads), the grouped-heads convention
    (heads divides hv)."""
    return x.repeat_interleave(hv // x.shape[2], dim=2)


def _steps_of(x: torch.Tensor | None, length: int) -> Sequence[torch.Tensor | None]:
    """``x``'s ``length`` steps (along dim 1), cut at once (see _steps); Nones for an
    absent input."""
    return [None] * length if x is None else x.unbind(1)


def _decayed(state: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
    """Diag(exp(g)) S for the states (rows, Hv, K, V): g None, (rows, Hv) per head or
    (rows, Hv, K) per key channel."""
    if g is None:
        return state
    decay = torch.exp(g)
    return state * (decay[..., None, None] if decay.dim() == 2 else decay[..., None])


def _outer(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """x y^T for each (row, head): (rows, Hv, K) and (rows, Hv, V) to (rows, Hv, K, V)."""
    return x[..., :, None] * y[..., None, :]


def _transposed_times(state: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """S^T x for each (row, head): (rows, Hv, K, V) and (rows, Hv, K) to (rows, Hv, V)."""
    return (x[..., None, :] @ state).squeeze(-2)


def _key_value_loop(
    q: torch.Tensor,
    v: torch.Tensor,
    scale: float | None,
    initial: torch.Tensor | None,
    cu_seqlens: Sequence[int] | None,
    update: Callable[[int, torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The driver of the (K, V)-state recurrences (the delta rule and its relatives),
    one step at a time, every batch row and value head at once: the states (rows, Hv,
    K, V) start from ``initial`` (zeros without one), ``S = update(t, S)`` at each step
    and ``o[:, t] = scale S^T q[:, t]`` (q read per value head; scale K^-1/2 by default).
    ``cu_seqlens`` (batch 1): the state restarts at each offset from that sequence's
    row of ``initial``. Returns (o (batch, L, Hv, V), the final states: one per batch
    row, or one per packed sequence)."""
    batch, length, hv, dv = v.shape
    dk = q.shape[3]
    scale = dk**-0.5 if scale is None else scale
    qs = _per_value_head(q, hv).unbind(1)
    # (the state's rows of ``initial``, the steps): the batch rows at once, or each
    # packed sequence (a batch of one)
    runs = (
        [(slice(None), range(length))]
        if cu_seqlens is None
        else [(slice(s, s + 1), range(lo, hi)) for s, (lo, hi) in enumerate(pairwise(cu_seqlens))]
    )
    outs: list[torch.Tensor | None] = [None] * length
    finals = []
    for rows, steps in runs:
        if initial is not None:
            state = initial[rows]
        else:
            state = v.new_zeros(batch if cu_seqlens is None else 1, hv, dk, dv)
        for t in steps:
            state = update(t, state)
            outs[t] = scale * _transposed_times(state, qs[t])
        finals.append(state)
    o = torch.stack(outs, 1) if length else v.new_zeros(batch, 0, hv, dv)  # type: ignore[arg-type]
    final = torch.cat(finals) if finals else v.new_zeros(0, hv, dk, dv)
    return o, final


def delta_rule_loop(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    qk_l2norm: bool = False,
    initial: torch.Tensor | None = None,
    cu_seqlens: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The delta rule, one step at a time, in the dtype it is given: q, k (batch, L, Hk,
    K); v (batch, L, Hv, V), value head h reading q/k head h // (Hv // Hk); beta
    (batch, L, Hv); g None, (batch, L, Hv) or (batch, L, Hv, K), log decays; initial
    (states, Hv, K, V)::

        S = Diag(exp(g[t])) S;  u = beta[t] (v[t] - S^T k[t]);  S = S + k[t] u^T
        o[t] = scale S^T q[t]     (q, k l2-normalized first when qk_l2norm)

    ``cu_seqlens`` (a list of offsets, batch 1): the state restarts at each offset
    from that sequence's row of ``initial`` (zeros by default). Returns (o, the final
    states: one per batch row, or one per packed sequence)."""
    hv = v.shape[2]
    if qk_l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    ks, vs, betas = _per_value_head(k, hv).unbind(1), v.unbind(1), beta.unbind(1)
    gs = _steps_of(g, v.shape[1])

    def update(t: int, state: torch.Tensor) -> torch.Tensor:
        state = _decayed(state, gs[t])
        u = betas[t][..., None] * (vs[t] - _transposed_times(state, ks[t]))
        return state + _outer(ks[t], u)

    return _key_value_loop(q, v, scale, initial, cu_seqlens, update)


def linear_attention_loop(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    initial: torch.Tensor | None = None,
    cu_seqlens: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(Gated) linear attention, one step at a time, in the dtype it is given, with the
    delta rule's conventions (``delta_rule_loop``): q, k (batch, L, Hk, K); v (batch,
    L, Hv, V); g None, (batch, L, Hv) or (batch, L, Hv, K), log decays; initial
    (states, Hv, K, V)::

        S[t] = Diag(exp(g[t])) S[t-1] + k[t] v[t]^T;   o[t] = scale S[t]^T q[t]

    Returns (o, the final states: one per batch row, or one per packed sequence)."""
    hv = v.shape[2]
    ks, vs = _per_value_head(k, hv).unbind(1), v.unbind(1)
    gs = _steps_of(g, v.shape[1])

    def update(t: int, state: torch.Tensor) -> torch.Tensor:
        return _decayed(state, gs[t]) + _outer(ks[t], vs[t])

    return _key_value_loop(q, v, scale, initial, cu_seqlens, update)


def dplr_delta_rule_loop(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float | None = None,
    initial: torch.Tensor | None = None,
    cu_seqlens: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The diagonal-plus-low-rank (generalized) delta rule, one step at a time, in the
    dtype it is given, with the delta rule's conventions (``delta_rule_loop``): q, k,
    a, b (batch, L, H, K), each with its own head count H dividing Hv (value head h
    reads head h // (Hv // H)); v (batch, L, Hv, V); g None, (batch, L, Hv) or (batch,
    L, Hv, K), log decays; initial (states, Hv, K, V)::

        S[t] = (Diag(exp(g[t])) + b[t] a[t]^T) S[t-1] + k[t] v[t]^T
        o[t] = scale S[t]^T q[t]

    (b = k^, a = -beta exp(g) * k^ and k = beta k^ is the delta rule with keys k^.)
    Returns (o, the final states: one per batch row, or one per packed sequence)."""
    hv = v.shape[2]
    ks, vs = _per_value_head(k, hv).unbind(1), v.unbind(1)
    as_, bs = _per_value_head(a, hv).unbind(1), _per_value_head(b, hv).unbind(1)
    gs = _steps_of(g, v.shape[1])

    def update(t: int, state: torch.Tensor) -> torch.Tensor:
        low_rank = _outer(bs[t], _transposed_times(state, as_[t]))  # b (a^T S[t-1])
        return _decayed(state, gs[t]) + low_rank + _outer(ks[t], vs[t])

    return _key_value_loop(q, v, scale, initial, cu_seqlens, update)


# --- convolutions and norms of the Mamba layers ---------------------------------------


def causal_conv_loop(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    silu: bool = False,
    seq_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """The depthwise causal convolution, one step and one tap at a time, in the dtype
    it is given: x (batch, L, channels), weight (channels, W), bias (channels,)::

        out[b, t] = act(bias + sum_k weight[:, k] x[b, t - (W - 1) + k])

    inputs before step 0 zero, and with ``seq_idx`` (batch, L) those of another
    sequence than step t's too; act: silu or none."""
    batch, length, channels = x.shape
    width = weight.shape[1]
    xs = x.unbind(1)
    steps = []
    for t in range(length):
        acc = x.new_zeros(batch, channels)
        for k in range(width):
            s = t - (width - 1) + k
            if s < 0:
                continue
            term = weight[:, k] * xs[s]
            if seq_idx is not None:  # rows where step s is in step t's sequence
                term = term * (seq_idx[:, s] == seq_idx[:, t]).to(term.dtype)[:, None]
            acc = acc + term
        steps.append(acc)
    out = torch.stack(steps, 1) if steps else x * 0  # in the graph of x even with no terms
    if bias is not None:
        out = out + bias
    return out * torch.sigmoid(out) if silu else out


def gated_rms_norm_loop(
    y: torch.Tensor,
    z: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    groups: int,
    norm_before_gate: bool,
) -> torch.Tensor:
    """Mamba-2's gated RMS norm, one group of the last dim at a time, in the dtype it
    is given: u = y (y silu(z) unless ``norm_before_gate``), each group of u divided by
    sqrt(mean(u^2) + eps), times ``weight``, then times silu(z) if
    ``norm_before_gate``."""
    gate = z * torch.sigmoid(z)
    u = y if norm_before_gate else y * gate
    size = y.shape[-1] // groups
    parts = []
    for i in range(groups):
        part = u[..., i * size : (i + 1) * size]
        parts.append(part / torch.sqrt((part * part).sum(-1, keepdim=True) / size + eps))
    out = torch.cat(parts, -1) * weight if parts else u
    return out * gate if norm_before_gate else out
