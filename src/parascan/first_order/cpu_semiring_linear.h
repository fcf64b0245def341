/* The linear semiring, numbers under + and x: the algebra of linear_scan,
 * out[t] = gates[t] * out[t-1] + tokens[t]. Defined once here for every
 * accumulation type T (ps_f32, ps_f64, ps_c64, ps_c128; cpu_common.h has their
 * arithmetic); cpu_instance.h binds the names below to the macros the templates
 * use (STEP, COMPOSE, ZERO, ONE, W_STEP, W_GATE, W_TOKEN).
 *
 * forward (cpu_forward.h):
 *   T_linear_step(a, s, b)     a s + b, one step of the scan
 *   T_linear_compose(a, q)     a q + 0, the gate of two steps, a after q
 *   T_linear_zero()            0, the empty state (no initial)
 *   T_linear_one()             1, the identity gate
 * backward (cpu_backward.h), the step weights d out[t] / d (out[t-1], gates[t],
 * tokens[t]) from the step's gate a, token b, previous output prev and output h:
 *   T_linear_bwd_weight(a, prev, h)   a
 *   T_linear_gate_weight(w, prev)     prev
 *   T_linear_token_weight(b, h)       1: ps_linear_token_weight_is_one, so the
 *                                     backward never reads tokens (nor h)
 * ps_linear_bwd_weights_first is 0: the backward rows run the chain first (their
 * weights are loads; see cpu_backward.h).
 * ps_linear_zero_gate_grad_from_empty: where the backward's time-major rows meet a
 * step from the empty state (t = 0 without initial) they store the gate gradient
 * as an exact 0 rather than g * conj(0) (which is -0 for negative g, NaN for
 * infinite g); the tile paths multiply by the empty state. Both as they have
 * always been.
 */
#ifndef PARASCAN_SEMIRING_LINEAR_H
#define PARASCAN_SEMIRING_LINEAR_H

#include "cpu_common.h"

#define ps_linear_token_weight_is_one 1
#define ps_linear_zero_gate_grad_from_empty 1
#define ps_linear_bwd_weights_first 0 /* the weights are the inputs: the chain first */

/* Real types: expressions, as cpu_common.h's arithmetic (see there why). */
#define ps_f32_linear_step(a, s, b) ps_f32_fma(a, s, b)
#define ps_f32_linear_compose(a, q) ps_f32_fma(a, q, 0.0f)
#define ps_f32_linear_zero() 0.0f
#define ps_f32_linear_one() 1.0f
#define ps_f32_linear_bwd_weight(a, prev, h) (a)
#define ps_f32_linear_gate_weight(w, prev) (prev)
#define ps_f32_linear_token_weight(b, h) 1.0f
#define ps_f64_linear_step(a, s, b) ps_f64_fma(a, s, b)
#define ps_f64_linear_compose(a, q) ps_f64_fma(a, q, 0.0)
#define ps_f64_linear_zero() 0.0
#define ps_f64_linear_one() 1.0
#define ps_f64_linear_bwd_weight(a, prev, h) (a)
#define ps_f64_linear_gate_weight(w, prev) (prev)
#define ps_f64_linear_token_weight(b, h) 1.0

/* Complex types: functions. */
#define PS_LINEAR_COMPLEX_SEMIRING(T, R)                                             \
    PS_MATH T T##_linear_step(T a, T s, T b) { return T##_fma(a, s, b); }            \
    PS_MATH T T##_linear_compose(T a, T q) { return T##_fma(a, q, T##_zero()); }     \
    PS_MATH T T##_linear_zero(void) { return T##_zero(); }                           \
    PS_MATH T T##_linear_one(void) { return (T){(R)1, (R)0}; }                       \
    PS_MATH T T##_linear_bwd_weight(T a, T prev, T h) {                              \
        (void)prev;                                                                  \
        (void)h;                                                                     \
        return a;                                                                    \
    }                                                                                \
    PS_MATH T T##_linear_gate_weight(T w, T prev) {                                  \
        (void)w;                                                                     \
        return prev;                                                                 \
    }                                                                                \
    PS_MATH T T##_linear_token_weight(T b, T h) {                                    \
        (void)b;                                                                     \
        (void)h;                                                                     \
        return (T){(R)1, (R)0};                                                      \
    }
PS_LINEAR_COMPLEX_SEMIRING(ps_c64, float)
PS_LINEAR_COMPLEX_SEMIRING(ps_c128, double)
#undef PS_LINEAR_COMPLEX_SEMIRING

#endif
