/* What the first-order scan kernels (first_order/) share: the work-unit sizes
 * and the helpers that run them, packed sequences, the arithmetic of each
 * accumulation type, and the naming macros of the templates (cpu_forward.h,
 * cpu_backward.h, cpu_packed.h). What every kernel shares is in _native/common.h; the
 * argument structs and their layout are in abi.h.
 */
#ifndef PARASCAN_FIRST_ORDER_CPU_COMMON_H
#define PARASCAN_FIRST_ORDER_CPU_COMMON_H

#include "common.h"

#include <stdint.h>
#include <stdlib.h>

/* Vectorize the next loop even where gcc's cost model hesitates (a long step
 * like logaddexp); setup.py builds with -fopenmp. */
#if defined(_OPENMP) || defined(__GNUC__)
#define PS_SIMD _Pragma("omp simd")
#else
#define PS_SIMD
#endif

enum { PS_BLOCK = 2048, PS_ROWS = 8, PS_TILE = 64 };

/* Rows at least this long, when there are at most PS_LONG_ROWS of them, are cut
 * into chunks scanned in parallel. Neither choice depends on the thread count, so
 * results are the same bits with any number of threads. */
#define PS_LONG_STEPS (INT64_C(1) << 16)
#define PS_LONG_ROWS 16
#define PS_LONG_CHUNKS 64 /* chunks per block of a long row (a multiple of PS_ROWS) */
#define PS_LONG_MIN_LEN 64 /* shorter chunks are not worth a barrier */
/* A long row's chunks hold about 8 KiB of each input, plus a cache line, so that the
 * 8 chunks stepped together do not all map to one cache set (as rows a power of two
 * apart would): long_len() = PS_LONG_CHUNK_BYTES / sizeof(element). */
#define PS_LONG_CHUNK_BYTES (8192 + 64)

/* ps_scan_constants (abi.h; defined in _native/abi.c) returns the constants above. */

/* Channels per time-major work unit: whole rows (up to PS_BLOCK), cut into more
 * blocks only when there are fewer rows than threads; multiples of 16 keep the
 * blocks' starts aligned for SIMD. */
static inline int64_t ps_channel_block(int64_t outer, int64_t inner, int64_t nthreads) {
    int64_t nblk = (inner + PS_BLOCK - 1) / PS_BLOCK;
    const int64_t want = outer > 0 ? (nthreads + outer - 1) / outer : 1;
    const int64_t most = (inner + 63) / 64;
    if (want > nblk) nblk = want < most ? want : most;
    if (nblk < 1) nblk = 1;
    int64_t block = (inner + nblk - 1) / nblk;
    block = (block + 15) / 16 * 16;
    return block < PS_BLOCK ? block : PS_BLOCK;
}

/* Run a kernel's work units: groups of PS_ROWS rows (`tc`) when time is
 * contiguous (inner == 1), else (outer index, channel block) pairs (`tm`), whose
 * workers recompute the block from the nthreads stored in their arguments. */
static inline int64_t ps_units(int64_t outer, int64_t inner, int64_t nthreads) {
    if (inner == 1) return (outer + PS_ROWS - 1) / PS_ROWS;
    const int64_t block = ps_channel_block(outer, inner, nthreads);
    return outer * ((inner + block - 1) / block);
}

static inline void ps_run_units(int64_t outer, int64_t inner, int64_t nthreads, ps_task_fn tc,
                                ps_task_fn tm, const void *args) {
    ps_parallel_for(ps_units(outer, inner, nthreads), nthreads, inner == 1 ? tc : tm, args);
}

/* A requested thread count as the parallel helpers use it: 1 .. PS_MAX_THREADS. */
static inline int64_t ps_clamp_threads(int64_t nthreads) {
    return nthreads < 1 ? 1 : nthreads > PS_MAX_THREADS ? PS_MAX_THREADS : nthreads;
}

/* Packed sequences (ps_varlen_args) with too few channels to keep the team busy
 * (first_order/cpu_packed.h walks the channels otherwise): each sequence is an
 * independent scan of its own steps, run by the plain entry on a view of them
 * (`run` builds that view for sequence s and calls the entry with `nthreads`), so
 * every input is read once and no state crosses a boundary; the sequence's tiles and
 * chunks start at its first step. A sequence big enough to share among the team (at
 * least 2^16 elements per thread, or a long row) runs alone with all of it, one
 * after another; the others run together, each whole on one thread, the team
 * splitting them by where they start (thread k takes those starting in its k-th
 * share of the steps), so that many short sequences cost one parallel region. */
typedef int (*ps_segment_fn)(const void *args, const ps_varlen_args *v, int64_t s,
                             int64_t nthreads);
typedef struct {
    const void *args;
    const ps_varlen_args *v;
    ps_segment_fn run;
    int64_t steps, channels, nthreads;
    int failed; /* a shared sequence's entry failed (written by any member, read after) */
} ps_varlen_job;

static inline int ps_varlen_alone(const ps_varlen_job *j, int64_t s) {
    const int64_t len = j->v->cu_seqlens[s + 1] - j->v->cu_seqlens[s];
    return len >= PS_LONG_STEPS ||
           (len > 0 && j->channels >= ((INT64_C(1) << 16) * j->nthreads + len - 1) / len);
}

/* The first sequence starting at or after step t (cu_seqlens is sorted). */
static inline int64_t ps_varlen_first_from(const ps_varlen_args *v, int64_t t) {
    int64_t lo = 0, hi = v->nseq;
    while (lo < hi) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (v->cu_seqlens[mid] < t) lo = mid + 1; else hi = mid;
    }
    return lo;
}

/* Members k0 .. k1 - 1 of the team: member k runs the shared sequences that start in
 * its k-th share of the steps (the last member's share runs to the end). */
static void ps_varlen_shared(const void *vp, int64_t k0, int64_t k1) {
    ps_varlen_job *j = (ps_varlen_job *)vp;
    const int64_t share = (j->steps + j->nthreads - 1) / j->nthreads; /* >= 1: steps > 0 */
    const int64_t s0 = ps_varlen_first_from(j->v, k0 * share);
    const int64_t s1 = k1 >= j->nthreads ? j->v->nseq : ps_varlen_first_from(j->v, k1 * share);
    for (int64_t s = s0; s < s1; ++s)
        if (!ps_varlen_alone(j, s) && j->run(j->args, j->v, s, 1) != 0)
            __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
}

/* 0; -1 when cu_seqlens is not 0 = cu[0] <= ... <= cu[nseq] = steps. */
static inline int ps_varlen_check(const ps_varlen_args *v, int64_t steps) {
    if (!v || v->nseq < 0 || !v->cu_seqlens || v->cu_seqlens[0] != 0 ||
        v->cu_seqlens[v->nseq] != steps)
        return -1;
    for (int64_t s = 0; s < v->nseq; ++s)
        if (v->cu_seqlens[s + 1] < v->cu_seqlens[s]) return -1;
    return 0;
}

/* 0; -1 when cu_seqlens is invalid (ps_varlen_check) or an entry failed. */
static inline int ps_run_varlen(const void *args, const ps_varlen_args *v, ps_segment_fn run,
                                int64_t steps, int64_t channels, int64_t nthreads) {
    if (ps_varlen_check(v, steps) != 0) return -1;
    if (channels == 0) return 0; /* nothing to read or write (data pointers may be NULL) */
    ps_varlen_job job = {args, v, run, steps, channels,
                         ps_threads_for(steps * channels, ps_clamp_threads(nthreads)), 0};
    if (steps > 0) ps_parallel_for(job.nthreads, job.nthreads, ps_varlen_shared, &job);
    for (int64_t s = 0; s < v->nseq; ++s)
        if ((steps == 0 || ps_varlen_alone(&job, s)) && run(args, v, s, job.nthreads) != 0)
            job.failed = 1;
    return job.failed ? -1 : 0;
}

/* The packed entries' schedule (first_order/cpu_packed.h) for outer x inner channels of
 * `steps` steps: the team size of the walk, or 0 where there are no steps or too few
 * work units to keep the team busy, and the sequences are shared instead
 * (ps_run_varlen). */
static inline int64_t ps_walk_threads(int64_t outer, int64_t steps, int64_t inner,
                                      int64_t nthreads) {
    const int64_t n = ps_threads_for(outer * inner * steps, ps_clamp_threads(nthreads));
    return steps == 0 || ps_units(outer, inner, n) < n ? 0 : n;
}

/* Point a time-indexed operand at its last step and negate its time stride
 * (needs `steps` and ST in scope). */
#define PS_FLIP(ptr, stride) \
    do { (ptr) = (ST *)(ptr) + (steps - 1) * (stride)[1]; (stride)[1] = -(stride)[1]; } while (0)

/* The arithmetic of each accumulation type T (ps_f32, ps_f64, ps_c64, ps_c128), on
 * which the semirings (first_order/semiring_*.h) and the backward are built:
 * T_fma(a, s, b) = a s + b, T_cfma(a, s, b) = conj(a) s + b, T_mulc(g, x) = g conj(x),
 * T_add(a, b) = a + b, T_zero() = 0. conj is the identity on real types.
 *
 * Real types: expressions (macros). As calls gcc would evaluate the arguments right
 * to left, which reorders the loads and the operands of + and * in the loops: slower
 * in places (3% measured), and which input NaN a result carries changes. */
#define ps_f32_fma(a, s, b) ((a) * (s) + (b))
#define ps_f32_cfma(a, s, b) ((a) * (s) + (b))
#define ps_f32_mulc(g, x) ((g) * (x))
#define ps_f32_add(a, b) ((a) + (b))
#define ps_f32_zero() 0.0f
#define ps_f64_fma(a, s, b) ((a) * (s) + (b))
#define ps_f64_cfma(a, s, b) ((a) * (s) + (b))
#define ps_f64_mulc(g, x) ((g) * (x))
#define ps_f64_add(a, b) ((a) + (b))
#define ps_f64_zero() 0.0

/* Complex types: functions on interleaved (re, im) pairs, the layout torch uses;
 * loads and stores go component by component (whole-struct copies keep gcc from
 * vectorizing). */
#define PS_COMPLEX_OPS(T, R)                                                      \
    static inline T T##_fma(T a, T s, T b) {                                      \
        return (T){a.re * s.re - a.im * s.im + b.re, a.re * s.im + a.im * s.re + b.im}; \
    }                                                                             \
    static inline T T##_cfma(T a, T s, T b) {                                     \
        return (T){a.re * s.re + a.im * s.im + b.re, a.re * s.im - a.im * s.re + b.im}; \
    }                                                                             \
    static inline T T##_mulc(T g, T x) {                                          \
        return (T){g.re * x.re + g.im * x.im, g.im * x.re - g.re * x.im};         \
    }                                                                             \
    static inline T T##_add(T a, T b) { return (T){a.re + b.re, a.im + b.im}; }   \
    static inline T T##_zero(void) { return (T){(R)0, (R)0}; }
PS_COMPLEX_OPS(ps_c64, float)
PS_COMPLEX_OPS(ps_c128, double)
#undef PS_COMPLEX_OPS
#define PS_LOAD_COMPLEX(p) ((ACC){(p)->re, (p)->im})
#define PS_STORE_COMPLEX(p, v) \
    do { const ACC v_ = (v); (p)->re = v_.re; (p)->im = v_.im; } while (0)

#endif
