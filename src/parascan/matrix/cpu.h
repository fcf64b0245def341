/* matrix_linear_scan CPU kernel: x[t] = W[t] @ x[t-1] + b[t] with d x d matrices W,
 * one matrix-vector product per step, for float32 and float64.
 *
 * The recurrence is sequential in t; its work per step is d^2 multiply-adds on
 * d^2 weights read once, so it streams W at memory speed. Batch elements are
 * independent and run on threads. (A parallel scan over t would need d^3 per
 * step for the products of weights: Python's ``torch`` backend does that where
 * it pays, see matrix/api.py.)
 */
#ifndef PARASCAN_MATRIX_RECURRENCE_H
#define PARASCAN_MATRIX_RECURRENCE_H

#include "abi.h" /* ps_matrix_linear_scan_args, ps_matrix_linear_scan_fwd_{f32,f64} */

#endif
