/* The product of a sequence of square matrices, M[0] @ M[1] @ ... @ M[T-1], for each
 * batch element: what associative_reduce(torch.matmul, x, dim) computes, for float32
 * and float64 CPU tensors that need no gradient (generic/cpu.py chooses it).
 *
 * Summary of algorithm. Each batch element's sequence is cut into segments (their
 * number depends on the batch and the length only, never on the thread count, so
 * the result is the same bits with any number of threads). A thread multiplies a
 * segment's matrices left to right, its running product held in cache, and each
 * M[t] is read from memory once; then the segment products of each batch element
 * are multiplied in order. A product of T matrices takes T - 1 matrix products, as
 * a tree does, but with no per-level pass over memory and no per-level call.
 *
 * The matrices are multiplied as blocks of d rounded up to 4 rows and to a vector
 * (8 float32 or 4 float64) columns, which tiles of 4 rows by 2 vectors (1 at the
 * right edge) cover exactly. The sums run over the d real columns only, so whatever
 * the padding holds (inf * 0 = NaN beside an infinite row) never reaches the
 * result. With d a multiple of the vector width and unit column stride, M[t] is
 * read in place.
 */
#ifndef PARASCAN_GENERIC_MATMUL_H
#define PARASCAN_GENERIC_MATMUL_H

#include "abi.h" /* ps_matmul_args, ps_matmul_reduce_{f32,f64}, ps_matmul_constants */

#endif
