#define _DEFAULT_SOURCE /* madvise and MADV_HUGEPAGE under -std=c11 */
#include "parallel.h"
#include "scan_common.h"

#include <pthread.h>
#if defined(__linux__)
#include <sys/mman.h>
#endif

typedef struct {
    ps_task_fn fn;
    const void *ctx;
    int64_t begin, end;
} ps_range;

static void *ps_run_range(void *p) {
    const ps_range *r = (const ps_range *)p;
    r->fn(r->ctx, r->begin, r->end);
    return NULL;
}

enum { PS_MAX_THREADS = 256 };

void ps_parallel_for(int64_t n, int64_t nthreads, ps_task_fn fn, const void *ctx) {
    if (n <= 0) return;
    if (nthreads > n) nthreads = n;
    if (nthreads > PS_MAX_THREADS) nthreads = PS_MAX_THREADS;
    if (nthreads <= 1) {
        fn(ctx, 0, n);
        return;
    }
    ps_range ranges[PS_MAX_THREADS];
    pthread_t threads[PS_MAX_THREADS];
    int started[PS_MAX_THREADS];
    const int64_t base = n / nthreads, extra = n % nthreads;
    int64_t begin = 0;
    for (int64_t i = 0; i < nthreads; ++i) {
        const int64_t len = base + (i < extra ? 1 : 0);
        ranges[i] = (ps_range){fn, ctx, begin, begin + len};
        begin += len;
    }
    for (int64_t i = 1; i < nthreads; ++i)
        started[i] = pthread_create(&threads[i], NULL, ps_run_range, &ranges[i]) == 0;
    ps_run_range(&ranges[0]);
    for (int64_t i = 1; i < nthreads; ++i) {
        if (started[i])
            pthread_join(threads[i], NULL);
        else
            ps_run_range(&ranges[i]);
    }
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

/* The library's ABI version, checked by Python before anything else is called
 * (_native.py): bump it whenever an argument struct or entry point changes. */
PS_API int64_t ps_abi_version(void) { return 3; }

/* Python passes the argument structs as flat int64 arrays (every member is 64
 * bits wide); it checks their sizes once against its own layout. */
PS_API int64_t ps_scan_fwd_args_size(void) { return (int64_t)sizeof(ps_scan_fwd_args); }
