/* Shared helpers for parascan's C kernels: a static parallel-for and thread teams (OpenMP),
 * and the scalar types the kernels are instantiated for.
 *
 * The kernels are plain C11 with no torch headers; Python loads them with ctypes
 * and wraps them as torch.library custom ops. Every index is int64_t.
 */
#ifndef PARASCAN_PARALLEL_H
#define PARASCAN_PARALLEL_H

#include <stdint.h>
#include <string.h>

/* Symbols that Python looks up; everything else is hidden (-fvisibility=hidden). */
#if defined(__GNUC__)
#define PS_API __attribute__((visibility("default")))
#else
#define PS_API
#endif

/* The most threads a parallel-for or a team uses, whatever nthreads asks for. */
enum { PS_MAX_THREADS = 256 };

typedef void (*ps_task_fn)(const void *ctx, int64_t begin, int64_t end);

/* Run fn(ctx, begin, end) over [0, n) split into at most nthreads contiguous
 * ranges of near-equal size, on an OpenMP team (parallel.c); the calling thread
 * takes the first range. A smaller team (a nested region) gets larger ranges, so
 * every index is run whatever the team's size. */
void ps_parallel_for(int64_t n, int64_t nthreads, ps_task_fn fn, const void *ctx);

/* A team of threads that meet at barriers, for work in phases that must not start
 * before every member has finished the previous one. */
typedef void (*ps_team_fn)(const void *ctx, int64_t member, int64_t size);

/* Run fn(ctx, member, size) on an OpenMP team of at most nthreads threads, member 0
 * on the calling thread. `size` is the team's actual size (at least 1): fn must
 * share its work by `size`, never by nthreads. */
void ps_parallel_team(int64_t nthreads, ps_team_fn fn, const void *ctx);

/* Inside fn: wait until every member of the team has arrived. */
void ps_team_barrier(void);

/* Ask the OS to back a freshly allocated output with 2 MiB pages (Linux THP in
 * "madvise" mode), so that writing it costs one page fault per 2 MiB instead of
 * one per 4 KiB: on a fresh 200 MB tensor that is most of the time of a pass.
 * Only the whole huge pages inside [ptr, ptr + bytes) are advised; buffers under
 * 4 MiB are left alone. A hint: failure changes nothing but speed. */
void ps_prefer_huge_pages(void *ptr, int64_t bytes);

/* Storage types without a portable C11 arithmetic type. */
typedef uint16_t ps_bf16;
typedef struct { float re, im; } ps_c64;
typedef struct { double re, im; } ps_c128;

/* A float's bits and back. */
static inline float ps_bits_to_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint32_t ps_f32_to_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* bfloat16 is a float's upper 16 bits. */
static inline float ps_bf16_to_f32(ps_bf16 v) { return ps_bits_to_f32((uint32_t)v << 16); }

/* Round to nearest even, NaN stays NaN (quiet), as torch converts. */
static inline ps_bf16 ps_f32_to_bf16(float f) {
    uint32_t u = ps_f32_to_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (ps_bf16)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (ps_bf16)(u >> 16);
}

/* IEEE half <-> float in plain integer and float arithmetic, with no branches the
 * vectorizer cannot turn into selects (compilers do not vectorize _Float16
 * casts without AVX-512 FP16). Round to nearest even; overflow gives infinity;
 * subnormals are exact; NaN stays NaN (quiet). */
typedef uint16_t ps_f16;

static inline float ps_f16_to_f32(ps_f16 h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t em = h & 0x7fffu;
    /* Exponent and mantissa moved into place, rescaled by 2^112: exact for normal
     * and subnormal halves alike. */
    const float scaled = ps_bits_to_f32(em << 13) * 0x1p112f;
    const uint32_t finite = ps_f32_to_bits(scaled);
    const uint32_t special = (em << 13) | 0x7f800000u; /* inf and NaN */
    const uint32_t is_special = 0u - (uint32_t)(em >= 0x7c00u); /* all ones or zero */
    return ps_bits_to_f32(sign | (special & is_special) | (finite & ~is_special));
}

static inline ps_f16 ps_f32_to_f16(float f) {
    const uint32_t bits = ps_f32_to_bits(f);
    const uint32_t sign = (bits >> 16) & 0x8000u;
    const uint32_t u = bits & 0x7fffffffu;
    /* Normal results: rebias and round to nearest even on the dropped 13 bits. */
    const uint32_t normal = (u + 0xc8000fffu + ((u >> 13) & 1u)) >> 13;
    /* Subnormal results: adding 0.5 makes the float unit do the rounding. */
    const uint32_t sub = ps_f32_to_bits(ps_bits_to_f32(u) + 0.5f) - 0x3f000000u;
    const uint32_t inf_nan = 0x7c00u | ((uint32_t)(u > 0x7f800000u) << 9);
    const uint32_t is_sub = 0u - (uint32_t)(u < 0x38800000u); /* masks: all ones or zero */
    const uint32_t is_big = 0u - (uint32_t)(u >= 0x47800000u);
    const uint32_t h = (sub & is_sub) | (normal & ~is_sub);
    return (ps_f16)(sign | (inf_nan & is_big) | (h & ~is_big));
}

#endif
