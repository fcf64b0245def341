/* Shared helpers for parascan's C kernels: a static parallel-for over pthreads,
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

typedef void (*ps_task_fn)(const void *ctx, int64_t begin, int64_t end);

/* Run fn(ctx, begin, end) over [0, n) split into at most nthreads contiguous
 * ranges of near-equal size. The calling thread takes the first range. If a
 * thread cannot be created its range runs on the calling thread instead, so
 * the result never depends on thread creation. */
void ps_parallel_for(int64_t n, int64_t nthreads, ps_task_fn fn, const void *ctx);

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

static inline float ps_bf16_to_f32(ps_bf16 v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Round to nearest even, NaN stays NaN (quiet), as torch converts. */
static inline ps_bf16 ps_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (ps_bf16)((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (ps_bf16)(u >> 16);
}

#endif
