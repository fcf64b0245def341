"""Triton kernels of the first-order scans (linear_scan, log_linear_scan), forward
and fused backward, called by triton.py.

Imported only when the ``triton`` backend runs (triton is an optional extra).

Summary of the algorithm: a chunked scan with a carry pass, so that a few channels
with a very long T still fill the device. Tensors are seen as (outer, T, inner),
each with its own strides (broadcast inputs are read in place); a channel is an
(outer, inner) pair. The time axis is cut into chunks of ``CHUNK`` steps, each
chunk into tiles of ``BLOCK_C`` channels x ``BLOCK_T`` steps.

1. ``_summaries`` (grid: channel blocks x chunks): each chunk's map of the state
   it receives, h -> M h + F: M the product of its multipliers (a sum of logs in
   log space), F its scan from the state of no steps.
2. ``_carries`` (grid: channel blocks): the state entering each chunk, composing
   the maps in order from the initial state. The chunks are few, so this pass is
   short.
3. ``_apply`` (grid: channel blocks x chunks): each chunk scanned again from its
   entering state, writing the results.

With one chunk (many channels: ``chunk`` reaches T) passes 1 and 2 are skipped and
``_apply`` starts from the initial state (``SINGLE``).

Coalescing. Each loop iteration loads one tile of every operand, and a warp's
loads cover contiguous memory in both layouts, by the choice of tile (``blocks``):

- time-major data (channels contiguous): tiles of 128 channels x 1 step, the
  consecutive channels of one step across a warp's threads, the state in
  registers from step to step;
- time-contiguous data (time stride 1): tiles of 8 channels x 64 steps, each row
  a run of 64 consecutive steps across the threads, scanned along time with
  ``tl.associative_scan`` (the combine of two affine maps), the state carried from
  tile to tile in registers.

Bytes moved per element (``e`` bytes per element of the dtype): one chunk: the
forward reads a and b and writes out, 3e; with chunks, pass 1 reads a and b again,
5e (the summaries, a few float32 values per chunk and channel, are negligible). The
linear backward reads a, grad_out and out (the previous state) and writes both
gradients, 5e (7e with chunks); the log backward also reads the log tokens, 6e (9e
with chunks; the neighbouring state it reads twice shares cache lines).

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
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

__all__ = [
    "BACKWARD",
    "INTERPRETED_BLOCKS",
    "LINEAR",
    "LINEAR_BWD",
    "LOG",
    "LOG_BWD",
    "TIME_CONTIGUOUS",
    "TIME_MAJOR",
    "Blocks",
    "blocks",
    "plan",
    "run",
]

LINEAR, LOG = 0, 1  # LINEAR.code, LOG.code
BACKWARD = 2
LINEAR_BWD, LOG_BWD = BACKWARD + LINEAR, BACKWARD + LOG


@dataclass(frozen=True)
class Blocks:
    """A tile: ``channels`` x ``steps`` (BLOCK_C x BLOCK_T), and the least number of
    steps in a chunk (a multiple of ``steps``)."""

    channels: int
    steps: int
    min_chunk: int


# The two tiles a GPU runs (see the module docstring), 4 warps each: 128 channels of
# one step (one element per thread), or 8 rows of 64 consecutive steps (4 per thread).
TIME_MAJOR = Blocks(channels=128, steps=1, min_chunk=16)
TIME_CONTIGUOUS = Blocks(channels=8, steps=64, min_chunk=64)
# In Triton's interpreter every element of a tile costs Python calls (and each one of
# ``tl.associative_scan``'s combines more), so the interpreter runs the same code on
# small tiles: (time-major, time-contiguous).
INTERPRETED_BLOCKS = (Blocks(channels=4, steps=1, min_chunk=4), Blocks(2, 4, min_chunk=8))


def blocks(time_contiguous: bool, interpreted: bool | None = None) -> Blocks:
    """The tile for a layout, on a GPU or (``interpreted``) in the interpreter."""
    if interpreted is None:
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if interpreted:
        return INTERPRETED_BLOCKS[time_contiguous]
    return TIME_CONTIGUOUS if time_contiguous else TIME_MAJOR


@triton.jit
def _logaddexp(u, v):
    # a NaN operand gives NaN (tl.maximum and tl.minimum drop a NaN operand by default:
    # a NaN input vanished from the scan), and an infinite larger one is the result
    # (inf - inf inside would be NaN where the loop has inf)
    big = tl.maximum(u, v, propagate_nan=tl.PropagateNan.ALL)
    small = tl.minimum(u, v, propagate_nan=tl.PropagateNan.ALL)
    infinite = (big == float("-inf")) | (big == float("inf"))
    safe = tl.where(infinite, 0.0, big)
    return tl.where(infinite, big, safe + tl.log(1.0 + tl.exp(small - safe)))


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
def _time(REVERSE: tl.constexpr, s, T):
    """The time index of step s of this pass: offsets t * stride may pass 2^31, and
    s is int64 (``_pass_tile``)."""
    if REVERSE:
        return T - 1 - s
    return s


@triton.jit
def _shift(REVERSE: tl.constexpr, t, NEXT: tl.constexpr):
    """The time index after t in this pass's order (``NEXT``), or the one before."""
    if REVERSE == NEXT:
        return t - 1
    return t + 1


@triton.jit
def _channels(cb, C, INNER, BLOCK_C: tl.constexpr):
    """Block cb's channels c as a column [BLOCK_C, 1] of int64 (offsets from here on
    are int64), their mask, and their (outer, inner) indices."""
    c = cb.to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)[:, None]
    return c, c < C, c // INNER, c % INNER


@triton.jit
def _chunk_end(k, CHUNK, T):
    """The end of chunk k's steps, min(T, (k + 1) CHUNK). Not tl.minimum: Triton 3.5's
    interpreter makes that a one-element block, which ``range`` refuses."""
    end = (k + 1) * CHUNK
    if end > T:
        end = T
    return end


@triton.jit
def _cmul(ar, ai, br, bi, IS_COMPLEX: tl.constexpr):
    if IS_COMPLEX:
        return ar * br - ai * bi, ar * bi + ai * br
    return ar * br, ai


@triton.jit
def _combine(MODE: tl.constexpr, IS_COMPLEX: tl.constexpr, mr, mi, hr, hi, dr, di):
    """The state after a step (or a chunk): m h + d, or logaddexp(m + h, d) in LOG
    (real: its imaginary part is d's zeros, of the result's shape, as every return of
    a compiled function must have one type)."""
    if MODE == 1:
        return _logaddexp(mr + hr, dr), di
    pr, pi = _cmul(mr, mi, hr, hi, IS_COMPLEX)
    return pr + dr, pi + di


@triton.jit
def _compose(MODE: tl.constexpr, IS_COMPLEX: tl.constexpr, Mr, Mi, mr, mi):
    """The multiplier of two steps: M m (M + m in LOG)."""
    if MODE == 1:
        return Mr + mr, Mi
    return _cmul(Mr, Mi, mr, mi, IS_COMPLEX)


# The combines of tl.associative_scan: two steps' affine maps, the earlier (m1, f1)
# then the later (m2, f2), composed into one: h -> m2 (m1 h + f1) + f2.
@triton.jit
def _then_real(m1, f1, m2, f2):
    return m2 * m1, m2 * f1 + f2


@triton.jit
def _then_complex(m1r, m1i, f1r, f1i, m2r, m2i, f2r, f2i):
    return (
        m2r * m1r - m2i * m1i,
        m2r * m1i + m2i * m1r,
        m2r * f1r - m2i * f1i + f2r,
        m2r * f1i + m2i * f1r + f2i,
    )


@triton.jit
def _then_log(m1, f1, m2, f2):
    return m1 + m2, _logaddexp(m2 + f1, f2)


# The same with a reset flag r (1 where a sequence starts, PACKED): a later map
# that resets ignores the earlier one (a select, never a product with 0, so that a
# non-finite state does not leak across the boundary as NaN).
@triton.jit
def _then_real_reset(r1, m1, f1, r2, m2, f2):
    keep = r2 > 0
    return tl.maximum(r1, r2), tl.where(keep, m2, m2 * m1), tl.where(keep, f2, m2 * f1 + f2)


@triton.jit
def _then_complex_reset(r1, m1r, m1i, f1r, f1i, r2, m2r, m2i, f2r, f2i):
    keep = r2 > 0
    return (
        tl.maximum(r1, r2),
        tl.where(keep, m2r, m2r * m1r - m2i * m1i),
        tl.where(keep, m2i, m2r * m1i + m2i * m1r),
        tl.where(keep, f2r, m2r * f1r - m2i * f1i + f2r),
        tl.where(keep, f2i, m2r * f1i + m2i * f1r + f2i),
    )


@triton.jit
def _then_log_reset(r1, m1, f1, r2, m2, f2):
    keep = r2 > 0
    f = tl.where(keep, f2, _logaddexp(m2 + f1, f2))
    return tl.maximum(r1, r2), tl.where(keep, m2, m1 + m2), f


@triton.jit
def _scan_tile(
    MODE: tl.constexpr, IS_COMPLEX: tl.constexpr, BLOCK_T: tl.constexpr, PACKED: tl.constexpr,
    mr, mi, dr, di, hr, hi, reset, rr, ri,
):  # fmt: skip
    """A tile's steps (multipliers m, tokens d: [BLOCK_C, BLOCK_T]) applied along
    time from the states (hr, hi) [BLOCK_C, 1] entering it: (the running products
    of the multipliers, the states), each [BLOCK_C, BLOCK_T]. The entering state is
    folded into the first step; the rest is a scan of affine maps. ``PACKED``: where
    ``reset`` holds, a sequence starts and the state is (rr, ri) whatever came
    before (the products then restart there too)."""
    first = tl.arange(0, BLOCK_T)[None, :] == 0
    cr, ci = _combine(MODE, IS_COMPLEX, mr, mi, hr, hi, dr, di)
    dr = tl.where(first, cr, dr)
    di = tl.where(first, ci, di)
    if PACKED:
        dr = tl.where(reset, rr, dr)
        di = tl.where(reset, ri, di)
    if BLOCK_T == 1:
        return mr, mi, dr, di
    if PACKED:
        flag = reset.to(tl.int8) + tl.zeros(mr.shape, tl.int8)  # int8: fewer registers
        if MODE == 1:
            _, Mr, Fr = tl.associative_scan((flag, mr, dr), 1, _then_log_reset)
            return Mr, mi, Fr, di
        if IS_COMPLEX:
            _, Mr, Mi, Fr, Fi = tl.associative_scan(
                (flag, mr, mi, dr, di), 1, _then_complex_reset
            )  # fmt: skip
            return Mr, Mi, Fr, Fi
        _, Mr, Fr = tl.associative_scan((flag, mr, dr), 1, _then_real_reset)
        return Mr, mi, Fr, di
    if MODE == 1:
        Mr, Fr = tl.associative_scan((mr, dr), 1, _then_log)
        return Mr, mi, Fr, di
    if IS_COMPLEX:
        return tl.associative_scan((mr, mi, dr, di), 1, _then_complex)
    Mr, Fr = tl.associative_scan((mr, dr), 1, _then_real)
    return Mr, mi, Fr, di


@triton.jit
def _last(x, BLOCK_T: tl.constexpr):
    """The last column of a tile [BLOCK_C, BLOCK_T], as a column [BLOCK_C, 1]."""
    if BLOCK_T == 1:
        return x
    last = tl.arange(0, BLOCK_T)[None, :] == BLOCK_T - 1
    return tl.sum(tl.where(last, x, 0.0), axis=1, keep_dims=True)


@triton.jit
def _resets(
    MODE: tl.constexpr, IS_COMPLEX: tl.constexpr, HAS_INIT: tl.constexpr, ACC: tl.constexpr,
    REVERSE: tl.constexpr, PACKED: tl.constexpr,
    s, t, T, seq_ptr, i_ptr, i_base, si1, mask, mr, mi, dr, di,
):  # fmt: skip
    """Packed sequences (``PACKED``; seq_ptr: each step's sequence, non-decreasing):
    where a sequence starts in this pass's order (its first step in the pass, and
    the pass's first step), and the state there: in a forward pass the step from the
    sequence's initial state (or the empty state), in a backward pass the token
    alone (the gradient reaching a sequence's last step comes from within it)."""
    if PACKED:
        inside = s < T
        q = tl.load(seq_ptr + t, mask=inside, other=-1)
        qp = tl.load(seq_ptr + _shift(REVERSE, t, False), mask=inside & (s > 0), other=-2)
        reset = (q != qp) & inside
        if MODE < 2:
            i_at = i_base + q.to(tl.int64) * si1
            hr, hi = _start(MODE, IS_COMPLEX, HAS_INIT, ACC, i_ptr, i_at, mask & reset)
            rr, ri = _combine(MODE, IS_COMPLEX, mr, mi, hr, hi, dr, di)
        else:
            rr, ri = dr, di
        return reset, rr, ri
    return s < 0, dr, di


@triton.jit
def _step_inputs(
    MODE: tl.constexpr, IS_COMPLEX: tl.constexpr, ACC: tl.constexpr, REVERSE: tl.constexpr,
    s, T, a_ptr, a_base, sa1, b_ptr, b_base, sb1, h_ptr, h_base, sh1, mask,
):  # fmt: skip
    """The time indices of the steps s of this pass, their multipliers (sum terms in
    LOG) and their tokens; outside ``mask`` the identity step (multiplier 1, token
    0; in LOG 0 and log 0), so that a tile past T carries its last state through."""
    t = _time(REVERSE, s, T)
    if MODE == 0 or MODE == 1:
        mr, mi = _load(a_ptr, a_base + t * sa1, mask, IS_COMPLEX, ACC)
    else:
        # the step before t in this pass's order (the next in the forward's); none at s = 0
        tp = _shift(REVERSE, t, False)
        has = mask & (s > 0)
        mr, mi = _load(a_ptr, a_base + tp * sa1, has, IS_COMPLEX, ACC)
        if MODE == 2:
            mi = -mi  # conj
        else:  # the step weight of tp: exp(la[tp] + h[t] - h[tp])
            h_t = tl.load(h_ptr + h_base + t * sh1, mask=has, other=0.0).to(ACC)
            h_tp = tl.load(h_ptr + h_base + tp * sh1, mask=has, other=float("-inf")).to(ACC)
            mr = tl.where(has, _weight(mr + h_t, h_tp), 0.0)
    dr, di = _load(b_ptr, b_base + t * sb1, mask, IS_COMPLEX, ACC)
    if MODE == 1:
        mr = tl.where(mask, mr, 0.0)
        dr = tl.where(mask, dr, float("-inf"))
    else:
        mr = tl.where(mask, mr, 1.0)
    return t, mr, mi, dr, di


@triton.jit
def _start(
    MODE: tl.constexpr, IS_COMPLEX: tl.constexpr, HAS_INIT: tl.constexpr, ACC: tl.constexpr,
    i_ptr, i_base, mask,
):  # fmt: skip
    """The state before the pass's (or a packed sequence's) first step, of
    ``i_base``'s shape: the initial state at ``i_base`` (forward modes, ``HAS_INIT``),
    else the empty state (log 0 in LOG, 0 otherwise)."""
    if HAS_INIT and MODE < 2:
        hr, hi = _load(i_ptr, i_base, mask, IS_COMPLEX, ACC)
    else:
        fill = float("-inf") if MODE == 1 else 0.0
        hr = tl.full(i_base.shape, fill, ACC)
        hi = tl.zeros(i_base.shape, ACC)
    return hr, hi


@triton.jit
def _pass_tile(
    MODE: tl.constexpr, IS_COMPLEX: tl.constexpr, HAS_INIT: tl.constexpr, ACC: tl.constexpr,
    REVERSE: tl.constexpr, PACKED: tl.constexpr, BLOCK_T: tl.constexpr,
    s0, T, in_channels, a_ptr, a_base, sa1, b_ptr, b_base, sb1, h_ptr, h_base, sh1, seq_ptr,
    i_ptr, i_base, si1, hr, hi,
):  # fmt: skip
    """The tile of this pass's steps s0 .. s0 + BLOCK_T - 1 scanned from the states
    (hr, hi) entering it: the steps s (a row [1, BLOCK_T] of int64), the tile's mask
    [BLOCK_C, BLOCK_T], the steps' time indices t, and ``_scan_tile``'s results."""
    s = s0 + tl.arange(0, BLOCK_T)[None, :].to(tl.int64)
    mask = in_channels & (s < T)
    t, mr, mi, dr, di = _step_inputs(
        MODE, IS_COMPLEX, ACC, REVERSE, s, T, a_ptr, a_base, sa1, b_ptr, b_base, sb1, h_ptr,
        h_base, sh1, mask,
    )  # fmt: skip
    reset, rr, ri = _resets(
        MODE, IS_COMPLEX, HAS_INIT, ACC, REVERSE, PACKED, s, t, T, seq_ptr, i_ptr, i_base, si1,
        mask, mr, mi, dr, di,
    )  # fmt: skip
    Pr, Pi, Hr, Hi = _scan_tile(MODE, IS_COMPLEX, BLOCK_T, PACKED, mr, mi, dr, di, hr, hi,
                                reset, rr, ri)  # fmt: skip
    return s, mask, t, Pr, Pi, Hr, Hi


@triton.jit
def _summaries(
    a_ptr, sa0, sa1, sa2, b_ptr, sb0, sb1, sb2, h_ptr, sh0, sh1, sh2, i_ptr, si0, si1, si2,
    seq_ptr, Mr_ptr, Mi_ptr, Fr_ptr, Fi_ptr, Rs_ptr, C, INNER, T, CHUNK,
    MODE: tl.constexpr, IS_COMPLEX: tl.constexpr, REVERSE: tl.constexpr,
    HAS_INIT: tl.constexpr, PACKED: tl.constexpr,
    ACC: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    cb, k = tl.program_id(0), tl.program_id(1)
    c, in_channels, o, i = _channels(cb, C, INNER, BLOCK_C)
    a_base, b_base, h_base = o * sa0 + i * sa2, o * sb0 + i * sb2, o * sh0 + i * sh2
    i_base = o * si0 + i * si2
    # the map of no steps: multiplier 1 (0 in LOG), state 0 (-inf, log 0, in LOG)
    Mr = tl.full((BLOCK_C, 1), 0.0 if MODE == 1 else 1.0, ACC)
    Fr = tl.full((BLOCK_C, 1), float("-inf") if MODE == 1 else 0.0, ACC)
    Mi = tl.zeros((BLOCK_C, 1), ACC)
    Fi = tl.zeros((BLOCK_C, 1), ACC)
    for s0 in range(k * CHUNK, _chunk_end(k, CHUNK, T), BLOCK_T):
        _, _, _, Pr, Pi, Hr, Hi = _pass_tile(
            MODE, IS_COMPLEX, HAS_INIT, ACC, REVERSE, PACKED, BLOCK_T, s0, T, in_channels,
            a_ptr, a_base, sa1, b_ptr, b_base, sb1, h_ptr, h_base, sh1, seq_ptr, i_ptr, i_base,
            si1, Fr, Fi,
        )  # fmt: skip
        Fr, Fi = _last(Hr, BLOCK_T), _last(Hi, BLOCK_T)
        Mr, Mi = _compose(MODE, IS_COMPLEX, Mr, Mi, _last(Pr, BLOCK_T), _last(Pi, BLOCK_T))
    tl.store(Mr_ptr + k * C + c, Mr, mask=in_channels)
    tl.store(Mi_ptr + k * C + c, Mi, mask=in_channels)
    tl.store(Fr_ptr + k * C + c, Fr, mask=in_channels)
    tl.store(Fi_ptr + k * C + c, Fi, mask=in_channels)
    if PACKED:
        # whether a sequence starts in the chunk: its first step's sequence differs from
        # the step's before it (or it is the first chunk), or from its last step's
        end = _chunk_end(k, CHUNK, T)
        t0 = _time(REVERSE, k.to(tl.int64) * CHUNK, T)
        q0 = tl.load(seq_ptr + t0)
        q1 = tl.load(seq_ptr + _time(REVERSE, end - 1, T))
        qb = tl.load(seq_ptr + _shift(REVERSE, t0, False), mask=k > 0, other=-1)
        R = tl.where((q0 != q1) | (q0 != qb), 1.0, 0.0).to(ACC) + tl.zeros((BLOCK_C, 1), ACC)
        tl.store(Rs_ptr + k * C + c, R, mask=in_channels)


@triton.jit
def _carries(
    Mr_ptr, Mi_ptr, Fr_ptr, Fi_ptr, Rs_ptr, Cr_ptr, Ci_ptr, i_ptr, si0, si2, C, INNER, N_CHUNKS,
    MODE: tl.constexpr, IS_COMPLEX: tl.constexpr, HAS_INIT: tl.constexpr, PACKED: tl.constexpr,
    ACC: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    cb = tl.program_id(0)
    c, in_channels, o, i = _channels(cb, C, INNER, BLOCK_C)
    hr, hi = _start(MODE, IS_COMPLEX, HAS_INIT, ACC, i_ptr, o * si0 + i * si2, in_channels)
    for k in range(0, N_CHUNKS):
        tl.store(Cr_ptr + k * C + c, hr, mask=in_channels)
        tl.store(Ci_ptr + k * C + c, hi, mask=in_channels)
        Mr = tl.load(Mr_ptr + k * C + c, mask=in_channels, other=0.0)
        Mi = tl.load(Mi_ptr + k * C + c, mask=in_channels, other=0.0)
        Fr = tl.load(Fr_ptr + k * C + c, mask=in_channels, other=0.0)
        Fi = tl.load(Fi_ptr + k * C + c, mask=in_channels, other=0.0)
        nr, ni = _combine(MODE, IS_COMPLEX, Mr, Mi, hr, hi, Fr, Fi)
        if PACKED:  # a chunk in which a sequence starts leaves its own state
            starts = tl.load(Rs_ptr + k * C + c, mask=in_channels, other=0.0) > 0
            nr, ni = tl.where(starts, Fr, nr), tl.where(starts, Fi, ni)
        hr, hi = nr, ni


@triton.jit
def _apply(
    a_ptr, sa0, sa1, sa2, b_ptr, sb0, sb1, sb2, h_ptr, sh0, sh1, sh2, e_ptr, se0, se1, se2,
    i_ptr, si0, si1, si2, seq_ptr, Cr_ptr, Ci_ptr, o1_ptr, o2_ptr, C, INNER, T, CHUNK,
    MODE: tl.constexpr, IS_COMPLEX: tl.constexpr, REVERSE: tl.constexpr,
    HAS_INIT: tl.constexpr, SINGLE: tl.constexpr, PACKED: tl.constexpr, ACC: tl.constexpr,
    BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr,
):  # fmt: skip
    cb, k = tl.program_id(0), tl.program_id(1)
    c, in_channels, o, i = _channels(cb, C, INNER, BLOCK_C)
    a_base, b_base, h_base = o * sa0 + i * sa2, o * sb0 + i * sb2, o * sh0 + i * sh2
    e_base, i_base = o * se0 + i * se2, o * si0 + i * si2
    out_base = o * (T * INNER) + i
    if SINGLE:  # one chunk: no carry pass, the initial state enters it
        hr, hi = _start(MODE, IS_COMPLEX, HAS_INIT, ACC, i_ptr, i_base, in_channels)
    else:
        hr = tl.load(Cr_ptr + k * C + c, mask=in_channels, other=0.0)
        hi = tl.load(Ci_ptr + k * C + c, mask=in_channels, other=0.0)
    for s0 in range(k * CHUNK, _chunk_end(k, CHUNK, T), BLOCK_T):
        s, mask, t, _, _, Hr, Hi = _pass_tile(
            MODE, IS_COMPLEX, HAS_INIT, ACC, REVERSE, PACKED, BLOCK_T, s0, T, in_channels,
            a_ptr, a_base, sa1, b_ptr, b_base, sb1, h_ptr, h_base, sh1, seq_ptr, i_ptr, i_base,
            si1, hr, hi,
        )  # fmt: skip
        hr, hi = _last(Hr, BLOCK_T), _last(Hi, BLOCK_T)
        if MODE < 2:
            _store(o1_ptr, out_base + t * INNER, Hr, Hi, mask, IS_COMPLEX)
        else:
            # the forward's state before t: the next step in this pass's order, if in
            # t's sequence; else t's initial state (its sequence's, PACKED)
            tn = _shift(REVERSE, t, True)
            inside = (tn >= 0) & (tn < T)
            outside = (tn < 0) | (tn >= T)  # not ~inside: Triton 3.3's interpreter lacks ~
            if PACKED:
                q = tl.load(seq_ptr + t, mask=s < T, other=0)
                qn = tl.load(seq_ptr + tn, mask=inside & (s < T), other=-1)
                inside = inside & (qn == q)
                outside = outside | (qn != q)
                i_at = i_base + q.to(tl.int64) * si1
            else:
                i_at = i_base + 0 * t
            if MODE == 2:
                xr, xi = _load(h_ptr, h_base + tn * sh1, mask & inside, IS_COMPLEX, ACC)
                if HAS_INIT:
                    ir, ii = _load(
                        i_ptr, i_at, mask & outside, IS_COMPLEX, ACC
                    )  # fmt: skip
                    xr, xi = tl.where(inside, xr, ir), tl.where(inside, xi, ii)
                _store(o1_ptr, out_base + t * INNER, Hr, Hi, mask, IS_COMPLEX)
                gr, gi = _cmul(Hr, Hi, xr, -xi, IS_COMPLEX)
                _store(o2_ptr, out_base + t * INNER, gr, gi, mask, IS_COMPLEX)
            else:
                h_t = tl.load(h_ptr + h_base + t * sh1, mask=mask, other=0.0).to(ACC)
                h_prev = tl.load(
                    h_ptr + h_base + tn * sh1, mask=mask & inside, other=float("-inf")
                ).to(ACC)
                if HAS_INIT:
                    init = tl.load(
                        i_ptr + i_at, mask=mask & outside, other=float("-inf")
                    ).to(ACC)  # fmt: skip
                    h_prev = tl.where(inside, h_prev, init)
                la = tl.load(a_ptr + a_base + t * sa1, mask=mask, other=0.0).to(ACC)
                lb = tl.load(e_ptr + e_base + t * se1, mask=mask, other=0.0).to(ACC)
                _store(o1_ptr, out_base + t * INNER, Hr * _weight(lb, h_t), Hi, mask, False)
                _store(
                    o2_ptr, out_base + t * INNER, Hr * _weight(la + h_prev, h_t), Hi, mask, False
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


def plan(
    steps: int, channels: int, time_stride: int, chunk: int | None = None
) -> tuple[Blocks, int]:
    """(the tile, the chunk length) for a pass: the time-contiguous tile where the
    tokens' time stride is 1, else the time-major one; chunks long enough that about
    2048 programs run (one chunk, no carry pass, when the channel blocks alone are
    that many), at least the tile's ``min_chunk`` and a whole number of tiles."""
    tile = blocks(time_contiguous=time_stride == 1 and steps > 1)
    if chunk is None:
        chunk = max(
            tile.min_chunk, triton.cdiv(steps, max(1, 2048 // triton.cdiv(channels, tile.channels)))
        )
    return tile, tile.steps * triton.cdiv(chunk, tile.steps)


def run(
    mode: int,
    a: torch.Tensor,
    b: torch.Tensor,
    h: torch.Tensor | None,
    e: torch.Tensor | None,
    initial: torch.Tensor | None,
    dim: int,
    reverse: bool,
    chunk: int | None = None,
    seq: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One chunked pass of ``mode`` over tensors of one shape and dtype along ``dim``
    (``reverse``: descending time, this pass's order). Forward modes return
    (out, None); backward modes (b: grad_out, h: the forward's output, e: log tokens
    for LOG_BWD) return (grad of the tokens, grad of the gates). Packed sequences:
    ``seq`` holds each step's sequence (int32, (T,), non-decreasing, on the device),
    and ``initial`` has b's shape with ``dim`` of size num_seqs; boundaries are
    handled inside the tiles and chunks (``PACKED``), in the same passes."""
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
    views = []
    for t in (a, b, h if h is not None else b, e if e is not None else b):
        v, st = _strides3(t, dims)
        views.append((_real_view(v), st))
    tile, chunk = plan(steps, channels, views[1][1][1], chunk)
    n_chunks = triton.cdiv(steps, chunk)
    c_blocks = triton.cdiv(channels, tile.channels)
    packed = seq is not None
    if initial is not None:
        i3 = initial.reshape(outer, -1, inner)  # (outer, num_seqs or 1, inner)
        init = _real_view(i3)
        i_strides = i3.stride()
    else:
        init, i_strides = views[1][0], (0, 0, 0)
    seq_ids = seq if seq is not None else torch.zeros(1, dtype=torch.int32, device=b.device)
    ACC = tl.float64 if acc == torch.float64 else tl.float32
    flags = dict(
        MODE=mode, IS_COMPLEX=is_complex, ACC=ACC, BLOCK_C=tile.channels,
        HAS_INIT=initial is not None, PACKED=packed,
    )  # fmt: skip
    (av, sa), (bv, sb), (hv, sh), (ev, se) = views
    carries = [init, init]  # unused with one chunk
    if n_chunks > 1:
        summaries = [  # M (re, im), F (re, im), and whether a sequence starts (PACKED)
            torch.empty((n_chunks, channels), dtype=acc, device=b.device)
            for _ in range(5 if packed else 4)
        ]
        if not packed:
            summaries.append(summaries[0])  # never read
        carries = [torch.empty((n_chunks, channels), dtype=acc, device=b.device) for _ in range(2)]
        _summaries[(c_blocks, n_chunks)](
            av, *sa, bv, *sb, hv, *sh, init, *i_strides, seq_ids, *summaries, channels, inner,
            steps, chunk, REVERSE=reverse, BLOCK_T=tile.steps, **flags,
        )  # fmt: skip
        _carries[(c_blocks,)](
            *summaries, *carries, init, i_strides[0], i_strides[2], channels, inner, n_chunks,
            **flags,
        )  # fmt: skip
    _apply[(c_blocks, n_chunks)](
        av, *sa, bv, *sb, hv, *sh, ev, *se, init, *i_strides, seq_ids, *carries,
        _real_view(o1), _real_view(o2 if o2 is not None else o1), channels, inner, steps, chunk,
        REVERSE=reverse, SINGLE=n_chunks == 1, BLOCK_T=tile.steps, **flags,
    )  # fmt: skip
    return o1, o2
