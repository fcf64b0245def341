/* Packed sequences (cu_seqlens) for one (semiring, dtype) block: the entries
 * ps_<OP>_fwd_varlen_<SFX> and ps_<OP>_bwd_varlen_<SFX> (ABI in abi.h). Included by
 * cpu_instance.h after cpu_forward.h and cpu_backward.h.
 *
 * Summary of algorithm. The sequences are independent scans of their own steps, so
 * a thread never waits for another at a boundary. Where the plain kernel's work
 * units (groups of PS_ROWS rows, or an outer index and a channel block) keep the
 * whole team busy, one parallel region runs them (the "walk"): each unit walks every
 * sequence in turn, from its own initial state, with the plain kernel's worker on a
 * view of that sequence's steps, so every input is read once, every output written
 * once, tiles start at each sequence's first step, and a boundary costs one call
 * and a state load, never a barrier. The arithmetic is the plain kernel's, step for
 * step, so the result is the same bits as scanning each sequence alone.
 * With fewer units than threads (few channels), the channels cannot keep the team
 * busy and the sequences are shared instead (ps_run_varlen, cpu_common.h): short ones
 * each whole on one thread in one region, big ones alone with the team. The
 * forward's long rows (cpu_forward.h, fwd_long: inner == 1, few rows) run alone
 * with the team in either case, as a plain call would run them. */

#define PS_FWD_VARLEN_ENTRY PS_CAT(PS_CAT(PS_CAT(PS_CAT(ps, OP), fwd), varlen), SFX)
#define PS_BWD_VARLEN_ENTRY PS_CAT(PS_CAT(PS_CAT(PS_CAT(ps, OP), bwd), varlen), SFX)

/* The operand at time step t of a time-indexed operand; NULL stays NULL. */
#define PS_AT(ptr, stride, t) ((ptr) ? (const ST *)(ptr) + (t) * (stride)[1] : NULL)

/* Sequence s's steps of the packed forward problem p, as a problem of their own. */
static ps_scan_fwd_args FN(fwd_view)(const ps_scan_fwd_args *f, const ps_varlen_args *v,
                                     int64_t s) {
    ps_scan_fwd_args p = *f;
    const int64_t t0 = v->cu_seqlens[s];
    p.steps = v->cu_seqlens[s + 1] - t0;
    p.gates = PS_AT(p.gates, p.gates_stride, t0);
    p.tokens = PS_AT(p.tokens, p.tokens_stride, t0);
    p.out = (ST *)p.out + t0 * p.out_stride[1];
    if (p.initial) p.initial = (const ST *)p.initial + s * v->initial_seq_stride;
    return p;
}

static ps_scan_bwd_args FN(bwd_view)(const ps_scan_bwd_args *f, const ps_varlen_args *v,
                                     int64_t s) {
    ps_scan_bwd_args p = *f;
    const int64_t t0 = v->cu_seqlens[s];
    p.steps = v->cu_seqlens[s + 1] - t0;
    p.gates = PS_AT(p.gates, p.gates_stride, t0);
    p.tokens = PS_AT(p.tokens, p.tokens_stride, t0);
    p.out = PS_AT(p.out, p.out_stride, t0);
    p.grad_out = PS_AT(p.grad_out, p.grad_out_stride, t0);
    p.grad_gates = (ST *)p.grad_gates + t0 * p.grad_gates_stride[1];
    p.grad_tokens = (ST *)p.grad_tokens + t0 * p.grad_tokens_stride[1];
    if (p.initial) p.initial = (const ST *)p.initial + s * v->initial_seq_stride;
    p.grad_initial = (ST *)p.grad_initial + s * v->grad_initial_seq_stride;
    return p;
}

/* The shared schedule's runners (ps_run_varlen): sequence s through the plain entry. */
static int FN(fwd_segment)(const void *vp, const ps_varlen_args *v, int64_t s, int64_t nthreads) {
    ps_scan_fwd_args p = FN(fwd_view)((const ps_scan_fwd_args *)vp, v, s);
    p.nthreads = nthreads;
    return PS_FWD_ENTRY(&p);
}

static int FN(bwd_segment)(const void *vp, const ps_varlen_args *v, int64_t s, int64_t nthreads) {
    ps_scan_bwd_args p = FN(bwd_view)((const ps_scan_bwd_args *)vp, v, s);
    p.nthreads = nthreads;
    return PS_BWD_ENTRY(&p);
}

/* Whether a plain call would scan a sequence of `len` steps as a long row
 * (cpu_forward.h's fwd_long, whose chunking changes the rounding). */
static int FN(fwd_is_long)(const ps_scan_fwd_args *f, int64_t len) {
#ifdef PS_ACC_IS_STORAGE
    return f->inner == 1 && len >= PS_LONG_STEPS && f->outer <= PS_LONG_ROWS;
#else
    (void)f, (void)len;
    return 0;
#endif
}

/* The walk's job: the packed problem, its sequences, and the plain worker of its
 * units. */
typedef struct {
    ps_scan_fwd_args full;
    const ps_varlen_args *v;
    ps_task_fn work;
} FN(fwd_walk_job);

typedef struct {
    ps_scan_bwd_args full;
    const ps_varlen_args *v;
    ps_task_fn work;
} FN(bwd_walk_job);

/* Sequence s's view as the plain entry hands it to its workers: under reverse,
 * every time-indexed operand pointed at the sequence's last step with its time
 * stride negated (fwd_flip, bwd_flip). */
static ps_scan_fwd_args FN(fwd_walk_view)(const ps_scan_fwd_args *f, const ps_varlen_args *v,
                                          int64_t s) {
    ps_scan_fwd_args p = FN(fwd_view)(f, v, s);
    FN(fwd_flip)(&p);
    return p;
}

static ps_scan_bwd_args FN(bwd_walk_view)(const ps_scan_bwd_args *f, const ps_varlen_args *v,
                                          int64_t s) {
    ps_scan_bwd_args p = FN(bwd_view)(f, v, s);
    FN(bwd_flip)(&p);
    return p;
}

/* Units u0 .. u1 - 1, each through every non-empty sequence in turn (the backward
 * from the last, so that memory streams one way); the long rows are left to the
 * entry. */
#ifdef PS_ACC_IS_STORAGE
/* Time-contiguous rows (inner == 1) are stepped in visits of whole cache lines (cpu_x86.h)
 * when a row's steps start on a line; a sequence starting inside a line would make
 * every visit straddle two lines per row, whose rows, a power of two apart, then
 * share cache sets and evict each other. So the sequence's first steps, up to the
 * next line boundary of unit u's first output row, run as a view of their own, and
 * the rest from the state they leave in `out`: the same bits where the state is
 * stored in its own type. 0 when the sequence needs no head. */
static int64_t FN(fwd_head)(const ps_scan_fwd_args *p, int64_t u) {
    const int64_t st = p->out_stride[1];
    if (p->inner != 1 || (st != 1 && st != -1)) return 0;
    const uintptr_t x = (uintptr_t)((const ST *)p->out + u * PS_ROWS * p->out_stride[0]);
    const uintptr_t line = 64, size = sizeof(ST);
    const uintptr_t bytes = st == 1 ? (line - x % line) % line : (x + size) % line;
    const int64_t head = (int64_t)(bytes / size);
    return head < p->steps ? head : 0;
}

/* The view past the first `head` steps of p, starting from the state out[head - 1]. */
static ps_scan_fwd_args FN(fwd_body)(const ps_scan_fwd_args *p, int64_t head) {
    ps_scan_fwd_args r = *p;
    r.steps -= head;
    r.gates = (const ST *)p->gates + head * p->gates_stride[1];
    r.tokens = (const ST *)p->tokens + head * p->tokens_stride[1];
    r.out = (ST *)p->out + head * p->out_stride[1];
    r.initial = (const ST *)p->out + (head - 1) * p->out_stride[1];
    r.initial_stride[0] = p->out_stride[0];
    r.initial_stride[1] = 0;
    return r;
}
#endif

static void FN(fwd_walk)(const void *vp, int64_t u0, int64_t u1) {
    const FN(fwd_walk_job) *j = (const FN(fwd_walk_job) *)vp;
    const ps_varlen_args *v = j->v;
    for (int64_t u = u0; u < u1; ++u)
        for (int64_t s = 0; s < v->nseq; ++s) {
            const int64_t len = v->cu_seqlens[s + 1] - v->cu_seqlens[s];
            if (len == 0 || FN(fwd_is_long)(&j->full, len)) continue;
            ps_scan_fwd_args p = FN(fwd_walk_view)(&j->full, v, s);
#ifdef PS_ACC_IS_STORAGE
            const int64_t head = FN(fwd_head)(&p, u);
            if (head > 0) {
                const ps_scan_fwd_args body = FN(fwd_body)(&p, head);
                p.steps = head;
                j->work(&p, u, u + 1);
                j->work(&body, u, u + 1);
                continue;
            }
#endif
            j->work(&p, u, u + 1);
        }
}

static void FN(bwd_walk)(const void *vp, int64_t u0, int64_t u1) {
    const FN(bwd_walk_job) *j = (const FN(bwd_walk_job) *)vp;
    const ps_varlen_args *v = j->v;
    for (int64_t u = u0; u < u1; ++u)
        for (int64_t s = v->nseq - 1; s >= 0; --s) {
            if (v->cu_seqlens[s + 1] == v->cu_seqlens[s]) continue;
            const ps_scan_bwd_args p = FN(bwd_walk_view)(&j->full, v, s);
            j->work(&p, u, u + 1);
        }
}

/* The gradient of an empty sequence's initial state is zero (its final state is its
 * initial state, whose gradient the caller adds). */
static void FN(bwd_zero_empty)(const ps_scan_bwd_args *f, const ps_varlen_args *v) {
    const int64_t *gis = f->grad_initial_stride;
    for (int64_t s = 0; s < v->nseq; ++s) {
        if (v->cu_seqlens[s + 1] != v->cu_seqlens[s]) continue;
        ST *gi = (ST *)f->grad_initial + s * v->grad_initial_seq_stride;
        for (int64_t o = 0; o < f->outer; ++o)
            for (int64_t c = 0; c < f->inner; ++c) STO(gi + o * gis[0] + c * gis[1], AZERO);
    }
}

PS_API int PS_FWD_VARLEN_ENTRY(const ps_scan_fwd_args *args, const ps_varlen_args *v) {
    if (args->outer < 0 || args->steps < 0 || args->inner < 0) return -1;
    if (ps_varlen_check(v, args->steps) != 0) return -1;
    const int64_t channels = args->outer * args->inner;
    if (channels == 0) return 0;
    ps_prefer_huge_pages(args->out, channels * args->steps * (int64_t)sizeof(ST));
    const int64_t nthreads = ps_walk_threads(args->outer, args->steps, args->inner, args->nthreads);
    if (nthreads == 0)
        return ps_run_varlen(args, v, FN(fwd_segment), args->steps, channels, args->nthreads);
    FN(fwd_walk_job) job = {*args, v, FN(fwd_time_major)};
    job.full.nthreads = nthreads;
    /* The views' strides are flipped alike: the same choice for every sequence. */
    if (args->inner == 1) job.work = FN(fwd_tc_worker)(&job.full);
    ps_parallel_for(ps_units(args->outer, args->inner, nthreads), nthreads, FN(fwd_walk), &job);
    int failed = 0;
    for (int64_t s = 0; s < v->nseq; ++s)
        if (FN(fwd_is_long)(args, v->cu_seqlens[s + 1] - v->cu_seqlens[s]) &&
            FN(fwd_segment)(args, v, s, nthreads) != 0)
            failed = 1;
    return failed ? -1 : 0;
}

PS_API int PS_BWD_VARLEN_ENTRY(const ps_scan_bwd_args *args, const ps_varlen_args *v) {
    if (args->outer < 0 || args->steps < 0 || args->inner < 0) return -1;
    if (ps_varlen_check(v, args->steps) != 0) return -1;
    const int64_t channels = args->outer * args->inner;
    if (channels == 0) return 0;
    const int64_t bytes = channels * args->steps * (int64_t)sizeof(ST);
    ps_prefer_huge_pages(args->grad_gates, bytes);
    ps_prefer_huge_pages(args->grad_tokens, bytes);
    const int64_t nthreads = ps_walk_threads(args->outer, args->steps, args->inner, args->nthreads);
    if (nthreads == 0)
        return ps_run_varlen(args, v, FN(bwd_segment), args->steps, channels, args->nthreads);
    FN(bwd_walk_job) job = {*args, v, FN(bwd_time_major)};
    job.full.nthreads = nthreads;
    /* The views' strides are flipped alike: the same choice for every sequence. */
    if (args->inner == 1) job.work = FN(bwd_tc_worker)(&job.full);
    FN(bwd_zero_empty)(args, v);
    ps_parallel_for(ps_units(args->outer, args->inner, nthreads), nthreads, FN(bwd_walk), &job);
    return 0;
}

#undef PS_AT
#undef PS_FWD_VARLEN_ENTRY
#undef PS_BWD_VARLEN_ENTRY
