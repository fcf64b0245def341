/* The vector math the selective scan (selective/cpu_kernel.h) and the SSD scan
 * (ssd/cpu_kernel.h, cpu_layer.h) share: exp, log1p and sigmoid over a GCC vector
 * of float or double, the same operations in the same order in every kernel.
 *
 * The constants, per element type (f32, f64), are defined once below. The
 * functions are a template: a kernel includes this header inside each of its
 * instantiations, having defined
 *   T, V, VI, VU   the element type; a GCC vector of them; the signed and unsigned
 *                  integer vectors of its lanes' width
 *   PS_VM_TYPE     f32 (T is float) or f64 (T is double): the constants' suffix
 *   PS_VM(name)    the instantiation's name for `name`
 *   PS_VM_ATTR     the functions' specifiers and attributes (static inline, the
 *                  target and the contraction of multiply-adds: each kernel keeps
 *                  its own, which decide the bits)
 * and gets PS_VM(ps_vselect), PS_VM(ps_vexp), PS_VM(ps_vexp_nonpos),
 * PS_VM(ps_vlog1p) and PS_VM(ps_vsigmoid). The includer undefines its parameters;
 * the template part has no include guard on purpose.
 */
#ifndef PARASCAN_VECTOR_MATH_CONSTANTS
#define PARASCAN_VECTOR_MATH_CONSTANTS

/* ---- float ---------------------------------------------------------------------- */
#define PS_EXP_LO_f32 -86.9f /* k >= -125: the result is normal */
#define PS_EXP_HI_f32 88.7228317f
#define PS_EXP_ROUND_f32 12582912.0f /* 1.5 2^23 */
#define PS_EXP_LOG2E_f32 1.44269504088896341f
#define PS_EXP_LN2_HI_f32 0.693359375f /* 9 bits: times k (8 bits) is exact */
#define PS_EXP_LN2_LO_f32 -2.12194440e-4f
#define PS_EXP_MANT_f32 23
#define PS_EXP_MANT_MASK_f32 0x007fffffu
#define PS_EXP_TWO_MANT_f32 8388608.0f
#define PS_EXP_BIAS_f32 127.0f
#define PS_EXP_SQRT2_f32 1.41421356f
/* A near-minimax fit (Chebyshev least squares) of (exp(r) - 1 - r) / r^2 on |r| <=
 * 0.3467: relative error 8e-9 before rounding. */
#define PS_EXP_POLY_f32(r, r2)                                                            \
    ((float)1 + ((r) + (r2) * (0.5f + (r) * (0.166665769f + (r) * (0.0416665545f +          \
                                   (r) * (0.00836319488f + (r) * 0.00139262034f))))))
/* atanh's series, s^2 / 3 + s^4 / 5 + ...: the next term is 2e-9 of the sum */
#define PS_EXP_ATANH_POLY_f32(s2)                                                         \
    ((s2) * ((float)(1.0 / 3) +                                                          \
             (s2) * ((float)(1.0 / 5) + (s2) * ((float)(1.0 / 7) + (s2) * (float)(1.0 / 9)))))

/* ---- double --------------------------------------------------------------------- */
#define PS_EXP_LO_f64 -708.0 /* k >= -1021: the result is normal */
#define PS_EXP_HI_f64 709.782712893384
#define PS_EXP_ROUND_f64 6755399441055744.0 /* 1.5 2^52 */
#define PS_EXP_LOG2E_f64 1.4426950408889634
#define PS_EXP_LN2_HI_f64 6.93147180369123816490e-01 /* 32 bits: times k (11 bits) is exact */
#define PS_EXP_LN2_LO_f64 1.90821492927058770002e-10
#define PS_EXP_MANT_f64 52
#define PS_EXP_MANT_MASK_f64 0x000fffffffffffffull
#define PS_EXP_TWO_MANT_f64 4503599627370496.0
#define PS_EXP_BIAS_f64 1023.0
#define PS_EXP_SQRT2_f64 1.4142135623730951
/* The same fit, degree 11: relative error 1.3e-17 before rounding. */
#define PS_EXP_POLY_f64(r, r2)                                                            \
    (1.0 + ((r) + (r2) * (0.5000000000000001 + (r) * (0.16666666666666667 +               \
        (r) * (0.041666666666624038 + (r) * (0.0083333333333300549 +                      \
        (r) * (0.0013888888917258758 + (r) * (0.00019841269863088254 +                    \
        (r) * (2.4801521225986432e-05 + (r) * (2.7557268406190795e-06 +                   \
        (r) * (2.7620121717381935e-07 + (r) * 2.5100411082014901e-08)))))))))))
/* atanh's series to s^18 / 19: the next term is 2e-17 of the sum */
#define PS_EXP_ATANH_POLY_f64(s2)                                                         \
    ((s2) * (1.0 / 3 + (s2) * (1.0 / 5 + (s2) * (1.0 / 7 + (s2) * (1.0 / 9 + (s2) *         \
        (1.0 / 11 + (s2) * (1.0 / 13 + (s2) * (1.0 / 15 + (s2) * (1.0 / 17 +                \
        (s2) * (1.0 / 19))))))))))

#endif /* PARASCAN_VECTOR_MATH_CONSTANTS */

/* ---- the template ----------------------------------------------------------------- */
#if !defined(T) || !defined(V) || !defined(VI) || !defined(VU) || !defined(PS_VM_TYPE) || \
    !defined(PS_VM) || !defined(PS_VM_ATTR)
#error "vector_math.h: define T, V, VI, VU, PS_VM_TYPE, PS_VM and PS_VM_ATTR first"
#endif

/* T's constant `name` (PS_EXP_<name>_<PS_VM_TYPE>). */
#define PS_VM_K(name) PS_CAT(PS_EXP_##name, PS_VM_TYPE)

/* x in every lane: one broadcast (x - 0 is x, -0 included). An expression: a vector
 * built inside an inlined function is lowered for the baseline before a target
 * clone inlines it (a chain of inserts instead of one broadcast). */
#define PS_VM_SPLAT(x) ((T)(x) - (V){})

/* m ? a : b per lane, for m all ones or all zeros (a comparison). */
PS_VM_ATTR V PS_VM(ps_vselect)(VI m, V a, V b) { return (V)((m & (VI)a) | (~m & (VI)b)); }

/* exp(x) within a few ulp (the polynomial's error plus the rounding of a dozen
 * operations) for results of at least the smallest normal number (x >= EXP_LO), 0
 * below (no subnormal results), inf above EXP_HI (the largest x with a finite exp),
 * NaN for NaN. x = k ln2 + r, k an integer rounded by adding and removing
 * 1.5 2^m (m: the mantissa bits), which leaves k in the low bits of the sum, and r
 * computed with a two-part ln2 (its high part times k is exact); exp(r) by a
 * polynomial, then 2^k applied by adding k to the exponent field (k shifted up by
 * m: the bits above k shift out). Lanes out of range compute garbage and are
 * replaced at the end. */
/* The body both exps share, up to `scaled` (the result for x in range). */
#define PS_VM_EXP_SCALED(x, scaled)                                                   \
    const V round = PS_VM_SPLAT(PS_VM_K(ROUND));                                      \
    const V t = (x) * PS_VM_K(LOG2E) + round;                                         \
    const V kf = t - round;                                                           \
    const V r = ((x) - kf * PS_VM_K(LN2_HI)) - kf * PS_VM_K(LN2_LO);                  \
    const V r2 = r * r;                                                               \
    const V p = PS_VM_K(POLY)(r, r2);                                                 \
    const V scaled = (V)((VU)p + ((VU)t << PS_VM_K(MANT)))
PS_VM_ATTR V PS_VM(ps_vexp)(V x) {
    PS_VM_EXP_SCALED(x, scaled);
    const VI small = (VI)(x < PS_VM_K(LO));
    const VI big = ~(VI)(x <= PS_VM_K(HI)); /* or NaN: x + inf is inf or NaN */
    return PS_VM(ps_vselect)(big, x + (T)INFINITY, (V)(~small & (VI)scaled));
}

/* exp(x) for x <= 0, never NaN (the selective scan's common case, dt >= 0 and A <= 0,
 * both finite): ps_vexp without the checks for large x and NaN. */
PS_VM_ATTR V PS_VM(ps_vexp_nonpos)(V x) {
    PS_VM_EXP_SCALED(x, scaled);
    return (V)(~(VI)(x < PS_VM_K(LO)) & (VI)scaled);
}

/* log1p(y) for y >= 0 (or NaN): w = 1 + y = 2^e m with m in [sqrt(1/2), sqrt(2)),
 * log m = 2 atanh(s), s = (m - 1) / (m + 1), and the rounding of 1 + y put back by
 * (y - (w - 1)) / w, which keeps tiny y exact. */
PS_VM_ATTR V PS_VM(ps_vlog1p)(V y) {
    const V one = PS_VM_SPLAT(1);
    const V w = one + y;
    const VU bits = (VU)w;
    V m = (V)((bits & PS_VM_K(MANT_MASK)) | (VU)one);
    const VI big = (VI)(m > PS_VM_K(SQRT2));
    m = PS_VM(ps_vselect)(big, m * (T)0.5, m);
    /* the biased exponent as a float: its integer under the bits of 2^mantissa */
    const V two_m = PS_VM_SPLAT(PS_VM_K(TWO_MANT));
    const V biased = (V)((bits >> PS_VM_K(MANT)) | (VU)two_m) - two_m;
    const V e = (biased - PS_VM_K(BIAS)) + (V)(big & (VI)one);
    const V f = m - one;
    const V s = f / (f + (T)2);
    const V logm = s * (T)2 + (s * (T)2) * PS_VM_K(ATANH_POLY)(s * s);
    const V corr = (y - (w - one)) / w;
    return e * PS_VM_K(LN2_HI) + ((logm + e * PS_VM_K(LN2_LO)) + corr);
}

/* 1 / (1 + exp(-x)) per lane. */
PS_VM_ATTR V PS_VM(ps_vsigmoid)(V x) {
    const V one = PS_VM_SPLAT(1);
    return one / (one + PS_VM(ps_vexp)(-x));
}

#undef PS_VM_EXP_SCALED
#undef PS_VM_K
#undef PS_VM_SPLAT
