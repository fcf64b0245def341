/* The log semiring, logaddexp as the sum and + as the product: the algebra of
 * log_linear_scan, out[t] = logaddexp(gates[t] + out[t-1], tokens[t]), the linear
 * scan of exp(out) in log space. Defined once here, with the scalar math it needs,
 * for every accumulation type T (ps_f32, ps_f64, ps_c64, ps_c128); cpu_instance.h
 * binds the names to the macros the templates use, as for cpu_semiring_linear.h:
 *   T_log_step(a, s, b)        logaddexp(a + s, b), one step of the scan
 *   T_log_compose(a, q)        a + q, the gate of two steps
 *   T_log_zero()               -inf (the log of 0), the empty state
 *   T_log_one()                0 (the log of 1), the identity gate
 * backward step weights from the step's gate a, token b, previous output prev and
 * output h (each 0 where h = -inf):
 *   T_log_bwd_weight(a, prev, h)   wu = exp(a + prev - h)
 *   T_log_gate_weight(w, prev)     wu (the weight of the gate is that of out[t-1])
 *   T_log_token_weight(b, h)       wb = exp(b - h)
 *
 * The scalar math is written so that gcc vectorizes the loops that call it (no
 * libm calls, no branches: selects and bit casts only).
 *
 * float32: exp and log1p are polynomial approximations with errors of about one
 * ulp (exp: range reduction by ln 2 in two parts, degree-7 Taylor polynomial on
 * |r| <= ln(2)/2; log1p on [0, 1]: one halving, then 2 atanh(s) as an odd series
 * in s = f / (2 + f), |s| <= 0.172). float64 and complex use libm.
 *
 * logaddexp(u, v) = max + log1p(exp(min - max)), with the special values of the
 * exact function: -inf and -inf give -inf, +inf and +inf give +inf, one -inf
 * gives the other argument exactly, NaN gives NaN. The weight exp(x - h), the
 * derivative of h = logaddexp(x, y) in x, is defined as 0 when h = -inf (both
 * x and y are -inf: log(0 + 0), whose gradient flows nowhere).
 */
#ifndef PARASCAN_SEMIRING_LOG_H
#define PARASCAN_SEMIRING_LOG_H

#include "cpu_common.h"

#include <math.h>
#include <stdint.h>

#define PS_LN2_F 0.693147180559945309f

/* exp(x) for x <= 88 (+inf above; 0 below -87, where the exact value is under
 * 1.7e-38); NaN stays NaN. */
PS_MATH float ps_exp_f32(float x) {
    const float xc = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x); /* NaN passes */
    const float shifter = 12582912.0f;                               /* 1.5 * 2^23 */
    const float t = xc * 1.44269504088896341f + shifter;              /* round(x / ln 2) */
    const float k = t - shifter;
    const int32_t n = (int32_t)(ps_f32_to_bits(t) - ps_f32_to_bits(shifter));
    const float r = (xc - k * 0.693145751953125f) - k * 1.42860682030941723e-6f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const float scale = ps_bits_to_f32((uint32_t)(n + 127) << 23);
    const float e = p * scale;
    return x < -87.0f ? 0.0f : (x > 88.0f ? INFINITY : e);
}

/* log(1 + e) for e in [0, 1] (NaN stays NaN). */
PS_MATH float ps_log1p_unit_f32(float e) {
    const int big = e > 0.41421356f; /* 1 + e > sqrt(2): use (1 + e) / 2 */
    const float f = big ? (e - 1.0f) * 0.5f : e;
    const float s = f / (2.0f + f);
    const float z = s * s;
    float p = 2.0f / 9.0f;
    p = p * z + 2.0f / 7.0f;
    p = p * z + 2.0f / 5.0f;
    p = p * z + 2.0f / 3.0f;
    p = p * z + 2.0f;
    return (big ? PS_LN2_F : 0.0f) + s * p;
}

PS_MATH float ps_logaddexp_f32(float u, float v) {
    const float hi = u > v ? u : v, lo = u > v ? v : u; /* NaN u: lo; NaN v: hi */
    const float d = lo == hi ? 0.0f : lo - hi;        /* equal infinities: 0 */
    return hi + ps_log1p_unit_f32(ps_exp_f32(d));
}

PS_MATH float ps_log_weight_f32(float x, float h) {
    const float e = ps_exp_f32(x - h); /* computed unconditionally: a select, no branch */
    return h == -INFINITY ? 0.0f : e;
}

static inline double ps_logaddexp_f64(double u, double v) {
    const double hi = u > v ? u : v, lo = u > v ? v : u;
    const double d = lo == hi ? 0.0 : lo - hi;
    return hi + log1p(exp(d));
}

static inline double ps_log_weight_f64(double x, double h) {
    return h == -INFINITY ? 0.0 : exp(x - h);
}

/* Complex: the complex log of exp(u) + exp(v), its imaginary part reduced to
 * [-pi, pi] (the principal value; any branch is a logarithm, and a bounded
 * phase keeps its precision over long sequences). Computed in double for both
 * widths, scalar: complex inputs are the rare, general case. */
static inline void ps_clogaddexp(double ur, double ui, double vr, double vi,
                                 double *hr, double *hi_) {
    if (isnan(ur) || isnan(ui) || isnan(vr) || isnan(vi)) {
        *hr = *hi_ = NAN;
        return;
    }
    if (vr > ur) { /* u: the larger real part */
        double t = ur; ur = vr; vr = t;
        t = ui; ui = vi; vi = t;
    }
    double r = ur, i = ui;
    if (isfinite(ur) && vr != -INFINITY) {
        /* log(1 + w), w = exp(v - u), |w| <= 1. log |1 + w| is log1p(2 wr + |w|^2) / 2
         * near w = 0 and log hypot(1 + wr, wi) for wr <= -1/2, where 1 + wr is exact and
         * the first form cancels (terms of nearly opposite sign: semiring.py's
         * _log1p_unit_disk, the same choice). */
        const double m = exp(vr - ur), wr = m * cos(vi - ui), wi = m * sin(vi - ui);
        r += wr > -0.5 ? 0.5 * log1p(wr * (2.0 + wr) + wi * wi) : log(hypot(1.0 + wr, wi));
        i += atan2(wi, 1.0 + wr);
    }
    if (r == -INFINITY) i = 0.0; /* log 0 */
    const double k = nearbyint(i * 0.159154943091895336);       /* i / (2 pi) */
    *hr = r;
    *hi_ = (i - k * 6.28318530717958623) - k * 2.44929359829470641e-16;
}

/* exp(x - h) (the weight of x in h = logaddexp(x, .)), 0 when h = log 0. */
static inline void ps_clog_weight(double xr, double xi, double hr, double hi_,
                                  double *wr, double *wi) {
    if (hr == -INFINITY && !isnan(xr) && !isnan(xi) && !isnan(hi_)) {
        *wr = *wi = 0.0;
        return;
    }
    const double m = exp(xr - hr);
    *wr = m * cos(xi - hi_);
    *wi = m * sin(xi - hi_);
}

/* The semiring, per accumulation type. */
#define ps_log_token_weight_is_one 0
#define ps_log_zero_gate_grad_from_empty 0
#define ps_log_bwd_weights_first 1 /* the weights cost two exp: first, as independent work */

/* Real types: expressions, as cpu_common.h's arithmetic (see there why). */
#define ps_f32_log_step(a, s, b) ps_logaddexp_f32((a) + (s), (b))
#define ps_f32_log_compose(a, q) ((a) + (q))
#define ps_f32_log_zero() (-INFINITY)
#define ps_f32_log_one() 0.0f
#define ps_f32_log_bwd_weight(a, prev, h) ps_log_weight_f32((a) + (prev), (h))
#define ps_f32_log_gate_weight(w, prev) (w)
#define ps_f32_log_token_weight(b, h) ps_log_weight_f32((b), (h))
#define ps_f64_log_step(a, s, b) ps_logaddexp_f64((a) + (s), (b))
#define ps_f64_log_compose(a, q) ((a) + (q))
#define ps_f64_log_zero() (-INFINITY)
#define ps_f64_log_one() 0.0
#define ps_f64_log_bwd_weight(a, prev, h) ps_log_weight_f64((a) + (prev), (h))
#define ps_f64_log_gate_weight(w, prev) (w)
#define ps_f64_log_token_weight(b, h) ps_log_weight_f64((b), (h))

/* Complex types: functions, in double for both widths. */
#define PS_LOG_COMPLEX_SEMIRING(T, R)                                                \
    static inline T T##_log_step(T a, T s, T b) {                                    \
        double hr, hi;                                                               \
        ps_clogaddexp((double)a.re + s.re, (double)a.im + s.im, b.re, b.im, &hr, &hi); \
        return (T){(R)hr, (R)hi};                                                    \
    }                                                                                \
    static inline T T##_log_weight(T x, T h) {                                       \
        double wr, wi;                                                               \
        ps_clog_weight(x.re, x.im, h.re, h.im, &wr, &wi);                            \
        return (T){(R)wr, (R)wi};                                                    \
    }                                                                                \
    PS_MATH T T##_log_compose(T a, T q) { return T##_add(a, q); }                    \
    PS_MATH T T##_log_zero(void) { return (T){-INFINITY, (R)0}; }                    \
    PS_MATH T T##_log_one(void) { return (T){(R)0, (R)0}; }                          \
    PS_MATH T T##_log_bwd_weight(T a, T prev, T h) {                                 \
        return T##_log_weight(T##_add(a, prev), h);                                  \
    }                                                                                \
    PS_MATH T T##_log_gate_weight(T w, T prev) {                                     \
        (void)prev;                                                                  \
        return w;                                                                    \
    }                                                                                \
    PS_MATH T T##_log_token_weight(T b, T h) { return T##_log_weight(b, h); }
PS_LOG_COMPLEX_SEMIRING(ps_c64, float)
PS_LOG_COMPLEX_SEMIRING(ps_c128, double)
#undef PS_LOG_COMPLEX_SEMIRING

#endif
