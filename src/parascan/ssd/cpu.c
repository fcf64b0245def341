/* The SSD scan's CPU kernel (Mamba-2's scan), forward and fused backward, float32 and
 * float64. The ABI is in abi.h (ps_ssd_args), the contract and the math in
 * ssd/canonical.py.
 *
 * Summary of algorithm.
 *   Each (batch row, head) is an independent scan of a (headdim, N) state with one
 *   scalar decay a[t] = exp(dt[t] A) per step. The kernel runs the recurrence itself,
 *   step by step, with the head's state held in L1 (64 x 64 floats: 16 KiB), stored
 *   transposed (hT[n][p]) so that every operation of a step is a vector over headdim
 *   times a broadcast scalar of B[t] or C[t]:
 *       hT[n] = a hT[n] + (dt x) B[t, n],   y += hT[n] C[t, n]     for n < N
 *   The forward keeps the decays out of the state where it can (the state held as
 *   h / scale, scale the product of the decays since it was last true, cpu_kernel.h,
 *   ps_ssd_fwd_task): a step is then hT[n] += (dt x / scale) B[t, n] and y is scale
 *   times the sum, two fused multiply-adds per state element instead of a multiply
 *   and two, and steps go two in one pass over the state; the scale is folded back
 *   (a full step) before each checkpoint, at each sequence's end and wherever it
 *   would leave [SCALE_LO, SCALE_HI]. Vectors of dt x and y are kept in registers,
 *   no lane sums. The rest of a step (dt x, D x, the silu(z) gate, and in the
 *   backward the rows of grad_x, grad_z and the sums of grad_dt and grad_D) is vector
 *   code too,
 *   silu through the shared vector exp (_native/vector_math.h, a few ulp): one libm exp
 *   per step and head (the decay) is all that is left scalar. Work units are (batch
 *   row, head) pairs (split further along headdim when
 *   there are fewer pairs than threads: rows of the state never interact); the
 *   backward hands its units to threads one at a time, since a unit's cost grows with
 *   its decays. The state entering every K-th step is stored as its checkpoint.
 *   Packed sequences are walked
 *   one after the other inside a unit: the state is reloaded from that sequence's
 *   initial state (or zeros) at its first step and stored as its final state after
 *   its last, so none crosses a boundary.
 *
 * Why the sequential recurrence and not the chunked (state-space duality) form.
 *   The chunked form turns a chunk of Q steps into matrix products: C B^T (Q x Q x N),
 *   its masked decays times x (Q x Q x headdim) and the chunk's state update and
 *   output (2 Q N headdim), about (Q / 2) (N + headdim) + 2 N headdim multiply-adds a
 *   step and head against the recurrence's 2 N headdim: at Q = 64 and N = headdim = 64
 *   1.5 times the work, plus the decay matrices' exps and the intermediate (Q, Q)
 *   tensors that go through memory. On a CPU the recurrence is not latency bound
 *   here (the N headdim lanes of a step are independent, thousands of them), so it
 *   runs at the vector units' multiply-add rate like a matrix product does, with
 *   its state never leaving L1. Measured on two shared (loaded) Sapphire Rapids
 *   cores at (1, L, 24 heads, 64, N 64), float32, against torch.bmm doing the
 *   recurrence's 2 N headdim multiply-adds a step: forward 1.2x (L 512) and 1.8x
 *   (L 4096) of that time, 5-10x faster than the chunked torch backend (forward
 *   and backward 5-15x); with bmm on an idle moment (1.2 ms at L 512) the forward
 *   is several times its limit, so the figures are bounds of a noisy machine. The
 *   chunked form wins where the matrix units are much faster
 *   than the vector ones (GPUs' tensor cores: the triton backend) or where N and
 *   headdim are so small that a step's state does not fill the vectors.
 *
 *   The backward walks the chunks from last to first per unit. A chunk's states are
 *   rebuilt from its checkpoint one at a time in place (pass 1, forward: grad_C,
 *   grad_z), then the adjoint recurrence runs backwards (pass 2):
 *       G[t] = a[t+1] G[t+1] + gy[t] (outer) C[t]    (G at a sequence's last step:
 *                                                     its grad_final)
 *       grad_B[t] = sum_p G[t] u[t],  grad_u[t] = G[t] B[t],  grad_a[t] = <G[t], h[t-1]>
 *   where grad_a comes from the per-step sums <C, grad_C> and <B, grad_B> instead of a
 *   multiply-add per state element (cpu_kernel.h, ps_ssd_bwd_chunk), so pass 2 reads no
 *   state: only the few steps where that difference would cancel keep theirs. A
 *   sequence's first step leaves a[t] G[t], its grad_initial. The sums over
 *   headdim (grad_B, grad_C) take vector lanes: W rows are summed at once by a tree
 *   of shuffles. grad_B and grad_C are kept per head for a span of chunks (at most
 *   PS_SSD_PARTIAL_BYTES), then summed over each group's heads in head order; A's and
 *   D's gradients are per unit, then summed over the batch in batch order: the same
 *   bits for any number of threads. No buffer holds a (batch, L, heads, headdim, N)
 *   tensor: at most one chunk of states per thread, the adjoint state per unit.
 *
 *   The hot functions are compiled three times (x86-64-v4: 16 floats a vector;
 *   x86-64-v3: 8; the baseline: 4), the first two with fused multiply-adds, and the
 *   CPU picks at run time (args.simd = 0 forces the baseline, for tests). The
 *   instruction sets round differently (fused or not): results agree to rounding,
 *   not bit for bit.
 */
#include "common.h"
#include "isa.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* The backward's per-head sums of grad_B and grad_C over a span of chunks, at most. */
#define PS_SSD_PARTIAL_BYTES (INT64_C(1) << 24)

/* 64-byte aligned memory, the size rounded up as aligned_alloc requires. */
static void *ps_ssd_alloc(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

static int ps_ssd_check(const ps_ssd_args *a, int backward) {
    if (a->batch < 0 || a->length < 0 || a->heads < 0 || a->headdim < 0 || a->nstate < 0 ||
        a->chunk < 1 || a->groups < 1 || a->heads % a->groups != 0)
        return -1;
    if (a->cu_seqlens) {
        if (a->batch != 1 || a->nseq < 0 || a->cu_seqlens[0] != 0 ||
            a->cu_seqlens[a->nseq] != a->length)
            return -1;
        for (int64_t s = 0; s < a->nseq; ++s)
            if (a->cu_seqlens[s + 1] < a->cu_seqlens[s]) return -1;
    }
    const int64_t steps = a->batch * a->length * a->heads;
    const int64_t elems = steps * a->headdim;
    const int64_t bc = a->batch * a->length * a->groups * a->nstate;
    if ((elems && !a->x) || (steps && !a->dt) || (a->heads && !a->A) || (bc && (!a->B || !a->C)))
        return -1;
    if (!backward)
        return (elems && !a->out) || (steps * a->nstate * a->headdim != 0 && !a->checkpoints)
                   ? -1
                   : 0;
    return (elems && (!a->grad_out || !a->grad_x || (a->z && !a->grad_z))) ||
                   (steps && !a->grad_dt) ||
                   (a->heads && !a->grad_A) || (bc && (!a->grad_B || !a->grad_C)) ||
                   (a->D && a->heads * a->headdim != 0 && !a->grad_D) ||
                   (steps * a->nstate * a->headdim != 0 && !a->checkpoints)
               ? -1
               : 0;
}

/* ---- float32 ---------------------------------------------------------------------- */
#define T float
#define TBYTES 4
#define TI int32_t
#define TU uint32_t
#define EXP expf
#define LO (-80.0f)
#define SCALE_LO 0x1p-30f /* the forward's scaled state (cpu_kernel.h, ps_ssd_fwd_task) */
#define SCALE_HI 0x1p30f
#define SFX f32
#include "cpu_levels.h"

/* ---- float64 ---------------------------------------------------------------------- */
#define T double
#define TBYTES 8
#define TI int64_t
#define TU uint64_t
#define EXP exp
#define LO (-700.0)
#define SCALE_LO 0x1p-200
#define SCALE_HI 0x1p200
#define SFX f64
#include "cpu_levels.h"

/* ---- entry points ----------------------------------------------------------------- */

/* Each entry runs the instance of the level the CPU has (_native/isa.h), the
 * baseline when a->simd is 0. */
#define PS_SSD_DISPATCH(fn, sfx, a) PS_ISA_DISPATCH(fn##_##sfx, (a)->simd, a)

/* An entry: check the arguments, clear the failure flag, run the level's instance. */
#define PS_SSD_ENTRY(name, check, backward, sfx, args_t)        \
    PS_API int name##_##sfx(args_t *a) {                          \
        if (check(a, backward)) return -1;                        \
        a->failed = 0;                                            \
        PS_SSD_DISPATCH(name, sfx, a)                             \
    }
PS_SSD_ENTRY(ps_ssd_fwd, ps_ssd_check, 0, f32, ps_ssd_args)
PS_SSD_ENTRY(ps_ssd_fwd, ps_ssd_check, 0, f64, ps_ssd_args)
PS_SSD_ENTRY(ps_ssd_bwd, ps_ssd_check, 1, f32, ps_ssd_args)
PS_SSD_ENTRY(ps_ssd_bwd, ps_ssd_check, 1, f64, ps_ssd_args)

/* The layer's convolution and gated norm (cpu_layer.h). */
static int ps_ssd_conv_check(const ps_ssd_conv_args *a, int backward) {
    if (a->batch < 0 || a->length < 0 || a->channels < 0 || a->width < 1 ||
        a->width > PS_SSD_CONV_MAX_WIDTH || a->split[0] < 0 || a->split[1] < 0 ||
        a->split[2] < 0 || a->split[0] + a->split[1] + a->split[2] != a->channels)
        return -1;
    const int64_t rows = a->batch * a->length;
    if (rows * a->channels != 0 && !a->x) return -1;
    if (a->channels && !a->weight) return -1;
    for (int p = 0; p < 3; ++p)
        if (rows * a->split[p] != 0 && !(backward ? a->grad_out[p] : a->out[p])) return -1;
    if (backward && ((rows * a->channels != 0 && !a->grad_x) || (a->channels && !a->grad_weight) ||
                     (a->channels && a->bias && !a->grad_bias)))
        return -1;
    return 0;
}

static int ps_ssd_norm_check(const ps_ssd_norm_args *a, int backward) {
    if (a->batch < 0 || a->length < 0 || a->dim < 1 || a->groups < 1 || a->dim % a->groups)
        return -1; /* dim 0: no norm (its rows' rstd would be 0 / 0) */
    const int64_t elems = a->batch * a->length * a->dim;
    if (elems && (!a->y || !a->z || !a->rstd)) return -1;
    if (a->dim && !a->weight) return -1;
    if (!backward) return elems && !a->out ? -1 : 0;
    return (elems && (!a->grad_out || !a->grad_y || !a->grad_z)) || (a->dim && !a->grad_weight)
               ? -1
               : 0;
}

PS_SSD_ENTRY(ps_ssd_conv_fwd, ps_ssd_conv_check, 0, f32, ps_ssd_conv_args)
PS_SSD_ENTRY(ps_ssd_conv_fwd, ps_ssd_conv_check, 0, f64, ps_ssd_conv_args)
PS_SSD_ENTRY(ps_ssd_conv_bwd, ps_ssd_conv_check, 1, f32, ps_ssd_conv_args)
PS_SSD_ENTRY(ps_ssd_conv_bwd, ps_ssd_conv_check, 1, f64, ps_ssd_conv_args)
PS_SSD_ENTRY(ps_ssd_norm_fwd, ps_ssd_norm_check, 0, f32, ps_ssd_norm_args)
PS_SSD_ENTRY(ps_ssd_norm_fwd, ps_ssd_norm_check, 0, f64, ps_ssd_norm_args)
PS_SSD_ENTRY(ps_ssd_norm_bwd, ps_ssd_norm_check, 1, f32, ps_ssd_norm_args)
PS_SSD_ENTRY(ps_ssd_norm_bwd, ps_ssd_norm_check, 1, f64, ps_ssd_norm_args)
