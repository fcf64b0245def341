/* AVX2 + FMA paths for float32 time-contiguous data (inner == 1), chosen at run
 * time by cpu_kernel.c when the CPU has them and every operand steps through
 * time with stride +1 (or -1 when reversed). Everything else uses the portable
 * tiles in cpu_kernel_impl.h.
 *
 * Summary of algorithm. A work unit is 8 rows. Eight steps of the 8 rows are
 * loaded as 8 vectors (one per row) and transposed in registers, so that vector
 * k holds step k of all 8 rows; the 8 recurrences then advance together with one
 * fused multiply-add per step, and the results are transposed back and stored.
 * A group with fewer than 8 rows reads its last row in the missing lanes and
 * never stores them. Steps past the last whole tile run as scalar code.
 */
#ifndef PARASCAN_LINEAR_CPU_KERNEL_X86_H
#define PARASCAN_LINEAR_CPU_KERNEL_X86_H

#include <immintrin.h>

#define PS_AVX2 __attribute__((target("avx2,fma")))

PS_AVX2 static inline void ps_transpose8(__m256 r[8]) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 s0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 s1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2));
    const __m256 s2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 s3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2));
    const __m256 s4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 s5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2));
    const __m256 s6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0));
    const __m256 s7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
    r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
    r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
    r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
    r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}

/* Steps t .. t+7 of a row whose time stride is +1 (rev == 0) or -1 (rev != 0). */
PS_AVX2 static inline __m256 ps_load8(const float *row, int64_t t, int rev) {
    if (!rev) return _mm256_loadu_ps(row + t);
    const __m256 v = _mm256_loadu_ps(row - t - 7);
    return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(7, 6, 5, 4, 3, 2, 1, 0));
}

PS_AVX2 static inline void ps_store8(float *row, int64_t t, int rev, __m256 v) {
    if (!rev) {
        _mm256_storeu_ps(row + t, v);
    } else {
        _mm256_storeu_ps(row - t - 7,
                         _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(7, 6, 5, 4, 3, 2, 1, 0)));
    }
}

/* Row pointers of the group at r0; lanes past nr repeat the last row (read only). */
static inline void ps_rows(const float *base, int64_t stride, int64_t r0, int64_t nr,
                           const float *rows[8]) {
    for (int64_t r = 0; r < 8; ++r) rows[r] = base + (r0 + (r < nr ? r : nr - 1)) * stride;
}

PS_AVX2 static void ps_fwd_tc_f32_avx2(const void *vp, int64_t u0, int64_t u1) {
    const ps_linear_fwd_args *p = (const ps_linear_fwd_args *)vp;
    const int64_t st = p->out_stride[1], steps = p->steps, whole = steps / 8 * 8;
    const int rev = st < 0;
    for (int64_t u = u0; u < u1; ++u) {
        const int64_t r0 = u * 8, nr = p->outer - r0 < 8 ? p->outer - r0 : 8;
        const float *a[8], *b[8], *x[8];
        ps_rows((const float *)p->gates, p->gates_stride[0], r0, nr, a);
        ps_rows((const float *)p->tokens, p->tokens_stride[0], r0, nr, b);
        ps_rows((const float *)p->out, p->out_stride[0], r0, nr, x);
        float s0[8];
        for (int64_t r = 0; r < 8; ++r)
            s0[r] = (r < nr && p->initial)
                        ? ((const float *)p->initial)[(r0 + r) * p->initial_stride[0]] : 0.0f;
        __m256 s = _mm256_loadu_ps(s0);
        for (int64_t t0 = 0; t0 < whole; t0 += 8) {
            __m256 va[8], vb[8];
            for (int r = 0; r < 8; ++r) {
                va[r] = ps_load8(a[r], t0, rev);
                vb[r] = ps_load8(b[r], t0, rev);
            }
            ps_transpose8(va);
            ps_transpose8(vb);
            for (int k = 0; k < 8; ++k) va[k] = s = _mm256_fmadd_ps(va[k], s, vb[k]);
            ps_transpose8(va);
            for (int64_t r = 0; r < nr; ++r) ps_store8((float *)x[r], t0, rev, va[r]);
        }
        _mm256_storeu_ps(s0, s);
        for (int64_t r = 0; r < nr; ++r) {
            float v = s0[r];
            for (int64_t t = whole; t < steps; ++t) {
                v = a[r][t * st] * v + b[r][t * st];
                ((float *)x[r])[t * st] = v;
            }
        }
    }
}

PS_AVX2 static void ps_bwd_tc_f32_avx2(const void *vp, int64_t u0, int64_t u1) {
    const ps_linear_bwd_args *p = (const ps_linear_bwd_args *)vp;
    const int64_t st = p->out_stride[1], steps = p->steps;
    const int rev = st < 0;
    for (int64_t u = u0; u < u1; ++u) {
        const int64_t r0 = u * 8, nr = p->outer - r0 < 8 ? p->outer - r0 : 8;
        const float *a[8], *x[8], *gx[8], *ga[8], *gb[8];
        ps_rows((const float *)p->gates, p->gates_stride[0], r0, nr, a);
        ps_rows((const float *)p->out, p->out_stride[0], r0, nr, x);
        ps_rows((const float *)p->grad_out, p->grad_out_stride[0], r0, nr, gx);
        ps_rows((const float *)p->grad_gates, p->grad_gates_stride[0], r0, nr, ga);
        ps_rows((const float *)p->grad_tokens, p->grad_tokens_stride[0], r0, nr, gb);
        __m256 g = _mm256_setzero_ps(), an = _mm256_setzero_ps();
        /* Whole tiles from the end while out[t0 - 1] exists; the rest is scalar. */
        int64_t t0 = steps - 8;
        for (; t0 >= 1; t0 -= 8) {
            __m256 va[8], vg[8], vx[8];
            for (int r = 0; r < 8; ++r) {
                va[r] = ps_load8(a[r], t0, rev);
                vg[r] = ps_load8(gx[r], t0, rev);
                vx[r] = ps_load8(x[r], t0 - 1, rev);
            }
            ps_transpose8(va);
            ps_transpose8(vg);
            ps_transpose8(vx);
            for (int k = 7; k >= 0; --k) {
                g = _mm256_fmadd_ps(an, g, vg[k]);
                an = va[k];
                vg[k] = g;
                vx[k] = _mm256_mul_ps(g, vx[k]);
            }
            ps_transpose8(vg);
            ps_transpose8(vx);
            for (int64_t r = 0; r < nr; ++r) {
                ps_store8((float *)gb[r], t0, rev, vg[r]);
                ps_store8((float *)ga[r], t0, rev, vx[r]);
            }
        }
        const int64_t rest = t0 + 8; /* steps [0, rest) remain */
        float gs[8], as[8];
        _mm256_storeu_ps(gs, g);
        _mm256_storeu_ps(as, an);
        for (int64_t r = 0; r < nr; ++r) {
            float gv = gs[r], av = as[r];
            const float x0 = p->initial
                                 ? ((const float *)p->initial)[(r0 + r) * p->initial_stride[0]] : 0.0f;
            for (int64_t t = rest - 1; t >= 0; --t) {
                gv = av * gv + gx[r][t * st];
                ((float *)gb[r])[t * st] = gv;
                ((float *)ga[r])[t * st] = gv * (t > 0 ? x[r][(t - 1) * st] : x0);
                av = a[r][t * st];
            }
            ((float *)p->grad_initial)[(r0 + r) * p->grad_initial_stride[0]] = av * gv;
        }
    }
}

static int ps_unit_time_stride(int64_t s, int64_t want) { return s == want && (s == 1 || s == -1); }

/* The AVX2 worker when this CPU and these strides allow it, else NULL. */
static ps_task_fn ps_fwd_tc_f32_fast(const ps_linear_fwd_args *p) {
    const int64_t s = p->out_stride[1];
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return NULL;
    if (!ps_unit_time_stride(s, s) || p->gates_stride[1] != s || p->tokens_stride[1] != s)
        return NULL;
    return ps_fwd_tc_f32_avx2;
}

static ps_task_fn ps_bwd_tc_f32_fast(const ps_linear_bwd_args *p) {
    const int64_t s = p->out_stride[1];
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return NULL;
    if (!ps_unit_time_stride(s, s) || p->gates_stride[1] != s || p->grad_out_stride[1] != s ||
        p->grad_gates_stride[1] != s || p->grad_tokens_stride[1] != s)
        return NULL;
    return ps_bwd_tc_f32_avx2;
}

#endif
