/* One instantiation of linear_scan's AVX2 time-contiguous kernels (see cpu_x86.h),
 * included once per type computed in float32 (float32, bfloat16, float16). The
 * includer defines XS (name suffix), XT (storage type), XLD(p) / XST(p, v) (scalar
 * load as float / store from float); the 8-wide conversions are ps_widen8_XS and
 * ps_narrow8_XS. */

#define XCAT2(a, b) a##_##b
#define XCAT(a, b) XCAT2(a, b)
#define XFN(name) XCAT(name, XS)

/* Steps t .. t+7 of a row whose time stride is +1 (rev == 0) or -1 (rev != 0). */
PS_AVX2 static inline __m256 XFN(ps_load8)(const XT *row, int64_t t, int rev) {
    return rev ? ps_reverse8(XFN(ps_widen8)(row - t - 7)) : XFN(ps_widen8)(row + t);
}

PS_AVX2 static inline void XFN(ps_store8)(XT *row, int64_t t, int rev, __m256 v) {
    if (rev)
        XFN(ps_narrow8)(row - t - 7, ps_reverse8(v));
    else
        XFN(ps_narrow8)(row + t, v);
}

/* The forward's work unit u (8 rows from row 8u, see PS_FWD_UNIT_ROWS): its row
 * pointers, and its rows' initial states as a vector in *s. Returns its real rows. */
PS_AVX2 static inline int64_t XFN(ps_fwd_unit)(const ps_scan_fwd_args *p, int64_t u,
                                              const XT *a[8], const XT *b[8], XT *x[8],
                                              __m256 *s) {
    const int64_t r0 = u * 8, nr = p->outer - r0 < 8 ? p->outer - r0 : 8;
    float s0[8];
    PS_FWD_UNIT_ROWS(p, XT, XLD, 0.0f, r0, nr, a, b, x, s0);
    *s = _mm256_loadu_ps(s0);
    return nr;
}

/* Steps [whole, steps) of the unit's nr rows (time stride st), one at a time from
 * their states in s. */
PS_AVX2 static inline void XFN(ps_fwd_rest)(const XT *const a[8], const XT *const b[8],
                                           XT *const x[8], int64_t nr, __m256 s,
                                           int64_t whole, int64_t steps, int64_t st) {
    float s0[8];
    _mm256_storeu_ps(s0, s);
    for (int64_t r = 0; r < nr; ++r) {
        float v = s0[r];
        for (int64_t t = whole; t < steps; ++t) {
            v = XLD(a[r] + t * st) * v + XLD(b[r] + t * st);
            XST(x[r] + t * st, v);
        }
    }
}

PS_AVX2 static void XFN(ps_fwd_tc_avx2)(const void *vp, int64_t u0, int64_t u1) {
    const ps_scan_fwd_args *p = (const ps_scan_fwd_args *)vp;
    const int64_t st = p->out_stride[1], steps = p->steps, whole = steps / 8 * 8;
    const int rev = st < 0;
    for (int64_t u = u0; u < u1; ++u) {
        const XT *a[8], *b[8];
        XT *x[8];
        __m256 s;
        const int64_t nr = XFN(ps_fwd_unit)(p, u, a, b, x, &s);
        int64_t t0 = 0;
        /* 16 steps per visit: each row's 64-byte line is used whole before the other
         * rows' lines (which may share its cache set) can evict it. */
        for (; t0 + 16 <= whole; t0 += 16) {
            __m256 va[16], vb[16];
            for (int r = 0; r < 8; ++r) {
                va[r] = XFN(ps_load8)(a[r], t0, rev);
                va[r + 8] = XFN(ps_load8)(a[r], t0 + 8, rev);
                vb[r] = XFN(ps_load8)(b[r], t0, rev);
                vb[r + 8] = XFN(ps_load8)(b[r], t0 + 8, rev);
            }
            ps_transpose8(va);
            ps_transpose8(va + 8);
            ps_transpose8(vb);
            ps_transpose8(vb + 8);
            for (int k = 0; k < 16; ++k) va[k] = s = _mm256_add_ps(_mm256_mul_ps(va[k], s), vb[k]);
            ps_transpose8(va);
            ps_transpose8(va + 8);
            for (int64_t r = 0; r < nr; ++r) {
                XFN(ps_store8)(x[r], t0, rev, va[r]);
                XFN(ps_store8)(x[r], t0 + 8, rev, va[r + 8]);
            }
        }
        for (; t0 < whole; t0 += 8) {
            __m256 va[8], vb[8];
            for (int r = 0; r < 8; ++r) {
                va[r] = XFN(ps_load8)(a[r], t0, rev);
                vb[r] = XFN(ps_load8)(b[r], t0, rev);
            }
            ps_transpose8(va);
            ps_transpose8(vb);
            for (int k = 0; k < 8; ++k) va[k] = s = _mm256_add_ps(_mm256_mul_ps(va[k], s), vb[k]);
            ps_transpose8(va);
            for (int64_t r = 0; r < nr; ++r) XFN(ps_store8)(x[r], t0, rev, va[r]);
        }
        XFN(ps_fwd_rest)(a, b, x, nr, s, whole, steps, st);
    }
}

PS_AVX2 static void XFN(ps_bwd_tc_avx2)(const void *vp, int64_t u0, int64_t u1) {
    const ps_scan_bwd_args *p = (const ps_scan_bwd_args *)vp;
    const int64_t st = p->out_stride[1], steps = p->steps;
    const int rev = st < 0;
    const XT *H = (const XT *)p->initial;
    XT *GH = (XT *)p->grad_initial;
    for (int64_t u = u0; u < u1; ++u) {
        const int64_t r0 = u * 8, nr = p->outer - r0 < 8 ? p->outer - r0 : 8;
        const XT *a[8], *x[8], *gx[8];
        XT *ga[8], *gb[8];
        PS_BWD_UNIT_ROWS(p, XT, r0, nr, a, x, gx, ga, gb);
        __m256 g = _mm256_setzero_ps(), an = _mm256_setzero_ps();
        /* Whole tiles from the end while out[t0 - 1] exists; the rest is scalar. */
        int64_t t0 = steps - 16;
        /* 16 steps per visit while they fit (see the forward), then 8 at a time. */
        for (; t0 >= 1; t0 -= 16) {
            __m256 va[16], vg[16], vx[16];
            for (int r = 0; r < 8; ++r) {
                va[r] = XFN(ps_load8)(a[r], t0, rev);
                va[r + 8] = XFN(ps_load8)(a[r], t0 + 8, rev);
                vg[r] = XFN(ps_load8)(gx[r], t0, rev);
                vg[r + 8] = XFN(ps_load8)(gx[r], t0 + 8, rev);
                vx[r] = XFN(ps_load8)(x[r], t0 - 1, rev);
                vx[r + 8] = XFN(ps_load8)(x[r], t0 + 7, rev);
            }
            for (int h = 0; h < 16; h += 8) {
                ps_transpose8(va + h);
                ps_transpose8(vg + h);
                ps_transpose8(vx + h);
            }
            for (int k = 15; k >= 0; --k) {
                g = _mm256_add_ps(_mm256_mul_ps(an, g), vg[k]);
                an = va[k];
                vg[k] = g;
                vx[k] = _mm256_mul_ps(g, vx[k]);
            }
            for (int h = 0; h < 16; h += 8) {
                ps_transpose8(vg + h);
                ps_transpose8(vx + h);
            }
            for (int64_t r = 0; r < nr; ++r) {
                XFN(ps_store8)(gb[r], t0, rev, vg[r]);
                XFN(ps_store8)(gb[r], t0 + 8, rev, vg[r + 8]);
                XFN(ps_store8)(ga[r], t0, rev, vx[r]);
                XFN(ps_store8)(ga[r], t0 + 8, rev, vx[r + 8]);
            }
        }
        t0 += 8;
        for (; t0 >= 1; t0 -= 8) {
            __m256 va[8], vg[8], vx[8];
            for (int r = 0; r < 8; ++r) {
                va[r] = XFN(ps_load8)(a[r], t0, rev);
                vg[r] = XFN(ps_load8)(gx[r], t0, rev);
                vx[r] = XFN(ps_load8)(x[r], t0 - 1, rev);
            }
            ps_transpose8(va);
            ps_transpose8(vg);
            ps_transpose8(vx);
            for (int k = 7; k >= 0; --k) {
                g = _mm256_add_ps(_mm256_mul_ps(an, g), vg[k]);
                an = va[k];
                vg[k] = g;
                vx[k] = _mm256_mul_ps(g, vx[k]);
            }
            ps_transpose8(vg);
            ps_transpose8(vx);
            for (int64_t r = 0; r < nr; ++r) {
                XFN(ps_store8)(gb[r], t0, rev, vg[r]);
                XFN(ps_store8)(ga[r], t0, rev, vx[r]);
            }
        }
        const int64_t rest = t0 + 8; /* steps [0, rest) remain */
        float gs[8], as[8];
        _mm256_storeu_ps(gs, g);
        _mm256_storeu_ps(as, an);
        for (int64_t r = 0; r < nr; ++r) {
            float gv = gs[r], av = as[r];
            const float x0 = H ? XLD(H + (r0 + r) * p->initial_stride[0]) : 0.0f;
            for (int64_t t = rest - 1; t >= 0; --t) {
                gv = av * gv + XLD(gx[r] + t * st);
                XST(gb[r] + t * st, gv);
                XST(ga[r] + t * st, gv * (t > 0 ? XLD(x[r] + (t - 1) * st) : x0));
                av = XLD(a[r] + t * st);
            }
            XST(GH + (r0 + r) * p->grad_initial_stride[0], av * gv);
        }
    }
}

/* The AVX2 worker when this CPU and these strides allow it, else NULL. */
static ps_task_fn XFN(ps_fwd_tc_fast)(const ps_scan_fwd_args *p) {
    const int64_t s = p->out_stride[1];
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") ||
        !__builtin_cpu_supports("f16c"))
        return NULL;
    if (!ps_unit_time_stride(s) || p->gates_stride[1] != s || p->tokens_stride[1] != s) return NULL;
    return XFN(ps_fwd_tc_avx2);
}

static ps_task_fn XFN(ps_bwd_tc_fast)(const ps_scan_bwd_args *p) {
    const int64_t s = p->out_stride[1];
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma") ||
        !__builtin_cpu_supports("f16c"))
        return NULL;
    if (!ps_unit_time_stride(s) || p->gates_stride[1] != s || p->grad_out_stride[1] != s ||
        p->grad_gates_stride[1] != s || p->grad_tokens_stride[1] != s)
        return NULL;
    return XFN(ps_bwd_tc_avx2);
}

#undef XFN
#undef XCAT
#undef XCAT2
#undef XS
#undef XT
#undef XLD
#undef XST
