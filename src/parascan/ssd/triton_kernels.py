"""Triton kernels of the SSD scan (Mamba-2), forward and backward, launched by
ssd_triton.py.

Imported only when the ``triton`` backend runs (triton is an optional extra).

Summary of the algorithm. One program per (batch row, head, block of ``BLOCK_P``
rows of the head's state); its piece of the state, ``BLOCK_P`` x ``BLOCK_N`` (N
padded to a power of 2), lives in registers and walks time one step at a time:

    a    = exp(dt[t] A)                              (a scalar per head and step)
    h    = a h + (dt[t] x[t]) (outer) B[t]           (BLOCK_P x BLOCK_N multiply-adds)
    y[t] = h @ C[t] (+ D x[t]),  out[t] = y[t] silu(z[t])

Each step reads one row of x (BLOCK_P contiguous elements), of B and C (N each,
shared by the group's heads through the caches) and one dt. The rows of a head are
independent, so the blocks of rows are programs of their own: (batch x heads x
ceil(headdim / BLOCK_P)) programs walk L side by side. A step's loads do not depend
on the state, so the walks are software-pipelined (``tl.range(num_stages=STAGES)``:
on sm_80 and later the loads of the next STAGES - 1 steps are in flight, as cp.async
copies into shared memory, while a step computes): the walk's chain per step is
then the arithmetic, not a load's latency.

``chunked_forward_kernel`` computes the same forward (same checkpoints) by the
state-space dual form, a block of BLOCK_T steps per iteration in matrix products
(its docstring has the equations); not for packed sequences.

Packed sequences (``PACKED``, batch 1): ``seq[t]`` is the sequence holding step t
and ``cu`` the offsets; the state is reset to the sequence's initial state (or
zeros) at its first step and stored as its final state after its last, so no state
crosses a boundary. Checkpoints: before step t with t % K == 0 (after such a reset),
the state entering step t is stored: the contract's checkpoints (canonical.py).

Backward (``backward_kernel``). With g_h[t] = dL/dh[t] (the state after step t),
g_y[t] = dL/dy[t] = grad_out[t] silu(z[t]) and u[t] = dt[t] x[t] (outer) B[t]:

    g_h[t]   = g_y[t] (outer) C[t] + a[t+1] g_h[t+1]       (g_h[last] gets dL/dfinal)
    dL/dx[t] = dt[t] (g_h[t] @ B[t]) + D g_y[t]
    dL/dB[t] = dt[t] sum_p x[t, p] g_h[t][p, :]             (summed over the group's heads)
    dL/dC[t] = sum_p g_y[t, p] h[t][p, :]                   (likewise)
    dL/ddt[t]= A a[t] <g_h[t], h[t-1]> + <g_h[t], x[t] (outer) B[t]>
             = A a[t] <g_h[t], h[t-1]> + x[t] . (g_h[t] @ B[t])
    dL/dA    = sum_t dt[t] a[t] <g_h[t], h[t-1]>              (da/dA = dt a, da/ddt = A a)
    dL/dD    = sum_t g_y[t] x[t];  dL/dz[t] = grad_out[t] y[t] silu'(z[t])
    dL/dinitial = a[first] g_h[first]  (the carry out of a sequence's first step)

(<., .> sums over the whole BLOCK_P x BLOCK_N tile.) The chunks of K steps are
visited from last to first; each is first walked forward from its checkpoint,
storing the state entering each step in a scratch buffer of the program's own (K
tiles), then backward, reading h[t-1] back and forming h[t] = a h[t-1] + u[t].

Sums across programs are deterministic, never atomics: each program writes its own
partial rows (of dL/dB and dL/dC per step: (batch, L, heads x row blocks, N); of
dL/ddt: (batch, L, heads, row blocks); of dL/dA and dL/dD per program), which the
launcher sums with torch over the row blocks and the heads of a group.

Every operand is contiguous (the launcher copies others) and every sum and state is
``ACC`` (float32, or float64 for float64 operands). Offsets are int64 from the
(batch, step) row on; the offsets within a row are int32.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["backward_kernel", "chunked_forward_kernel", "forward_kernel"]


@triton.jit
def _program(
    HEADS, HEADDIM, N, RATIO, N_PB, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr
):  # fmt: skip
    """This program's batch row b (int64), head, block of rows pb, group, the rows p
    [BLOCK_P], the states n [BLOCK_N], their masks, and the offsets of its tile
    within a (headdim, N) state [BLOCK_P, BLOCK_N] with its mask. The grid is flat:
    the row blocks of a head consecutive, then the heads, then the batch rows."""
    pid = tl.program_id(0)
    pb = pid % N_PB
    head = (pid // N_PB) % HEADS
    b = (pid // (N_PB * HEADS)).to(tl.int64)
    p = pb * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_ok = p < HEADDIM
    n_ok = n < N
    tile = p[:, None] * N + n[None, :]
    tile_ok = p_ok[:, None] & n_ok[None, :]
    return b, head, pb, head // RATIO, p, n, p_ok, n_ok, tile, tile_ok


@triton.jit
def _head(A_ptr, D_ptr, head, HEADDIM, N, p, p_ok, tile, HAS_D: tl.constexpr, ACC: tl.constexpr,
          BLOCK_P: tl.constexpr):  # fmt: skip
    """The head's decay rate A, its rows of D (zeros without), and the offset of the
    program's tile within a (heads, headdim, N) state, less the sequence's offset."""
    A = tl.load(A_ptr + head).to(ACC)
    Dv = tl.zeros((BLOCK_P,), ACC)
    if HAS_D:
        Dv = tl.load(D_ptr + head * HEADDIM + p, mask=p_ok, other=0.0).to(ACC)
    return A, Dv, (head * HEADDIM) * N + tile


@triton.jit
def _restart(h, t, init_ptr, cu_ptr, seq_ptr, HEADS, HEADDIM, N, state, tile_ok,
             HAS_INIT: tl.constexpr, ACC: tl.constexpr, BLOCK_P: tl.constexpr,
             BLOCK_N: tl.constexpr):  # fmt: skip
    """Packed sequences: step t's sequence s, and the state entering the step: the
    sequence's initial state (zeros without) at its first step, else ``h``."""
    s = tl.load(seq_ptr + t).to(tl.int64)
    if t == tl.load(cu_ptr + s):  # the sequence's first step: its initial state
        if HAS_INIT:
            h = tl.load(init_ptr + s * HEADS * HEADDIM * N + state, mask=tile_ok)
            h = h.to(ACC)
        else:
            h = tl.zeros((BLOCK_P, BLOCK_N), ACC)
    return h, s


@triton.jit
def _forward_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, init_ptr, cu_ptr, seq_ptr,
    out_ptr, final_ptr, ck_ptr,
    L, HEADS, HEADDIM, N, GROUPS, RATIO, N_PB, K, N_CHUNKS,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_INIT: tl.constexpr, PACKED: tl.constexpr,
    ACC: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    b, head, _, group, p, n, p_ok, n_ok, tile, tile_ok = _program(
        HEADS, HEADDIM, N, RATIO, N_PB, BLOCK_P, BLOCK_N
    )  # fmt: skip
    A, Dv, state = _head(A_ptr, D_ptr, head, HEADDIM, N, p, p_ok, tile, HAS_D, ACC, BLOCK_P)
    h = tl.zeros((BLOCK_P, BLOCK_N), ACC)
    if not PACKED and HAS_INIT:
        h = tl.load(init_ptr + b * HEADS * HEADDIM * N + state, mask=tile_ok, other=0.0)
        h = h.to(ACC)
    for t in tl.range(0, L, num_stages=STAGES):
        if PACKED:
            h, s = _restart(h, t, init_ptr, cu_ptr, seq_ptr, HEADS, HEADDIM, N, state, tile_ok,
                            HAS_INIT, ACC, BLOCK_P, BLOCK_N)  # fmt: skip
        if t % K == 0:
            ck = ((b * N_CHUNKS + t // K) * HEADS * HEADDIM) * N + state
            tl.store(ck_ptr + ck, h, mask=tile_ok)
        row = b * L + t
        dt = tl.load(dt_ptr + row * HEADS + head).to(ACC)
        x = tl.load(x_ptr + (row * HEADS + head) * HEADDIM + p, mask=p_ok, other=0.0).to(ACC)
        Bt = tl.load(B_ptr + (row * GROUPS + group) * N + n, mask=n_ok, other=0.0).to(ACC)
        Ct = tl.load(C_ptr + (row * GROUPS + group) * N + n, mask=n_ok, other=0.0).to(ACC)
        h = tl.exp(dt * A) * h + (dt * x)[:, None] * Bt[None, :]
        y = tl.sum(h * Ct[None, :], axis=1)
        if HAS_D:
            y += Dv * x
        at = (row * HEADS + head) * HEADDIM + p
        if HAS_Z:
            zz = tl.load(z_ptr + at, mask=p_ok, other=0.0).to(ACC)
            y = y * zz / (1.0 + tl.exp(-zz))  # z silu(z)
        tl.store(out_ptr + at, y, mask=p_ok)
        if PACKED:  # noqa: SIM102 (a compile-time branch: s exists only when packed)
            if t == tl.load(cu_ptr + s + 1) - 1:  # the sequence's last step
                tl.store(final_ptr + s * HEADS * HEADDIM * N + state, h, mask=tile_ok)
    if not PACKED:
        tl.store(final_ptr + b * HEADS * HEADDIM * N + state, h, mask=tile_ok)


@triton.jit
def _backward_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, init_ptr, cu_ptr, seq_ptr,
    ck_ptr, go_ptr, gf_ptr,
    gx_ptr, gz_ptr, gi_ptr, gdt_ptr, gB_ptr, gC_ptr, gA_ptr, gD_ptr, scratch_ptr,
    L, HEADS, HEADDIM, N, GROUPS, RATIO, N_PB, K, N_CHUNKS,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_INIT: tl.constexpr, PACKED: tl.constexpr,
    ACC: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
):  # fmt: skip
    b, head, pb, group, p, n, p_ok, n_ok, tile, tile_ok = _program(
        HEADS, HEADDIM, N, RATIO, N_PB, BLOCK_P, BLOCK_N
    )  # fmt: skip
    A, Dv, state = _head(A_ptr, D_ptr, head, HEADDIM, N, p, p_ok, tile, HAS_D, ACC, BLOCK_P)
    # the program's scratch: K whole (padded) tiles, the states entering a chunk's steps
    program = tl.program_id(0).to(tl.int64)
    scratch = (
        scratch_ptr
        + program * K * (BLOCK_P * BLOCK_N)
        + tl.arange(0, BLOCK_P)[:, None] * BLOCK_N
        + n[None, :]
    )
    # the partial rows of dL/dB, dL/dC (N per step) and dL/ddt (one per step) it writes
    part = head * N_PB + pb
    # g_h of the step after the one being visited, times its decay: dL/dfinal first
    gh = tl.zeros((BLOCK_P, BLOCK_N), ACC)
    if not PACKED:
        gh = tl.load(gf_ptr + b * HEADS * HEADDIM * N + state, mask=tile_ok, other=0.0)
        gh = gh.to(ACC)
    gA = tl.zeros((BLOCK_P,), ACC)  # summed over the rows at the end
    gD = tl.zeros((BLOCK_P,), ACC)
    for cc in range(0, N_CHUNKS):
        c = N_CHUNKS - 1 - cc
        start = c * K
        end = start + K
        if end > L:  # not tl.minimum: the interpreter makes that a block, range refuses it
            end = L
        # 1. the chunk forward from its checkpoint, storing the state entering each step
        ck = ((b * N_CHUNKS + c) * HEADS * HEADDIM) * N + state
        h = tl.load(ck_ptr + ck, mask=tile_ok, other=0.0).to(ACC)
        tl.debug_barrier()  # the previous chunk's reads of the scratch are done
        for t in tl.range(start, end, num_stages=STAGES):
            if PACKED:
                h, _ = _restart(h, t, init_ptr, cu_ptr, seq_ptr, HEADS, HEADDIM, N, state,
                                tile_ok, HAS_INIT, ACC, BLOCK_P, BLOCK_N)  # fmt: skip
            tl.store(scratch + (t - start) * (BLOCK_P * BLOCK_N), h)
            row = b * L + t
            dt = tl.load(dt_ptr + row * HEADS + head).to(ACC)
            x = tl.load(x_ptr + (row * HEADS + head) * HEADDIM + p, mask=p_ok, other=0.0).to(ACC)
            Bt = tl.load(B_ptr + (row * GROUPS + group) * N + n, mask=n_ok, other=0.0).to(ACC)
            h = tl.exp(dt * A) * h + (dt * x)[:, None] * Bt[None, :]
        tl.debug_barrier()  # the entering states are stored
        # 2. the steps from last to first
        for tt in tl.range(start, end, num_stages=STAGES):
            t = end - 1 - (tt - start)
            if PACKED:
                s = tl.load(seq_ptr + t).to(tl.int64)
                if t == tl.load(cu_ptr + s + 1) - 1:  # a sequence's last step: dL/dfinal
                    gh = tl.load(gf_ptr + s * HEADS * HEADDIM * N + state, mask=tile_ok)
                    gh = gh.to(ACC)
            row = b * L + t
            at = (row * HEADS + head) * HEADDIM + p  # x's, z's, out's rows
            bc = (row * GROUPS + group) * N + n  # B's and C's
            dt = tl.load(dt_ptr + row * HEADS + head).to(ACC)
            x = tl.load(x_ptr + at, mask=p_ok, other=0.0).to(ACC)
            Bt = tl.load(B_ptr + bc, mask=n_ok, other=0.0).to(ACC)
            Ct = tl.load(C_ptr + bc, mask=n_ok, other=0.0).to(ACC)
            go = tl.load(go_ptr + at, mask=p_ok, other=0.0).to(ACC)
            gy = go
            if HAS_Z:
                zz = tl.load(z_ptr + at, mask=p_ok, other=0.0).to(ACC)
                sz = 1.0 / (1.0 + tl.exp(-zz))  # sigmoid(z); exp overflow gives 0
                gy = go * zz * sz
            h_prev = tl.load(scratch + (t - start) * (BLOCK_P * BLOCK_N))
            a = tl.exp(dt * A)
            h = a * h_prev + (dt * x)[:, None] * Bt[None, :]
            gh += gy[:, None] * Ct[None, :]
            # the partial sums over this program's rows (summed over programs later)
            gC = tl.sum(gy[:, None] * h, axis=0)
            tl.store(gC_ptr + (row * HEADS * N_PB + part) * N + n, gC, mask=n_ok)
            ghB = tl.sum(gh * Bt[None, :], axis=1)  # [BLOCK_P]
            gB = dt * tl.sum(gh * x[:, None], axis=0)
            tl.store(gB_ptr + (row * HEADS * N_PB + part) * N + n, gB, mask=n_ok)
            gx = dt * ghB
            if HAS_D:
                gx += gy * Dv
                gD += gy * x
            tl.store(gx_ptr + at, gx, mask=p_ok)
            if HAS_Z:
                y = tl.sum(h * Ct[None, :], axis=1)
                if HAS_D:
                    y += Dv * x
                # d silu(z) / dz = s (1 + z (1 - s)), s = sigmoid(z)
                tl.store(gz_ptr + at, go * y * sz * (1.0 + zz * (1.0 - sz)), mask=p_ok)
            sh = tl.sum(gh * h_prev, axis=1)  # <g_h, h[t-1]> per row
            tl.store(
                gdt_ptr + (row * HEADS + head) * N_PB + pb, tl.sum(A * a * sh + x * ghB, axis=0)
            )
            gA += dt * a * sh
            gh = a * gh  # into the step before
            if PACKED and HAS_INIT:  # noqa: SIM102 (compile-time, then a run-time branch)
                if t == tl.load(cu_ptr + s):  # a sequence's first step: dL/dinitial
                    tl.store(gi_ptr + s * HEADS * HEADDIM * N + state, gh, mask=tile_ok)
    if not PACKED and HAS_INIT:
        tl.store(gi_ptr + b * HEADS * HEADDIM * N + state, gh, mask=tile_ok)
    program_row = (b * HEADS + head) * N_PB + pb
    tl.store(gA_ptr + program_row, tl.sum(gA, axis=0))
    if HAS_D:
        tl.store(gD_ptr + (b * HEADS + head) * HEADDIM + p, gD, mask=p_ok)


@triton.jit
def _chunked_forward_kernel(
    x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, init_ptr, cu_ptr, seq_ptr,
    out_ptr, final_ptr, ck_ptr,
    L, HEADS, HEADDIM, N, GROUPS, RATIO, N_PB, K, N_CHUNKS,
    HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_INIT: tl.constexpr, PACKED: tl.constexpr,
    ACC: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
    BLOCK_T: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The forward by the state-space dual form, blocks of BLOCK_T steps (not packed:
    PACKED must be False; cu_ptr and seq_ptr are not read). Within a block, with
    la[t] = dt[t] A, seg[i, j] = la[j+1] + ... + la[i] (i >= j) and cum[i] = la[0] +
    ... + la[i]:

        y[i]  = sum_{j <= i} exp(seg[i, j]) dt[j] (C[i] . B[j]) x[j] + exp(cum[i]) h C[i]
        h_end = exp(cum[T-1]) h + sum_j exp(seg[T-1, j]) dt[j] x[j] (outer) B[j]

    four matrix products per block (C B^T, its weighted product with x, C h^T and
    x^T B) instead of T rank-one updates. seg is summed directly (a cumulative sum
    of a masked matrix, not a difference of running sums, which would cancel), and
    steps past L have dt = 0: a decay of 1 and no input. K is a multiple of BLOCK_T."""
    b, head, _, group, p, n, p_ok, n_ok, tile, tile_ok = _program(
        HEADS, HEADDIM, N, RATIO, N_PB, BLOCK_P, BLOCK_N
    )  # fmt: skip
    A, Dv, state = _head(A_ptr, D_ptr, head, HEADDIM, N, p, p_ok, tile, HAS_D, ACC, BLOCK_P)
    h = tl.zeros((BLOCK_P, BLOCK_N), ACC)
    if HAS_INIT:
        h = tl.load(init_ptr + b * HEADS * HEADDIM * N + state, mask=tile_ok, other=0.0)
        h = h.to(ACC)
    i = tl.arange(0, BLOCK_T)
    causal = i[:, None] >= i[None, :]  # [i, j]: j <= i
    for t0 in tl.range(0, L, BLOCK_T, num_stages=STAGES):
        if t0 % K == 0:
            ck = ((b * N_CHUNKS + t0 // K) * HEADS * HEADDIM) * N + state
            tl.store(ck_ptr + ck, h, mask=tile_ok)
        t = t0 + i
        t_ok = t < L
        row = b * L + t  # [BLOCK_T]
        dt = tl.load(dt_ptr + row * HEADS + head, mask=t_ok, other=0.0).to(ACC)
        at = (row[:, None] * HEADS + head) * HEADDIM + p[None, :]  # [BLOCK_T, BLOCK_P]
        tp_ok = t_ok[:, None] & p_ok[None, :]
        x = tl.load(x_ptr + at, mask=tp_ok, other=0.0).to(ACC)
        bc = (row[:, None] * GROUPS + group) * N + n[None, :]  # [BLOCK_T, BLOCK_N]
        tn_ok = t_ok[:, None] & n_ok[None, :]
        Bt = tl.load(B_ptr + bc, mask=tn_ok, other=0.0).to(ACC)
        Ct = tl.load(C_ptr + bc, mask=tn_ok, other=0.0).to(ACC)
        la = dt * A
        cum = tl.cumsum(la, 0)
        # seg[i, j]: the cumulative sum over k of la[k] for j < k (row k, column j)
        seg = tl.cumsum(tl.where(i[:, None] > i[None, :], la[:, None], 0.0), 0)
        decay = tl.where(causal, tl.exp(seg), 0.0)
        cb = tl.dot(Ct, tl.trans(Bt), input_precision=PRECISION)  # [i, j] = C[i] . B[j]
        xdt = x * dt[:, None]
        # causality under NaN and inf: the mask selects (a later B's NaN times 0 would
        # reach an earlier row), and a non-finite dt x[j, p] (which makes the state's
        # row p, and channel p of every output from step j on, non-finite) is zeroed in
        # the product over the block's steps from j on, those entries made NaN
        bad = (xdt != xdt) | (tl.abs(xdt) == float("inf"))
        spoilt = tl.cumsum(bad.to(tl.int32), 0) > 0
        w = tl.where(causal, cb * decay, 0.0)
        y = tl.dot(w, tl.where(spoilt, 0.0, xdt), input_precision=PRECISION)
        y = tl.where(spoilt, float("nan"), y)
        y += tl.exp(cum)[:, None] * tl.dot(Ct, tl.trans(h), input_precision=PRECISION)
        if HAS_D:
            y += Dv[None, :] * x
        if HAS_Z:
            zz = tl.load(z_ptr + at, mask=tp_ok, other=0.0).to(ACC)
            y = y * zz / (1.0 + tl.exp(-zz))
        tl.store(out_ptr + at, y, mask=tp_ok)
        # the block's decay to its end, per step (seg's last row) and whole (cum's last)
        to_end = tl.sum(tl.where(i[:, None] == BLOCK_T - 1, decay, 0.0), axis=0)  # [j]
        whole = tl.sum(tl.where(i == BLOCK_T - 1, tl.exp(cum), 0.0), axis=0)
        h = whole * h + tl.dot(tl.trans(xdt * to_end[:, None]), Bt, input_precision=PRECISION)
    tl.store(final_ptr + b * HEADS * HEADDIM * N + state, h, mask=tile_ok)


forward_kernel = _forward_kernel
chunked_forward_kernel = _chunked_forward_kernel
backward_kernel = _backward_kernel
