/* Gated linear attention's CPU kernel (linear attention, simple GLA, RetNet, Lightning
 * attention, GLA, HGRN2), forward and fused backward, float32 and float64. The ABI is
 * in abi.h (ps_linear_attention_args), the contract and the math in
 * linear_attention/canonical.py: per (batch row, value head), with d[t] = exp(g[t])
 * (1 without a gate),
 *       S[t] = Diag(d[t]) S[t-1] + k[t] v[t]^T,   o[t] = S[t]^T q[t].
 *
 * Summary of algorithm.
 *   The delta rule's scheme (delta_rule/cpu.c) without the erase term: column blocks of
 *   the (K, V) state, every operation a vector over a block's columns times a broadcast
 *   scalar. Here the state's rows never interact, so a register block of RB rows of a
 *   column block (cpu_instance.h) stays in registers through all the steps of a chunk
 *   (`chunk`, 64): a step is, per row i, x_i += k_i v (a multiply-add, k_i broadcast)
 *   and o += q_i x_i (another), the output's partial sums added into the chunk's output
 *   rows once per register block, in block order. Work units are (batch row, head)
 *   pairs, split further into groups of column blocks when there are fewer pairs than
 *   threads: the same bits for any thread count. The decoding step (one step from a
 *   state, nothing kept for a backward) reads the state in place and streams the final
 *   one past the caches, the same operations in the same order.
 *
 * Decays without a multiply per step: frames.
 *   A decay would cost a multiply per state element and step (a third of the work). The
 *   tile instead holds X = Diag(lam)^-1 S, lam the product of the decays since the last
 *   "rebase" (per key channel): a step then adds (k / lam) v^T to X and reads the output
 *   as X^T (q lam), exactly the ungated step on rescaled k and q (prepared per chunk,
 *   a few exps per key channel). A step rebases (X = Diag(lam d) X + k v^T, back to
 *   lam = 1) when log lam would leave [-PS_LA_FRAME, PS_LA_FRAME] (or is not finite: a
 *   -inf reset, a NaN), and always at a chunk's and a sequence's last step, so that
 *   checkpoints and final states are the true state. Rounding: the terms of X are those
 *   of S times 1 / lam, each read back times a lam no larger (decays <= 1), so errors
 *   stay relative to the largest term as in the plain recurrence; the frame's bound only
 *   keeps X within range (|X| <= |S| e^PS_LA_FRAME). A NaN or infinity reaches the
 *   outputs of its step and the later ones only (a step's frame depends on the decays
 *   up to it alone).
 *
 * The backward.
 *   Per unit (a q/k head with its value heads, in head order), per head, the chunks from
 *   last to first, per register block: sweep A rebuilds the chunk's states from its
 *   checkpoint in the same frames and takes grad q~ = X go (the rows' lane sums of
 *   vectors summed over the column blocks, then reduced W steps at a time); sweep B runs
 *   the adjoint from the chunk's last step to its first in the same frames:
 *       dX += q~ go^T,  grad k~ = dX v,  grad v = dX^T k~,  dX = Diag(lam d) dX (rebase)
 *   (dX is the gradient of the state in the step's frame; at a sequence's last step it
 *   is its grad_final, at its first it becomes its grad_initial). grad q = lam grad q~,
 *   grad k = grad k~ / lam. The gates need no sweep of their own:
 *       grad_g[t] = q[t] * grad_q[t] - k[t] * grad_k[t] + grad_g[t+1]   (per channel)
 *   (from grad_g[t] = d[t] * rowsum(dS[t] * S[t-1])), started at a sequence's last step
 *   from rowsum(grad_final * S) and at a chunk's last step from rowsum(dS * S), the
 *   state's gradient carried in from the next chunk (both taken by sweep A), so that a
 *   sum runs over one chunk at most. A gate per head sums the channels. Grouped heads'
 *   grad_q and grad_k are summed in head order: the same bits for any thread count. No
 *   buffer holds a (batch, L, heads, K, V) tensor, nor a chunk's states.
 *
 *   The hot functions are compiled three times (x86-64-v4: 16 floats a vector;
 *   x86-64-v3: 8; the baseline: 4), the first two with fused multiply-adds, and the CPU
 *   picks at run time (args.simd = 0 forces the baseline, for tests).
 */
#include "common.h"
#include "isa.h"
#include "kv_state.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h> /* the decoding step's non-temporal stores (_native/kv_tiles.h) */
#endif

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* A step's flags (cpu_kernel.h, the preparation of a chunk). */
enum { PS_LA_REBASE = 1, PS_LA_START = 2, PS_LA_END = 4 };

static int ps_la_check(const ps_linear_attention_args *a, int backward) {
    if (a->batch < 0 || a->length < 0 || a->kheads < 1 || a->heads < 1 || a->dk < 1 ||
        a->dv < 1 || a->chunk < 1 || a->heads % a->kheads != 0 || a->gate < 0 || a->gate > 2)
        return -1;
    double scale;
    memcpy(&scale, &a->scale_bits, sizeof scale);
    if (!isfinite(scale) || (backward && scale != 1.0)) return -1; /* the backward's q: canonical */
    if (a->cu_seqlens && ps_kv_bad_offsets(a->cu_seqlens, a->nseq, a->batch, a->length))
        return -1;
    const int64_t steps = a->batch * a->length * a->heads;
    if (steps && (!a->q || !a->k || !a->v || (a->gate && !a->g))) return -1;
    if (!backward) return steps && !a->out ? -1 : 0; /* checkpoints NULL: none stored */
    return steps && (!a->checkpoints || !a->grad_out || !a->grad_q || !a->grad_k ||
                     !a->grad_v || (a->gate && !a->grad_g))
               ? -1
               : 0;
}

/* ---- float32 ---------------------------------------------------------------------- */
#define PS_ISA_INSTANCE "../linear_attention/cpu_instance.h"
#define T float
#define TBYTES 4
#define TI int32_t
#define TU uint32_t
#define SFX f32
#include "isa_levels.h"
#undef T
#undef TBYTES
#undef TI
#undef TU
#undef SFX

/* ---- float64 ---------------------------------------------------------------------- */
#define T double
#define TBYTES 8
#define TI int64_t
#define TU uint64_t
#define SFX f64
#include "isa_levels.h"
#undef T
#undef TBYTES
#undef TI
#undef TU
#undef SFX
#undef PS_ISA_INSTANCE

/* ---- entry points ----------------------------------------------------------------- */

/* An entry: check the arguments, clear the failure flag, run the instance of the
 * level the CPU has (the baseline when a->simd is 0), then the sequences with no step
 * (their final state is the initial one, their grad_initial the grad_final). */
#define PS_LA_ENTRY(name, fn, backward, sfx, elem)                                       \
    PS_API int name##_##sfx(ps_linear_attention_args *a) {                                \
        if (ps_la_check(a, backward)) return -1;                                          \
        a->failed = 0;                                                                    \
        int rc;                                                                           \
        switch (ps_isa_level(a->simd)) {                                                  \
        PS_LA_CASES(fn, sfx)                                                              \
        default: rc = fn##_##sfx##_base(a);                                               \
        }                                                                                 \
        if (rc == 0)                                                                      \
            ps_kv_empty_states(a->cu_seqlens, a->nseq, a->batch, a->length,               \
                               (elem) * (size_t)(a->heads * a->dk * a->dv),               \
                               backward ? a->grad_final : a->initial,                     \
                               backward ? a->grad_initial : a->final);                    \
        return rc;                                                                        \
    }
#if PS_ISA_X86
#define PS_LA_CASES(fn, sfx)                                                              \
    case PS_ISA_V4: rc = fn##_##sfx##_v4(a); break;                                       \
    case PS_ISA_V3: rc = fn##_##sfx##_v3(a); break;
#else
#define PS_LA_CASES(fn, sfx)
#endif
PS_LA_ENTRY(ps_linear_attention_fwd, ps_la_fwd, 0, f32, sizeof(float))
PS_LA_ENTRY(ps_linear_attention_fwd, ps_la_fwd, 0, f64, sizeof(double))
PS_LA_ENTRY(ps_linear_attention_bwd, ps_la_bwd, 1, f32, sizeof(float))
PS_LA_ENTRY(ps_linear_attention_bwd, ps_la_bwd, 1, f64, sizeof(double))
