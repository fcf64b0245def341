/* C ABI of the log_linear_scan CPU kernels (mirrored by ctypes in cpu.py).
 *
 * The forward takes ps_scan_fwd_args (scan_common.h, which describes the views):
 * forward:  out[t] = logaddexp(gates[t] + out[t-1], tokens[t]),
 *           out[-1] = initial (-inf when initial is NULL).
 * backward: with the weights wu[t] = exp(gates[t] + out[t-1] - out[t]) and
 *           wb[t] = exp(tokens[t] - out[t]) (0 where out[t] = -inf; see logmath.h)
 *           and g[t] = grad_out[t] + conj(wu[t+1]) * g[t+1] (g[steps] = 0):
 *           grad_gates[t] = g[t] * conj(wu[t]), grad_tokens[t] = g[t] * conj(wb[t]),
 *           grad_initial = g[0] * conj(wu[0]).
 * reverse != 0 runs time backwards (out[t+1] feeds out[t]) in both.
 */
#ifndef PARASCAN_LOGSPACE_CPU_KERNEL_H
#define PARASCAN_LOGSPACE_CPU_KERNEL_H

#include "scan_common.h"

typedef struct {
    int64_t outer, steps, inner;
    const void *gates;    int64_t gates_stride[3];
    const void *tokens;   int64_t tokens_stride[3];
    const void *out;      int64_t out_stride[3];
    const void *grad_out; int64_t grad_out_stride[3];
    const void *initial;  int64_t initial_stride[2]; /* NULL: -inf */
    void *grad_gates;     int64_t grad_gates_stride[3];
    void *grad_tokens;    int64_t grad_tokens_stride[3];
    void *grad_initial;   int64_t grad_initial_stride[2];
    int64_t reverse, nthreads;
} ps_log_bwd_args;

#endif
