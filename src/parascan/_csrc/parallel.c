#define _DEFAULT_SOURCE /* madvise and MADV_HUGEPAGE under -std=c11 */
#include "parallel.h"
#include "scan_common.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
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

static inline void ps_cpu_relax(void) {
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_ia32_pause();
#endif
}

/* Spin on `*flag` while it equals `value`: a few thousand pauses (a barrier between
 * short phases), then yield, so that waiting on a busy machine does not steal the
 * CPU from the thread being waited for. */
static void ps_wait_while(_Atomic int64_t *flag, int64_t value) {
    for (int64_t spins = 0; atomic_load_explicit(flag, memory_order_acquire) == value; ++spins) {
        if (spins < 4096)
            ps_cpu_relax();
        else
            sched_yield();
    }
}

void ps_barrier_wait(ps_barrier *b) {
    if (b->size <= 1) return;
    const int64_t phase = atomic_load_explicit(&b->phase, memory_order_acquire);
    if (atomic_fetch_add_explicit(&b->count, 1, memory_order_acq_rel) == b->size - 1) {
        atomic_store_explicit(&b->count, 0, memory_order_relaxed);
        atomic_store_explicit(&b->phase, phase + 1, memory_order_release);
    } else {
        ps_wait_while(&b->phase, phase);
    }
}

typedef struct {
    ps_team_fn fn;
    const void *ctx;
    ps_barrier *barrier;
    _Atomic int64_t *go; /* 0 until the team's size is known */
    int64_t member;
} ps_member;

static void *ps_run_member(void *p) {
    const ps_member *m = (const ps_member *)p;
    ps_wait_while(m->go, 0);
    m->fn(m->ctx, m->member, m->barrier->size, m->barrier);
    return NULL;
}

void ps_parallel_team(int64_t nthreads, ps_team_fn fn, const void *ctx) {
    if (nthreads > PS_MAX_THREADS) nthreads = PS_MAX_THREADS;
    ps_barrier barrier = {0, 0, 1};
    _Atomic int64_t go = 0;
    ps_member members[PS_MAX_THREADS];
    pthread_t threads[PS_MAX_THREADS];
    int64_t started = 0;
    /* Threads wait for `go`, so that members can be numbered 1..started without
     * gaps whichever creations fail. */
    for (int64_t i = 1; i < nthreads; ++i) {
        members[started] = (ps_member){fn, ctx, &barrier, &go, 0};
        if (pthread_create(&threads[started], NULL, ps_run_member, &members[started]) == 0)
            ++started;
    }
    for (int64_t i = 0; i < started; ++i) members[i].member = i + 1;
    barrier.size = started + 1;
    atomic_store_explicit(&go, 1, memory_order_release);
    fn(ctx, 0, barrier.size, &barrier);
    for (int64_t i = 0; i < started; ++i) pthread_join(threads[i], NULL);
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
