"""Triton kernels of the first-order scans (linear_scan, log_linear_scan), forward
and fused backward, called by triton.py.

Imported only when the ``triton`` backend runs (triton is an optional extra).

Summary of the algorithm: a chunked scan with a carry pass, so that a few channels
with a very long T still fill the device. Tensors are seen as (outer, T, inner),
each with its own strides (broadcast inputs are read in place); a channel is an
(outer, inner) pair. The time axis is cut into chunks of ``CHUNK`` steps.

1. ``_summaries`` (grid: channel blocks x chunks): each chunk's map of the state
   it receives, h -> M h + F: M the product of its multipliers (a sum of logs in
   log space), F its scan from the state of no steps.
2. ``_carries`` (grid: channel blocks): the state entering each chunk, composing
   the maps in order from the initial state. The chunks are few, so this pass is
   short.
3. ``_apply`` (grid: channel blocks x chunks): each chunk scanned again from its
   entering state, writing the results.

Every pass accumulates in float32 (float64 for float64), with carries in that
precision, and stores in the tensor's dtype. Modes (a forward's MODE is its
semiring's code, semiring.py; a backward's is BACKWARD + that code):

- ``LINEAR``: x[t] = a[t] x[t-1] + b[t] (real or complex).
- ``LOG``: h[t] = logaddexp(la[t] + h[t-1], lb[t]) (real).
- ``LINEAR_BWD``: g[t] = G[t] + conj(a[t']) g[t'], t' the step before t in the
  backward's order (the next in the forward's); writes dL/db = g and
  dL/da = g conj(x[t-1]).
- ``LOG_BWD``: the same chain with the step weights wu[t'] = exp(la[t'] + h[t'-1] -
  h[t']); writes dL/dla = g wu and dL/dlb = g exp(lb - h).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

__all__ = ["BACKWARD", "LINEAR", "LINEAR_BWD", "LOG", "LOG_BWD", "backward", "forward"]

LINEAR, LOG = 0, 1  # LINEAR.code, LOG.code
BACKWARD = 2
LINEAR_BWD, LOG_BWD = BACKWARD + LINEAR, BACKWARD + LOG
_BLOCK_C = 32


@triton.jit
def _logaddexp(u, v):
    big = tl.maximum(u, v)
    small = tl.minimum(u, v)
    safe = tl.where(big == float("-inf"), 0.0, big)
    return tl.where(big == float("-inf"), big, safe + tl.log(1.0 + tl.exp(small - safe)))


@triton.jit
def _weight(x, h):
    # exp(x - h), 0 where h is log 0
    safe = tl.where(h == float("-inf"), 0.0, h)
    return tl.where(h == float("-inf"), 0.0, tl.exp(x - safe))


@triton.jit
def _load(ptr, off, mask, IS_COMPLEX: tl.constexpr, ACC: tl.constexpr):
    if IS_COMPLEX:
        re = tl.load(ptr + 2 * off, mask=mask, other=0.0).to(ACC)
        im = tl.load(ptr + 2 * off + 1, mask=mask, other=0.0).to(ACC)
    else:
        re = tl.load(ptr + off, mask=mask, other=0.0).to(ACC)
        im = tl.zeros_like(re)
    return re, im


@triton.jit
def _store(ptr, off, re, im, mask, IS_COMPLEX: tl.constexpr):
    if IS_COMPLEX:
        tl.store(ptr + 2 * off, re.to(ptr.dtype.element_ty), mask=mask)
        tl.store(ptr + 2 * off + 1, im.to(ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(ptr + off, re.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _both(mask, cond):
    """``mask & cond`` for a block mask and a scalar condition. Written as a select:
    Triton 3.9's interpreter turns ``&`` of a block and a scalar int1 into int32,
    which it then refuses as a mask (on a GPU both forms compile the same)."""
    return tl.where(cond, mask, False)


@triton.jit
def _time(REVERSE: tl.constexpr, s, T):
    """The time index of step s of this pass, as int64: offsets t * stride may pass 2^31."""
    if REVERSE:
        return tl.cast(T - 1 - s, tl.int64)
    return tl.cast(s, tl.int64)


@triton.jit
def _shift(REVERSE: tl.constexpr, t, NEXT: tl.constexpr):
    """The time index after t in this pass's order (``NEXT``), or the one before."""
    if REVERSE == NEXT:
        return t - 1
    return t + 1


@triton.jit
def _cmul(ar, ai, br, bi, IS_COMPLEX: tl.constexpr):
    if IS_COMPLEX:
        return ar * br - ai * bi, ar * bi + ai * br
    return ar * br, ai


@triton.jit
def _multiplier(
    MODE: tl.constexpr,
    IS_COMPLEX: tl.constexpr,
    ACC: tl.constexpr,
    REVERSE: tl.constexpr,
    s,
    T,
    a_ptr,
    a_base,
    sa1,
    h_ptr,
    h_base,
    sh1,
    mask,
):
    """The multiplier of step s of this pass (a sum term in LOG)."""
    t = _time(REVERSE, s, T)
    if MODE == 0 or MODE == 1:
        mr, mi = _load(a_ptr, a_base + t * sa1, mask, IS_COMPLEX, ACC)
    else:
        # the step before t in this pass's order (the next in the forward's); none at s = 0
        tp = _shift(REVERSE, t, False)
        has = _both(mask, s > 0)
        mr, mi = _load(a_ptr, a_base + tp * sa1, has, IS_COMPLEX, ACC)
        if MODE == 2:
            mi = -mi  # conj
        else:  # the step weight of tp: exp(la[tp] + h[t] - h[tp])
            h_t = tl.load(h_ptr + h_base + t * sh1, mask=has, other=0.0).to(ACC)
            h_tp = tl.load(h_ptr + h_base + tp * sh1, mask=has, other=float("-inf")).to(ACC)
            mr = tl.where(has, _weight(mr + h_t, h_tp), 0.0)
    return mr, mi


@triton.jit
def _advance(
    MODE: tl.constexpr,
    IS_COMPLEX: tl.constexpr,
    ACC: tl.constexpr,
    REVERSE: tl.constexpr,
    s,
    T,
    a_ptr,
    a_base,
    sa1,
    b_ptr,
    b_base,
    sb1,
    h_ptr,
    h_base,
    sh1,
    mask,
    hr,
    hi,
):
    """Step s of this pass applied to the state (hr, hi): (its time index, its
    multiplier, the new state)."""
    t = _time(REVERSE, s, T)
    mr, mi = _multiplier(
        MODE, IS_COMPLEX, ACC, REVERSE, s, T, a_ptr, a_base, sa1, h_ptr, h_base, sh1, mask
    )
    dr, di = _load(b_ptr, b_base + t * sb1, mask, IS_COMPLEX, ACC)
    hr, hi = _combine(MODE, IS_COMPLEX, mr, mi, hr, hi, dr, di)
    return t, mr, mi, hr, hi


@triton.jit
def _combine(MODE: tl.constexpr, IS_COMPLEX: tl.constexpr, mr, mi, hr, hi, dr, di):
    """The state after a step (or a chunk): m h + d, or logaddexp(m + h, d) in LOG."""
    if MODE == 1:
        return _logaddexp(mr + hr, dr), hi
    pr, pi = _cmul(mr, mi, hr, hi, IS_COMPLEX)
    return pr + dr, pi + di


@triton.jit
def _compose(MODE: tl.constexpr, IS_COMPLEX: tl.constexpr, Mr, Mi, mr, mi):
    """The multiplier of two steps: M m (M + m in LOG)."""
    if MODE == 1:
        return Mr + mr, Mi
    return _cmul(Mr, Mi, mr, mi, IS_COMPLEX)


@triton.jit
def _summaries(
    a_ptr, sa0, sa1, sa2, b_ptr, sb0, sb1, sb2, h_ptr, sh0, sh1, sh2,
    Mr_ptr, Mi_ptr, Fr_ptr, Fi_ptr, C, INNER, T, CHUNK,
    MODE: tl.constexpr, IS_COMPLEX: tl.constexpr, REVERSE: tl.constexpr,
    ACC: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    cb, k = tl.program_id(0), tl.program_id(1)
    c = cb.to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)  # int64 offsets from here on
    mask = c < C
    o, i = c // INNER, c % INNER
    a_base, b_base, h_base = o * sa0 + i * sa2, o * sb0 + i * sb2, o * sh0 + i * sh2
    # the map of no steps: multiplier 1 (0 in LOG), state 0 (-inf, log 0, in LOG)
    if MODE == 1:
        Mr = tl.zeros((BLOCK_C,), ACC)
        Fr = tl.full((BLOCK_C,), float("-inf"), ACC)
    else:
        Mr = tl.full((BLOCK_C,), 1.0, ACC)
        Fr = tl.zeros((BLOCK_C,), ACC)
    Mi = tl.zeros((BLOCK_C,), ACC)
    Fi = tl.zeros((BLOCK_C,), ACC)
    for s in range(k * CHUNK, tl.minimum(T, (k + 1) * CHUNK)):
        _, mr, mi, Fr, Fi = _advance(
            MODE, IS_COMPLEX, ACC, REVERSE, s, T, a_ptr, a_base, sa1, b_ptr, b_base, sb1,
            h_ptr, h_base, sh1, mask, Fr, Fi,
        )  # fmt: skip
        Mr, Mi = _compose(MODE, IS_COMPLEX, Mr, Mi, mr, mi)
    tl.store(Mr_ptr + k * C + c, Mr, mask=mask)
    tl.store(Mi_ptr + k * C + c, Mi, mask=mask)
    tl.store(Fr_ptr + k * C + c, Fr, mask=mask)
    tl.store(Fi_ptr + k * C + c, Fi, mask=mask)


@triton.jit
def _carries(
    Mr_ptr, Mi_ptr, Fr_ptr, Fi_ptr, Cr_ptr, Ci_ptr, i_ptr, si0, si2, C, INNER, N_CHUNKS,
    MODE: tl.constexpr, IS_COMPLEX: tl.constexpr, HAS_INIT: tl.constexpr,
    ACC: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    cb = tl.program_id(0)
    c = cb.to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)  # int64 offsets from here on
    mask = c < C
    o, i = c // INNER, c % INNER
    if HAS_INIT and MODE < 2:
        hr, hi = _load(i_ptr, o * si0 + i * si2, mask, IS_COMPLEX, ACC)
    elif MODE == 1:
        hr = tl.full((BLOCK_C,), float("-inf"), ACC)
        hi = tl.zeros((BLOCK_C,), ACC)
    else:
        hr = tl.zeros((BLOCK_C,), ACC)
        hi = tl.zeros((BLOCK_C,), ACC)
    for k in range(0, N_CHUNKS):
        tl.store(Cr_ptr + k * C + c, hr, mask=mask)
        tl.store(Ci_ptr + k * C + c, hi, mask=mask)
        Mr = tl.load(Mr_ptr + k * C + c, mask=mask, other=0.0)
        Mi = tl.load(Mi_ptr + k * C + c, mask=mask, other=0.0)
        Fr = tl.load(Fr_ptr + k * C + c, mask=mask, other=0.0)
        Fi = tl.load(Fi_ptr + k * C + c, mask=mask, other=0.0)
        hr, hi = _combine(MODE, IS_COMPLEX, Mr, Mi, hr, hi, Fr, Fi)


@triton.jit
def _apply(
    a_ptr, sa0, sa1, sa2, b_ptr, sb0, sb1, sb2, h_ptr, sh0, sh1, sh2, e_ptr, se0, se1, se2,
    i_ptr, si0, si2, Cr_ptr, Ci_ptr, o1_ptr, o2_ptr, C, INNER, T, CHUNK,
    MODE: tl.constexpr, IS_COMPLEX: tl.constexpr, REVERSE: tl.constexpr,
    HAS_INIT: tl.constexpr, ACC: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    cb, k = tl.program_id(0), tl.program_id(1)
    c = cb.to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)  # int64 offsets from here on
    mask = c < C
    o, i = c // INNER, c % INNER
    a_base, b_base, h_base = o * sa0 + i * sa2, o * sb0 + i * sb2, o * sh0 + i * sh2
    e_base, i_base = o * se0 + i * se2, o * si0 + i * si2
    out_base = o * (T * INNER) + i
    hr = tl.load(Cr_ptr + k * C + c, mask=mask, other=0.0)
    hi = tl.load(Ci_ptr + k * C + c, mask=mask, other=0.0)
    for s in range(k * CHUNK, tl.minimum(T, (k + 1) * CHUNK)):
        t, _, _, hr, hi = _advance(
            MODE, IS_COMPLEX, ACC, REVERSE, s, T, a_ptr, a_base, sa1, b_ptr, b_base, sb1,
            h_ptr, h_base, sh1, mask, hr, hi,
        )  # fmt: skip
        if MODE < 2:
            _store(o1_ptr, out_base + t * INNER, hr, hi, mask, IS_COMPLEX)
        else:
            # the forward's state before t: the next step in this pass's order
            tn = _shift(REVERSE, t, True)
            inside = (tn >= 0) & (tn < T)
            if MODE == 2:
                xr, xi = _load(h_ptr, h_base + tn * sh1, _both(mask, inside), IS_COMPLEX, ACC)
                if HAS_INIT:
                    ir, ii = _load(i_ptr, i_base, _both(mask, ~inside), IS_COMPLEX, ACC)
                    xr, xi = tl.where(inside, xr, ir), tl.where(inside, xi, ii)
                _store(o1_ptr, out_base + t * INNER, hr, hi, mask, IS_COMPLEX)
                gr, gi = _cmul(hr, hi, xr, -xi, IS_COMPLEX)
                _store(o2_ptr, out_base + t * INNER, gr, gi, mask, IS_COMPLEX)
            else:
                h_t = tl.load(h_ptr + h_base + t * sh1, mask=mask, other=0.0).to(ACC)
                h_prev = tl.load(
                    h_ptr + h_base + tn * sh1, mask=_both(mask, inside), other=float("-inf")
                ).to(ACC)
                if HAS_INIT:
                    init = tl.load(i_ptr + i_base, mask=mask, other=float("-inf")).to(ACC)
                    h_prev = tl.where(inside, h_prev, init)
                la = tl.load(a_ptr + a_base + t * sa1, mask=mask, other=0.0).to(ACC)
                lb = tl.load(e_ptr + e_base + t * se1, mask=mask, other=0.0).to(ACC)
                _store(o1_ptr, out_base + t * INNER, hr * _weight(lb, h_t), hi, mask, False)
                _store(
                    o2_ptr, out_base + t * INNER, hr * _weight(la + h_prev, h_t), hi, mask, False
                )


def _strides3(
    t: torch.Tensor, dims: tuple[int, int, int]
) -> tuple[torch.Tensor, tuple[int, int, int]]:
    if t.is_contiguous():
        return t, (dims[1] * dims[2], dims[2], 1)
    v = t.reshape(dims)
    return v, (v.stride(0), v.stride(1), v.stride(2))


def _real_view(t: torch.Tensor) -> torch.Tensor:
    return torch.view_as_real(t) if t.is_complex() else t


def forward(
    mode: int,
    a: torch.Tensor,
    b: torch.Tensor,
    initial: torch.Tensor | None,
    dim: int,
    reverse: bool,
    chunk: int | None = None,
) -> torch.Tensor:
    """A forward scan (LINEAR or LOG) of tensors of one shape and dtype along ``dim``."""
    out, _ = _run(mode, a, b, None, None, initial, dim, reverse, chunk)
    return out


def backward(
    mode: int,
    a: torch.Tensor,
    grad_out: torch.Tensor,
    out: torch.Tensor,
    log_tokens: torch.Tensor | None,
    initial: torch.Tensor | None,
    dim: int,
    reverse: bool,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A backward pass (LINEAR_BWD or LOG_BWD) in the order ``reverse`` (the opposite
    of the forward's): (the tokens' gradient, the gates' gradient)."""
    grad_tokens, grad_gates = _run(mode, a, grad_out, out, log_tokens, initial, dim, reverse, chunk)
    return grad_tokens, grad_gates if grad_gates is not None else grad_tokens


def _run(
    mode: int,
    a: torch.Tensor,
    b: torch.Tensor,
    h: torch.Tensor | None,
    e: torch.Tensor | None,
    initial: torch.Tensor | None,
    dim: int,
    reverse: bool,
    chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunked pass of ``mode`` over tensors of one shape and dtype along ``dim``
    (``reverse``: descending time, this pass's order). Forward modes return
    (out, None); backward modes (b: grad_out, h: the forward's output, e: log tokens
    for LOG_BWD) return (grad of the tokens, grad of the gates)."""
    dim %= b.dim()
    outer, steps, inner = math.prod(b.shape[:dim]), b.shape[dim], math.prod(b.shape[dim + 1 :])
    dims = (outer, steps, inner)
    o1 = torch.empty(b.shape, dtype=b.dtype, device=b.device)
    o2 = torch.empty_like(o1) if mode >= LINEAR_BWD else None
    channels = outer * inner
    if steps == 0 or channels == 0:
        return o1, o2
    is_complex = b.is_complex()
    acc = torch.float64 if b.dtype in (torch.float64, torch.complex128) else torch.float32
    blocks = triton.cdiv(channels, _BLOCK_C)
    if chunk is None:
        chunk = max(16, triton.cdiv(steps, max(1, 2048 // blocks)))
    n_chunks = triton.cdiv(steps, chunk)
    views = []
    for t in (a, b, h if h is not None else b, e if e is not None else b):
        v, st = _strides3(t, dims)
        views.append((_real_view(v), st))
    if initial is not None:
        init = _real_view(initial.reshape(outer, inner))
        i_strides = initial.reshape(outer, inner).stride()
    else:
        init, i_strides = views[1][0], (0, 0)
    summaries = [torch.empty((n_chunks, channels), dtype=acc, device=b.device) for _ in range(4)]
    carries = [torch.empty((n_chunks, channels), dtype=acc, device=b.device) for _ in range(2)]
    ACC = tl.float64 if acc == torch.float64 else tl.float32
    flags = dict(MODE=mode, IS_COMPLEX=is_complex, ACC=ACC, BLOCK_C=_BLOCK_C)
    (av, sa), (bv, sb), (hv, sh), (ev, se) = views
    _summaries[(blocks, n_chunks)](
        av, *sa, bv, *sb, hv, *sh, *summaries, channels, inner, steps, chunk,
        REVERSE=reverse, **flags,
    )  # fmt: skip
    _carries[(blocks,)](
        *summaries, *carries, init, *i_strides, channels, inner, n_chunks,
        HAS_INIT=initial is not None, **flags,
    )  # fmt: skip
    _apply[(blocks, n_chunks)](
        av, *sa, bv, *sb, hv, *sh, ev, *se, init, *i_strides, *carries,
        _real_view(o1), _real_view(o2 if o2 is not None else o1), channels, inner, steps, chunk,
        REVERSE=reverse, HAS_INIT=initial is not None, **flags,
    )  # fmt: skip
    return o1, o2
