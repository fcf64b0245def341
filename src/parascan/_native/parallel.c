#define _DEFAULT_SOURCE /* madvise and MADV_HUGEPAGE under -std=c11 */
#include "parallel.h"

#include <omp.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

/* Threads come from OpenMP: torch's own pool when torch is loaded (it ships
 * libgomp.so.1, and the loader gives this library the copy already in the process),
 * so parascan's threads are torch's threads. A second pool of its own would compete
 * for the cores with torch's workers, which spin for a while after each torch op. */

void ps_parallel_for(int64_t n, int64_t nthreads, ps_task_fn fn, const void *ctx) {
    if (n <= 0) return;
    if (nthreads > n) nthreads = n;
    if (nthreads > PS_MAX_THREADS) nthreads = PS_MAX_THREADS;
    if (nthreads <= 1) {
        fn(ctx, 0, n);
        return;
    }
#pragma omp parallel num_threads((int)nthreads)
    {
        /* The team may be smaller than asked (nested regions): share by its size. */
        const int64_t size = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t base = n / size, extra = n % size;
        const int64_t begin = me * base + (me < extra ? me : extra);
        fn(ctx, begin, begin + base + (me < extra ? 1 : 0));
    }
}

void ps_team_barrier(void) {
#pragma omp barrier
}

void ps_parallel_team(int64_t nthreads, ps_team_fn fn, const void *ctx) {
    if (nthreads > PS_MAX_THREADS) nthreads = PS_MAX_THREADS;
    if (nthreads <= 1) { /* no region at all (a barrier outside one is a no-op) */
        fn(ctx, 0, 1);
        return;
    }
#pragma omp parallel num_threads((int)nthreads)
    fn(ctx, omp_get_thread_num(), omp_get_num_threads());
}

void ps_prefer_huge_pages(void *ptr, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const uintptr_t huge = (uintptr_t)1 << 21;
    if (bytes < (int64_t)(2 * huge)) return;
    const uintptr_t begin = ((uintptr_t)ptr + huge - 1) & ~(huge - 1);
    const uintptr_t end = ((uintptr_t)ptr + (uintptr_t)bytes) & ~(huge - 1);
    if (end > begin) (void)madvise((void *)begin, end - begin, MADV_HUGEPAGE);
#else
    (void)ptr;
    (void)bytes;
#endif
}
