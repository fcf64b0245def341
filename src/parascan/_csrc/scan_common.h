/* What the first-order scan kernels (linear_scan, log_linear_scan) share: the
 * forward ABI, the work-unit sizes, and the naming macros of the per-dtype
 * templates (scan_forward_impl.h and each op's backward).
 *
 * Every tensor is seen as a 3-d strided view (outer, steps, inner) with the scan
 * running along `steps`; strides are in elements of the storage type (a complex
 * element counts as one), any sign, zero for broadcast dimensions. Python passes
 * the argument structs as flat int64 arrays (every member is 64 bits wide) and
 * checks their sizes once against its own layout.
 */
#ifndef PARASCAN_SCAN_COMMON_H
#define PARASCAN_SCAN_COMMON_H

#include "parallel.h"

#include <stdint.h>
#include <stdlib.h>

/* forward: out[o, t, c] = STEP(gates[o, t, c], out[o, t-1, c], tokens[o, t, c]),
 * out[o, -1, c] = initial[o, c] (the op's empty state when initial is NULL);
 * reverse != 0 runs time backwards (out[t+1] feeds out[t]). */
typedef struct {
    int64_t outer, steps, inner;
    const void *gates;   int64_t gates_stride[3];
    const void *tokens;  int64_t tokens_stride[3];
    const void *initial; int64_t initial_stride[2]; /* NULL: the empty state */
    void *out;           int64_t out_stride[3];
    int64_t reverse, nthreads;
} ps_scan_fwd_args;

/* The hot loops are compiled twice (x86-64-v3: AVX2 + FMA + F16C, and the
 * baseline) and the CPU picks at load time, so one build runs on any x86-64. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PS_HOT __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define PS_HOT
#endif

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

/* The constants above, for tests and fuzzers that place lengths around them:
 * out[] = {PS_BLOCK, PS_ROWS, PS_TILE, PS_LONG_STEPS, PS_LONG_ROWS, PS_LONG_CHUNKS,
 * PS_LONG_MIN_LEN, PS_LONG_CHUNK_BYTES}; returns how many there are (at most n are
 * written). */
PS_API int64_t ps_scan_constants(int64_t *out, int64_t n);

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

/* Below this many elements a kernel runs on the calling thread: starting
 * threads costs more than the work. */
static inline int64_t ps_threads_for(int64_t elements, int64_t nthreads) {
    return elements < (INT64_C(1) << 16) ? 1 : nthreads;
}

/* Run a kernel's work units: groups of PS_ROWS rows (`tc`) when time is
 * contiguous (inner == 1), else (outer index, channel block) pairs (`tm`), whose
 * workers recompute the block from the nthreads stored in their arguments. */
static inline void ps_run_units(int64_t outer, int64_t inner, int64_t nthreads, ps_task_fn tc,
                                ps_task_fn tm, const void *args) {
    if (inner == 1) {
        ps_parallel_for((outer + PS_ROWS - 1) / PS_ROWS, nthreads, tc, args);
    } else {
        const int64_t block = ps_channel_block(outer, inner, nthreads);
        ps_parallel_for(outer * ((inner + block - 1) / block), nthreads, tm, args);
    }
}

/* Template naming: FN(name) is name_SFX for the dtype being instantiated. */
#define PS_CAT2(a, b) a##_##b
#define PS_CAT(a, b) PS_CAT2(a, b)
#define FN(name) PS_CAT(name, SFX)

/* Point a time-indexed operand at its last step and negate its time stride
 * (needs `steps` and ST in scope). */
#define PS_FLIP(ptr, stride) \
    do { (ptr) = (ST *)(ptr) + (steps - 1) * (stride)[1]; (stride)[1] = -(stride)[1]; } while (0)

/* Complex arithmetic on interleaved (re, im) pairs, the layout torch uses:
 * T_fma(a, s, b) = a s + b, T_cfma(a, s, b) = conj(a) s + b, T_mulc(g, x) = g conj(x);
 * loads and stores component by component (whole-struct copies keep gcc from
 * vectorizing). */
#define PS_COMPLEX_OPS(T)                                                         \
    static inline T T##_fma(T a, T s, T b) {                                      \
        return (T){a.re * s.re - a.im * s.im + b.re, a.re * s.im + a.im * s.re + b.im}; \
    }                                                                             \
    static inline T T##_cfma(T a, T s, T b) {                                     \
        return (T){a.re * s.re + a.im * s.im + b.re, a.re * s.im - a.im * s.re + b.im}; \
    }                                                                             \
    static inline T T##_mulc(T g, T x) {                                          \
        return (T){g.re * x.re + g.im * x.im, g.im * x.re - g.re * x.im};         \
    }
PS_COMPLEX_OPS(ps_c64)
PS_COMPLEX_OPS(ps_c128)
#define PS_LOAD_COMPLEX(p) ((ACC){(p)->re, (p)->im})
#define PS_STORE_COMPLEX(p, v) \
    do { const ACC v_ = (v); (p)->re = v_.re; (p)->im = v_.im; } while (0)

#endif
