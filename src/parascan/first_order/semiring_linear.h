/* The linear semiring, numbers under + and x: the algebra of linear_scan,
 * out[t] = gates[t] * out[t-1] + tokens[t]. Defined once here for every
 * accumulation type T (ps_f32, ps_f64, ps_c64, ps_c128; common.h has their
 * arithmetic); scan_instance.h binds the names below to the macros the templates
 * use (STEP, COMPOSE, ZERO, ONE, W_STEP, W_GATE, W_TOKEN).
 *
 * forward (scan_forward.h):
 *   T_linear_step(a, s, b)     a s + b, one step of the scan
 *   T_linear_compose(a, q)     a q + 0, the gate of two steps, a after q
 *   T_linear_zero()            0, the empty state (no initial)
 *   T_linear_one()             1, the identity gate
 * backward (scan_backward.h), the step weights d out[t] / d (out[t-1], gates[t],
 * tokens[t]) from the step's gate a, token b, previous output prev and output h:
 *   T_linear_bwd_weight(a, prev, h)   a
 *   T_linear_gate_weight(w, prev)     prev
 *   T_linear_token_weight(b, h)       1: ps_linear_token_weight_is_one, so the
 *                                     backward never reads tokens (nor h)
 * ps_linear_zero_gate_grad_from_empty: where the backward's time-major rows meet a
 * step from the empty state (t = 0 without initial) they store the gate gradient
 * as an exact 0 rather than g * conj(0) (which is -0 for negative g, NaN for
 * infinite g); the tile paths multiply by the empty state. Both as they have
 * always been.
 */
#ifndef PARASCAN_SEMIRING_LINEAR_H
#define PARASCAN_SEMIRING_LINEAR_H

#include "common.h"

enum { ps_linear_token_weight_is_one = 1, ps_linear_zero_gate_grad_from_empty = 1 };

#define PS_LINEAR_SEMIRING(T, A, ZERO_, ONE_)                                        \
    PS_MATH A T##_linear_step(A a, A s, A b) { return T##_fma(a, s, b); }            \
    PS_MATH A T##_linear_compose(A a, A q) { return T##_fma(a, q, ZERO_); }          \
    PS_MATH A T##_linear_zero(void) { return ZERO_; }                                \
    PS_MATH A T##_linear_one(void) { return ONE_; }                                  \
    PS_MATH A T##_linear_bwd_weight(A a, A prev, A h) {                              \
        (void)prev;                                                                  \
        (void)h;                                                                     \
        return a;                                                                    \
    }                                                                                \
    PS_MATH A T##_linear_gate_weight(A w, A prev) {                                  \
        (void)w;                                                                     \
        return prev;                                                                 \
    }                                                                                \
    PS_MATH A T##_linear_token_weight(A b, A h) {                                    \
        (void)b;                                                                     \
        (void)h;                                                                     \
        return ONE_;                                                                 \
    }

PS_LINEAR_SEMIRING(ps_f32, float, 0.0f, 1.0f)
PS_LINEAR_SEMIRING(ps_f64, double, 0.0, 1.0)
PS_LINEAR_SEMIRING(ps_c64, ps_c64, ((ps_c64){0.0f, 0.0f}), ((ps_c64){1.0f, 0.0f}))
PS_LINEAR_SEMIRING(ps_c128, ps_c128, ((ps_c128){0.0, 0.0}), ((ps_c128){1.0, 0.0}))
#undef PS_LINEAR_SEMIRING

#endif
