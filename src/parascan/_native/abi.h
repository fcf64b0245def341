/* The C ABI of parascan's kernel library: every argument struct an entry point
 * takes, in one place. parascan/_native/__init__.py mirrors each struct as a list
 * of field names (ARG_FIELDS) and checks its size against ps_<name>_args_size()
 * once; bump PS_ABI_VERSION whenever a struct or an entry point changes.
 *
 * Every member is 64 bits wide (int64_t or a pointer), so Python passes a struct
 * as a flat int64 array in member order. Strides are in elements of the storage
 * type (a complex element counts as one), of any sign, zero for a broadcast
 * dimension. An entry point returns 0 on success.
 *
 * Entry points (<sfx>: f16, bf16, f32, f64, c64, c128 unless said otherwise):
 *   ps_linear_scan_fwd_<sfx>, ps_log_linear_scan_fwd_<sfx>   (ps_scan_fwd_args)
 *   ps_linear_scan_bwd_<sfx>, ps_log_linear_scan_bwd_<sfx>   (ps_scan_bwd_args)
 *   ps_linear_scan_fwd_varlen_<sfx>, ps_log_linear_scan_fwd_varlen_<sfx>
 *                                         (ps_scan_fwd_args, ps_varlen_args)
 *   ps_linear_scan_bwd_varlen_<sfx>, ps_log_linear_scan_bwd_varlen_<sfx>
 *                                         (ps_scan_bwd_args, ps_varlen_args)
 *   ps_matrix_linear_scan_fwd_{f32,f64}                      (ps_matrix_linear_scan_args)
 *   ps_matmul_reduce_{f32,f64}                                (ps_matmul_args)
 *   ps_selective_fwd_{f32,f64,c64,c128}                       (ps_selective_fwd_args)
 *   ps_selective_bwd_{f32,f64,c64,c128}                       (ps_selective_bwd_args)
 *     (the suffix names the state: f32/f64 for a real A, c64/c128 for a complex one;
 *     every other real tensor is float32 for f32/c64, float64 for f64/c128)
 *   ps_selective_step_{f32,f64}                               (ps_selective_step_args)
 *   ps_ssd_fwd_{f32,f64}, ps_ssd_bwd_{f32,f64}                 (ps_ssd_args)
 *   ps_ssd_conv_fwd_{f32,f64}, ps_ssd_conv_bwd_{f32,f64}       (ps_ssd_conv_args)
 *   ps_ssd_norm_fwd_{f32,f64}, ps_ssd_norm_bwd_{f32,f64}       (ps_ssd_norm_args)
 *   ps_delta_fwd_{f32,f64}, ps_delta_bwd_{f32,f64}             (ps_delta_args)
 *   ps_linear_attention_fwd_{f32,f64}, ps_linear_attention_bwd_{f32,f64}
 *                                                 (ps_linear_attention_args)
 *   ps_dplr_fwd_{f32,f64}, ps_dplr_bwd_{f32,f64}               (ps_dplr_args)
 *   ps_selective_math_{f32,f64}(which, x, out, n)  (no struct: the selective scan's own
 *     vector exp, softplus, log1p, sigmoid one by one, for tests; selective/cpu_kernel.h)
 */
#ifndef PARASCAN_ABI_H
#define PARASCAN_ABI_H

#include "parallel.h"

#include <stdint.h>

#define PS_ABI_VERSION 15

/* The first-order scans (first_order/): every tensor is seen as a 3-d strided
 * view (outer, steps, inner) with the scan running along `steps`; states
 * (initial, grad_initial) as 2-d views (outer, inner). reverse != 0 runs time
 * backwards (out[t+1] feeds out[t]).
 *
 * forward: out[o, t, c] = STEP(gates[o, t, c], out[o, t-1, c], tokens[o, t, c]),
 * out[o, -1, c] = initial[o, c] (the semiring's empty state when initial is NULL):
 *   linear_scan      STEP(a, s, b) = a s + b,               empty state 0
 *   log_linear_scan  STEP(a, s, b) = logaddexp(a + s, b),   empty state -inf */
typedef struct {
    int64_t outer, steps, inner;
    const void *gates;   int64_t gates_stride[3];
    const void *tokens;  int64_t tokens_stride[3];
    const void *initial; int64_t initial_stride[2]; /* NULL: the empty state */
    void *out;           int64_t out_stride[3];
    int64_t reverse, nthreads;
} ps_scan_fwd_args;

/* backward (fused): with the step weights of the semiring (first_order/semiring_*.h)
 * w[t] = d out[t] / d out[t-1], wa[t] = d out[t] / d gates[t], wb[t] = d out[t] / d tokens[t]
 * and g[t] = grad_out[t] + conj(w[t+1]) g[t+1] (g[steps] = 0):
 *   grad_gates[t] = g[t] conj(wa[t]), grad_tokens[t] = g[t] conj(wb[t]),
 *   grad_initial = conj(w[0]) g[0].
 *   linear_scan      w = gates, wa = out[t-1], wb = 1 (tokens is never read: NULL)
 *   log_linear_scan  w = wa = exp(gates[t] + out[t-1] - out[t]), wb = exp(tokens[t] - out[t])
 *                    (each 0 where out[t] = -inf) */
typedef struct {
    int64_t outer, steps, inner;
    const void *gates;    int64_t gates_stride[3];
    const void *tokens;   int64_t tokens_stride[3];   /* NULL for linear_scan */
    const void *out;      int64_t out_stride[3];
    const void *grad_out; int64_t grad_out_stride[3];
    const void *initial;  int64_t initial_stride[2];  /* NULL: the empty state */
    void *grad_gates;     int64_t grad_gates_stride[3];
    void *grad_tokens;    int64_t grad_tokens_stride[3];
    void *grad_initial;   int64_t grad_initial_stride[2];
    int64_t reverse, nthreads;
} ps_scan_bwd_args;

/* Packed sequences (cu_seqlens), beside a ps_scan_fwd_args or ps_scan_bwd_args:
 * the steps are nseq sequences, sequence s holding steps cu_seqlens[s] ..
 * cu_seqlens[s + 1] - 1 (0 = cu_seqlens[0] <= ... <= cu_seqlens[nseq] = steps), each
 * scanned from its own initial state as if alone (reverse: within each sequence).
 * initial and grad_initial point at sequence 0's state, (outer, inner) strided as
 * in the scan's struct; sequence s's lies s * initial_seq_stride (grad_initial_seq_stride)
 * elements further. An empty sequence's grad_initial is 0. */
typedef struct {
    const int64_t *cu_seqlens;
    int64_t nseq, initial_seq_stride, grad_initial_seq_stride;
} ps_varlen_args;

/* matrix_linear_scan (matrix/cpu.h): x[t] = W[t] @ x[t-1] + b[t].
 * ``out`` is contiguous (batch, steps, d). A batch stride of 0 shares a tensor
 * across the batch (broadcasting). W may have any row and column strides (a
 * transposed view is read in place); b and initial have unit stride along d. */
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
} ps_matrix_linear_scan_args;

/* associative_reduce(torch.matmul) (generic/cpu.h): the product of each batch
 * element's sequence of square matrices. x is (batch, steps, d, d) with any
 * strides; out is contiguous (batch, d, d). */
typedef struct {
    int64_t batch, steps, d;
    const void *x;
    int64_t x_batch, x_step, x_row, x_col;
    void *out;
    int64_t nthreads;
    int64_t simd; /* 0: the portable block products even where AVX2 is there (tests) */
} ps_matmul_args;

/* The selective scan (selective/cpu.c; the contract and the math are in
 * selective/canonical.py):
 *   dt[t]  = softplus(delta[t] + delta_bias) if softplus else delta[t] + delta_bias
 *   h[t]   = exp(dt[t] A) h[t-1] + dt[t] u[t] B[t],   h[-1] = initial (NULL: zeros)
 *   y[t]   = sum_n C[t, n] h[t, n]   (complex state: 2 Re sum_n C[t, n] h[t, n])
 *   out[t] = (y[t] + D u[t]) silu(z[t])   (D, z: NULL when absent)
 * per (batch, channel), with an N-wide state. Every tensor comes with the strides
 * of its shape below. B and C are each time-invariant (groups == 0: (dim, nstate))
 * or variable (groups = G >= 1 dividing dim: (batch, G, nstate, length), channel d
 * reading group d / (dim / G)); with a complex state each is complex (complex == 1)
 * or real (0), and must be real with a real one. The operands, shared by both
 * entries: */
typedef struct {
    int64_t batch, dim, length, nstate;
    int64_t chunk; /* K, the steps between checkpoints (1 .. 4096) */
    const void *u;          int64_t u_stride[3];       /* (batch, dim, length) */
    const void *delta;      int64_t delta_stride[3];   /* (batch, dim, length) */
    const void *A;          int64_t A_stride[2];       /* (dim, nstate), the state's type */
    const void *B;          int64_t B_stride[4];       /* as said above */
    int64_t B_groups, B_complex;
    const void *C;          int64_t C_stride[4];
    int64_t C_groups, C_complex;
    const void *D;          int64_t D_stride;          /* (dim,) or NULL */
    const void *z;          int64_t z_stride[3];       /* (batch, dim, length) or NULL */
    const void *delta_bias; int64_t delta_bias_stride; /* (dim,) or NULL */
    const void *initial;    int64_t initial_stride[3]; /* (batch, dim, nstate) or NULL */
    int64_t softplus, nthreads;
} ps_selective_operands;

/* forward: out, the last state, and the state entering each chunk of K steps,
 * checkpoints[:, :, c] = h[c K - 1] (nchunks = ceil(length / K); final is the
 * initial state when length == 0). */
typedef struct {
    ps_selective_operands in;
    void *out;         int64_t out_stride[3];         /* (batch, dim, length) */
    void *final;       int64_t final_stride[3];       /* (batch, dim, nstate) */
    void *checkpoints; int64_t checkpoints_stride[4]; /* (batch, dim, nchunks, nstate) */
} ps_selective_fwd_args;

/* backward: from the forward's checkpoints, grad_out and grad_final (both always
 * given), the gradient of every operand, each with its operand's shape and type
 * (B and C summed over the batch when invariant, over the channels of a group when
 * variable; A, D and delta_bias over batch and time); the pointer of an absent
 * operand's gradient is NULL. Complex gradients are torch's (conjugate Wirtinger).
 * Every sum runs in an order fixed by the shapes alone: the same bits with any
 * number of threads. */
typedef struct {
    ps_selective_operands in;
    const void *checkpoints; int64_t checkpoints_stride[4];
    const void *grad_out;    int64_t grad_out_stride[3];
    const void *grad_final;  int64_t grad_final_stride[3];
    void *grad_u;            int64_t grad_u_stride[3];
    void *grad_delta;        int64_t grad_delta_stride[3];
    void *grad_A;            int64_t grad_A_stride[2];
    void *grad_B;            int64_t grad_B_stride[4];
    void *grad_C;            int64_t grad_C_stride[4];
    void *grad_D;            int64_t grad_D_stride;
    void *grad_z;            int64_t grad_z_stride[3];
    void *grad_delta_bias;   int64_t grad_delta_bias_stride;
    void *grad_initial;      int64_t grad_initial_stride[3];
} ps_selective_bwd_args;

/* One decoding step of the selective or SSD scan (selective/cpu_step.h), in place on
 * a real state of the entry's type, every operand of that type, any strides:
 *   dt'  = softplus(dt + dt_bias) if softplus else dt + dt_bias   (dt_bias NULL: 0)
 *   h    = exp(dt' A) h + dt' x B,   y = sum_n C h
 *   out  = (y + D x) silu(z)   (D, z: NULL when absent)
 * per unit (batch, head, row), head h reading B of group h / (heads / B_groups), C of
 * group h / (heads / C_groups).
 * Mamba-1's layout is headdim 1 (a head per channel). */
typedef struct {
    int64_t batch, heads, headdim, nstate, B_groups, C_groups;
    void *state;         int64_t state_stride[4];   /* (batch, heads, headdim, nstate) */
    const void *x;       int64_t x_stride[3];       /* (batch, heads, headdim) */
    const void *dt;      int64_t dt_stride[3];      /* (batch, heads, headdim) */
    const void *A;       int64_t A_stride[3];       /* (heads, headdim, nstate) */
    const void *B;       int64_t B_stride[3];       /* (batch, B_groups, nstate) */
    const void *C;       int64_t C_stride[3];       /* (batch, C_groups, nstate) */
    const void *D;       int64_t D_stride[2];       /* (heads, headdim) or NULL */
    const void *z;       int64_t z_stride[3];       /* (batch, heads, headdim) or NULL */
    const void *dt_bias; int64_t dt_bias_stride[2]; /* (heads, headdim) or NULL */
    void *out;           int64_t out_stride[3];     /* (batch, heads, headdim) */
    int64_t softplus, nthreads;
} ps_selective_step_args;

/* The SSD scan (Mamba-2's; ssd/cpu.c, the contract and the math in
 * ssd/canonical.py), one struct for both entries. Every tensor is contiguous in
 * the shape given and of the entry's type (float32 or float64): x, z, out, grad_out,
 * grad_x, grad_z (batch, length, heads, headdim); dt, grad_dt (batch, length, heads);
 * A, grad_A (heads,); B, C, grad_B, grad_C (batch, length, groups, nstate), groups
 * dividing heads; D, grad_D (heads, headdim); initial, final, grad_final,
 * grad_initial (S, heads, headdim, nstate) with S = nseq when packed, else batch;
 * checkpoints (batch, ceil(length / chunk), heads, headdim, nstate). cu_seqlens
 * (nseq + 1 offsets, batch 1) or NULL: packed sequences. D, z, initial (zeros) and
 * grad_initial may be NULL; so may final (no final state stored) and grad_final
 * (zeros); grad_D, grad_z must be given with D, z. The forward
 * writes out, final and checkpoints and reads none of the backward's members; the
 * backward reads checkpoints, grad_out and grad_final and writes every gradient.
 * simd = 0 runs the portable build; failed is set by the kernel (out of memory). */
typedef struct {
    int64_t batch, length, heads, headdim, groups, nstate, chunk;
    const int64_t *cu_seqlens; int64_t nseq;
    const void *x, *dt, *A, *B, *C, *D, *z, *initial;
    void *out, *final, *checkpoints;
    const void *grad_out, *grad_final;
    void *grad_x, *grad_dt, *grad_A, *grad_B, *grad_C, *grad_D, *grad_z, *grad_initial;
    int64_t nthreads, simd, failed;
} ps_ssd_args;

/* The Mamba-2 layer's neighbours of the SSD scan (ssd/cpu_layer.h): the
 * depthwise causal convolution before it and the gated RMS norm after it, forward and
 * backward, float32 or float64 (every tensor of the entry's type).
 *
 * Convolution, for width K, per batch row and channel c:
 *   pre[t, c] = bias[c] + sum_k weight[c, k] x[t - K + 1 + k, c]   (x before step 0: 0)
 *   out[t, c] = silu(pre[t, c]) if silu else pre[t, c]
 * x (batch, length, channels) with strides (x_stride[0], x_stride[1], 1); weight
 * (channels, width) contiguous, width at most PS_SSD_CONV_MAX_WIDTH; bias (channels,)
 * or NULL. out (and grad_out) come in three contiguous pieces, (batch, length,
 * split[i]) with split[0] + split[1] + split[2] = channels (a piece may be empty and
 * NULL): the channels [0, split[0]) in piece 0, the next split[1] in piece 1, the rest
 * in piece 2 (Mamba-2 splits them into the scan's x, B and C). The backward reads x,
 * weight, bias and grad_out and writes grad_x ((batch, length, channels) with strides
 * (grad_x_stride[0], grad_x_stride[1], 1)), grad_weight (channels, width) and grad_bias
 * (NULL when bias is); its sums over batch and time run in an order fixed by the
 * shapes: the same bits for any number of threads. */
enum { PS_SSD_CONV_MAX_WIDTH = 16 }; /* ssd/layer.py: CONV_MAX_WIDTH */
typedef struct {
    int64_t batch, length, channels, width;
    const void *x; int64_t x_stride[2];
    const void *weight, *bias;
    int64_t silu;
    int64_t split[3];
    void *out[3];
    const void *grad_out[3];
    void *grad_x; int64_t grad_x_stride[2];
    void *grad_weight, *grad_bias;
    int64_t nthreads, simd, failed;
} ps_ssd_conv_args;

/* Gated RMS norm over groups of dim / groups channels, per (batch, step):
 *   u = y silu(z) (before_gate == 0) or y (before_gate != 0)
 *   rstd[g] = 1 / sqrt(mean over group g of u^2 + eps)
 *   out = u rstd weight, times silu(z) when before_gate != 0
 * y, out, grad_out, grad_y (batch, length, dim) contiguous; z (batch, length, dim) and
 * grad_z with strides (*_stride[0], *_stride[1], 1); weight, grad_weight (dim,); rstd
 * (batch, length, groups), written by the forward and read by the backward; eps_bits:
 * the bits of eps as an IEEE double. The backward writes grad_y, grad_z and
 * grad_weight, the last summed over batch and time in an order fixed by the shapes. */
typedef struct {
    int64_t batch, length, dim, groups;
    const void *y;
    const void *z; int64_t z_stride[2];
    const void *weight;
    int64_t eps_bits, before_gate;
    void *out, *rstd;
    const void *grad_out;
    void *grad_y;
    void *grad_z; int64_t grad_z_stride[2];
    void *grad_weight;
    int64_t nthreads, simd, failed;
} ps_ssd_norm_args;

/* The delta rule (delta_rule/cpu.c, the contract and the math in
 * delta_rule/canonical.py), one struct for both entries. Every tensor is contiguous
 * in the shape given and of the entry's type (float32 or float64): q, k, grad_q,
 * grad_k (batch, length, kheads, dk); v, out, grad_out, grad_v (batch, length, heads,
 * dv), kheads dividing heads; beta, grad_beta (batch, length, heads); g, grad_g
 * (batch, length, heads) when gate is 1 (a log decay per head), (batch, length,
 * heads, dk) when gate is 2 (per key channel), NULL when gate is 0 (no decay);
 * initial, final, grad_final, grad_initial (S, heads, dk, dv) with S = nseq when
 * packed, else batch; checkpoints (batch, ceil(length / chunk), heads, dk, dv), the
 * state entering each chunk's first step. cu_seqlens (nseq + 1 offsets, batch 1) or
 * NULL: packed sequences. initial (zeros), final and the forward's checkpoints (not
 * stored), grad_final (zeros) and grad_initial (not computed) may be NULL. qk_form: 0,
 * q and k canonical (q scaled, both normalized when asked); the forward alone may take
 * them raw: 1, q times the scale whose IEEE double bits are scale_bits; 2, both rows
 * normalized first (x / sqrt(sum x^2 + 1e-6)), then q times the scale. The forward writes out, final and
 * checkpoints; the backward reads checkpoints, grad_out and grad_final and writes
 * every other gradient. simd = 0 runs the portable build; failed is set by the
 * kernel (out of memory). */
typedef struct {
    int64_t batch, length, kheads, heads, dk, dv, gate, chunk, qk_form, scale_bits;
    const int64_t *cu_seqlens; int64_t nseq;
    const void *q, *k, *v, *beta, *g, *initial;
    void *out, *final, *checkpoints;
    const void *grad_out, *grad_final;
    void *grad_q, *grad_k, *grad_v, *grad_beta, *grad_g, *grad_initial;
    int64_t nthreads, simd, failed;
} ps_delta_args;

/* Gated linear attention (linear_attention/cpu.c, the contract and the math in
 * linear_attention/canonical.py), one struct for both entries, as ps_delta_args
 * without beta: every tensor contiguous in the shape given and of the entry's type
 * (float32 or float64): q, k, grad_q, grad_k (batch, length, kheads, dk); v, out,
 * grad_out, grad_v (batch, length, heads, dv), kheads dividing heads; g, grad_g
 * (batch, length, heads) when gate is 1 (a log decay per head), (batch, length, heads,
 * dk) when gate is 2 (per key channel), NULL when gate is 0 (no decay); initial, final,
 * grad_final, grad_initial (S, heads, dk, dv) with S = nseq when packed, else batch;
 * checkpoints (batch, ceil(length / chunk), heads, dk, dv), the state entering each
 * chunk's first step. cu_seqlens (nseq + 1 offsets, batch 1) or NULL: packed
 * sequences. initial (zeros), final and the forward's checkpoints (not stored),
 * grad_final (zeros) and grad_initial (not computed) may be NULL. The forward reads q
 * times the scale whose IEEE double bits are scale_bits (q raw, the public function's
 * inference path); the backward takes canonical q, scale 1. The forward writes out,
 * final and checkpoints; the backward reads checkpoints, grad_out and grad_final and
 * writes every other gradient. simd = 0 runs the portable build; failed is set by the
 * kernel (out of memory). */
typedef struct {
    int64_t batch, length, kheads, heads, dk, dv, gate, chunk, scale_bits;
    const int64_t *cu_seqlens; int64_t nseq;
    const void *q, *k, *v, *g, *initial;
    void *out, *final, *checkpoints;
    const void *grad_out, *grad_final;
    void *grad_q, *grad_k, *grad_v, *grad_g, *grad_initial;
    int64_t nthreads, simd, failed;
} ps_linear_attention_args;

/* The generalized delta rule (dplr/cpu.c, the contract and the math in dplr/canonical.py),
 * one struct for both entries, as ps_linear_attention_args with a and b: q, k, a, b and
 * their gradients (batch, length, kheads, dk), contiguous and of the entry's type like
 * every other tensor there. The forward reads q times the scale whose IEEE double bits
 * are scale_bits; the backward takes canonical q, scale 1. */
typedef struct {
    int64_t batch, length, kheads, heads, dk, dv, gate, chunk, scale_bits;
    const int64_t *cu_seqlens; int64_t nseq;
    const void *q, *k, *v, *a, *b, *g, *initial;
    void *out, *final, *checkpoints;
    const void *grad_out, *grad_final;
    void *grad_q, *grad_k, *grad_v, *grad_a, *grad_b, *grad_g, *grad_initial;
    int64_t nthreads, simd, failed;
} ps_dplr_args;

/* ---- Every function the library exports ---------------------------------------- */

/* The first-order scans (first_order/cpu.c), per dtype. */
#define PS_SCAN_ENTRIES(op, sfx)                                                   \
    PS_API int ps_##op##_fwd_##sfx(const ps_scan_fwd_args *args);                  \
    PS_API int ps_##op##_bwd_##sfx(const ps_scan_bwd_args *args);                  \
    PS_API int ps_##op##_fwd_varlen_##sfx(const ps_scan_fwd_args *args,            \
                                           const ps_varlen_args *v);               \
    PS_API int ps_##op##_bwd_varlen_##sfx(const ps_scan_bwd_args *args,            \
                                           const ps_varlen_args *v);
#define PS_SCAN_DTYPES(op)                                                         \
    PS_SCAN_ENTRIES(op, f16) PS_SCAN_ENTRIES(op, bf16) PS_SCAN_ENTRIES(op, f32)    \
    PS_SCAN_ENTRIES(op, f64) PS_SCAN_ENTRIES(op, c64) PS_SCAN_ENTRIES(op, c128)
PS_SCAN_DTYPES(linear_scan)
PS_SCAN_DTYPES(log_linear_scan)
#undef PS_SCAN_DTYPES
#undef PS_SCAN_ENTRIES
/* The first-order scans' block constants, for tests and fuzzers that place lengths
 * around them: out[] = {PS_BLOCK, PS_ROWS, PS_TILE, PS_LONG_STEPS, PS_LONG_ROWS,
 * PS_LONG_CHUNKS, PS_LONG_MIN_LEN, PS_LONG_CHUNK_BYTES} (first_order/cpu_common.h);
 * returns how many there are (at most n are written). */
PS_API int64_t ps_scan_constants(int64_t *out, int64_t n);

/* matrix_linear_scan (matrix/cpu.c). */
PS_API int ps_matrix_linear_scan_fwd_f32(const ps_matrix_linear_scan_args *args);
PS_API int ps_matrix_linear_scan_fwd_f64(const ps_matrix_linear_scan_args *args);

/* associative_reduce(torch.matmul) (generic/cpu.c): 0 on success; 1 for a bad shape,
 * 2 when the scratch memory cannot be allocated. ps_matmul_constants, for tests:
 * out[] = {PS_PRODUCT_ITEMS, PS_PRODUCT_MIN_SEGMENT}; returns the count. */
PS_API int ps_matmul_reduce_f32(const ps_matmul_args *args);
PS_API int ps_matmul_reduce_f64(const ps_matmul_args *args);
PS_API int64_t ps_matmul_constants(int64_t *out, int64_t n);

/* The selective scan (selective/cpu.c) and its decoding step (selective/cpu_step.h).
 * ps_selective_math_<sfx>: the scan's own vector functions one by one, for tests of
 * their accuracy (which 0: exp, 1: softplus, 2: log1p (x >= 0), 3: sigmoid, 4: exp
 * for x <= 0); 1 for another `which`. */
PS_API int ps_selective_fwd_f32(const ps_selective_fwd_args *f);
PS_API int ps_selective_fwd_f64(const ps_selective_fwd_args *f);
PS_API int ps_selective_fwd_c64(const ps_selective_fwd_args *f);
PS_API int ps_selective_fwd_c128(const ps_selective_fwd_args *f);
PS_API int ps_selective_bwd_f32(const ps_selective_bwd_args *g);
PS_API int ps_selective_bwd_f64(const ps_selective_bwd_args *g);
PS_API int ps_selective_bwd_c64(const ps_selective_bwd_args *g);
PS_API int ps_selective_bwd_c128(const ps_selective_bwd_args *g);
PS_API int ps_selective_step_f32(const ps_selective_step_args *a);
PS_API int ps_selective_step_f64(const ps_selective_step_args *a);
PS_API int ps_selective_math_f32(int64_t which, const float *x, float *out, int64_t n);
PS_API int ps_selective_math_f64(int64_t which, const double *x, double *out, int64_t n);

/* The SSD scan and its layer's convolution and norm (ssd/cpu.c). */
#define PS_SSD_ENTRIES(name, args_t)                                               \
    PS_API int ps_##name##_fwd_f32(args_t *a);                                     \
    PS_API int ps_##name##_fwd_f64(args_t *a);                                     \
    PS_API int ps_##name##_bwd_f32(args_t *a);                                     \
    PS_API int ps_##name##_bwd_f64(args_t *a);
PS_SSD_ENTRIES(ssd, ps_ssd_args)
PS_SSD_ENTRIES(ssd_conv, ps_ssd_conv_args)
PS_SSD_ENTRIES(ssd_norm, ps_ssd_norm_args)
PS_SSD_ENTRIES(delta, ps_delta_args) /* the delta rule (delta_rule/cpu.c) */
/* gated linear attention (linear_attention/cpu.c) */
PS_SSD_ENTRIES(linear_attention, ps_linear_attention_args)
PS_SSD_ENTRIES(dplr, ps_dplr_args) /* the generalized delta rule (dplr/cpu.c) */
#undef PS_SSD_ENTRIES

/* What Python checks before anything else is called (abi.c): the version and the
 * size of every argument struct, ps_<name>_args_size() for each name of
 * parascan._native.ARG_FIELDS. */
PS_API int64_t ps_abi_version(void);
PS_API int64_t ps_scan_fwd_args_size(void);
PS_API int64_t ps_scan_bwd_args_size(void);
PS_API int64_t ps_varlen_args_size(void);
PS_API int64_t ps_matrix_linear_scan_args_size(void);
PS_API int64_t ps_matmul_args_size(void);
PS_API int64_t ps_selective_fwd_args_size(void);
PS_API int64_t ps_selective_bwd_args_size(void);
PS_API int64_t ps_selective_step_args_size(void);
PS_API int64_t ps_ssd_args_size(void);
PS_API int64_t ps_ssd_conv_args_size(void);
PS_API int64_t ps_ssd_norm_args_size(void);
PS_API int64_t ps_delta_args_size(void);
PS_API int64_t ps_linear_attention_args_size(void);
PS_API int64_t ps_dplr_args_size(void);

#endif
