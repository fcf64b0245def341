/* The generalized delta rule's CPU kernel (diagonal plus rank one: RWKV-7), forward and
 * fused backward, float32 and float64. The ABI is in abi.h (ps_dplr_args), the contract
 * and the math in dplr/canonical.py.
 *
 * Summary of algorithm.
 *   Each (batch row, value head) is an independent recurrence of a (K, V) state, and
 *   each column of that state evolves on its own given a, b, k and the decays:
 *       x[t] = S[t-1]^T a[t]
 *       S[t] = Diag(d[t]) S[t-1] + b[t] x[t]^T + k[t] v[t]^T,   d[t] = exp(g[t]) (1 without)
 *       o[t] = S[t]^T q[t] = S[t-1]^T (d[t] q[t]) + (b[t] . q[t]) x[t] + (k[t] . q[t]) v[t]
 *   The delta rule's scheme (delta_rule/cpu.c, where the choice of the recurrence over
 *   the chunked form is argued): column blocks of VB lanes of the state (2 vectors:
 *   cpu_instance.h), a block's K rows held in L1, every operation a vector over the
 *   block's columns times a broadcast scalar. A step is one sweep over the rows that
 *   applies the update and reads the next step's x and S^T (d q) from the updated row:
 *   four multiply-adds per state element in the forward's frames (below), the four of
 *   the limit the bench measures. Work units are (batch row, head) pairs, split further
 *   into groups of column blocks when there are fewer pairs than threads; a thread runs
 *   its units chunk by chunk, up to 16 at a time (neighbouring heads' rows of a chunk
 *   share pages: 1.2x faster at RWKV-7's shape than a unit's whole sequence at once). The
 *   state entering every chunk (`chunk` steps, 64) is stored as its checkpoint; packed
 *   sequences are walked one after the other inside a unit, the state reloaded from each
 *   one's initial state (or zeros) at its first step and stored as its final state
 *   after its last. The decoding step reads the state in place and streams the final
 *   one past the caches.
 *
 *   Decays without a multiply per step: frames (linear_attention/cpu.c's). In the forward
 *   a tile holds X = Diag(lam)^-1 S, lam the product of the decays since the frame began
 *   (per key channel, or per head), so that a step is the ungated one on rescaled
 *   operands, prepared per chunk (an exp and a division per key channel):
 *       x = X^T (a lam'),  X += (b / lam) x^T + (k / lam) v^T,  S^T (d q) = X^T (d q lam')
 *   (lam' the product before the step, lam = lam' d after it). A step rebases, X = Diag(
 *   lam) X + b x^T + k v^T (the multiply again) and a new frame with lam = 1, when log lam
 *   would leave [-16, 16] (float32; [-32, 32] for float64) or is not finite (a zero
 *   decay, a NaN), and always at a chunk's and a sequence's last step, so that
 *   checkpoints and final states are the true state. A frame's first step has lam' = 1:
 *   its operands are the plain step's bits (a decoding step's, too). Rounding: the terms
 *   of X are those of S times 1 / lam, each read back times a lam no larger (decays <= 1),
 *   so errors stay relative to the largest term as in the plain recurrence. At RWKV-7's
 *   shape the forward went from 1.76x to 1.53x the multiply-add limit. The backward
 *   rebuilds a chunk's states in the same frames (the forward's bits, three operations
 *   an element instead of four); the adjoint's sums over a row of S[t-1] are taken over
 *   the row of X and multiplied by the row's lam' (grad_a) or lam = lam' d (grad_q,
 *   grad_g), once per row, step and column block.
 *
 *   Unlike the chunked form (the torch backend, dplr/chunked.py), the recurrence solves
 *   no triangular system: its rounding is the float64 loop's, step for step, in the
 *   state's type.
 *
 * The backward.
 *   Per unit (a q/k head with its value heads, in head order; up to 16 units chunk by
 *   chunk, as the forward's), the chunks from last to first, per head and group of
 *   column blocks: each block's states before each step of the chunk and each step's x
 *   are rebuilt from the checkpoint (chunk x blocks x K x VB), then the adjoint runs
 *   from the chunk's last step to its first, with dS the gradient of the state after
 *   step t:
 *       dS += q go^T,  dx = dS^T b,  grad_v = dS^T k,  grad_b = dS x,  grad_k = dS v,
 *       grad_q = Diag(d) S[t-1] go + b (x . go) + k (v . go),
 *       grad_g = d * rows of dS * S[t-1],  grad_a = S[t-1] dx,
 *       dS = Diag(d) dS + a dx^T   (the gradient of the state before the step)
 *   the last two lines (part B) of step t in the same sweep as the first three (part
 *   A) of step t - 1. A group holds as many column blocks as a chunk's rebuilt states
 *   of 1 MiB take (4 of 16 lanes at RWKV-7's K = V = 64 and 64 steps), and a step
 *   sweeps them one after the other, so that the sums over a row's columns are vectors
 *   carried from block to block and summed over their lanes once per row, step and
 *   group (W rows at a time, by a lane-sum tree whose in-lane levels come first). Groups
 *   add their shares into the chunk's sums in block order and value heads that share
 *   q/k heads in head order: the same bits for any number of threads. dS at a
 *   sequence's last step is its grad_final (or zeros) and at its first becomes its
 *   grad_initial. No buffer holds a (batch, L, heads, K, V) tensor: one chunk of one
 *   group's states per thread.
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

static int ps_dplr_check(const ps_dplr_args *a, int backward) {
    if (a->batch < 0 || a->length < 0 || a->kheads < 1 || a->heads < 1 || a->dk < 1 ||
        a->dv < 1 || a->chunk < 1 || a->heads % a->kheads != 0 || a->gate < 0 || a->gate > 2)
        return -1;
    double scale;
    memcpy(&scale, &a->scale_bits, sizeof scale);
    if (!isfinite(scale) || (backward && scale != 1.0)) return -1; /* the backward's q: canonical */
    if (a->cu_seqlens && ps_kv_bad_offsets(a->cu_seqlens, a->nseq, a->batch, a->length))
        return -1;
    const int64_t steps = a->batch * a->length * a->heads;
    if (steps && (!a->q || !a->k || !a->v || !a->a || !a->b || (a->gate && !a->g))) return -1;
    if (!backward) return steps && !a->out ? -1 : 0; /* checkpoints NULL: none stored */
    return steps && (!a->checkpoints || !a->grad_out || !a->grad_q || !a->grad_k ||
                     !a->grad_v || !a->grad_a || !a->grad_b || (a->gate && !a->grad_g))
               ? -1
               : 0;
}

/* The states of the sequences with no step: the final state is the initial one (zeros
 * without it), and so grad_initial is grad_final. */
static void ps_dplr_empty(const ps_dplr_args *a, int backward, size_t elem) {
    ps_kv_empty_states(a->cu_seqlens, a->nseq, a->batch, a->length,
                       elem * (size_t)(a->heads * a->dk * a->dv),
                       backward ? a->grad_final : a->initial,
                       backward ? a->grad_initial : a->final);
}

/* ---- float32 ---------------------------------------------------------------------- */
#define PS_ISA_INSTANCE "../dplr/cpu_instance.h"
#define T float
#define TBYTES 4
#define TI int32_t
#define TU uint32_t
#define EXP expf
#define SFX f32
#include "isa_levels.h"
#undef T
#undef TBYTES
#undef TI
#undef TU
#undef EXP
#undef SFX

/* ---- float64 ---------------------------------------------------------------------- */
#define T double
#define TBYTES 8
#define TI int64_t
#define TU uint64_t
#define EXP exp
#define SFX f64
#include "isa_levels.h"
#undef T
#undef TBYTES
#undef TI
#undef TU
#undef EXP
#undef SFX
#undef PS_ISA_INSTANCE

/* ---- entry points ----------------------------------------------------------------- */

/* An entry: check the arguments, clear the failure flag, run the instance of the level
 * the CPU has (_native/isa.h; the baseline when a->simd is 0), then the sequences with
 * no step. */
#define PS_DPLR_ENTRY(name, backward, sfx, elem)                         \
    PS_API int name##_##sfx(ps_dplr_args *a) {                            \
        if (ps_dplr_check(a, backward)) return -1;                       \
        a->failed = 0;                                                    \
        int rc;                                                           \
        switch (ps_isa_level(a->simd)) {                                  \
        PS_DPLR_CASES(name, sfx)                                          \
        default: rc = name##_##sfx##_base(a);                             \
        }                                                                 \
        if (rc == 0) ps_dplr_empty(a, backward, elem);                    \
        return rc;                                                        \
    }
#if PS_ISA_X86
#define PS_DPLR_CASES(name, sfx)                                          \
    case PS_ISA_V4: rc = name##_##sfx##_v4(a); break;                     \
    case PS_ISA_V3: rc = name##_##sfx##_v3(a); break;
#else
#define PS_DPLR_CASES(name, sfx)
#endif
PS_DPLR_ENTRY(ps_dplr_fwd, 0, f32, sizeof(float))
PS_DPLR_ENTRY(ps_dplr_fwd, 0, f64, sizeof(double))
PS_DPLR_ENTRY(ps_dplr_bwd, 1, f32, sizeof(float))
PS_DPLR_ENTRY(ps_dplr_bwd, 1, f64, sizeof(double))
