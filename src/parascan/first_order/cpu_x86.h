/* linear_scan's AVX2 paths (cpu.c names them per dtype; the portable templates
 * call them where the CPU and the strides allow, else do the work themselves):
 * time-contiguous data (inner == 1) in float32, bfloat16, float16 (cpu_x86_float.h)
 * and complex64, when the CPU has AVX2 (and F16C) and every operand steps through
 * time with stride +1 (or -1 when reversed); float32's long-sequence reduce and
 * scan; and the half types' time-major rows. Everything else uses the portable
 * tiles of cpu_forward.h and cpu_backward.h. Half types are widened to float32 on
 * load and rounded (to nearest even) on store, 8 at a time. The time-contiguous
 * and row paths compute what the portable code computes, multiply then add, to
 * the bit; the float32 long-sequence paths reassociate (see there).
 *
 * Summary of algorithm. A work unit is 8 rows. Eight steps of the 8 rows are
 * loaded as 8 vectors (one per row) and transposed in registers, so that vector
 * k holds step k of all 8 rows; the 8 recurrences then advance together with one
 * multiply and add per step, and the results are transposed back and stored.
 * A group with fewer than 8 rows reads its last row in the missing lanes and
 * never stores them. Steps past the last whole tile run as scalar code.
 */
#ifndef PARASCAN_SCAN_X86_H
#define PARASCAN_SCAN_X86_H

#include <immintrin.h>

#define PS_AVX2 __attribute__((target("avx2,fma,f16c")))

PS_AVX2 static inline __attribute__((always_inline)) void ps_transpose8(__m256 r[8]) {
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

/* Reverse the 8 lanes: a row read backwards in time. */
PS_AVX2 static inline __m256 ps_reverse8(__m256 v) {
    return _mm256_permutevar8x32_ps(v, _mm256_setr_epi32(7, 6, 5, 4, 3, 2, 1, 0));
}

/* 8 storage elements <-> 8 floats, per type. */
PS_AVX2 static inline __m256 ps_widen8_f32(const float *p) { return _mm256_loadu_ps(p); }
PS_AVX2 static inline void ps_narrow8_f32(float *p, __m256 v) { _mm256_storeu_ps(p, v); }

PS_AVX2 static inline __m256 ps_widen8_bf16(const ps_bf16 *p) {
    const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}
PS_AVX2 static inline void ps_narrow8_bf16(ps_bf16 *p, __m256 v) {
    /* As ps_f32_to_bf16: round to nearest even, NaN made quiet. */
    const __m256i u = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd));
    const __m256i quiet = _mm256_or_si256(u, _mm256_set1_epi32(0x00400000));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    const __m256i r = _mm256_srli_epi32(_mm256_blendv_epi8(rounded, quiet, nan), 16);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xd8);
    _mm_storeu_si128((__m128i *)p, _mm256_castsi256_si128(packed));
}

PS_AVX2 static inline __m256 ps_widen8_f16(const ps_f16 *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
PS_AVX2 static inline void ps_narrow8_f16(ps_f16 *p, __m256 v) {
    _mm_storeu_si128((__m128i *)p, _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}

static int ps_unit_time_stride(int64_t s) { return s == 1 || s == -1; }

/* Row pointers of the group at r0; lanes past nr repeat the last row (read only). */
static inline int64_t ps_row(int64_t r0, int64_t r, int64_t nr) { return r0 + (r < nr ? r : nr - 1); }

/* The row pointers (arrays of 8 T pointers) of the 8-row work unit at r0, nr of them
 * real, through ps_row: forward (gates, tokens, out, and the rows' initial states s0,
 * loaded with LD, or `zero` without `initial`) and backward (gates, out, grad_out,
 * grad_gates, grad_tokens). */
#define PS_FWD_UNIT_ROWS(p, T, LD, zero, r0, nr, a, b, x, s0)                                  \
    for (int64_t r_ = 0; r_ < 8; ++r_) {                                                    \
        const int64_t row_ = ps_row(r0, r_, nr);                                            \
        a[r_] = (const T *)(p)->gates + row_ * (p)->gates_stride[0];                        \
        b[r_] = (const T *)(p)->tokens + row_ * (p)->tokens_stride[0];                      \
        x[r_] = (T *)(p)->out + row_ * (p)->out_stride[0];                                  \
        s0[r_] = (r_ < (nr) && (p)->initial)                                                \
                     ? LD((const T *)(p)->initial + row_ * (p)->initial_stride[0])          \
                     : (zero);                                                              \
    }

#define PS_BWD_UNIT_ROWS(p, T, r0, nr, a, x, gx, ga, gb)                                      \
    for (int64_t r_ = 0; r_ < 8; ++r_) {                                                    \
        const int64_t row_ = ps_row(r0, r_, nr);                                            \
        a[r_] = (const T *)(p)->gates + row_ * (p)->gates_stride[0];                        \
        x[r_] = (const T *)(p)->out + row_ * (p)->out_stride[0];                            \
        gx[r_] = (const T *)(p)->grad_out + row_ * (p)->grad_out_stride[0];                 \
        ga[r_] = (T *)(p)->grad_gates + row_ * (p)->grad_gates_stride[0];                   \
        gb[r_] = (T *)(p)->grad_tokens + row_ * (p)->grad_tokens_stride[0];                 \
    }

#define PS_DEREF(ptr) (*(ptr))

#define XS f32
#define XT float
#define XLD(p) (*(p))
#define XST(p, v) (*(p) = (v))
#include "cpu_x86_float.h"
/* The long-sequence reduce for float32: 8 chunks (rows of `steps` steps, time
 * stride st = +1 or -1, rows `row_stride` apart) to their final state from zero
 * and the product of their gates. Only the chunk's affine map is needed, so its
 * steps may be associated in any order: each 16-step tile is reduced as four
 * independent 4-step chains combined in a tree, and only the tile maps are chained,
 * which hides the latency of a step. The product is flushed to zero once it falls
 * below 2^-64 (it would soon be subnormal, which is slow): what it would contribute
 * to a carry is under 2^-64 of that carry, far below float32 rounding. */
PS_AVX2 static inline void ps_affine_after(__m256 *q, __m256 *s, __m256 a, __m256 b) {
    /* (q, s) := (a, b) after (q, s): the map h -> a (q h + s) + b. */
    *s = _mm256_add_ps(_mm256_mul_ps(a, *s), b);
    *q = _mm256_mul_ps(a, *q);
}

PS_AVX2 static void ps_reduce8_f32_avx2(const float *a0, const float *b0, int64_t row_a,
                                        int64_t row_b, int64_t steps, int rev, float *state,
                                        float *prod) {
    const int64_t whole = steps / 16 * 16, st = rev ? -1 : 1;
    const __m256 tiny = _mm256_set1_ps(0x1p-64f);
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 s = _mm256_setzero_ps(), q = _mm256_set1_ps(1.0f);
    for (int64_t t0 = 0; t0 < whole; t0 += 16) {
        __m256 va[16], vb[16];
        for (int r = 0; r < 8; ++r) {
            va[r] = ps_load8_f32(a0 + r * row_a, t0, rev);
            va[r + 8] = ps_load8_f32(a0 + r * row_a, t0 + 8, rev);
            vb[r] = ps_load8_f32(b0 + r * row_b, t0, rev);
            vb[r + 8] = ps_load8_f32(b0 + r * row_b, t0 + 8, rev);
        }
        ps_transpose8(va);
        ps_transpose8(va + 8);
        ps_transpose8(vb);
        ps_transpose8(vb + 8);
        __m256 cq[4], cs[4];
        for (int j = 0; j < 4; ++j) {
            cq[j] = va[4 * j];
            cs[j] = vb[4 * j];
            for (int i = 1; i < 4; ++i) ps_affine_after(&cq[j], &cs[j], va[4 * j + i], vb[4 * j + i]);
        }
        ps_affine_after(&cq[0], &cs[0], cq[1], cs[1]);
        ps_affine_after(&cq[2], &cs[2], cq[3], cs[3]);
        ps_affine_after(&cq[0], &cs[0], cq[2], cs[2]);
        ps_affine_after(&q, &s, cq[0], cs[0]);
        /* Keep q unless |q| < 2^-64 (NaN is kept). */
        q = _mm256_and_ps(q, _mm256_cmp_ps(_mm256_and_ps(q, abs_mask), tiny, _CMP_NLT_UQ));
    }
    _mm256_storeu_ps(state, s);
    _mm256_storeu_ps(prod, q);
    for (int r = 0; r < 8; ++r)
        for (int64_t t = whole; t < steps; ++t) {
            const float a = a0[r * row_a + t * st];
            state[r] = a * state[r] + b0[r * row_b + t * st];
            prod[r] = a * prod[r];
        }
}

/* The long-sequence scan for float32 (phase 3): the time-contiguous kernel's work
 * units (8 chunks as rows, from their carries), with each 8-step tile computed as
 * two 4-step chains from zero (their prefix maps, independent of each other) that
 * are then applied to the state entering each chain: only one step in four waits
 * for the previous one. The arithmetic is reassociated within a tile, as the
 * long-sequence split already does across chunks; the error is of the same order. */
PS_AVX2 static void ps_long_scan_f32_avx2(const void *vp, int64_t u0, int64_t u1) {
    const ps_scan_fwd_args *p = (const ps_scan_fwd_args *)vp;
    const int64_t st = p->out_stride[1], steps = p->steps, whole = steps / 8 * 8;
    const int rev = st < 0;
    for (int64_t u = u0; u < u1; ++u) {
        const float *a[8], *b[8];
        float *x[8];
        __m256 s;
        const int64_t nr = ps_fwd_unit_f32(p, u, a, b, x, &s);
        for (int64_t t0 = 0; t0 < whole; t0 += 8) {
            __m256 va[8], vb[8];
            for (int r = 0; r < 8; ++r) {
                va[r] = ps_load8_f32(a[r], t0, rev);
                vb[r] = ps_load8_f32(b[r], t0, rev);
            }
            ps_transpose8(va);
            ps_transpose8(vb);
            for (int k = 1; k < 8; ++k) /* prefix maps of each 4-step chain */
                if (k % 4) {
                    vb[k] = _mm256_add_ps(_mm256_mul_ps(va[k], vb[k - 1]), vb[k]);
                    va[k] = _mm256_mul_ps(va[k], va[k - 1]);
                }
            for (int j = 0; j < 2; ++j) {
                const __m256 e = s;
                for (int i = 0; i < 4; ++i)
                    va[4 * j + i] = _mm256_add_ps(_mm256_mul_ps(va[4 * j + i], e), vb[4 * j + i]);
                s = va[4 * j + 3];
            }
            ps_transpose8(va);
            for (int64_t r = 0; r < nr; ++r) ps_store8_f32(x[r], t0, rev, va[r]);
        }
        ps_fwd_rest_f32(a, b, x, nr, s, whole, steps, st);
    }
}

/* The same, when this CPU and these strides allow it: returns 0 when done, 1 when
 * the portable code must do it. */
static int ps_reduce8_f32_fast(const float *a0, const float *b0, int64_t row_a, int64_t row_b,
                               int64_t steps, int64_t sa, int64_t sb, float *state,
                               float *prod) {
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("f16c")) return 1;
    if (!ps_unit_time_stride(sa) || sb != sa) return 1;
    ps_reduce8_f32_avx2(a0, b0, row_a, row_b, steps, sa < 0, state, prod);
    return 0;
}

static ps_task_fn ps_long_scan_f32_fast(const ps_scan_fwd_args *p) {
    return ps_fwd_tc_fast_f32(p) ? ps_long_scan_f32_avx2 : NULL;
}

#define XS bf16
#define XT ps_bf16
#define XLD(p) ps_bf16_to_f32(*(p))
#define XST(p, v) (*(p) = ps_f32_to_bf16(v))
#include "cpu_x86_float.h"
#define XS f16
#define XT ps_f16
#define XLD(p) ps_f16_to_f32(*(p))
#define XST(p, v) (*(p) = ps_f32_to_f16(v))
#include "cpu_x86_float.h"

/* Half-type time-major rows (channels contiguous), 8 channels at a time with
 * AVX2 conversions (F16C for float16); the portable row loops call these when the
 * CPU has them (gcc does not vectorize the portable conversions). Same arithmetic as
 * the portable rows: multiply, then add, in float32. One pair per half type. */
static int ps_have_f16c(void) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}

#define PS_HALF_ROWS(XS, XT, XLD, XST)                                                        \
    PS_AVX2 static void ps_fwd_row_##XS##_avx2(int64_t n, float *restrict s, const XT *a,      \
                                               const XT *b, XT *x) {                          \
        int64_t c = 0;                                                                        \
        for (; c + 8 <= n; c += 8) {                                                          \
            const __m256 v = _mm256_add_ps(                                                   \
                _mm256_mul_ps(ps_widen8_##XS(a + c), _mm256_loadu_ps(s + c)),                 \
                ps_widen8_##XS(b + c));                                                       \
            _mm256_storeu_ps(s + c, v);                                                       \
            ps_narrow8_##XS(x + c, v);                                                        \
        }                                                                                     \
        for (; c < n; ++c) {                                                                  \
            s[c] = XLD(a[c]) * s[c] + XLD(b[c]);                                              \
            x[c] = XST(s[c]);                                                                 \
        }                                                                                     \
    }                                                                                         \
    PS_AVX2 static void ps_bwd_row_##XS##_avx2(int64_t n, float *restrict g,                  \
                                               float *restrict an, const XT *a,               \
                                               const XT *gx, const XT *xp, XT *ga, XT *gb) {  \
        int64_t c = 0;                                                                        \
        for (; c + 8 <= n; c += 8) {                                                          \
            const __m256 v = _mm256_add_ps(                                                   \
                _mm256_mul_ps(_mm256_loadu_ps(an + c), _mm256_loadu_ps(g + c)),               \
                ps_widen8_##XS(gx + c));                                                      \
            _mm256_storeu_ps(g + c, v);                                                       \
            ps_narrow8_##XS(gb + c, v);                                                       \
            ps_narrow8_##XS(ga + c, _mm256_mul_ps(v, ps_widen8_##XS(xp + c)));                \
            _mm256_storeu_ps(an + c, ps_widen8_##XS(a + c));                                  \
        }                                                                                     \
        for (; c < n; ++c) {                                                                  \
            g[c] = an[c] * g[c] + XLD(gx[c]);                                                 \
            gb[c] = XST(g[c]);                                                                \
            ga[c] = XST(g[c] * XLD(xp[c]));                                                   \
            an[c] = XLD(a[c]);                                                                \
        }                                                                                     \
    }                                                                                         \
    static int ps_fwd_row_##XS##_fast(int64_t n, float *s, const XT *a, const XT *b, XT *x) { \
        if (!ps_have_f16c()) return 1;                                                        \
        ps_fwd_row_##XS##_avx2(n, s, a, b, x);                                                \
        return 0;                                                                             \
    }                                                                                         \
    static int ps_bwd_row_##XS##_fast(int64_t n, float *g, float *an, const XT *a,            \
                                      const XT *gx, const XT *xp, XT *ga, XT *gb) {           \
        if (!ps_have_f16c()) return 1;                                                        \
        ps_bwd_row_##XS##_avx2(n, g, an, a, gx, xp, ga, gb);                                  \
        return 0;                                                                             \
    }

PS_HALF_ROWS(f16, ps_f16, ps_f16_to_f32, ps_f32_to_f16)
PS_HALF_ROWS(bf16, ps_bf16, ps_bf16_to_f32, ps_f32_to_bf16)
#undef PS_HALF_ROWS

/* complex64 time-contiguous rows. A vector holds one step of 4 rows (re, im
 * interleaved); a work unit's 8 rows are two such groups, stepped one after the
 * other so that their chains overlap. Each row is visited 8 steps (one cache line)
 * at a time: two loads, and a 4 x 4 transpose of 64-bit elements puts step k of the
 * 4 rows in vector k. The complex products are computed in the portable code's
 * order (multiply, then add or subtract, then add the token), so every path gives
 * the same bits. */
PS_AVX2 static inline __m256 ps_load4_c64(const ps_c64 *row, int64_t t, int rev) {
    if (!rev) return _mm256_loadu_ps((const float *)(row + t));
    const __m256d v = _mm256_loadu_pd((const double *)(row - t - 3));
    return _mm256_castpd_ps(_mm256_permute4x64_pd(v, 0x1b));
}

PS_AVX2 static inline void ps_store4_c64(ps_c64 *row, int64_t t, int rev, __m256 v) {
    if (!rev)
        _mm256_storeu_ps((float *)(row + t), v);
    else
        _mm256_storeu_pd((double *)(row - t - 3), _mm256_permute4x64_pd(_mm256_castps_pd(v), 0x1b));
}

PS_AVX2 static inline __attribute__((always_inline)) void ps_transpose4_c64(__m256 r[4]) {
    const __m256d r0 = _mm256_castps_pd(r[0]), r1 = _mm256_castps_pd(r[1]);
    const __m256d r2 = _mm256_castps_pd(r[2]), r3 = _mm256_castps_pd(r[3]);
    const __m256d t0 = _mm256_unpacklo_pd(r0, r1), t1 = _mm256_unpackhi_pd(r0, r1);
    const __m256d t2 = _mm256_unpacklo_pd(r2, r3), t3 = _mm256_unpackhi_pd(r2, r3);
    r[0] = _mm256_castpd_ps(_mm256_permute2f128_pd(t0, t2, 0x20));
    r[1] = _mm256_castpd_ps(_mm256_permute2f128_pd(t1, t3, 0x20));
    r[2] = _mm256_castpd_ps(_mm256_permute2f128_pd(t0, t2, 0x31));
    r[3] = _mm256_castpd_ps(_mm256_permute2f128_pd(t1, t3, 0x31));
}

/* a s + b: (ar sr - ai si + br, ar si + ai sr + bi). */
PS_AVX2 static inline __m256 ps_cfma_c64(__m256 a, __m256 s, __m256 b) {
    const __m256 ar = _mm256_moveldup_ps(a), ai = _mm256_movehdup_ps(a);
    const __m256 sw = _mm256_permute_ps(s, 0xb1);
    return _mm256_add_ps(_mm256_addsub_ps(_mm256_mul_ps(ar, s), _mm256_mul_ps(ai, sw)), b);
}

/* g conj(x): (gr xr + gi xi, gi xr - gr xi); subtracting a negated product is the
 * same addition, bit for bit. conj(a) g + b is mulc(g, a) + b. */
PS_AVX2 static inline __m256 ps_cmulc_c64(__m256 g, __m256 x) {
    const __m256 xr = _mm256_moveldup_ps(x);
    const __m256 xi = _mm256_xor_ps(_mm256_movehdup_ps(x), _mm256_set1_ps(-0.0f));
    const __m256 gw = _mm256_permute_ps(g, 0xb1);
    return _mm256_addsub_ps(_mm256_mul_ps(g, xr), _mm256_mul_ps(gw, xi));
}

/* 8 steps of the 4 rows rows[0..3] from t, as vectors v[0..7] (step k in v[k]). */
PS_AVX2 static inline __attribute__((always_inline)) void
ps_gather8_c64(__m256 v[8], const ps_c64 *const rows[4], int64_t t, int rev) {
    for (int i = 0; i < 4; ++i) {
        v[i] = ps_load4_c64(rows[i], t, rev);
        v[i + 4] = ps_load4_c64(rows[i], t + 4, rev);
    }
    ps_transpose4_c64(v);
    ps_transpose4_c64(v + 4);
}

PS_AVX2 static inline __attribute__((always_inline)) void
ps_scatter8_c64(ps_c64 *const rows[4], int64_t nrows, int64_t t, int rev, __m256 v[8]) {
    ps_transpose4_c64(v);
    ps_transpose4_c64(v + 4);
    for (int64_t i = 0; i < nrows; ++i) {
        ps_store4_c64(rows[i], t, rev, v[i]);
        ps_store4_c64(rows[i], t + 4, rev, v[i + 4]);
    }
}

static inline int64_t ps_group_rows(int64_t nr, int grp) {
    const int64_t n = nr - 4 * grp;
    return n < 0 ? 0 : n > 4 ? 4 : n;
}

PS_AVX2 static void ps_fwd_tc_c64_avx2(const void *vp, int64_t u0, int64_t u1) {
    const ps_scan_fwd_args *p = (const ps_scan_fwd_args *)vp;
    const int64_t st = p->out_stride[1], steps = p->steps, whole = steps / 8 * 8;
    const int rev = st < 0;
    for (int64_t u = u0; u < u1; ++u) {
        const int64_t r0 = u * 8, nr = p->outer - r0 < 8 ? p->outer - r0 : 8;
        const ps_c64 *a[8], *b[8];
        ps_c64 *x[8];
        ps_c64 s0[8];
        PS_FWD_UNIT_ROWS(p, ps_c64, PS_DEREF, ((ps_c64){0.0f, 0.0f}), r0, nr, a, b, x, s0);
        __m256 s[2] = {_mm256_loadu_ps((const float *)s0), _mm256_loadu_ps((const float *)(s0 + 4))};
        for (int64_t t0 = 0; t0 < whole; t0 += 8)
            for (int grp = 0; grp < 2; ++grp) {
                __m256 va[8], vb[8];
                ps_gather8_c64(va, a + 4 * grp, t0, rev);
                ps_gather8_c64(vb, b + 4 * grp, t0, rev);
                for (int k = 0; k < 8; ++k) va[k] = s[grp] = ps_cfma_c64(va[k], s[grp], vb[k]);
                ps_scatter8_c64(x + 4 * grp, ps_group_rows(nr, grp), t0, rev, va);
            }
        _mm256_storeu_ps((float *)s0, s[0]);
        _mm256_storeu_ps((float *)(s0 + 4), s[1]);
        for (int64_t r = 0; r < nr; ++r) {
            ps_c64 v = s0[r];
            for (int64_t t = whole; t < steps; ++t) {
                v = ps_c64_fma(a[r][t * st], v, b[r][t * st]);
                x[r][t * st] = v;
            }
        }
    }
}

PS_AVX2 static void ps_bwd_tc_c64_avx2(const void *vp, int64_t u0, int64_t u1) {
    const ps_scan_bwd_args *p = (const ps_scan_bwd_args *)vp;
    const int64_t st = p->out_stride[1], steps = p->steps;
    const int rev = st < 0;
    const ps_c64 *H = (const ps_c64 *)p->initial;
    ps_c64 *GH = (ps_c64 *)p->grad_initial;
    for (int64_t u = u0; u < u1; ++u) {
        const int64_t r0 = u * 8, nr = p->outer - r0 < 8 ? p->outer - r0 : 8;
        const ps_c64 *a[8], *x[8], *gx[8];
        ps_c64 *ga[8], *gb[8];
        PS_BWD_UNIT_ROWS(p, ps_c64, r0, nr, a, x, gx, ga, gb);
        __m256 g[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        __m256 an[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        /* Whole tiles from the end while out[t0 - 1] exists; the rest is scalar. */
        int64_t t0 = steps - 8;
        for (; t0 >= 1; t0 -= 8)
            for (int grp = 0; grp < 2; ++grp) {
                __m256 va[8], vg[8], vx[8];
                ps_gather8_c64(va, a + 4 * grp, t0, rev);
                ps_gather8_c64(vg, gx + 4 * grp, t0, rev);
                ps_gather8_c64(vx, x + 4 * grp, t0 - 1, rev);
                for (int k = 7; k >= 0; --k) {
                    g[grp] = _mm256_add_ps(ps_cmulc_c64(g[grp], an[grp]), vg[k]);
                    an[grp] = va[k];
                    vg[k] = g[grp];
                    vx[k] = ps_cmulc_c64(g[grp], vx[k]);
                }
                const int64_t rows = ps_group_rows(nr, grp);
                ps_scatter8_c64(gb + 4 * grp, rows, t0, rev, vg);
                ps_scatter8_c64(ga + 4 * grp, rows, t0, rev, vx);
            }
        const int64_t rest = t0 + 8; /* steps [0, rest) remain */
        ps_c64 gs[8], as[8];
        _mm256_storeu_ps((float *)gs, g[0]);
        _mm256_storeu_ps((float *)(gs + 4), g[1]);
        _mm256_storeu_ps((float *)as, an[0]);
        _mm256_storeu_ps((float *)(as + 4), an[1]);
        for (int64_t r = 0; r < nr; ++r) {
            ps_c64 gv = gs[r], av = as[r];
            const ps_c64 x0 = H ? H[(r0 + r) * p->initial_stride[0]] : (ps_c64){0.0f, 0.0f};
            for (int64_t t = rest - 1; t >= 0; --t) {
                gv = ps_c64_cfma(av, gv, gx[r][t * st]);
                gb[r][t * st] = gv;
                ga[r][t * st] = ps_c64_mulc(gv, t > 0 ? x[r][(t - 1) * st] : x0);
                av = a[r][t * st];
            }
            GH[(r0 + r) * p->grad_initial_stride[0]] = ps_c64_cfma(av, gv, (ps_c64){0.0f, 0.0f});
        }
    }
}

static ps_task_fn ps_fwd_tc_fast_c64(const ps_scan_fwd_args *p) {
    const int64_t s = p->out_stride[1];
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return NULL;
    if (!ps_unit_time_stride(s) || p->gates_stride[1] != s || p->tokens_stride[1] != s) return NULL;
    return ps_fwd_tc_c64_avx2;
}

static ps_task_fn ps_bwd_tc_fast_c64(const ps_scan_bwd_args *p) {
    const int64_t s = p->out_stride[1];
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return NULL;
    if (!ps_unit_time_stride(s) || p->gates_stride[1] != s || p->grad_out_stride[1] != s ||
        p->grad_gates_stride[1] != s || p->grad_tokens_stride[1] != s)
        return NULL;
    return ps_bwd_tc_c64_avx2;
}

#endif
