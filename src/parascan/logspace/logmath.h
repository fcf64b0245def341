/* Scalar math for the log-space scan, written so that gcc vectorizes the loops
 * that call it (no libm calls, no branches: selects and bit casts only).
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
#ifndef PARASCAN_LOGSPACE_LOGMATH_H
#define PARASCAN_LOGSPACE_LOGMATH_H

#include "parallel.h"

#include <math.h>
#include <stdint.h>

#define PS_LN2_F 0.693147180559945309f

/* Always inlined: a call left in a loop stops it from vectorizing, and gcc's
 * heuristics decline to inline these once they have many callers. */
#if defined(__GNUC__)
#define PS_MATH static inline __attribute__((always_inline))
#else
#define PS_MATH static inline
#endif

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
        /* log(1 + w), w = exp(v - u), |w| <= 1 */
        const double m = exp(vr - ur), wr = m * cos(vi - ui), wi = m * sin(vi - ui);
        r += 0.5 * log1p(wr * (2.0 + wr) + wi * wi);
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

#endif
