/* The delta rule's CPU kernel (DeltaNet, Gated DeltaNet, Kimi Delta Attention),
 * forward and fused backward, float32 and float64. The ABI is in abi.h
 * (ps_delta_args), the contract and the math in delta_rule/canonical.py.
 *
 * Summary of algorithm.
 *   Each (batch row, value head) is an independent recurrence of a (K, V) state, and
 *   each column of that state evolves on its own given k, beta and the decays:
 *       x[t]   = S[t-1]^T (d[t] k[t]),  u[t] = beta[t] (v[t] - x[t])
 *       S[t]   = Diag(d[t]) S[t-1] + k[t] u[t]^T,   d[t] = exp(g[t]) (1 without a gate)
 *       o[t]   = S[t]^T q[t] = S[t-1]^T (d[t] q[t]) + (k[t] . q[t]) u[t]
 *   The kernel runs that recurrence step by step on column blocks of VB lanes (256
 *   bytes of a row, 64 floats or 32 doubles, with AVX-512; 128 bytes on the other
 *   levels), a block's K rows (32 KiB at K = 128) held in L1, with every operation a
 *   vector over the block's columns times a broadcast scalar: a step is one sweep
 *   over the rows that applies the update and reads the next step's x and S^T (d q)
 *   from the updated row (a multiply and three multiply-adds per state element, d k
 *   and d q precomputed per chunk of steps: a gate per key channel costs what a gate
 *   per head does). Work units are (batch row,
 *   head) pairs, split further into groups of column blocks when there are fewer
 *   pairs than threads. The state entering every chunk (`chunk` steps, 64) is stored
 *   as its checkpoint; packed sequences are walked one after the other inside a
 *   unit, the state reloaded from each one's initial state (or zeros) at its first
 *   step and stored as its final state after its last.
 *
 * Why the recurrence and not the chunked WY (UT transform) form.
 *   The chunked form (the torch backend, delta_rule/chunked.py) turns c steps into
 *   matrix products and one triangular solve: about c (K + V) / 2 + 3 K V multiply-
 *   adds a step against the recurrence's 3 K V, plus with a gate per key channel a
 *   (c, c, K) tensor of decays per block. On a CPU the recurrence is not latency
 *   bound (a step's K V lanes are independent), so it runs at the vector units'
 *   multiply-add rate as a matrix product would, its state never leaving L1, and
 *   needs no exp of a decay difference: measured at Qwen3.5's shape (BENCHMARKS.md)
 *   the C forward is several times faster than the torch backend's. The chunked form
 *   wins where matrix units far outrun the vector ones (GPUs' tensor cores).
 *
 * The backward.
 *   Per unit, the chunks from last to first, per chunk the column blocks in order:
 *   the block's states before each step of the chunk are rebuilt from the checkpoint
 *   (chunk x K x VB: 2 MiB at K = 128 with AVX-512, in L2 and beyond), then the adjoint
 *   runs from the chunk's last step to its first, with dS the gradient of the state
 *   after step t:
 *       dS += q go^T,  du = dS^T k,  dv = beta du,  grad_beta = du . (v - x)
 *       grad_q = Diag(d) S[t-1] go + k (u . go),  dP = dS - k dv^T
 *       grad_k = dS u - Diag(d) S[t-1] dv,  grad_g = rows of dP * Diag(d) S[t-1]
 *       dS = Diag(d) dP   (the gradient of the state before the step)
 *   The sums over a row's columns (grad_q, grad_k, a key channel's grad_g) take lane
 *   sums of a vector per row, W rows at a time by a tree of shuffles. A block's
 *   shares are added into the chunk's sums in block order, and value heads that
 *   share q and k heads (grouped heads) are summed in head order after all units:
 *   the same bits for any number of threads. dS at a sequence's last step is its
 *   grad_final (or zeros) and at its first becomes its grad_initial. No buffer holds
 *   a (batch, L, heads, K, V) tensor: one chunk of one block's states per thread.
 *
 * Why those block widths.
 *   A row's lane sums cost the same whatever the block's width, and the adjoint takes
 *   three a row (grad_q's, grad_k's and, with a gate per key channel, grad_g's): a
 *   wider block spreads them over more columns. With 64-byte vectors, blocks of 256
 *   bytes (4 vectors) measured the backward 10 to 15% faster than blocks of 128 bytes
 *   (AMD EPYC Zen 4, Qwen3.5's and Kimi Linear's shapes, 1 and 2 threads; the forward
 *   the same), although a chunk's rebuilt states (2 MiB) then outgrow its 1 MiB L2;
 *   the forward's four sets of NB accumulators still fit the 32 vector registers. The
 *   levels with 16 registers keep 128 bytes (AVX2: 4 vectors; the baseline: 8).
 *
 *   The hot functions are compiled three times (x86-64-v4: 16 floats a vector;
 *   x86-64-v3: 8; the baseline: 4), the first two with fused multiply-adds, and the
 *   CPU picks at run time (args.simd = 0 forces the baseline, for tests).
 */
#include "common.h"
#include "isa.h"
#include "kv_state.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h> /* the decoding step's non-temporal stores (_native/kv_tiles.h) */
#endif

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static int ps_delta_check(const ps_delta_args *a, int backward) {
    if (a->batch < 0 || a->length < 0 || a->kheads < 1 || a->heads < 1 || a->dk < 1 ||
        a->dv < 1 || a->chunk < 1 || a->heads % a->kheads != 0 || a->gate < 0 || a->gate > 2 ||
        a->qk_form < 0 || a->qk_form > 2)
        return -1;
    if (a->cu_seqlens && ps_kv_bad_offsets(a->cu_seqlens, a->nseq, a->batch, a->length))
        return -1;
    const int64_t steps = a->batch * a->length * a->heads;
    if (steps && (!a->q || !a->k || !a->v || !a->beta || (a->gate && !a->g))) return -1;
    if (!backward) return steps && !a->out ? -1 : 0; /* checkpoints NULL: none stored */
    if (a->qk_form) return -1; /* the backward takes canonical q and k */
    return steps && (!a->checkpoints || !a->grad_out || !a->grad_q || !a->grad_k || !a->grad_v || !a->grad_beta ||
                     (a->gate && !a->grad_g))
               ? -1
               : 0;
}

/* The states of the sequences with no step: the final state is the initial one
 * (zeros without it), and so grad_initial is grad_final. */
static void ps_delta_empty(const ps_delta_args *a, int backward, size_t elem) {
    ps_kv_empty_states(a->cu_seqlens, a->nseq, a->batch, a->length,
                       elem * (size_t)(a->heads * a->dk * a->dv),
                       backward ? a->grad_final : a->initial,
                       backward ? a->grad_initial : a->final);
}

/* ---- float32 ---------------------------------------------------------------------- */
#define PS_ISA_INSTANCE "../delta_rule/cpu_instance.h"
#define T float
#define TBYTES 4
#define TI int32_t
#define TU uint32_t
#define EXP expf
#define SQRT sqrtf
#define SFX f32
#include "isa_levels.h"
#undef T
#undef TBYTES
#undef TI
#undef TU
#undef EXP
#undef SQRT
#undef SFX

/* ---- float64 ---------------------------------------------------------------------- */
#define T double
#define TBYTES 8
#define TI int64_t
#define TU uint64_t
#define EXP exp
#define SQRT sqrt
#define SFX f64
#include "isa_levels.h"
#undef T
#undef TBYTES
#undef TI
#undef TU
#undef EXP
#undef SQRT
#undef SFX
#undef PS_ISA_INSTANCE

/* ---- entry points ----------------------------------------------------------------- */

/* An entry: check the arguments, clear the failure flag, run the instance of the
 * level the CPU has (_native/isa.h; the baseline when a->simd is 0), then the
 * sequences with no step. */
#define PS_DELTA_ENTRY(name, backward, sfx, elem)                        \
    PS_API int name##_##sfx(ps_delta_args *a) {                           \
        if (ps_delta_check(a, backward)) return -1;                      \
        a->failed = 0;                                                    \
        int rc;                                                           \
        switch (ps_isa_level(a->simd)) {                                  \
        PS_DELTA_CASES(name, sfx)                                         \
        default: rc = name##_##sfx##_base(a);                             \
        }                                                                 \
        if (rc == 0) ps_delta_empty(a, backward, elem);                   \
        return rc;                                                        \
    }
#if PS_ISA_X86
#define PS_DELTA_CASES(name, sfx)                                         \
    case PS_ISA_V4: rc = name##_##sfx##_v4(a); break;                     \
    case PS_ISA_V3: rc = name##_##sfx##_v3(a); break;
#else
#define PS_DELTA_CASES(name, sfx)
#endif
PS_DELTA_ENTRY(ps_delta_fwd, 0, f32, sizeof(float))
PS_DELTA_ENTRY(ps_delta_fwd, 0, f64, sizeof(double))
PS_DELTA_ENTRY(ps_delta_bwd, 1, f32, sizeof(float))
PS_DELTA_ENTRY(ps_delta_bwd, 1, f64, sizeof(double))
