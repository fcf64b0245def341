/* The fused backward of linear_scan, included by cpu_kernel.c once per dtype
 * after scan_forward_impl.h (whose gather/scatter tiles it shares). Besides the
 * forward's macros the includer defines CFMA(a,s,b) conj(a) * s + b and
 * MULC(g,x) g * conj(x), and optionally PS_BWD_TC_FAST / PS_BWD_ROW_FAST (see
 * scan_forward_impl.h for the pattern). It walks time backwards with the same
 * work units as the forward.
 */

/* One backward time step over n channels: g = grad_out + conj(a_next) * g,
 * grad_tokens = g, grad_gates = g * conj(x_prev) (zero when x_prev is NULL),
 * then a_next = gates of this step. */
static inline void FN(bwd_row)(int64_t n, ACC *restrict g, ACC *restrict an,
                               const ST *restrict a, int64_t as,
                               const ST *restrict gx, int64_t gxs,
                               const ST *restrict xp, int64_t xps,
                               ST *restrict ga, int64_t gas,
                               ST *restrict gb, int64_t gbs) {
    if (as == 1 && gxs == 1 && xps == 1 && gas == 1 && gbs == 1 && xp) {
#ifdef PS_BWD_ROW_FAST
        if (PS_BWD_ROW_FAST(n, g, an, a, gx, xp, ga, gb) == 0) return;
#endif
        for (int64_t c = 0; c < n; ++c) {
            const ACC v = CFMA(an[c], g[c], LD(gx + c));
            g[c] = v;
            STO(gb + c, v);
            STO(ga + c, MULC(v, LD(xp + c)));
            an[c] = LD(a + c);
        }
    } else {
        for (int64_t c = 0; c < n; ++c) {
            const ACC v = CFMA(an[c], g[c], LD(gx + c * gxs));
            g[c] = v;
            STO(gb + c * gbs, v);
            STO(ga + c * gas, xp ? MULC(v, LD(xp + c * xps)) : ZERO);
            an[c] = LD(a + c * as);
        }
    }
}

PS_HOT static void FN(bwd_time_major)(const void *vp, int64_t u0, int64_t u1) {
    const ps_linear_bwd_args *p = (const ps_linear_bwd_args *)vp;
    const int64_t *as = p->gates_stride, *xs = p->out_stride, *gxs = p->grad_out_stride;
    const int64_t *gas = p->grad_gates_stride, *gbs = p->grad_tokens_stride;
    const int64_t *is = p->initial_stride, *gis = p->grad_initial_stride;
    const int64_t block = ps_channel_block(p->outer, p->inner, p->nthreads);
    const int64_t nblk = (p->inner + block - 1) / block;
    ACC g[PS_BLOCK], an[PS_BLOCK];
    for (int64_t u = u0; u < u1; ++u) {
        const int64_t o = u / nblk, c0 = (u % nblk) * block;
        const int64_t n = p->inner - c0 < block ? p->inner - c0 : block;
        const ST *a = (const ST *)p->gates + o * as[0] + c0 * as[2];
        const ST *x = (const ST *)p->out + o * xs[0] + c0 * xs[2];
        const ST *gx = (const ST *)p->grad_out + o * gxs[0] + c0 * gxs[2];
        ST *ga = (ST *)p->grad_gates + o * gas[0] + c0 * gas[2];
        ST *gb = (ST *)p->grad_tokens + o * gbs[0] + c0 * gbs[2];
        const ST *x0 = p->initial ? (const ST *)p->initial + o * is[0] + c0 * is[1] : NULL;
        for (int64_t c = 0; c < n; ++c) g[c] = an[c] = ZERO;
        for (int64_t t = p->steps - 1; t >= 0; --t) {
            const ST *xp = t > 0 ? x + (t - 1) * xs[1] : x0;
            const int64_t xps = t > 0 ? xs[2] : is[1];
            FN(bwd_row)(n, g, an, a + t * as[1], as[2], gx + t * gxs[1], gxs[2], xp, xps,
                        ga + t * gas[1], gas[2], gb + t * gbs[1], gbs[2]);
        }
        ST *gi = (ST *)p->grad_initial + o * gis[0] + c0 * gis[1];
        for (int64_t c = 0; c < n; ++c) STO(gi + c * gis[1], CFMA(an[c], g[c], ZERO));
    }
}

PS_HOT static void FN(bwd_time_contiguous)(const void *vp, int64_t u0, int64_t u1) {
    const ps_linear_bwd_args *p = (const ps_linear_bwd_args *)vp;
    const int64_t *as = p->gates_stride, *xs = p->out_stride, *gxs = p->grad_out_stride;
    const int64_t *gas = p->grad_gates_stride, *gbs = p->grad_tokens_stride;
    const int64_t *is = p->initial_stride, *gis = p->grad_initial_stride;
    ACC ta[PS_TILE][PS_ROWS], tg[PS_TILE][PS_ROWS], tx[PS_TILE][PS_ROWS];
    ACC g[PS_ROWS], an[PS_ROWS];
    for (int64_t u = u0; u < u1; ++u) {
        const int64_t r0 = u * PS_ROWS;
        const int64_t nr = p->outer - r0 < PS_ROWS ? p->outer - r0 : PS_ROWS;
        const ST *a = (const ST *)p->gates + r0 * as[0];
        const ST *x = (const ST *)p->out + r0 * xs[0];
        const ST *gx = (const ST *)p->grad_out + r0 * gxs[0];
        ST *ga = (ST *)p->grad_gates + r0 * gas[0];
        ST *gb = (ST *)p->grad_tokens + r0 * gbs[0];
        for (int64_t r = 0; r < PS_ROWS; ++r) g[r] = an[r] = ZERO;
        const int64_t last = (p->steps - 1) / PS_TILE * PS_TILE;
        for (int64_t t0 = last; t0 >= 0; t0 -= PS_TILE) {
            const int64_t n = p->steps - t0 < PS_TILE ? p->steps - t0 : PS_TILE;
            FN(gather)(ta, n, nr, a + t0 * as[1], as[0], as[1]);
            FN(gather)(tg, n, nr, gx + t0 * gxs[1], gxs[0], gxs[1]);
            /* tx[k] = out[t0 + k - 1]; at t0 == 0 the first is the initial state. */
            if (t0 > 0) {
                FN(gather)(tx, n, nr, x + (t0 - 1) * xs[1], xs[0], xs[1]);
            } else {
                if (n > 1) FN(gather)(tx + 1, n - 1, nr, x, xs[0], xs[1]);
                for (int64_t r = 0; r < PS_ROWS; ++r)
                    tx[0][r] = (r < nr && p->initial) ? LD((const ST *)p->initial + (r0 + r) * is[0]) : ZERO;
            }
            for (int64_t k = n - 1; k >= 0; --k)
                for (int64_t r = 0; r < PS_ROWS; ++r) {
                    const ACC v = CFMA(an[r], g[r], tg[k][r]);
                    g[r] = v;
                    an[r] = ta[k][r];
                    tg[k][r] = v;
                    tx[k][r] = MULC(v, tx[k][r]);
                }
            FN(scatter)(gb + t0 * gbs[1], gbs[0], gbs[1], tg, n, nr);
            FN(scatter)(ga + t0 * gas[1], gas[0], gas[1], tx, n, nr);
        }
        for (int64_t r = 0; r < nr; ++r)
            STO((ST *)p->grad_initial + (r0 + r) * gis[0], CFMA(an[r], g[r], ZERO));
    }
}

PS_API int FN(ps_linear_scan_bwd)(const ps_linear_bwd_args *args) {
    if (args->outer < 0 || args->steps < 0 || args->inner < 0) return -1;
    if (args->outer == 0 || args->inner == 0) return 0;
    if (args->steps == 0) {
        for (int64_t o = 0; o < args->outer; ++o)
            for (int64_t c = 0; c < args->inner; ++c)
                STO((ST *)args->grad_initial + o * args->grad_initial_stride[0] + c * args->grad_initial_stride[1], ZERO);
        return 0;
    }
    ps_linear_bwd_args p = *args;
    const int64_t steps = p.steps;
    ps_prefer_huge_pages(p.grad_gates, p.outer * p.steps * p.inner * (int64_t)sizeof(ST));
    ps_prefer_huge_pages(p.grad_tokens, p.outer * p.steps * p.inner * (int64_t)sizeof(ST));
    if (p.reverse) {
        PS_FLIP(p.gates, p.gates_stride);
        PS_FLIP(p.out, p.out_stride);
        PS_FLIP(p.grad_out, p.grad_out_stride);
        PS_FLIP(p.grad_gates, p.grad_gates_stride);
        PS_FLIP(p.grad_tokens, p.grad_tokens_stride);
    }
    const int64_t nthreads = ps_threads_for(p.outer * p.steps * p.inner, p.nthreads);
    ps_task_fn tc = NULL;
#ifdef PS_BWD_TC_FAST
    if (p.inner == 1) tc = PS_BWD_TC_FAST(&p);
#endif
    if (!tc) tc = FN(bwd_time_contiguous);
    p.nthreads = nthreads;
    ps_run_units(p.outer, p.inner, nthreads, tc, FN(bwd_time_major), &p);
    return 0;
}
