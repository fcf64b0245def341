/* The fused backward of a first-order scan, one template for every semiring and
 * dtype: cpu_instance.h instantiates it once per (semiring, dtype), after
 * cpu_forward.h, whose gather / scatter tiles it shares.
 *
 * Summary of algorithm. Walking time backwards, the gradient reaching out[t] is
 * g[t] = grad_out[t] + conj(w[t+1]) g[t+1] (g[steps] = 0): a linear recurrence in
 * every semiring, whose gates are the step weights w. The semirings differ only in
 * those weights (semiring_*.h), computed from the step's gate a, token b, previous
 * output prev = out[t-1] (at t = 0 the initial state, or the empty state ZERO) and
 * output h = out[t]:
 *   W_STEP(a, prev, h)  w[t] = d out[t] / d out[t-1]   linear: a      log: exp(a + prev - h)
 *   W_GATE(w, prev)     d out[t] / d gates[t]           linear: prev   log: w
 *   W_TOKEN(b, h)       d out[t] / d tokens[t]          linear: 1      log: exp(b - h)
 * and grad_gates[t] = g[t] conj(W_GATE), grad_tokens[t] = g[t] conj(W_TOKEN),
 * grad_initial = conj(w[0]) g[0]. So the chain carried from step to step is one
 * multiply-add, and the weights (exp, in log space) are computed off it, as
 * independent work the vector units overlap. Each input is read once and each
 * gradient written once, with the forward's work units.
 *
 * Besides the forward's macros the block defines CFMA(a, s, b) = conj(a) s + b,
 * MULC(g, x) = g conj(x), AZERO (0 in ACC), PS_BWD_ENTRY, the weights above and three
 * constants of the semiring: TOKEN_WEIGHT_IS_ONE (grad_tokens is g itself, and the
 * tokens are never read: they may be NULL), ZERO_GATE_GRAD_FROM_EMPTY (see
 * cpu_semiring_linear.h) and BWD_WEIGHTS_FIRST (the rows' schedule, below); optionally PS_BWD_TC_FAST and PS_BWD_ROW_FAST, faster
 * time-contiguous workers and unit-stride rows (the pattern of cpu_forward.h's
 * PS_FWD_TC_FAST and PS_FWD_ROW_FAST).
 */

/* The backward rows' two schedules, chosen by the semiring's BWD_WEIGHTS_FIRST. Where
 * the step weights cost something (exp, in log space) they come first, independent
 * work the vector units overlap with the chain, and the unit-stride loop is marked
 * PS_SIMD (gcc's cost model declines it otherwise); where the weights are the inputs
 * themselves (linear), the chain comes first and gcc vectorizes unaided. The same
 * statements in the other order measured 4% (linear, float64) to 13% (log, float32)
 * slower. Both are written out here: hc and prev are out[t] and out[t-1], v the
 * gradient reaching out[t], w the weight w[t]. */

/* One backward time step over n channels, any strides (hp: out[t-1], NULL for the
 * empty state; b is not read when TOKEN_WEIGHT_IS_ONE): g = grad_out + conj(w_next) g,
 * the gradients, then w_next = w[t]. */
static inline void FN(bwd_row)(int64_t n, ACC *restrict g, ACC *restrict wn,
                               const ST *restrict a, int64_t as,
                               const ST *restrict b, int64_t bs,
                               const ST *restrict h, int64_t hs,
                               const ST *restrict hp, int64_t hps,
                               const ST *restrict gx, int64_t gxs,
                               ST *restrict ga, int64_t gas,
                               ST *restrict gb, int64_t gbs) {
    (void)b, (void)bs; /* the linear semiring's weights read neither tokens nor out[t] */
    for (int64_t c = 0; c < n; ++c) {
#if BWD_WEIGHTS_FIRST
        const ACC hc = LD(h + c * hs);
        const ACC prev = hp ? LD(hp + c * hps) : ZERO;
        const ACC v = CFMA(wn[c], g[c], LD(gx + c * gxs));
        const ACC w = W_STEP(LD(a + c * as), prev, hc);
        g[c] = v;
        wn[c] = w;
        STO(ga + c * gas, hp || !ZERO_GATE_GRAD_FROM_EMPTY ? MULC(v, W_GATE(w, prev)) : AZERO);
        STO(gb + c * gbs, TOKEN_WEIGHT_IS_ONE ? v : MULC(v, W_TOKEN(LD(b + c * bs), hc)));
#else
        const ACC v = CFMA(wn[c], g[c], LD(gx + c * gxs));
        const ACC hc = LD(h + c * hs);
        g[c] = v;
        STO(gb + c * gbs, TOKEN_WEIGHT_IS_ONE ? v : MULC(v, W_TOKEN(LD(b + c * bs), hc)));
        const ACC prev = hp ? LD(hp + c * hps) : ZERO;
        const ACC w = W_STEP(LD(a + c * as), prev, hc);
        STO(ga + c * gas, hp || !ZERO_GATE_GRAD_FROM_EMPTY ? MULC(v, W_GATE(w, prev)) : AZERO);
        wn[c] = w;
#endif
        (void)hc;
    }
}

/* The same step when every operand, out[t-1] (or the initial state) included, has
 * unit stride along the channels, written out so that the compiler vectorizes it. */
static inline void FN(bwd_row_unit)(int64_t n, ACC *restrict g, ACC *restrict wn,
                                    const ST *restrict a, const ST *restrict b,
                                    const ST *restrict h, const ST *restrict hp,
                                    const ST *restrict gx, ST *restrict ga,
                                    ST *restrict gb) {
    (void)b; /* as in bwd_row */
#ifdef PS_BWD_ROW_FAST
    if (PS_BWD_ROW_FAST(n, g, wn, a, gx, hp, ga, gb) == 0) return;
#endif
#if BWD_WEIGHTS_FIRST
    PS_SIMD
#endif
    for (int64_t c = 0; c < n; ++c) {
#if BWD_WEIGHTS_FIRST
        const ACC hc = LD(h + c);
        const ACC prev = LD(hp + c);
        const ACC v = CFMA(wn[c], g[c], LD(gx + c));
        const ACC w = W_STEP(LD(a + c), prev, hc);
        g[c] = v;
        wn[c] = w;
        STO(ga + c, MULC(v, W_GATE(w, prev)));
        STO(gb + c, TOKEN_WEIGHT_IS_ONE ? v : MULC(v, W_TOKEN(LD(b + c), hc)));
#else
        const ACC v = CFMA(wn[c], g[c], LD(gx + c));
        const ACC hc = LD(h + c);
        g[c] = v;
        STO(gb + c, TOKEN_WEIGHT_IS_ONE ? v : MULC(v, W_TOKEN(LD(b + c), hc)));
        const ACC prev = LD(hp + c);
        const ACC w = W_STEP(LD(a + c), prev, hc);
        STO(ga + c, MULC(v, W_GATE(w, prev)));
        wn[c] = w;
#endif
        (void)hc;
    }
}

PS_HOT static void FN(bwd_time_major)(const void *vp, int64_t u0, int64_t u1) {
    const ps_scan_bwd_args *p = (const ps_scan_bwd_args *)vp;
    const int64_t *as = p->gates_stride, *bs = p->tokens_stride, *xs = p->out_stride;
    const int64_t *gxs = p->grad_out_stride, *gas = p->grad_gates_stride;
    const int64_t *gbs = p->grad_tokens_stride;
    const int64_t *is = p->initial_stride, *gis = p->grad_initial_stride;
    const int64_t block = ps_channel_block(p->outer, p->inner, p->nthreads);
    const int64_t nblk = (p->inner + block - 1) / block;
    const int unit = as[2] == 1 && xs[2] == 1 && gxs[2] == 1 && gas[2] == 1 && gbs[2] == 1 &&
                     (TOKEN_WEIGHT_IS_ONE || bs[2] == 1);
    ACC g[PS_BLOCK], wn[PS_BLOCK];
    for (int64_t u = u0; u < u1; ++u) {
        const int64_t o = u / nblk, c0 = (u % nblk) * block;
        const int64_t n = p->inner - c0 < block ? p->inner - c0 : block;
        const ST *a = (const ST *)p->gates + o * as[0] + c0 * as[2];
        const ST *b = TOKEN_WEIGHT_IS_ONE ? NULL : (const ST *)p->tokens + o * bs[0] + c0 * bs[2];
        const ST *x = (const ST *)p->out + o * xs[0] + c0 * xs[2];
        const ST *gx = (const ST *)p->grad_out + o * gxs[0] + c0 * gxs[2];
        ST *ga = (ST *)p->grad_gates + o * gas[0] + c0 * gas[2];
        ST *gb = (ST *)p->grad_tokens + o * gbs[0] + c0 * gbs[2];
        const ST *x0 = p->initial ? (const ST *)p->initial + o * is[0] + c0 * is[1] : NULL;
        for (int64_t c = 0; c < n; ++c) g[c] = wn[c] = AZERO;
        for (int64_t t = p->steps - 1; t >= 0; --t) {
            const ST *bt = TOKEN_WEIGHT_IS_ONE ? NULL : b + t * bs[1];
            const ST *hp = t > 0 ? x + (t - 1) * xs[1] : x0;
            const int64_t hps = t > 0 ? xs[2] : is[1];
            if (unit && hp && hps == 1) {
                FN(bwd_row_unit)(n, g, wn, a + t * as[1], bt, x + t * xs[1], hp, gx + t * gxs[1],
                                 ga + t * gas[1], gb + t * gbs[1]);
                continue;
            }
            FN(bwd_row)(n, g, wn, a + t * as[1], as[2], bt, bs[2], x + t * xs[1], xs[2], hp,
                        hps, gx + t * gxs[1], gxs[2], ga + t * gas[1], gas[2], gb + t * gbs[1],
                        gbs[2]);
        }
        ST *gi = (ST *)p->grad_initial + o * gis[0] + c0 * gis[1];
        for (int64_t c = 0; c < n; ++c) STO(gi + c * gis[1], CFMA(wn[c], g[c], AZERO));
    }
}

/* The outputs before the first tile's steps: th[0] = the initial state (or the empty
 * state), th[k + 1] = out[k]. Run once per group of rows, and kept out of line: inlined
 * into the worker's tile loop it made that loop measurably slower (5% for
 * log_linear_scan in float32). */
__attribute__((noinline, cold)) static void FN(gather_first)(ACC (*th)[PS_ROWS], int64_t n,
                                                             int64_t nr, const ST *x,
                                                             const int64_t *xs,
                                                             const ST *initial, int64_t is0) {
    FN(gather)(th + 1, n, nr, x, xs[0], xs[1]);
    for (int64_t r = 0; r < PS_ROWS; ++r) th[0][r] = (r < nr && initial) ? LD(initial + r * is0) : ZERO;
}

PS_HOT static void FN(bwd_time_contiguous)(const void *vp, int64_t u0, int64_t u1) {
    const ps_scan_bwd_args *p = (const ps_scan_bwd_args *)vp;
    const int64_t *as = p->gates_stride, *bs = p->tokens_stride, *xs = p->out_stride;
    const int64_t *gxs = p->grad_out_stride, *gas = p->grad_gates_stride;
    const int64_t *gbs = p->grad_tokens_stride;
    const int64_t *is = p->initial_stride, *gis = p->grad_initial_stride;
    /* th[k + 1] = out[t0 + k]; th[0] = out[t0 - 1] (the initial state at t0 == 0).
     * After the chain, th[k] holds grad_gates[t0 + k] and tg[k] grad_tokens[t0 + k]. */
    ACC ta[PS_TILE][PS_ROWS], tb[PS_TILE][PS_ROWS], tg[PS_TILE][PS_ROWS];
    ACC th[PS_TILE + 1][PS_ROWS];
    ACC g[PS_ROWS], wn[PS_ROWS];
    for (int64_t u = u0; u < u1; ++u) {
        const int64_t r0 = u * PS_ROWS;
        const int64_t nr = p->outer - r0 < PS_ROWS ? p->outer - r0 : PS_ROWS;
        const ST *a = (const ST *)p->gates + r0 * as[0];
        const ST *b = TOKEN_WEIGHT_IS_ONE ? NULL : (const ST *)p->tokens + r0 * bs[0];
        const ST *x = (const ST *)p->out + r0 * xs[0];
        const ST *gx = (const ST *)p->grad_out + r0 * gxs[0];
        ST *ga = (ST *)p->grad_gates + r0 * gas[0];
        ST *gb = (ST *)p->grad_tokens + r0 * gbs[0];
        for (int64_t r = 0; r < PS_ROWS; ++r) g[r] = wn[r] = AZERO;
        const int64_t last = (p->steps - 1) / PS_TILE * PS_TILE;
        for (int64_t t0 = last; t0 >= 0; t0 -= PS_TILE) {
            const int64_t n = p->steps - t0 < PS_TILE ? p->steps - t0 : PS_TILE;
            FN(gather)(ta, n, nr, a + t0 * as[1], as[0], as[1]);
            if (!TOKEN_WEIGHT_IS_ONE) FN(gather)(tb, n, nr, b + t0 * bs[1], bs[0], bs[1]);
            FN(gather)(tg, n, nr, gx + t0 * gxs[1], gxs[0], gxs[1]);
            if (t0 > 0)
                FN(gather)(th, n + 1, nr, x + (t0 - 1) * xs[1], xs[0], xs[1]);
            else
                FN(gather_first)(th, n, nr, x, xs, p->initial ? (const ST *)p->initial + r0 * is[0] : NULL, is[0]);
            /* The weights first (independent work), then the short chain. */
            for (int64_t k = 0; k < n; ++k)
                for (int64_t r = 0; r < PS_ROWS; ++r) {
                    ta[k][r] = W_STEP(ta[k][r], th[k][r], th[k + 1][r]);
                    if (!TOKEN_WEIGHT_IS_ONE) tb[k][r] = W_TOKEN(tb[k][r], th[k + 1][r]);
                }
            for (int64_t k = n - 1; k >= 0; --k)
                for (int64_t r = 0; r < PS_ROWS; ++r) {
                    const ACC v = CFMA(wn[r], g[r], tg[k][r]);
                    g[r] = v;
                    wn[r] = ta[k][r];
                    th[k][r] = MULC(v, W_GATE(ta[k][r], th[k][r]));
                    tg[k][r] = TOKEN_WEIGHT_IS_ONE ? v : MULC(v, tb[k][r]);
                }
            FN(scatter)(ga + t0 * gas[1], gas[0], gas[1], th, n, nr);
            FN(scatter)(gb + t0 * gbs[1], gbs[0], gbs[1], tg, n, nr);
        }
        for (int64_t r = 0; r < nr; ++r)
            STO((ST *)p->grad_initial + (r0 + r) * gis[0], CFMA(wn[r], g[r], AZERO));
    }
}

/* reverse, handled once (as fwd_flip): the time-indexed operands of p from their last
 * step. The tokens are not read, and may be NULL, when TOKEN_WEIGHT_IS_ONE. */
static inline void FN(bwd_flip)(ps_scan_bwd_args *p) {
    const int64_t steps = p->steps;
    if (p->reverse) {
        PS_FLIP(p->gates, p->gates_stride);
        if (!TOKEN_WEIGHT_IS_ONE) PS_FLIP(p->tokens, p->tokens_stride);
        PS_FLIP(p->out, p->out_stride);
        PS_FLIP(p->grad_out, p->grad_out_stride);
        PS_FLIP(p->grad_gates, p->grad_gates_stride);
        PS_FLIP(p->grad_tokens, p->grad_tokens_stride);
    }
}

/* The time-contiguous worker for p (as fwd_tc_worker). */
static inline ps_task_fn FN(bwd_tc_worker)(const ps_scan_bwd_args *p) {
    ps_task_fn tc = NULL;
#ifdef PS_BWD_TC_FAST
    if (p->inner == 1) tc = PS_BWD_TC_FAST(p);
#else
    (void)p;
#endif
    return tc ? tc : FN(bwd_time_contiguous);
}

PS_API int PS_BWD_ENTRY(const ps_scan_bwd_args *args) {
    if (args->outer < 0 || args->steps < 0 || args->inner < 0) return -1;
    if (args->outer == 0 || args->inner == 0) return 0;
    if (args->steps == 0) {
        for (int64_t o = 0; o < args->outer; ++o)
            for (int64_t c = 0; c < args->inner; ++c)
                STO((ST *)args->grad_initial + o * args->grad_initial_stride[0] + c * args->grad_initial_stride[1], AZERO);
        return 0;
    }
    ps_scan_bwd_args p = *args;
    ps_prefer_huge_pages(p.grad_gates, p.outer * p.steps * p.inner * (int64_t)sizeof(ST));
    ps_prefer_huge_pages(p.grad_tokens, p.outer * p.steps * p.inner * (int64_t)sizeof(ST));
    FN(bwd_flip)(&p);
    const int64_t nthreads = ps_threads_for(p.outer * p.steps * p.inner, p.nthreads);
    const ps_task_fn tc = FN(bwd_tc_worker)(&p);
    p.nthreads = nthreads;
    ps_run_units(p.outer, p.inner, nthreads, tc, FN(bwd_time_major), &p);
    return 0;
}
