/* matrix_linear_scan CPU kernel; see cpu.h for the algorithm, abi.h for the ABI. */
#include "cpu.h"

/* y = W x + b for one step. Row-major W: d dot products over contiguous rows.
 * Column-major W (a transposed view): d column updates, contiguous along y.
 * Anything else: plain strided loops. */
#define PS_MATVEC(SFX, T)                                                              \
    static inline void ps_matvec_##SFX(int64_t d, const T *w, int64_t w_row,          \
                                       int64_t w_col, const T *x, const T *b, T *y) {  \
        if (w_col == 1) {                                                              \
            for (int64_t i = 0; i < d; i++) {                                          \
                const T *row = w + i * w_row;                                          \
                T acc = 0;                                                             \
                _Pragma("omp simd reduction(+ : acc)") for (int64_t j = 0; j < d; j++) \
                    acc += row[j] * x[j];                                              \
                y[i] = acc + b[i];                                                     \
            }                                                                          \
        } else if (w_row == 1) {                                                       \
            for (int64_t i = 0; i < d; i++) y[i] = 0;                                  \
            for (int64_t j = 0; j < d; j++) {                                          \
                const T *col = w + j * w_col;                                          \
                const T xj = x[j];                                                     \
                _Pragma("omp simd") for (int64_t i = 0; i < d; i++) y[i] += col[i] * xj; \
            }                                                                          \
            for (int64_t i = 0; i < d; i++) y[i] += b[i];                              \
        } else {                                                                       \
            for (int64_t i = 0; i < d; i++) {                                          \
                T acc = 0;                                                             \
                for (int64_t j = 0; j < d; j++) acc += w[i * w_row + j * w_col] * x[j]; \
                y[i] = acc + b[i];                                                     \
            }                                                                          \
        }                                                                              \
    }

/* Batch elements [begin, end): each runs its own chain over t. When W is shared
 * by the batch (w_batch == 0) the loops swap, so each W[t] is read from memory
 * once and reused from cache by every batch element of the range. */
#define PS_MATRIX_TASK(SFX, T)                                                         \
    PS_MATVEC(SFX, T)                                                                  \
    static void ps_matrix_task_##SFX(const void *ctx, int64_t begin, int64_t end) {    \
        const ps_matrix_linear_scan_args *a = (const ps_matrix_linear_scan_args *)ctx; \
        const T *w = (const T *)a->weights;                                            \
        const T *bias = (const T *)a->biases;                                          \
        const T *init = (const T *)a->initial;                                         \
        T *out = (T *)a->out;                                                          \
        const int64_t d = a->d, steps = a->steps;                                      \
        const int64_t outer = a->w_batch == 0 ? steps : end - begin;                   \
        const int64_t inner = a->w_batch == 0 ? end - begin : steps;                   \
        for (int64_t p = 0; p < outer; p++) {                                          \
            for (int64_t q = 0; q < inner; q++) {                                      \
                const int64_t n = a->w_batch == 0 ? begin + q : begin + p;             \
                const int64_t s = a->w_batch == 0 ? p : q;                             \
                const int64_t t = a->reverse ? steps - 1 - s : s;                      \
                const T *x = s == 0 ? init + n * a->i_batch                            \
                                    : out + (n * steps + (a->reverse ? t + 1 : t - 1)) * d; \
                ps_matvec_##SFX(d, w + n * a->w_batch + t * a->w_step, a->w_row,       \
                                a->w_col, x, bias + n * a->b_batch + t * a->b_step,    \
                                out + (n * steps + t) * d);                            \
            }                                                                          \
        }                                                                              \
    }                                                                                  \
    PS_API int ps_matrix_linear_scan_fwd_##SFX(const ps_matrix_linear_scan_args *a) { \
        if (a->batch < 0 || a->steps < 0 || a->d < 0) return 1;                        \
        if (a->batch == 0 || a->steps == 0 || a->d == 0) return 0;                     \
        /* A thread per batch range when there is enough work to share. */             \
        const int64_t work = a->batch * a->steps * a->d * a->d;                        \
        const int64_t nthreads = work < (INT64_C(1) << 16) ? 1 : a->nthreads;          \
        ps_parallel_for(a->batch, nthreads, ps_matrix_task_##SFX, a);                  \
        return 0;                                                                      \
    }

PS_MATRIX_TASK(f32, float)
PS_MATRIX_TASK(f64, double)
