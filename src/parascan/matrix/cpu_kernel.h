/* matrix_linear_scan CPU kernel: x[t] = W[t] @ x[t-1] + b[t] with d x d matrices W,
 * one matrix-vector product per step, for float32 and float64.
 *
 * The recurrence is sequential in t; its work per step is d^2 multiply-adds on
 * d^2 weights read once, so it streams W at memory speed. Batch elements are
 * independent and run on threads. (A parallel scan over t would need d^3 per
 * step for the products of weights: Python's ``torch`` backend does that where
 * it pays, see matrix/api.py.)
 */
#ifndef PARASCAN_MATRIX_CPU_KERNEL_H
#define PARASCAN_MATRIX_CPU_KERNEL_H

#include "parallel.h"

/* Every member is 64 bits wide: Python passes the struct as a flat int64 array.
 * Strides are in elements. ``out`` is contiguous (batch, steps, d). A batch stride
 * of 0 shares a tensor across the batch (broadcasting). W may have any row and
 * column strides (a transposed view is read in place); b and initial have unit
 * stride along d. */
typedef struct {
    int64_t batch, steps, d;
    const void *weights;
    int64_t w_batch, w_step, w_row, w_col;
    const void *biases;
    int64_t b_batch, b_step;
    const void *initial; /* never NULL: Python passes zeros for "no initial" */
    int64_t i_batch;
    void *out;
    int64_t reverse, nthreads;
} ps_matrix_args;

PS_API int64_t ps_matrix_args_size(void);
PS_API int ps_matrix_scan_fwd_f32(const ps_matrix_args *args);
PS_API int ps_matrix_scan_fwd_f64(const ps_matrix_args *args);

#endif
