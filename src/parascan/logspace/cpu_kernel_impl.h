/* The fused backward of log_linear_scan, included by cpu_kernel.c once per dtype
 * after scan_forward_impl.h (whose gather/scatter tiles it shares). Besides the
 * forward's macros the includer defines ADD(a, b), CFMA(a,s,b) conj(a) * s + b,
 * MULC(g,x) g * conj(x) and WEIGHT(x, h), the weight exp(x - h) (0 at h = -inf).
 *
 * Summary of algorithm. Walking time backwards, the gradient reaching out[t] is
 * g[t] = grad_out[t] + conj(wu[t+1]) g[t+1]: a linear recurrence whose gates,
 * the weights wu, come from the inputs and the saved output alone. So the chain
 * carried from step to step is one multiply-add, and the weights (exp) are
 * computed off it, as independent work the vector units overlap. Each input is
 * read once and each gradient written once, with the forward's work units.
 */

/* One backward time step over n channels (hp: out[t-1], NULL for the empty
 * state): g = grad_out + conj(w_next) * g, the gradients, then w_next = wu[t]. */
static inline void FN(bwd_row)(int64_t n, ACC *restrict g, ACC *restrict wn,
                               const ST *restrict a, int64_t as,
                               const ST *restrict b, int64_t bs,
                               const ST *restrict h, int64_t hs,
                               const ST *restrict hp, int64_t hps,
                               const ST *restrict gx, int64_t gxs,
                               ST *restrict ga, int64_t gas,
                               ST *restrict gb, int64_t gbs) {
    for (int64_t c = 0; c < n; ++c) {
        const ACC hc = LD(h + c * hs);
        const ACC prev = hp ? LD(hp + c * hps) : ZERO;
        const ACC v = CFMA(wn[c], g[c], LD(gx + c * gxs));
        const ACC wu = WEIGHT(ADD(LD(a + c * as), prev), hc);
        g[c] = v;
        wn[c] = wu;
        STO(ga + c * gas, MULC(v, wu));
        STO(gb + c * gbs, MULC(v, WEIGHT(LD(b + c * bs), hc)));
    }
}

/* The unit-stride case, written out so that the compiler vectorizes it. */
static inline void FN(bwd_row_unit)(int64_t n, ACC *restrict g, ACC *restrict wn,
                                    const ST *restrict a, const ST *restrict b,
                                    const ST *restrict h, const ST *restrict hp,
                                    const ST *restrict gx, ST *restrict ga,
                                    ST *restrict gb) {
    PS_SIMD
    for (int64_t c = 0; c < n; ++c) {
        const ACC hc = LD(h + c);
        const ACC v = CFMA(wn[c], g[c], LD(gx + c));
        const ACC wu = WEIGHT(ADD(LD(a + c), LD(hp + c)), hc);
        g[c] = v;
        wn[c] = wu;
        STO(ga + c, MULC(v, wu));
        STO(gb + c, MULC(v, WEIGHT(LD(b + c), hc)));
    }
}

PS_HOT static void FN(bwd_time_major)(const void *vp, int64_t u0, int64_t u1) {
    const ps_log_bwd_args *p = (const ps_log_bwd_args *)vp;
    const int64_t *as = p->gates_stride, *bs = p->tokens_stride, *xs = p->out_stride;
    const int64_t *gxs = p->grad_out_stride, *gas = p->grad_gates_stride;
    const int64_t *gbs = p->grad_tokens_stride;
    const int64_t *is = p->initial_stride, *gis = p->grad_initial_stride;
    const int64_t block = ps_channel_block(p->outer, p->inner, p->nthreads);
    const int64_t nblk = (p->inner + block - 1) / block;
    const int unit = as[2] == 1 && bs[2] == 1 && xs[2] == 1 && gxs[2] == 1 &&
                     gas[2] == 1 && gbs[2] == 1;
    ACC g[PS_BLOCK], wn[PS_BLOCK];
    for (int64_t u = u0; u < u1; ++u) {
        const int64_t o = u / nblk, c0 = (u % nblk) * block;
        const int64_t n = p->inner - c0 < block ? p->inner - c0 : block;
        const ST *a = (const ST *)p->gates + o * as[0] + c0 * as[2];
        const ST *b = (const ST *)p->tokens + o * bs[0] + c0 * bs[2];
        const ST *x = (const ST *)p->out + o * xs[0] + c0 * xs[2];
        const ST *gx = (const ST *)p->grad_out + o * gxs[0] + c0 * gxs[2];
        ST *ga = (ST *)p->grad_gates + o * gas[0] + c0 * gas[2];
        ST *gb = (ST *)p->grad_tokens + o * gbs[0] + c0 * gbs[2];
        const ST *x0 = p->initial ? (const ST *)p->initial + o * is[0] + c0 * is[1] : NULL;
        for (int64_t c = 0; c < n; ++c) g[c] = wn[c] = ZERO_WEIGHT;
        for (int64_t t = p->steps - 1; t >= 0; --t) {
            if (unit && t > 0) {
                FN(bwd_row_unit)(n, g, wn, a + t * as[1], b + t * bs[1], x + t * xs[1],
                                 x + (t - 1) * xs[1], gx + t * gxs[1], ga + t * gas[1],
                                 gb + t * gbs[1]);
                continue;
            }
            const ST *hp = t > 0 ? x + (t - 1) * xs[1] : x0;
            const int64_t hps = t > 0 ? xs[2] : is[1];
            FN(bwd_row)(n, g, wn, a + t * as[1], as[2], b + t * bs[1], bs[2], x + t * xs[1],
                        xs[2], hp, hps, gx + t * gxs[1], gxs[2], ga + t * gas[1], gas[2],
                        gb + t * gbs[1], gbs[2]);
        }
        ST *gi = (ST *)p->grad_initial + o * gis[0] + c0 * gis[1];
        for (int64_t c = 0; c < n; ++c) STO(gi + c * gis[1], CFMA(wn[c], g[c], ZERO_WEIGHT));
    }
}

PS_HOT static void FN(bwd_time_contiguous)(const void *vp, int64_t u0, int64_t u1) {
    const ps_log_bwd_args *p = (const ps_log_bwd_args *)vp;
    const int64_t *as = p->gates_stride, *bs = p->tokens_stride, *xs = p->out_stride;
    const int64_t *gxs = p->grad_out_stride, *gas = p->grad_gates_stride;
    const int64_t *gbs = p->grad_tokens_stride;
    const int64_t *is = p->initial_stride, *gis = p->grad_initial_stride;
    /* th[k + 1] = out[t0 + k]; th[0] = out[t0 - 1] (the initial state at t0 == 0). */
    ACC ta[PS_TILE][PS_ROWS], tb[PS_TILE][PS_ROWS], tg[PS_TILE][PS_ROWS];
    ACC th[PS_TILE + 1][PS_ROWS];
    ACC g[PS_ROWS], wn[PS_ROWS];
    for (int64_t u = u0; u < u1; ++u) {
        const int64_t r0 = u * PS_ROWS;
        const int64_t nr = p->outer - r0 < PS_ROWS ? p->outer - r0 : PS_ROWS;
        const ST *a = (const ST *)p->gates + r0 * as[0];
        const ST *b = (const ST *)p->tokens + r0 * bs[0];
        const ST *x = (const ST *)p->out + r0 * xs[0];
        const ST *gx = (const ST *)p->grad_out + r0 * gxs[0];
        ST *ga = (ST *)p->grad_gates + r0 * gas[0];
        ST *gb = (ST *)p->grad_tokens + r0 * gbs[0];
        for (int64_t r = 0; r < PS_ROWS; ++r) g[r] = wn[r] = ZERO_WEIGHT;
        const int64_t last = (p->steps - 1) / PS_TILE * PS_TILE;
        for (int64_t t0 = last; t0 >= 0; t0 -= PS_TILE) {
            const int64_t n = p->steps - t0 < PS_TILE ? p->steps - t0 : PS_TILE;
            FN(gather)(ta, n, nr, a + t0 * as[1], as[0], as[1]);
            FN(gather)(tb, n, nr, b + t0 * bs[1], bs[0], bs[1]);
            FN(gather)(tg, n, nr, gx + t0 * gxs[1], gxs[0], gxs[1]);
            if (t0 > 0) {
                FN(gather)(th, n + 1, nr, x + (t0 - 1) * xs[1], xs[0], xs[1]);
            } else {
                FN(gather)(th + 1, n, nr, x, xs[0], xs[1]);
                for (int64_t r = 0; r < PS_ROWS; ++r)
                    th[0][r] = (r < nr && p->initial) ? LD((const ST *)p->initial + (r0 + r) * is[0]) : ZERO;
            }
            /* The weights first (independent work), then the short chain. */
            for (int64_t k = 0; k < n; ++k)
                for (int64_t r = 0; r < PS_ROWS; ++r) {
                    ta[k][r] = WEIGHT(ADD(ta[k][r], th[k][r]), th[k + 1][r]);
                    tb[k][r] = WEIGHT(tb[k][r], th[k + 1][r]);
                }
            for (int64_t k = n - 1; k >= 0; --k)
                for (int64_t r = 0; r < PS_ROWS; ++r) {
                    const ACC v = CFMA(wn[r], g[r], tg[k][r]);
                    g[r] = v;
                    wn[r] = ta[k][r];
                    ta[k][r] = MULC(v, ta[k][r]);
                    tb[k][r] = MULC(v, tb[k][r]);
                }
            FN(scatter)(ga + t0 * gas[1], gas[0], gas[1], ta, n, nr);
            FN(scatter)(gb + t0 * gbs[1], gbs[0], gbs[1], tb, n, nr);
        }
        for (int64_t r = 0; r < nr; ++r)
            STO((ST *)p->grad_initial + (r0 + r) * gis[0], CFMA(wn[r], g[r], ZERO_WEIGHT));
    }
}

PS_API int FN(ps_log_scan_bwd)(const ps_log_bwd_args *args) {
    if (args->outer < 0 || args->steps < 0 || args->inner < 0) return -1;
    if (args->outer == 0 || args->inner == 0) return 0;
    if (args->steps == 0) {
        for (int64_t o = 0; o < args->outer; ++o)
            for (int64_t c = 0; c < args->inner; ++c)
                STO((ST *)args->grad_initial + o * args->grad_initial_stride[0] + c * args->grad_initial_stride[1], ZERO_WEIGHT);
        return 0;
    }
    ps_log_bwd_args p = *args;
    const int64_t steps = p.steps;
    ps_prefer_huge_pages(p.grad_gates, p.outer * p.steps * p.inner * (int64_t)sizeof(ST));
    ps_prefer_huge_pages(p.grad_tokens, p.outer * p.steps * p.inner * (int64_t)sizeof(ST));
    if (p.reverse) {
        PS_FLIP(p.gates, p.gates_stride);
        PS_FLIP(p.tokens, p.tokens_stride);
        PS_FLIP(p.out, p.out_stride);
        PS_FLIP(p.grad_out, p.grad_out_stride);
        PS_FLIP(p.grad_gates, p.grad_gates_stride);
        PS_FLIP(p.grad_tokens, p.grad_tokens_stride);
    }
    const int64_t nthreads = ps_threads_for(p.outer * p.steps * p.inner, p.nthreads);
    p.nthreads = nthreads;
    ps_run_units(p.outer, p.inner, nthreads, FN(bwd_time_contiguous), FN(bwd_time_major), &p);
    return 0;
}
