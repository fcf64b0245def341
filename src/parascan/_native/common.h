/* What the CPU kernels share (first_order/, selective/, ssd/ and delta_rule/ include
 * it; matrix/ and generic/ need only abi.h): the ABI (abi.h), the thread helpers
 * (parallel.h), the function attributes of the hot loops and inlined math, the thread
 * count of a small job, the split of few units among threads and token pasting. What
 * only the first-order scans use (their work units, tiles, packed sequences and
 * accumulation arithmetic) is in first_order/cpu_common.h.
 */
#ifndef PARASCAN_COMMON_H
#define PARASCAN_COMMON_H

#include "abi.h"
#include "parallel.h"

#include <stdint.h>
#include <stdlib.h>

/* The hot loops are compiled twice (x86-64-v3: AVX2 + FMA + F16C, and the
 * baseline) and the CPU picks at load time, so one build runs on any x86-64. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PS_HOT __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define PS_HOT
#endif

/* Always inlined: a call left in a loop stops it from vectorizing, and gcc's
 * heuristics decline to inline these once they have many callers. */
#if defined(__GNUC__)
#define PS_MATH static inline __attribute__((always_inline))
#else
#define PS_MATH static inline
#endif

/* Below this many elements a kernel runs on the calling thread: starting
 * threads costs more than the work. */
static inline int64_t ps_threads_for(int64_t elements, int64_t nthreads) {
    return elements < (INT64_C(1) << 16) ? 1 : nthreads;
}

/* Into how many parts to cut each of `units` independent units (a batch row's head)
 * so that every thread has work: 1 when the units alone cover the threads, else
 * enough parts to, at most `parts` (the unit's pieces that never interact, e.g. the
 * state's column blocks) and at least 1. */
static inline int64_t ps_split_units(int64_t units, int64_t parts, int64_t nthreads) {
    if (units <= 0 || units >= nthreads) return 1;
    const int64_t split = (nthreads + units - 1) / units;
    return split > parts ? (parts > 1 ? parts : 1) : split;
}

/* Token pasting: PS_CAT(a, b) is a_b, after expanding a and b. */
#define PS_CAT2(a, b) a##_##b
#define PS_CAT(a, b) PS_CAT2(a, b)

#endif
