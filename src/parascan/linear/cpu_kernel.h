/* C ABI of the linear_scan CPU kernels (mirrored by ctypes in cpu.py).
 *
 * The forward takes ps_scan_fwd_args (scan_common.h, which describes the views):
 * forward:  out[o, t, c] = gates[o, t, c] * out[o, t-1, c] + tokens[o, t, c],
 *           out[o, -1, c] = initial[o, c] (zero when initial is NULL).
 * backward: with g[t] = grad_out[t] + conj(gates[t+1]) * g[t+1] (g[steps] = 0),
 *           grad_tokens[t] = g[t], grad_gates[t] = g[t] * conj(out[t-1]),
 *           grad_initial = conj(gates[0]) * g[0].
 * reverse != 0 runs time backwards (out[t+1] feeds out[t]) in both.
 */
#ifndef PARASCAN_LINEAR_CPU_KERNEL_H
#define PARASCAN_LINEAR_CPU_KERNEL_H

#include "scan_common.h"

typedef struct {
    int64_t outer, steps, inner;
    const void *gates;    int64_t gates_stride[3];
    const void *out;      int64_t out_stride[3];
    const void *grad_out; int64_t grad_out_stride[3];
    const void *initial;  int64_t initial_stride[2]; /* NULL: zeros */
    void *grad_gates;     int64_t grad_gates_stride[3];
    void *grad_tokens;    int64_t grad_tokens_stride[3];
    void *grad_initial;   int64_t grad_initial_stride[2];
    int64_t reverse, nthreads;
} ps_linear_bwd_args;

#endif
