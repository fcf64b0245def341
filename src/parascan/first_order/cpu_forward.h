/* The forward of a first-order scan, out[t] = STEP(a[t], out[t-1], b[t]), one
 * template for every semiring and dtype: cpu_instance.h instantiates it once per
 * (semiring, dtype). linear_scan steps with a * s + b; log_linear_scan with
 * logaddexp(a + s, b), the same algebra in the log semiring, so its tiles, threads
 * and long-sequence chunking carry over. The block defines (cpu_instance.h):
 *   ST   storage type     ACC  accumulation type    LD(p) / STO(p, v)  load / store
 *   STEP(a, s, b)  one step      ZERO  the empty state     ONE  the identity gate
 *   COMPOSE(a, q)  the gate of two steps, a after q
 *   FN(name)  the block's own name for a function   PS_FWD_ENTRY  its exported entry
 *   PS_ACC_IS_STORAGE  defined when ACC and ST are one type (enables long chunks)
 * and optionally PS_FWD_TC_FAST: a function that returns a faster time-contiguous
 * worker for the given arguments, or NULL; PS_REDUCE8_FAST: a faster reduce of 8
 * long-sequence chunks, returning 0 when it did the work; PS_LONG_SCAN_FAST: the
 * same as PS_FWD_TC_FAST for the chunks of a long sequence (phase 3 below);
 * PS_FWD_ROW_FAST: faster unit-stride time-major rows, the same.
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
            const ACC v = STEP(LD(a + c), s[c], LD(b + c));
            s[c] = v;
            STO(x + c, v);
        }
    } else {
        for (int64_t c = 0; c < n; ++c) {
            const ACC v = STEP(LD(a + c * as), s[c], LD(b + c * bs));
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
                for (int64_t r = 0; r < PS_ROWS; ++r) ta[k][r] = s[r] = STEP(ta[k][r], s[r], tb[k][r]);
            FN(scatter)(x + t0 * xs[1], xs[0], xs[1], ta, n, nr);
        }
    }
}

#ifdef PS_ACC_IS_STORAGE
/* Long sequences with few chains (inner == 1, few rows): the time axis is cut into
 * chunks that run in parallel (SIMD lanes and threads) with a carry fix-up, and the
 * work is blocked so that the inputs leave memory once. Each row is walked in
 * blocks of PS_LONG_CHUNKS chunks of long_len() steps (about 512 KiB of each
 * input); after the team of threads has touched the output's pages (touch_pages),
 * for each block it:
 *   1. reduces every chunk to its affine map: the product of its gates and its
 *      final state from the empty state (8 chunks step together, as SIMD rows),
 *      reading the block's inputs from memory into the caches;
 *   2. meets at a barrier, then every member chains the block's carries (one step
 *      per chunk, from the state entering the block, the same on every member);
 *   3. scans its chunks from their carries with a time-contiguous worker
 *      (PS_LONG_SCAN_FAST where the includer has one), reading the inputs again
 *      from its cache and writing the outputs.
 * Members take whole groups of 8 chunks; the arithmetic does not depend on who
 * does what, so the result is the same bits with any number of threads. The last
 * block of a row may be shorter: its chunks are shorter, and the few steps past its
 * last whole chunk (or all of it, when it is too short to split) run serially on
 * member 0. Only for dtypes that accumulate in their own type: the carries pass
 * through the kernel's `initial`, which has the storage type. */
typedef struct {
    ps_scan_fwd_args full; /* the whole problem */
    ps_task_fn scan;       /* phase 3: the time-contiguous worker */
    int64_t len;           /* chunk length of a whole block */
    ACC *prod, *state;     /* per chunk of a block, double-buffered by block parity */
} FN(long_job);

/* Phase 1 for 8 chunks, each `steps` long, rows `row_a` / `row_b` apart. */
static void FN(reduce8)(const ST *a, const ST *b, int64_t row_a, int64_t row_b, int64_t steps,
                        int64_t sa, int64_t sb, ACC *state, ACC *prod) {
#ifdef PS_REDUCE8_FAST
    if (PS_REDUCE8_FAST(a, b, row_a, row_b, steps, sa, sb, state, prod) == 0) return;
#endif
    ACC ta[PS_TILE][PS_ROWS], tb[PS_TILE][PS_ROWS], s[PS_ROWS], q[PS_ROWS];
    for (int64_t r = 0; r < PS_ROWS; ++r) {
        s[r] = ZERO;
        q[r] = ONE;
    }
    for (int64_t t0 = 0; t0 < steps; t0 += PS_TILE) {
        const int64_t n = steps - t0 < PS_TILE ? steps - t0 : PS_TILE;
        FN(gather)(ta, n, PS_ROWS, a + t0 * sa, row_a, sa);
        FN(gather)(tb, n, PS_ROWS, b + t0 * sb, row_b, sb);
        for (int64_t k = 0; k < n; ++k)
            for (int64_t r = 0; r < PS_ROWS; ++r) {
                s[r] = STEP(ta[k][r], s[r], tb[k][r]);
                q[r] = COMPOSE(ta[k][r], q[r]);
            }
    }
    for (int64_t r = 0; r < PS_ROWS; ++r) {
        state[r] = s[r];
        prod[r] = q[r];
    }
}

/* Steps [t0, t0 + n) of row o as a time-contiguous problem of `rows` rows (chunks)
 * of `len` steps, starting from the states at `initial`. */
static ps_scan_fwd_args FN(block_rows)(const ps_scan_fwd_args *f, int64_t o, int64_t t0,
                                       int64_t rows, int64_t len, const ACC *initial) {
    ps_scan_fwd_args r = *f;
    r.outer = rows;
    r.steps = len;
    r.gates = (const ST *)f->gates + o * f->gates_stride[0] + t0 * f->gates_stride[1];
    r.tokens = (const ST *)f->tokens + o * f->tokens_stride[0] + t0 * f->tokens_stride[1];
    r.out = (ST *)f->out + o * f->out_stride[0] + t0 * f->out_stride[1];
    r.gates_stride[0] = len * f->gates_stride[1];
    r.tokens_stride[0] = len * f->tokens_stride[1];
    r.out_stride[0] = len * f->out_stride[1];
    r.initial = initial;
    r.initial_stride[0] = 1;
    r.initial_stride[1] = 0;
    return r;
}

/* The chunk length of a row's whole blocks (see PS_LONG_CHUNK_BYTES). */
static int64_t FN(long_len)(void) {
    return PS_LONG_CHUNK_BYTES / (int64_t)sizeof(ST);
}

/* Fresh output memory is zeroed by the OS at its first touch, one (huge) page at a
 * time, by the touching thread. Left to the scan, that work falls on whichever
 * member writes a page first and stalls the others at the next barrier; instead the
 * members first touch every page of the output in turn (page number modulo team
 * size), so the zeroing runs in parallel. Only for rows whose output is contiguous,
 * where every byte in the row's range is the output's. */
static void FN(touch_pages)(const ps_scan_fwd_args *f, int64_t o, int64_t me, int64_t size) {
    const int64_t st = f->out_stride[1];
    if (st != 1 && st != -1) return;
    const ST *x = (const ST *)f->out + o * f->out_stride[0];
    const uintptr_t p0 = (uintptr_t)x, p1 = (uintptr_t)(x + (f->steps - 1) * st);
    const uintptr_t lo = p0 < p1 ? p0 : p1, hi = (p0 < p1 ? p1 : p0) + sizeof(ST);
    const uintptr_t page = (uintptr_t)1 << 21;
    for (uintptr_t q = lo; q < hi; q = (q / page + 1) * page)
        if ((int64_t)((q / page) % (uintptr_t)size) == me) *(volatile char *)q = 0;
}

/* Row o, block by block, by members `me` of `size` of a team. *parity
 * picks the half of the double-buffered summaries for the next block; it runs on
 * across rows (a member may start the next row while another still reads the
 * summaries of this row's last block). */
static void FN(long_row)(const FN(long_job) *job, int64_t o, int64_t me, int64_t size,
                         int64_t *parity) {
    const ps_scan_fwd_args *f = &job->full;
    const int64_t groups = PS_LONG_CHUNKS / PS_ROWS;
    const int64_t g0 = me * groups / size, g1 = (me + 1) * groups / size; /* my groups */
    const int64_t block = PS_LONG_CHUNKS * job->len;
    ACC carry[PS_LONG_CHUNKS];
    ACC entering = f->initial ? LD((const ST *)f->initial + o * f->initial_stride[0]) : ZERO;
    for (int64_t t0 = 0; t0 < f->steps;) {
        const int64_t left = f->steps - t0;
        const int64_t n = left < block ? left : block;
        const int64_t len = n / PS_LONG_CHUNKS;
        if (len < PS_LONG_MIN_LEN) { /* too short to split: the row's last block */
            if (me == 0) {
                const ps_scan_fwd_args p = FN(block_rows)(f, o, t0, 1, n, &entering);
                job->scan(&p, 0, 1);
            }
            return;
        }
        const ps_scan_fwd_args p = FN(block_rows)(f, o, t0, PS_LONG_CHUNKS, len, carry);
        ACC *prod = job->prod + *parity * PS_LONG_CHUNKS;
        ACC *state = job->state + *parity * PS_LONG_CHUNKS;
        for (int64_t g = g0; g < g1; ++g)
            FN(reduce8)((const ST *)p.gates + g * PS_ROWS * p.gates_stride[0],
                        (const ST *)p.tokens + g * PS_ROWS * p.tokens_stride[0],
                        p.gates_stride[0], p.tokens_stride[0], len, p.gates_stride[1],
                        p.tokens_stride[1], state + g * PS_ROWS, prod + g * PS_ROWS);
        /* After this barrier no member reads the other parity's summaries any more,
         * so the next block may overwrite them. */
        ps_team_barrier();
        for (int64_t k = 0; k < PS_LONG_CHUNKS; ++k) {
            carry[k] = entering;
            entering = STEP(prod[k], entering, state[k]);
        }
        job->scan(&p, g0, g1);
        *parity ^= 1;
        const int64_t done = PS_LONG_CHUNKS * len;
        if (done < n && me == 0) { /* the row's last steps, past its last chunk */
            const ps_scan_fwd_args tail = FN(block_rows)(f, o, t0 + done, 1, n - done, &entering);
            job->scan(&tail, 0, 1);
        }
        t0 += n;
    }
}

static void FN(long_member)(const void *vp, int64_t me, int64_t size) {
    const FN(long_job) *job = (const FN(long_job) *)vp;
    const ps_scan_fwd_args *f = &job->full;
    for (int64_t o = 0; o < f->outer; ++o) FN(touch_pages)(f, o, me, size);
    ps_team_barrier();
    int64_t parity = 0;
    for (int64_t o = 0; o < f->outer; ++o) FN(long_row)(job, o, me, size, &parity);
}

static void FN(fwd_long)(const ps_scan_fwd_args *p, int64_t nthreads) {
    ACC prod[2 * PS_LONG_CHUNKS], state[2 * PS_LONG_CHUNKS];
    FN(long_job) job = {*p, NULL, FN(long_len)(), prod, state};
#if defined(PS_LONG_SCAN_FAST)
    job.scan = PS_LONG_SCAN_FAST(p);
#elif defined(PS_FWD_TC_FAST)
    job.scan = PS_FWD_TC_FAST(p);
#endif
    if (!job.scan) job.scan = FN(fwd_time_contiguous);
    ps_parallel_team(nthreads, FN(long_member), &job);
}

#endif

/* reverse, handled once: every time-indexed operand of p pointed at its last step,
 * its time stride negated. */
static inline void FN(fwd_flip)(ps_scan_fwd_args *p) {
    const int64_t steps = p->steps;
    if (p->reverse) {
        PS_FLIP(p->gates, p->gates_stride);
        PS_FLIP(p->tokens, p->tokens_stride);
        PS_FLIP(p->out, p->out_stride);
    }
}

/* The time-contiguous worker for p: the includer's faster one where it has one that
 * takes p's strides, else the portable tiles. */
static inline ps_task_fn FN(fwd_tc_worker)(const ps_scan_fwd_args *p) {
    ps_task_fn tc = NULL;
#ifdef PS_FWD_TC_FAST
    if (p->inner == 1) tc = PS_FWD_TC_FAST(p);
#else
    (void)p;
#endif
    return tc ? tc : FN(fwd_time_contiguous);
}

PS_API int PS_FWD_ENTRY(const ps_scan_fwd_args *args) {
    if (args->outer < 0 || args->steps < 0 || args->inner < 0) return -1;
    if (args->outer == 0 || args->steps == 0 || args->inner == 0) return 0;
    ps_scan_fwd_args p = *args;
    ps_prefer_huge_pages(p.out, p.outer * p.steps * p.inner * (int64_t)sizeof(ST));
    FN(fwd_flip)(&p);
    const int64_t nthreads = ps_threads_for(p.outer * p.steps * p.inner, p.nthreads);
#ifdef PS_ACC_IS_STORAGE
    if (p.inner == 1 && p.steps >= PS_LONG_STEPS && p.outer <= PS_LONG_ROWS) {
        FN(fwd_long)(&p, nthreads);
        return 0;
    }
#endif
    const ps_task_fn tc = FN(fwd_tc_worker)(&p);
    p.nthreads = nthreads;
    ps_run_units(p.outer, p.inner, nthreads, tc, FN(fwd_time_major), &p);
    return 0;
}
