/* The forward kernels of a first-order scan, s[t] = STEP(a[t], s[t-1], b[t]),
 * instantiated once per dtype by each op's cpu_kernel.c (after scan_common.h).
 * linear_scan steps with a * s + b; log_linear_scan with logaddexp(a + s, b),
 * the same algebra in the log semiring. The includer defines:
 *   SFX        name suffix (f32, ...)        ST   storage type     ACC  accumulation type
 *   LD(p)      load *p as ACC                STO(p, v)  store ACC v to *p
 *   FMA(a,s,b) one step                      ZERO  the empty state  ONE  the identity gate
 *   COMPOSE(a, q)  optional: the gate of two steps, a after q (default FMA(a, q, ZERO))
 *   PS_FWD_ENTRY  the exported entry's name, without the dtype suffix
 *   PS_ACC_IS_STORAGE  defined when ACC and ST are one type (enables long chunks)
 * and optionally PS_FWD_TC_FAST: a function that returns a faster time-contiguous
 * worker for the given arguments, or NULL; PS_REDUCE8_FAST: a faster reduce of 8
 * long-sequence chunks, returning 0 when it did the work; PS_FWD_ROW_FAST: faster
 * unit-stride time-major rows, the same.
 *
 * Summary of algorithm. The recurrence is sequential in time and independent
 * across (outer, inner), so parallelism and SIMD come from the independent
 * channels, and each channel's chain is walked once, reading every input once
 * and writing every output once:
 *  - inner > 1 ("time-major", channels contiguous): a work unit is one outer
 *    index and a block of channels (whole rows of up to PS_BLOCK channels, split
 *    further only when there are fewer rows than threads), so each thread streams
 *    through memory; the block's states live in a local array, and each time
 *    step is a unit-stride loop the compiler vectorizes.
 *  - inner == 1 ("time-contiguous"): a work unit is PS_ROWS rows whose chains
 *    are stepped together through transposed tiles of PS_TILE steps, so the
 *    independent chains form one vector and hide the step's latency.
 * reverse is handled once, up front, by pointing every time-indexed operand at
 * its last step and negating its time stride.
 */

static inline void FN(fwd_row)(int64_t n, ACC *restrict s,
                               const ST *restrict a, int64_t as,
                               const ST *restrict b, int64_t bs,
                               ST *restrict x, int64_t xs) {
    if (as == 1 && bs == 1 && xs == 1) {
#ifdef PS_FWD_ROW_FAST
        if (PS_FWD_ROW_FAST(n, s, a, b, x) == 0) return;
#endif
        PS_SIMD
        for (int64_t c = 0; c < n; ++c) {
            const ACC v = FMA(LD(a + c), s[c], LD(b + c));
            s[c] = v;
            STO(x + c, v);
        }
    } else {
        for (int64_t c = 0; c < n; ++c) {
            const ACC v = FMA(LD(a + c * as), s[c], LD(b + c * bs));
            s[c] = v;
            STO(x + c * xs, v);
        }
    }
}

static inline void FN(load_state)(int64_t n, ACC *restrict s, const ST *p, int64_t ps) {
    for (int64_t c = 0; c < n; ++c) s[c] = p ? LD(p + c * ps) : ZERO;
}

PS_HOT static void FN(fwd_time_major)(const void *vp, int64_t u0, int64_t u1) {
    const ps_scan_fwd_args *p = (const ps_scan_fwd_args *)vp;
    const int64_t *gs = p->gates_stride, *ts = p->tokens_stride, *xs = p->out_stride;
    const int64_t *is = p->initial_stride;
    const int64_t block = ps_channel_block(p->outer, p->inner, p->nthreads);
    const int64_t nblk = (p->inner + block - 1) / block;
    ACC s[PS_BLOCK];
    for (int64_t u = u0; u < u1; ++u) {
        const int64_t o = u / nblk, c0 = (u % nblk) * block;
        const int64_t n = p->inner - c0 < block ? p->inner - c0 : block;
        const ST *a = (const ST *)p->gates + o * gs[0] + c0 * gs[2];
        const ST *b = (const ST *)p->tokens + o * ts[0] + c0 * ts[2];
        ST *x = (ST *)p->out + o * xs[0] + c0 * xs[2];
        FN(load_state)(n, s, p->initial ? (const ST *)p->initial + o * is[0] + c0 * is[1] : NULL, is[1]);
        for (int64_t t = 0; t < p->steps; ++t)
            FN(fwd_row)(n, s, a + t * gs[1], gs[2], b + t * ts[1], ts[2], x + t * xs[1], xs[2]);
    }
}

/* Time-contiguous data is processed in tiles of PS_ROWS rows x PS_TILE steps,
 * transposed into a local array so that the PS_ROWS independent chains step
 * together as one vector, and each row is read in whole cache lines (rows that
 * lie a power of two apart would otherwise all fall into one cache set).
 * Rows past nr read as zero and are never stored. */
static inline void FN(gather)(ACC (*tile)[PS_ROWS], int64_t n, int64_t nr,
                              const ST *src, int64_t row_stride, int64_t step_stride) {
    for (int64_t r = 0; r < PS_ROWS; ++r) {
        if (r < nr) {
            const ST *row = src + r * row_stride;
            if (step_stride == 1)
                for (int64_t k = 0; k < n; ++k) tile[k][r] = LD(row + k);
            else
                for (int64_t k = 0; k < n; ++k) tile[k][r] = LD(row + k * step_stride);
        } else {
            for (int64_t k = 0; k < n; ++k) tile[k][r] = ZERO;
        }
    }
}

static inline void FN(scatter)(ST *dst, int64_t row_stride, int64_t step_stride,
                               ACC (*tile)[PS_ROWS], int64_t n, int64_t nr) {
    for (int64_t r = 0; r < nr; ++r) {
        ST *row = dst + r * row_stride;
        if (step_stride == 1)
            for (int64_t k = 0; k < n; ++k) STO(row + k, tile[k][r]);
        else
            for (int64_t k = 0; k < n; ++k) STO(row + k * step_stride, tile[k][r]);
    }
}

PS_HOT static void FN(fwd_time_contiguous)(const void *vp, int64_t u0, int64_t u1) {
    const ps_scan_fwd_args *p = (const ps_scan_fwd_args *)vp;
    const int64_t *gs = p->gates_stride, *ts = p->tokens_stride, *xs = p->out_stride;
    const int64_t *is = p->initial_stride;
    ACC ta[PS_TILE][PS_ROWS], tb[PS_TILE][PS_ROWS], s[PS_ROWS];
    for (int64_t u = u0; u < u1; ++u) {
        const int64_t r0 = u * PS_ROWS;
        const int64_t nr = p->outer - r0 < PS_ROWS ? p->outer - r0 : PS_ROWS;
        const ST *a = (const ST *)p->gates + r0 * gs[0];
        const ST *b = (const ST *)p->tokens + r0 * ts[0];
        ST *x = (ST *)p->out + r0 * xs[0];
        for (int64_t r = 0; r < PS_ROWS; ++r)
            s[r] = (r < nr && p->initial) ? LD((const ST *)p->initial + (r0 + r) * is[0]) : ZERO;
        for (int64_t t0 = 0; t0 < p->steps; t0 += PS_TILE) {
            const int64_t n = p->steps - t0 < PS_TILE ? p->steps - t0 : PS_TILE;
            FN(gather)(ta, n, nr, a + t0 * gs[1], gs[0], gs[1]);
            FN(gather)(tb, n, nr, b + t0 * ts[1], ts[0], ts[1]);
            for (int64_t k = 0; k < n; ++k)
                for (int64_t r = 0; r < PS_ROWS; ++r) ta[k][r] = s[r] = FMA(ta[k][r], s[r], tb[k][r]);
            FN(scatter)(x + t0 * xs[1], xs[0], xs[1], ta, n, nr);
        }
    }
}

#ifndef COMPOSE
#define COMPOSE(a, q) FMA((a), (q), ZERO)
#define PS_COMPOSE_IS_DEFAULT
#endif

#ifdef PS_ACC_IS_STORAGE
/* Long sequences with few chains (inner == 1, few rows): the time axis of each row
 * is cut into chunks that run in parallel, in three phases:
 *   1. every full chunk is reduced to its affine map: the product of its gates and
 *      its final state from a zero start (8 chunks step together, as rows);
 *   2. the chunks' carries are chained, one step per chunk, serially;
 *   3. the ordinary time-contiguous kernel runs over the chunks as rows, each
 *      starting from its carry (the tail past the last full chunk runs last).
 * It reads the inputs twice, so it is used only where the direct kernel would leave
 * SIMD lanes and threads idle. Only for dtypes that accumulate in their own type:
 * the carries pass through the kernel's `initial`, which has the storage type. */
typedef struct {
    ps_scan_fwd_args p; /* a chunk per row: outer = chunks, steps = chunk length */
    ps_scan_fwd_args full; /* the whole problem */
    ps_task_fn scan;      /* phase 3: the time-contiguous worker */
    ACC *prod, *state;    /* per (row, chunk): product of gates, final state from 0 */
    ACC *carry;           /* per (row, chunk): the state entering the chunk */
} FN(long_job);

/* The chunk rows of original row o, as a time-contiguous problem. */
static ps_scan_fwd_args FN(chunk_rows)(const FN(long_job) *job, int64_t o) {
    const ps_scan_fwd_args *f = &job->full;
    ps_scan_fwd_args r = job->p;
    r.gates = (const ST *)f->gates + o * f->gates_stride[0];
    r.tokens = (const ST *)f->tokens + o * f->tokens_stride[0];
    r.out = (ST *)f->out + o * f->out_stride[0];
    r.initial = job->carry + o * job->p.outer;
    return r;
}

PS_HOT static void FN(reduce_chunks)(const void *vp, int64_t u0, int64_t u1) {
    const FN(long_job) *job = (const FN(long_job) *)vp;
    const int64_t chunks = job->p.outer, groups = chunks / PS_ROWS;
    ACC ta[PS_TILE][PS_ROWS], tb[PS_TILE][PS_ROWS], s[PS_ROWS], q[PS_ROWS];
    for (int64_t u = u0; u < u1; ++u) {
        const int64_t o = u / groups, r0 = (u % groups) * PS_ROWS;
        const ps_scan_fwd_args p = FN(chunk_rows)(job, o);
        const int64_t *gs = p.gates_stride, *ts = p.tokens_stride;
        const ST *a = (const ST *)p.gates + r0 * gs[0];
        const ST *b = (const ST *)p.tokens + r0 * ts[0];
#ifdef PS_REDUCE8_FAST
        if (PS_REDUCE8_FAST(a, b, gs[0], ts[0], p.steps, gs[1], ts[1],
                            job->state + o * chunks + r0, job->prod + o * chunks + r0) == 0)
            continue;
#endif
        for (int64_t r = 0; r < PS_ROWS; ++r) {
            s[r] = ZERO;
            q[r] = ONE;
        }
        for (int64_t t0 = 0; t0 < p.steps; t0 += PS_TILE) {
            const int64_t n = p.steps - t0 < PS_TILE ? p.steps - t0 : PS_TILE;
            FN(gather)(ta, n, PS_ROWS, a + t0 * gs[1], gs[0], gs[1]);
            FN(gather)(tb, n, PS_ROWS, b + t0 * ts[1], ts[0], ts[1]);
            for (int64_t k = 0; k < n; ++k)
                for (int64_t r = 0; r < PS_ROWS; ++r) {
                    s[r] = FMA(ta[k][r], s[r], tb[k][r]);
                    q[r] = COMPOSE(ta[k][r], q[r]);
                }
        }
        for (int64_t r = 0; r < PS_ROWS; ++r) {
            job->state[o * chunks + r0 + r] = s[r];
            job->prod[o * chunks + r0 + r] = q[r];
        }
    }
}

PS_HOT static void FN(scan_chunks)(const void *vp, int64_t u0, int64_t u1) {
    const FN(long_job) *job = (const FN(long_job) *)vp;
    const int64_t groups = job->p.outer / PS_ROWS;
    for (int64_t u = u0; u < u1; ++u) {
        const int64_t o = u / groups, g = u % groups;
        const ps_scan_fwd_args p = FN(chunk_rows)(job, o);
        job->scan(&p, g, g + 1);
    }
}

/* Returns 0 when done, 1 when this problem is not worth (or able) to chunk. */
static int FN(fwd_long)(const ps_scan_fwd_args *p, int64_t nthreads) {
    /* A fixed number of chunks, whatever the thread count, so that the result (its
     * rounding) does not depend on how many threads computed it. */
    int64_t chunks = (PS_LONG_CHUNKS + p->outer - 1) / p->outer;
    chunks = (chunks + PS_ROWS - 1) / PS_ROWS * PS_ROWS;
    const int64_t len = p->steps / chunks; /* the tail, steps % chunks, runs last */
    if (len < 1024) return 1;
    const int64_t pairs = p->outer * chunks;
    ACC *buf = (ACC *)malloc((size_t)(3 * pairs + p->outer) * sizeof(ACC));
    if (!buf) return 1;
    FN(long_job) job = {*p, *p, NULL, buf, buf + pairs, buf + 2 * pairs};
    job.p.outer = chunks;
    job.p.steps = len;
    job.p.gates_stride[0] = len * p->gates_stride[1];
    job.p.tokens_stride[0] = len * p->tokens_stride[1];
    job.p.out_stride[0] = len * p->out_stride[1];
    job.p.initial_stride[0] = 1;
    job.p.initial_stride[1] = 0;
#ifdef PS_FWD_TC_FAST
    job.scan = PS_FWD_TC_FAST(&job.p);
#endif
    if (!job.scan) job.scan = FN(fwd_time_contiguous);
    const int64_t units = p->outer * (chunks / PS_ROWS);
    ps_parallel_for(units, nthreads, FN(reduce_chunks), &job);
    ACC *ends = buf + 3 * pairs; /* each row's state after its last full chunk */
    for (int64_t o = 0; o < p->outer; ++o) {
        ACC c = p->initial ? LD((const ST *)p->initial + o * p->initial_stride[0]) : ZERO;
        for (int64_t k = 0; k < chunks; ++k) {
            job.carry[o * chunks + k] = c;
            c = FMA(job.prod[o * chunks + k], c, job.state[o * chunks + k]);
        }
        ends[o] = c;
    }
    ps_parallel_for(units, nthreads, FN(scan_chunks), &job);
    const int64_t done = chunks * len;
    if (done < p->steps) { /* fewer than `chunks` steps per row */
        ps_scan_fwd_args tail = *p;
        tail.steps = p->steps - done;
        tail.gates = (const ST *)p->gates + done * p->gates_stride[1];
        tail.tokens = (const ST *)p->tokens + done * p->tokens_stride[1];
        tail.out = (ST *)p->out + done * p->out_stride[1];
        tail.initial = ends;
        tail.initial_stride[0] = 1;
        FN(fwd_time_contiguous)(&tail, 0, (p->outer + PS_ROWS - 1) / PS_ROWS);
    }
    free(buf);
    return 0;
}

#endif

PS_API int FN(PS_FWD_ENTRY)(const ps_scan_fwd_args *args) {
    if (args->outer < 0 || args->steps < 0 || args->inner < 0) return -1;
    if (args->outer == 0 || args->steps == 0 || args->inner == 0) return 0;
    ps_scan_fwd_args p = *args;
    const int64_t steps = p.steps;
    ps_prefer_huge_pages(p.out, p.outer * p.steps * p.inner * (int64_t)sizeof(ST));
    if (p.reverse) {
        PS_FLIP(p.gates, p.gates_stride);
        PS_FLIP(p.tokens, p.tokens_stride);
        PS_FLIP(p.out, p.out_stride);
    }
    const int64_t nthreads = ps_threads_for(p.outer * p.steps * p.inner, p.nthreads);
#ifdef PS_ACC_IS_STORAGE
    if (p.inner == 1 && p.steps >= PS_LONG_STEPS && p.outer <= PS_LONG_ROWS &&
        FN(fwd_long)(&p, nthreads) == 0)
        return 0;
#endif
    ps_task_fn tc = NULL;
#ifdef PS_FWD_TC_FAST
    if (p.inner == 1) tc = PS_FWD_TC_FAST(&p);
#endif
    if (!tc) tc = FN(fwd_time_contiguous);
    p.nthreads = nthreads;
    ps_run_units(p.outer, p.inner, nthreads, tc, FN(fwd_time_major), &p);
    return 0;
}

#ifdef PS_COMPOSE_IS_DEFAULT
#undef COMPOSE
#undef PS_COMPOSE_IS_DEFAULT
#endif
