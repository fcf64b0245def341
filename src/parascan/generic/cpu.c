/* Products of sequences of square matrices; see cpu.h for the algorithm, abi.h
 * for the ABI. */
#include "cpu.h"

#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define PS_PRODUCT_AVX2 1
#define PS_AVX2_FMA __attribute__((target("avx2,fma")))
#endif

/* A batch of at least this many sequences is shared among threads by sequence;
 * a smaller one has its sequences cut into segments of at least
 * PS_PRODUCT_MIN_SEGMENT matrices, up to this many pieces of work in all. */
enum { PS_PRODUCT_ITEMS = 16, PS_PRODUCT_MIN_SEGMENT = 8 };

PS_API int64_t ps_matmul_constants(int64_t *out, int64_t n) {
    const int64_t values[] = {PS_PRODUCT_ITEMS, PS_PRODUCT_MIN_SEGMENT};
    for (int64_t i = 0; i < n && i < 2; i++) out[i] = values[i];
    return 2;
}

static int64_t ps_product_segments(int64_t batch, int64_t steps) {
    if (batch >= PS_PRODUCT_ITEMS) return 1;
    int64_t segs = (PS_PRODUCT_ITEMS + batch - 1) / batch;
    const int64_t cap = steps / PS_PRODUCT_MIN_SEGMENT;
    if (segs > cap) segs = cap;
    return segs < 1 ? 1 : segs;
}

/* The block products: c = a @ b over k < d, for blocks of dr rows (d rounded up to
 * 4) and dc columns (d rounded up to the vector width V), row stride dc, except b,
 * whose row stride is ldb. Tiles of 4 rows by 2V columns (V at the right edge when
 * dc is an odd number of vectors); a column panel of b stays in L1 while the rows
 * of a stream past; every sum runs in order of k. The padding rows and columns of
 * c get values that nothing reads again: k < d never reaches them. */
#define PS_PORTABLE_MM(SFX, T, V)                                                      \
    static void ps_mm_##SFX(int64_t d, int64_t dr, int64_t dc, const T *a, const T *b, \
                            int64_t ldb, T *c) {                                       \
        for (int64_t j = 0; j < dc; j += 2 * V) {                                      \
            const int64_t w = dc - j < 2 * V ? dc - j : 2 * V;                         \
            for (int64_t i = 0; i < dr; i += 4) {                                      \
                T acc[4][2 * V];                                                       \
                memset(acc, 0, sizeof acc);                                            \
                for (int64_t k = 0; k < d; k++) {                                      \
                    const T *bk = b + k * ldb + j;                                     \
                    for (int r = 0; r < 4; r++) {                                      \
                        const T ar = a[(i + r) * dc + k];                              \
                        for (int64_t q = 0; q < w; q++) acc[r][q] += ar * bk[q];       \
                    }                                                                  \
                }                                                                      \
                for (int r = 0; r < 4; r++)                                            \
                    memcpy(c + (i + r) * dc + j, acc[r], (size_t)w * sizeof(T));       \
            }                                                                          \
        }                                                                              \
    }

PS_PORTABLE_MM(f32, float, 8)
PS_PORTABLE_MM(f64, double, 4)

#ifdef PS_PRODUCT_AVX2
/* The same tiles in registers: 4 rows by 2 vectors, eight independent sums, which
 * cover the latency of the fused multiply-adds; one vector wide at the edge. */
#define PS_AVX2_MM(SFX, T, VEC, SET0, LOAD, BCAST, STORE, VFMADD, V)                   \
    PS_AVX2_FMA static void ps_mm_##SFX##_avx2(int64_t d, int64_t dr, int64_t dc,      \
                                               const T *a, const T *b, int64_t ldb,    \
                                               T *c) {                                 \
        int64_t j = 0;                                                                 \
        for (; j + 2 * V <= dc; j += 2 * V) {                                          \
            for (int64_t i = 0; i < dr; i += 4) {                                      \
                const T *a0 = a + i * dc, *a1 = a0 + dc, *a2 = a1 + dc, *a3 = a2 + dc; \
                VEC c00 = SET0(), c01 = c00, c10 = c00, c11 = c00;                     \
                VEC c20 = c00, c21 = c00, c30 = c00, c31 = c00;                        \
                for (int64_t k = 0; k < d; k++) {                                      \
                    const VEC b0 = LOAD(b + k * ldb + j), b1 = LOAD(b + k * ldb + j + V); \
                    VEC x = BCAST(a0 + k), y = BCAST(a1 + k);                          \
                    c00 = VFMADD(x, b0, c00), c01 = VFMADD(x, b1, c01);                \
                    c10 = VFMADD(y, b0, c10), c11 = VFMADD(y, b1, c11);                \
                    x = BCAST(a2 + k), y = BCAST(a3 + k);                              \
                    c20 = VFMADD(x, b0, c20), c21 = VFMADD(x, b1, c21);                \
                    c30 = VFMADD(y, b0, c30), c31 = VFMADD(y, b1, c31);                \
                }                                                                      \
                T *o = c + i * dc + j;                                                 \
                STORE(o, c00), STORE(o + V, c01), o += dc;                             \
                STORE(o, c10), STORE(o + V, c11), o += dc;                             \
                STORE(o, c20), STORE(o + V, c21), o += dc;                             \
                STORE(o, c30), STORE(o + V, c31);                                      \
            }                                                                          \
        }                                                                              \
        if (j == dc) return;                                                           \
        for (int64_t i = 0; i < dr; i += 4) {                                          \
            const T *a0 = a + i * dc, *a1 = a0 + dc, *a2 = a1 + dc, *a3 = a2 + dc;     \
            VEC c0 = SET0(), c1 = c0, c2 = c0, c3 = c0;                                \
            for (int64_t k = 0; k < d; k++) {                                          \
                const VEC b0 = LOAD(b + k * ldb + j);                                  \
                c0 = VFMADD(BCAST(a0 + k), b0, c0), c1 = VFMADD(BCAST(a1 + k), b0, c1); \
                c2 = VFMADD(BCAST(a2 + k), b0, c2), c3 = VFMADD(BCAST(a3 + k), b0, c3); \
            }                                                                          \
            T *o = c + i * dc + j;                                                     \
            STORE(o, c0), STORE(o + dc, c1), STORE(o + 2 * dc, c2), STORE(o + 3 * dc, c3); \
        }                                                                              \
    }

PS_AVX2_MM(f32, float, __m256, _mm256_setzero_ps, _mm256_loadu_ps, _mm256_broadcast_ss,
           _mm256_storeu_ps, _mm256_fmadd_ps, 8)
PS_AVX2_MM(f64, double, __m256d, _mm256_setzero_pd, _mm256_loadu_pd, _mm256_broadcast_sd,
           _mm256_storeu_pd, _mm256_fmadd_pd, 4)
#endif

/* The per-dtype driver. A block holds a d x d matrix in dr x dc storage (see the
 * block products). Every member owns three: the running product, the next one, and
 * M[t] when it cannot be read in place (unit column stride and d a multiple of V). */
#define PS_MATMUL_REDUCE(SFX, T, V)                                                    \
    typedef void (*ps_mm_fn_##SFX)(int64_t, int64_t, int64_t, const T *, const T *,    \
                                   int64_t, T *);                                      \
    typedef struct {                                                                   \
        const ps_matmul_args *p;                                                       \
        int64_t dr, dc, segs;                                                          \
        T *res;  /* batch * segs segment products, when segs > 1 */                    \
        T *work; /* three blocks per member */                                         \
        ps_mm_fn_##SFX mm;                                                             \
    } ps_product_ctx_##SFX;                                                            \
                                                                                       \
    /* The d x d matrix at m (strides row, col) into dst (row stride ld). */           \
    static void ps_copy_##SFX(int64_t d, const T *m, int64_t row, int64_t col, T *dst, \
                              int64_t ld) {                                            \
        for (int64_t i = 0; i < d; i++)                                                \
            for (int64_t j = 0; j < d; j++) dst[i * ld + j] = m[i * row + j * col];    \
    }                                                                                  \
                                                                                       \
    static void ps_product_member_##SFX(const void *vctx, int64_t member, int64_t size) { \
        const ps_product_ctx_##SFX *c = (const ps_product_ctx_##SFX *)vctx;            \
        const ps_matmul_args *p = c->p;                                                \
        const int64_t d = p->d, dr = c->dr, dc = c->dc, block = dr * dc, segs = c->segs; \
        const int direct = d == dc && p->x_col == 1;                                   \
        T *acc = c->work + member * 3 * block, *next = acc + block, *bcopy = next + block; \
        memset(acc, 0, (size_t)(3 * block) * sizeof(T)); /* the padding starts at 0 */ \
        const int64_t items = p->batch * segs;                                         \
        for (int64_t it = items * member / size; it < items * (member + 1) / size; it++) { \
            const int64_t n = it / segs, s = it % segs;                                \
            const int64_t lo = p->steps * s / segs, hi = p->steps * (s + 1) / segs;    \
            const T *x = (const T *)p->x + n * p->x_batch;                             \
            ps_copy_##SFX(d, x + lo * p->x_step, p->x_row, p->x_col, acc, dc);         \
            for (int64_t t = lo + 1; t < hi; t++) {                                    \
                const T *m = x + t * p->x_step;                                        \
                if (direct) {                                                          \
                    c->mm(d, dr, dc, acc, m, p->x_row, next);                          \
                } else {                                                               \
                    ps_copy_##SFX(d, m, p->x_row, p->x_col, bcopy, dc);                \
                    c->mm(d, dr, dc, acc, bcopy, dc, next);                            \
                }                                                                      \
                T *swap = acc;                                                         \
                acc = next, next = swap;                                               \
            }                                                                          \
            if (segs == 1) {                                                           \
                ps_copy_##SFX(d, acc, dc, 1, (T *)p->out + n * d * d, d);              \
            } else {                                                                   \
                memcpy(c->res + it * block, acc, (size_t)block * sizeof(T));           \
            }                                                                          \
        }                                                                              \
        if (segs == 1) return;                                                         \
        ps_team_barrier(); /* every segment product is in res */                       \
        for (int64_t n = p->batch * member / size; n < p->batch * (member + 1) / size; n++) { \
            const T *left = c->res + n * segs * block;                                 \
            for (int64_t s = 1; s < segs; s++) {                                       \
                T *out = left == acc ? next : acc;                                     \
                c->mm(d, dr, dc, left, c->res + (n * segs + s) * block, dc, out);      \
                left = out;                                                            \
            }                                                                          \
            ps_copy_##SFX(d, left, dc, 1, (T *)p->out + n * d * d, d);                 \
        }                                                                              \
    }                                                                                  \
                                                                                       \
    PS_API int ps_matmul_reduce_##SFX(const ps_matmul_args *p) {                       \
        if (p->batch < 0 || p->steps < 1 || p->d < 0) return 1;                        \
        if (p->batch == 0 || p->d == 0) return 0;                                      \
        const int64_t d = p->d, dr = (d + 3) / 4 * 4, dc = (d + V - 1) / V * V;        \
        const int64_t segs = ps_product_segments(p->batch, p->steps), items = p->batch * segs; \
        /* Threads only when the work is worth a team (about 2^20 multiply-adds). */   \
        const double work = (double)p->batch * (double)p->steps * (double)d * (double)d * (double)d; \
        int64_t nthreads = work < 1048576.0 ? 1 : p->nthreads;                         \
        if (nthreads > items) nthreads = items;                                        \
        if (nthreads > PS_MAX_THREADS) nthreads = PS_MAX_THREADS;                      \
        if (nthreads < 1) nthreads = 1;                                                \
        const int64_t blocks = (segs > 1 ? items : 0) + 3 * nthreads;                  \
        const double bytes = (double)blocks * (double)(dr * dc) * (double)sizeof(T);   \
        if (bytes > 0x1p46) return 2;                                                  \
        T *buffer = (T *)aligned_alloc(64, ((size_t)bytes + 63) / 64 * 64);            \
        if (buffer == NULL) return 2;                                                  \
        ps_product_ctx_##SFX ctx = {p, dr, dc, segs, buffer + 3 * nthreads * dr * dc, buffer, \
                                    ps_mm_##SFX};                                      \
        PS_PRODUCT_PICK_AVX2(SFX)                                                      \
        ps_parallel_team(nthreads, ps_product_member_##SFX, &ctx);                     \
        free(buffer);                                                                  \
        return 0;                                                                      \
    }

#ifdef PS_PRODUCT_AVX2
#define PS_PRODUCT_PICK_AVX2(SFX)                                                      \
    if (p->simd && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))    \
        ctx.mm = ps_mm_##SFX##_avx2;
#else
#define PS_PRODUCT_PICK_AVX2(SFX)
#endif

PS_MATMUL_REDUCE(f32, float, 8)
PS_MATMUL_REDUCE(f64, double, 4)
