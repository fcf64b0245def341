/* One instantiation of the selective scan's CPU kernel (cpu.c explains the
 * algorithm), for one real type T: the entries ps_selective_{fwd,bwd}_<SFX> (a real
 * state) and ps_selective_{fwd,bwd}_<CSFX> (a complex state of T pairs). cpu_instance.h
 * defines:
 *   SFX, CSFX         the suffixes (f32 and c64, or f64 and c128)
 *   T, V, VI, VU, W   the real type; the vector of W of them (32 bytes) and the signed
 *                     and unsigned integer vectors of its lanes' width
 *   the scalar libm names EXP, COS, SIN
 * (the vector math's constants are _native/vector_math.h's, by SFX)
 * and undefines nothing: the end of this header does. No include guard on purpose.
 */

#define FN(name) PS_CAT(name, SFX)
#define CTX FN(ps_sel_ctx_t)
#define SCRATCH FN(ps_sel_scratch_t)

/* ---- vector math: the same operations in the same order on every path ------- */

/* x in every lane: one broadcast (x - 0 is x, -0 included). A macro: a vector built
 * inside an inlined function is lowered for the baseline before the AVX2 clone
 * inlines it (a chain of inserts instead of one broadcast). */
#define SPLAT(x) ((T)(x) - (V){})

/* exp, exp for x <= 0, log1p, sigmoid and the lane select (_native/vector_math.h),
 * inlined into every caller with this kernel's contraction (PS_MATH). */
#define PS_VM_TYPE SFX
#define PS_VM(name) FN(name)
#define PS_VM_ATTR PS_MATH
#include "vector_math.h"
#undef PS_VM_TYPE
#undef PS_VM
#undef PS_VM_ATTR

/* softplus with mamba's threshold: x where x > 20, else log1p(exp(x)). */
PS_MATH V FN(ps_sel_softplus)(V x) {
    const V th = SPLAT(20);
    const VI above = (VI)(x > th);
    const V e = FN(ps_vexp)(FN(ps_vselect)(above, th, x));
    return FN(ps_vselect)(above, x, FN(ps_vlog1p)(e));
}

/* d softplus / dx: 1 where x > 20, else sigmoid(x). */
PS_MATH V FN(ps_sel_softplus_grad)(V x) {
    const V one = SPLAT(1);
    return FN(ps_vselect)((VI)(x > (T)20), one, one / (one + FN(ps_vexp)(-x)));
}

/* out[i] = sum of the lanes of p[i], i < W, in a fixed tree (pairs, then halves). */
#if defined(__clang__)
#define PS_SEL_SHUF(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define PS_SEL_SHUF(a, b, ...) __builtin_shuffle(a, b, (VI){__VA_ARGS__})
#endif
PS_MATH V FN(ps_sel_lane_sums)(const V *p) {
#if W == 8
    V q[4];
    for (int i = 0; i < 4; i++)
        q[i] = PS_SEL_SHUF(p[2 * i], p[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               PS_SEL_SHUF(p[2 * i], p[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    const V r0 = PS_SEL_SHUF(q[0], q[1], 0, 1, 8, 9, 4, 5, 12, 13) +
                 PS_SEL_SHUF(q[0], q[1], 2, 3, 10, 11, 6, 7, 14, 15);
    const V r1 = PS_SEL_SHUF(q[2], q[3], 0, 1, 8, 9, 4, 5, 12, 13) +
                 PS_SEL_SHUF(q[2], q[3], 2, 3, 10, 11, 6, 7, 14, 15);
    return PS_SEL_SHUF(r0, r1, 0, 1, 2, 3, 8, 9, 10, 11) +
           PS_SEL_SHUF(r0, r1, 4, 5, 6, 7, 12, 13, 14, 15);
#elif W == 4
    const V q0 = PS_SEL_SHUF(p[0], p[1], 0, 4, 2, 6) + PS_SEL_SHUF(p[0], p[1], 1, 5, 3, 7);
    const V q1 = PS_SEL_SHUF(p[2], p[3], 0, 4, 2, 6) + PS_SEL_SHUF(p[2], p[3], 1, 5, 3, 7);
    return PS_SEL_SHUF(q0, q1, 0, 1, 4, 5) + PS_SEL_SHUF(q0, q1, 2, 3, 6, 7);
#else
#error "cpu_kernel.h: W must be 4 or 8"
#endif
}

/* out[t] = the lane sum of p[t] for t < kpad (a multiple of W). */
PS_MATH void FN(ps_sel_lane_sums_rows)(const V *p, T *out, int64_t kpad) {
    for (int64_t t = 0; t < kpad; t += W) *(V *)(out + t) = FN(ps_sel_lane_sums)(p + t);
}

/* ---- one call's geometry and buffers ------------------------------------------ */

/* Per member of the team, in T elements: kpad-long rows, then the state rows. */
enum {
    FN(PS_SEL_DT), FN(PS_SEL_DU), FN(PS_SEL_X), FN(PS_SEL_U), FN(PS_SEL_Z), FN(PS_SEL_Y),
    FN(PS_SEL_G), FN(PS_SEL_GDU), FN(PS_SEL_GDA), FN(PS_SEL_ROWS)
};

typedef struct {
    T *row[FN(PS_SEL_ROWS)]; /* dt, du, x = delta + bias, u, z, y, g, g_du, g_dtA */
    V *p, *pa, *pb;          /* kpad lane vectors each: the sums over n, lane by lane */
    T *bchunk, *cchunk;      /* variable B and C of a span: span * K rows of S */
    T *gbown, *gcown;        /* backward: one channel's g_B, g_C of a span, where each
                                channel is a group of its own (span * K rows of S) */
    T *a, *binv, *cinv;      /* one channel's A, invariant B and C: S each */
    T *h;                    /* forward: the states of a unit's channels (unit * S) */
    T *hs, *da;              /* backward: h[t-1] for the chunk's steps (kpad + 1 rows of S),
                                exp(dt A) (kpad rows) */
} SCRATCH;

typedef struct {
    const ps_selective_operands *in;
    const ps_selective_fwd_args *fwd; /* exactly one of fwd and bwd */
    const ps_selective_bwd_args *bwd;
    int64_t cplx;               /* a complex state (planar: S = 2 npad, re then im) */
    int64_t npad, S, nv, kpad;  /* N rounded up to W (at least W), the state row, its
                                   vectors, and K rounded up to W */
    int64_t nchunks, channels;  /* ceil(length / K), batch * dim */
    int64_t span;               /* chunks whose variable B and C are packed at once */
    int64_t bper, cper;         /* channels per group of B and C (0: invariant) */
    int64_t bshared, cshared;   /* groups of more than one channel: packed once per
                                   unit, their gradients summed over units */
    /* work units (cpu.c): segments of seg channels (nseg per batch element),
     * each cut into upseg units of at most `unit` channels; units in all */
    int64_t seg, nseg, unit, upseg, units;
    int64_t scratch_len;        /* T elements per member */
    T *scratch;                 /* nthreads * scratch_len */
    T *partial;                 /* backward: per span parity and unit, the span's g_B
                                   (if shared) then g_C (if shared), span * K rows of
                                   S each: per_unit elements */
    int64_t per_unit;
    T *persist;                 /* backward: per channel, PS_SEL_PERSIST(S) elements */
} CTX;

/* A backward channel's running sums: the carried gradient of h, g_A, the invariant
 * g_B and g_C (S each), then the lane sums of g_D and g_delta_bias (W each). */
#define PS_SEL_PERSIST(S) (4 * (S) + 2 * W)

static int64_t FN(ps_sel_scratch_len)(const CTX *c) {
    const int64_t S = c->S, kpad = c->kpad;
    const int64_t rows = c->span * c->in->chunk * S;
    const int64_t own = c->bwd ? ((c->bper == 1) + (c->cper == 1)) * rows : 0;
    return FN(PS_SEL_ROWS) * kpad + 3 * kpad * W + ((c->bper != 0) + (c->cper != 0)) * rows +
           own + 3 * S + c->unit * S + (2 * kpad + 1) * S;
}

static SCRATCH FN(ps_sel_scratch)(const CTX *c, int64_t member) {
    SCRATCH s;
    const int64_t S = c->S, kpad = c->kpad;
    T *p = c->scratch + member * c->scratch_len;
    for (int i = 0; i < FN(PS_SEL_ROWS); i++, p += kpad) s.row[i] = p;
    s.p = (V *)p, p += kpad * W;
    s.pa = (V *)p, p += kpad * W;
    s.pb = (V *)p, p += kpad * W;
    const int64_t rows = c->span * c->in->chunk * S;
    s.bchunk = p, p += c->bper ? rows : 0;
    s.cchunk = p, p += c->cper ? rows : 0;
    s.gbown = p, p += c->bwd && c->bper == 1 ? rows : 0;
    s.gcown = p, p += c->bwd && c->cper == 1 ? rows : 0;
    s.a = p, p += S;
    s.binv = p, p += S;
    s.cinv = p, p += S;
    s.h = p, p += c->unit * S;
    s.hs = p, p += (kpad + 1) * S;
    s.da = p;
    return s;
}

/* Where element `off` of a tensor of T (or of complex T pairs) begins. */
#define PS_SEL_AT(ptr, off, cplx) ((const T *)(ptr) + ((cplx) ? 2 * (off) : (off)))
#define PS_SEL_AT_W(ptr, off, cplx) ((T *)(ptr) + ((cplx) ? 2 * (off) : (off)))

/* A state-like row of n elements (stride `stride`, complex pairs when `scplx`) into
 * dst's planar layout (re [0, npad), im [npad, 2 npad) when `cplx`), zero-padded;
 * src NULL reads zeros. */
static inline void FN(ps_sel_read_row)(T *dst, const T *src, int64_t stride, int64_t scplx,
                                       int64_t n, int64_t npad, int64_t cplx) {
    for (int64_t i = 0; i < (cplx ? 2 * npad : npad); i++) dst[i] = 0;
    if (src == NULL) return;
    for (int64_t i = 0; i < n; i++) {
        if (scplx) {
            dst[i] = src[2 * i * stride];
            dst[npad + i] = src[2 * i * stride + 1];
        } else {
            dst[i] = src[i * stride];
        }
    }
}

/* The first n elements of a planar row out to a tensor row (complex pairs when
 * `dcplx`, else the real parts). */
static inline void FN(ps_sel_write_row)(T *dst, int64_t stride, int64_t dcplx, const T *src,
                                        int64_t n, int64_t npad) {
    for (int64_t i = 0; i < n; i++) {
        if (dcplx) {
            dst[2 * i * stride] = src[i];
            dst[2 * i * stride + 1] = src[npad + i];
        } else {
            dst[i * stride] = src[i];
        }
    }
}

/* Variable B or C of group (b, g) for steps t0 .. t0 + len - 1 into rows of S. */
static void FN(ps_sel_pack_chunk)(const CTX *c, T *dst, const void *src, const int64_t *st,
                                  int64_t scplx, int64_t b, int64_t g, int64_t t0,
                                  int64_t len) {
    const int64_t S = c->S, N = c->in->nstate, npad = c->npad;
    for (int64_t t = 0; t < len; t++)
        for (int64_t i = 0; i < S; i++) dst[t * S + i] = 0;
    const T *base = PS_SEL_AT(src, b * st[0] + g * st[1] + t0 * st[3], scplx);
    for (int64_t n = 0; n < N; n++) {
        const T *row = base + (scplx ? 2 : 1) * n * st[2];
        const int64_t ts = (scplx ? 2 : 1) * st[3];
        for (int64_t t = 0; t < len; t++) dst[t * S + n] = row[t * ts];
        if (scplx)
            for (int64_t t = 0; t < len; t++) dst[t * S + npad + n] = row[t * ts + 1];
    }
}

/* One channel's A, D, delta_bias and invariant B and C. */
static void FN(ps_sel_channel_params)(const CTX *c, SCRATCH *s, int64_t d, T *D, T *bias) {
    const ps_selective_operands *in = c->in;
    const int64_t N = in->nstate, npad = c->npad, cx = c->cplx;
    FN(ps_sel_read_row)(s->a, PS_SEL_AT(in->A, d * in->A_stride[0], cx), in->A_stride[1], cx,
                        N, npad, cx);
    if (c->bper == 0)
        FN(ps_sel_read_row)(s->binv, PS_SEL_AT(in->B, d * in->B_stride[0], in->B_complex),
                            in->B_stride[1], in->B_complex, N, npad, cx);
    if (c->cper == 0)
        FN(ps_sel_read_row)(s->cinv, PS_SEL_AT(in->C, d * in->C_stride[0], in->C_complex),
                            in->C_stride[1], in->C_complex, N, npad, cx);
    *D = in->D ? ((const T *)in->D)[d * in->D_stride] : 0;
    *bias = in->delta_bias ? ((const T *)in->delta_bias)[d * in->delta_bias_stride] : 0;
}

/* A (batch, dim, length) tensor's row (b, d) from step t0, and its time stride. */
#define PS_SEL_ROW(ptr, st, b, d, t0) \
    ((const T *)(ptr) + (b) * (st)[0] + (d) * (st)[1] + (t0) * (st)[2])
#define PS_SEL_ROW_W(ptr, st, b, d, t0) \
    ((T *)(ptr) + (b) * (st)[0] + (d) * (st)[1] + (t0) * (st)[2])

/* Asks for the cache lines of a row's steps t0 .. t0 + len - 1 ahead of their use
 * (rows of neighbouring channels lie a whole row apart, too far for the hardware
 * prefetchers to follow). */
static inline void FN(ps_sel_prefetch_row)(const void *ptr, const int64_t *st, int64_t b,
                                           int64_t d, int64_t t0, int64_t len, int write) {
    if (ptr == NULL || len <= 0) return;
    const T *p = PS_SEL_ROW(ptr, st, b, d, t0);
    if (st[2] == 1) {
        const uintptr_t line = 64, last = (uintptr_t)(p + len - 1);
        for (uintptr_t a = (uintptr_t)p & ~(line - 1); a <= last; a += line) {
            if (write) __builtin_prefetch((const void *)a, 1);
            else __builtin_prefetch((const void *)a, 0);
        }
    } else {
        for (int64_t k = 0; k < len; k++) {
            if (write) __builtin_prefetch(p + k * st[2], 1);
            else __builtin_prefetch(p + k * st[2], 0);
        }
    }
}

/* The rows a chunk of channel (b, d) reads and writes, in up to three parts (part
 * 0: the inputs, 1 and 2: the backward's grad_out and outputs), so that no more
 * lines are asked for at once than the core tracks. */
static void FN(ps_sel_prefetch)(const CTX *c, int64_t part, int64_t b, int64_t d, int64_t t0,
                                int64_t len) {
    const ps_selective_operands *in = c->in;
    const ps_selective_bwd_args *g = c->bwd;
    if (part == 0) {
        FN(ps_sel_prefetch_row)(in->u, in->u_stride, b, d, t0, len, 0);
        FN(ps_sel_prefetch_row)(in->delta, in->delta_stride, b, d, t0, len, 0);
        FN(ps_sel_prefetch_row)(in->z, in->z_stride, b, d, t0, len, 0);
        if (c->fwd) FN(ps_sel_prefetch_row)(c->fwd->out, c->fwd->out_stride, b, d, t0, len, 1);
    } else if (part == 1) {
        FN(ps_sel_prefetch_row)(g->grad_out, g->grad_out_stride, b, d, t0, len, 0);
        FN(ps_sel_prefetch_row)(in->z ? g->grad_z : NULL, g->grad_z_stride, b, d, t0, len, 1);
    } else {
        FN(ps_sel_prefetch_row)(g->grad_u, g->grad_u_stride, b, d, t0, len, 1);
        FN(ps_sel_prefetch_row)(g->grad_delta, g->grad_delta_stride, b, d, t0, len, 1);
    }
}

/* The chunk's u, x = delta + bias, z, dt and du = dt u, zero past len. */
PS_MATH void FN(ps_sel_prepass)(const CTX *c, SCRATCH *s, int64_t b, int64_t d, int64_t t0,
                                int64_t len, T bias) {
    const ps_selective_operands *in = c->in;
    T *u = s->row[FN(PS_SEL_U)], *x = s->row[FN(PS_SEL_X)], *z = s->row[FN(PS_SEL_Z)];
    T *dt = s->row[FN(PS_SEL_DT)], *du = s->row[FN(PS_SEL_DU)];
    const T *up = PS_SEL_ROW(in->u, in->u_stride, b, d, t0);
    const T *xp = PS_SEL_ROW(in->delta, in->delta_stride, b, d, t0);
    const int64_t us = in->u_stride[2], xs = in->delta_stride[2];
    for (int64_t k = 0; k < len; k++) u[k] = up[k * us];
    if (in->delta_bias) {
        for (int64_t k = 0; k < len; k++) x[k] = xp[k * xs] + bias;
    } else {
        for (int64_t k = 0; k < len; k++) x[k] = xp[k * xs];
    }
    for (int64_t k = len; k < c->kpad; k++) u[k] = 0, x[k] = 0;
    if (in->z) {
        const T *zp = PS_SEL_ROW(in->z, in->z_stride, b, d, t0);
        const int64_t zs = in->z_stride[2];
        for (int64_t k = 0; k < len; k++) z[k] = zp[k * zs];
        for (int64_t k = len; k < c->kpad; k++) z[k] = 0;
    }
    for (int64_t k = 0; k < c->kpad; k += W) {
        const V xv = *(const V *)(x + k);
        const V dv = in->softplus ? FN(ps_sel_softplus)(xv) : xv;
        *(V *)(dt + k) = dv;
        *(V *)(du + k) = dv * *(const V *)(u + k);
    }
}

/* ---- the real state: the N lanes of h in nv vectors ------------------------- */

/* Steps 0 .. len - 1 from h (nv vectors, updated): p[t] = C[t] h[t] lane by lane;
 * hs/da, when given, receive h[t] in row t + 1 and exp(dt[t] A) in row t. B and C
 * advance bstep and cstep vectors a step (0: invariant). nonpos: every dt[t] A is
 * at most 0, none NaN (ps_sel_nonpos). */
PS_MATH void FN(ps_sel_steps)(int64_t len, const int64_t nv, const int nonpos,
                              const T *restrict dt,
                              const T *restrict du, const V *restrict a,
                              const V *restrict bv, int64_t bstep, const V *restrict cv,
                              int64_t cstep, V *restrict h, V *restrict p, V *restrict hs,
                              V *restrict da) {
    for (int64_t t = 0; t < len; t++) {
        const V dtv = SPLAT(dt[t]), duv = SPLAT(du[t]);
        const V *bt = bv + t * bstep, *ct = cv + t * cstep;
        V acc = SPLAT(0);
        for (int64_t j = 0; j < nv; j++) {
            const V x = dtv * a[j];
            const V e = nonpos ? FN(ps_vexp_nonpos)(x) : FN(ps_vexp)(x);
            h[j] = e * h[j] + duv * bt[j];
            acc = j == 0 ? ct[0] * h[0] : acc + ct[j] * h[j];
            if (da) da[t * nv + j] = e, hs[(t + 1) * nv + j] = h[j];
        }
        p[t] = acc;
    }
}

/* The adjoint sweep over steps len - 1 .. 0 (hs[t] = h[t-1], da[t] = exp(dt[t] A)):
 *   g_h[t]  = C[t] g[t] + gh     (gh: exp(dt[t+1] A) g_h[t+1], carried; updated)
 *   gw      = g_h[t] (exp(dt[t] A) h[t-1])    (the gradient of dt[t] A)
 *   g_A    += gw dt[t];   pa[t] = gw A;   pb[t] = g_h[t] B[t]   (lane by lane)
 *   g_B[t] += g_h[t] du[t];   g_C[t] += g[t] h[t]
 * gb and gc advance gbstep and gcstep vectors a step (0: one running sum).
 * Where a decay may exceed 1 (not nonpos: a growing state, dt A > 0), gw multiplies
 * g_h[t] by exp(dt A) h[t-1], a term of h[t] that the forward computes too (finite
 * where h[t] is), never by g_h[t] exp(dt A) first: that product can overflow where
 * h[t-1] is 0 (no state yet), and inf * 0 made gw NaN where the loop's is finite.
 * (The carried exp(dt A) g_h[t] overflows there, as the loop's gradient of h[t-1]
 * does.) With every decay at most 1 (nonpos, ps_sel_nonpos: the normal regime)
 * g_h[t] exp(dt A) cannot overflow, and gw reuses it, one multiply fewer. */
PS_MATH void FN(ps_sel_sweep)(int64_t len, const int64_t nv, const int nonpos,
                              const T *restrict dt,
                              const T *restrict du, const T *restrict g,
                              const V *restrict a, const V *restrict bv, int64_t bstep,
                              const V *restrict cv, int64_t cstep, const V *restrict hs,
                              const V *restrict da, V *restrict gh, V *restrict ga,
                              V *restrict gb, int64_t gbstep, V *restrict gc,
                              int64_t gcstep, V *restrict pa, V *restrict pb) {
    for (int64_t t = len - 1; t >= 0; t--) {
        const V dtv = SPLAT(dt[t]), duv = SPLAT(du[t]);
        const V gv = SPLAT(g[t]);
        const V *bt = bv + t * bstep, *ct = cv + t * cstep;
        V *gbt = gb + t * gbstep, *gct = gc + t * gcstep;
        V acca = SPLAT(0), accb = acca;
        for (int64_t j = 0; j < nv; j++) {
            const V e = da[t * nv + j];
            const V ghj = ct[j] * gv + gh[j];
            const V ghe = ghj * e;
            const V gw = nonpos ? ghe * hs[t * nv + j] : ghj * (e * hs[t * nv + j]);
            ga[j] = ga[j] + gw * dtv;
            acca = j == 0 ? gw * a[0] : acca + gw * a[j];
            accb = j == 0 ? ghj * bt[0] : accb + ghj * bt[j];
            gbt[j] = gbt[j] + ghj * duv;
            gct[j] = gct[j] + gv * hs[(t + 1) * nv + j];
            gh[j] = ghe;
        }
        pa[t] = acca;
        pb[t] = accb;
    }
}

/* ps_sel_sweep where a decay may exceed 1 (a growing state), out of line: the normal
 * regime's code in ps_sel_bwd_chunk stays as it was, its sweep inlined for each small
 * nv (PS_SEL_BY_NV). */
PS_HOT __attribute__((noinline)) static void FN(ps_sel_sweep_growing)(
    const CTX *c, const SCRATCH *s, int64_t len, const T *dt, const T *du, const T *g,
    const T *bv, int64_t bstep, const T *cv, int64_t cstep, T *gh, T *ga, T *gb,
    int64_t gbstep, T *gc, int64_t gcstep) {
    FN(ps_sel_sweep)(len, c->nv, 0, dt, du, g, (const V *)s->a, (const V *)bv, bstep / W,
                     (const V *)cv, cstep / W, (const V *)s->hs, (const V *)s->da, (V *)gh,
                     (V *)ga, (V *)gb, gbstep / W, (V *)gc, gcstep / W, s->pa, s->pb);
}

/* Calls ps_sel_steps / ps_sel_sweep with nv a constant where it is small, so that
 * the state stays in registers. */
#define PS_SEL_BY_NV(nv, CALL)                     \
    switch (nv) {                                  \
        case 1: CALL(1); break;                    \
        case 2: CALL(2); break;                    \
        case 3: CALL(3); break;                    \
        case 4: CALL(4); break;                    \
        default: CALL(nv); break;                  \
    }

/* STMT with the chunk's nv = NV state vectors at hv through hp: a local copy (kept in
 * registers) when NV is a small constant, copied back after; else hv itself. */
#define PS_SEL_STATE_IN_REGISTERS(NV, hv, hp, STMT)                                        \
    do {                                                                                  \
        V hl_[(NV) <= 4 ? (NV) : 1];                                                      \
        V *hp = (NV) <= 4 ? hl_ : (hv);                                                   \
        if ((NV) <= 4)                                                                    \
            for (int64_t j_ = 0; j_ < (NV); j_++) hl_[j_] = (hv)[j_];                     \
        STMT;                                                                             \
        if ((NV) <= 4)                                                                    \
            for (int64_t j_ = 0; j_ < (NV); j_++) (hv)[j_] = hl_[j_];                     \
    } while (0)

/* Whether every dt[t] A[n] of a chunk is at most 0 and not NaN: 0 <= dt < inf and
 * -inf < A <= 0 (the padding lanes of A are 0). */
static inline int FN(ps_sel_nonpos)(const T *dt, int64_t len, const T *a, int64_t npad) {
    int ok = 1;
    for (int64_t k = 0; k < len; k++) ok &= dt[k] >= 0 && dt[k] < (T)INFINITY;
    for (int64_t n = 0; n < npad; n++) ok &= a[n] <= 0 && a[n] > -(T)INFINITY;
    return ok;
}

/* ---- the complex state (planar rows of S = 2 npad), scalar ---------------------- */

/* As ps_sel_steps: y[t] = 2 Re sum_n C[t, n] h[t, n]. */
static inline void FN(ps_sel_csteps)(const CTX *c, int64_t len, const T *dt, const T *du,
                                     const T *a, const T *bv, int64_t bstep, const T *cv,
                                     int64_t cstep, T *h, T *y, T *hs, T *da) {
    const int64_t N = c->in->nstate, np = c->npad, S = c->S;
    for (int64_t t = 0; t < len; t++) {
        const T *bt = bv + t * bstep, *ct = cv + t * cstep;
        T acc = 0;
        for (int64_t n = 0; n < N; n++) {
            const T m = EXP(dt[t] * a[n]), ai = dt[t] * a[np + n];
            const T er = m * COS(ai), ei = m * SIN(ai);
            const T hr = h[n], hi = h[np + n];
            const T nr = (er * hr - ei * hi) + du[t] * bt[n];
            const T ni = (er * hi + ei * hr) + du[t] * bt[np + n];
            h[n] = nr, h[np + n] = ni;
            acc = acc + (ct[n] * nr - ct[np + n] * ni);
            if (da) da[t * S + n] = er, da[t * S + np + n] = ei;
        }
        if (hs) memcpy(hs + (t + 1) * S, h, (size_t)S * sizeof(T));
        y[t] = 2 * acc;
    }
}

/* As ps_sel_sweep, in complex arithmetic with torch's conjugate convention:
 *   g_h = 2 g conj(C) + gh,   gw = g_h conj(exp(dt A) h[t-1]),   g_A += gw dt,
 *   g_dtA[t] = sum Re(gw conj(A)),   g_du[t] = sum Re(g_h conj(B)),
 *   g_B += g_h du,   g_C += 2 g conj(h[t]),   gh = conj(exp(dt A)) g_h. */
static inline void FN(ps_sel_csweep)(const CTX *c, int64_t len, const T *dt, const T *du,
                                     const T *g, const T *a, const T *bv, int64_t bstep,
                                     const T *cv, int64_t cstep, const T *hs, const T *da,
                                     T *gh, T *ga, T *gb, int64_t gbstep, T *gc,
                                     int64_t gcstep, T *gda, T *gdu) {
    const int64_t N = c->in->nstate, np = c->npad, S = c->S;
    for (int64_t t = len - 1; t >= 0; t--) {
        const T *bt = bv + t * bstep, *ct = cv + t * cstep;
        const T *hp = hs + t * S, *hn = hs + (t + 1) * S, *e = da + t * S;
        T *gbt = gb + t * gbstep, *gct = gc + t * gcstep;
        const T g2 = 2 * g[t];
        T acca = 0, accb = 0;
        for (int64_t n = 0; n < N; n++) {
            const T ghr = ct[n] * g2 + gh[n], ghi = gh[np + n] - ct[np + n] * g2;
            const T er = e[n], ei = e[np + n];
            const T pr = er * hp[n] - ei * hp[np + n], pi = er * hp[np + n] + ei * hp[n];
            const T gwr = ghr * pr + ghi * pi, gwi = ghi * pr - ghr * pi;
            ga[n] = ga[n] + gwr * dt[t];
            ga[np + n] = ga[np + n] + gwi * dt[t];
            acca = acca + (gwr * a[n] + gwi * a[np + n]);
            accb = accb + (ghr * bt[n] + ghi * bt[np + n]);
            gbt[n] = gbt[n] + ghr * du[t];
            gbt[np + n] = gbt[np + n] + ghi * du[t];
            gct[n] = gct[n] + g2 * hn[n];
            gct[np + n] = gct[np + n] - g2 * hn[np + n];
            gh[n] = er * ghr + ei * ghi;
            gh[np + n] = er * ghi - ei * ghr;
        }
        gda[t] = acca;
        gdu[t] = accb;
    }
}

/* ---- the forward ---------------------------------------------------------------- */

/* One channel's chunk: steps t0 .. t0 + len - 1 from the state h (updated), out;
 * bvar and cvar: the chunk's rows of variable B and C. */
PS_HOT static void FN(ps_sel_fwd_chunk)(const CTX *c, SCRATCH *s, int64_t b, int64_t d,
                                        int64_t t0, int64_t len, T *h, const T *bvar,
                                        const T *cvar) {
    const ps_selective_operands *in = c->in;
    T D, bias;
    FN(ps_sel_channel_params)(c, s, d, &D, &bias);
    FN(ps_sel_prepass)(c, s, b, d, t0, len, bias);
    const T *bv = c->bper ? bvar : s->binv, *cv = c->cper ? cvar : s->cinv;
    const int64_t bstep = c->bper ? c->S : 0, cstep = c->cper ? c->S : 0;
    const T *dt = s->row[FN(PS_SEL_DT)], *du = s->row[FN(PS_SEL_DU)];
    T *y = s->row[FN(PS_SEL_Y)];
    if (c->cplx) {
        FN(ps_sel_csteps)(c, len, dt, du, s->a, bv, bstep, cv, cstep, h, y, NULL, NULL);
        for (int64_t k = len; k < c->kpad; k++) y[k] = 0;
    } else {
        const int64_t nv = c->nv;
        const int nonpos = FN(ps_sel_nonpos)(dt, len, s->a, c->npad);
        V *hv = (V *)h;
#define PS_SEL_FWD_CALL(NV)                                                               \
    PS_SEL_STATE_IN_REGISTERS(                                                            \
        NV, hv, hp,                                                                       \
        if (nonpos)                                                                       \
            FN(ps_sel_steps)(len, NV, 1, dt, du, (const V *)s->a, (const V *)bv,          \
                             bstep / W, (const V *)cv, cstep / W, hp, s->p, NULL, NULL);  \
        else                                                                              \
            FN(ps_sel_steps)(len, NV, 0, dt, du, (const V *)s->a, (const V *)bv,          \
                             bstep / W, (const V *)cv, cstep / W, hp, s->p, NULL, NULL))
        PS_SEL_BY_NV(nv, PS_SEL_FWD_CALL)
#undef PS_SEL_FWD_CALL
        for (int64_t t = len; t < c->kpad; t++) s->p[t] = SPLAT(0);
        FN(ps_sel_lane_sums_rows)(s->p, y, c->kpad);
    }
    const T *u = s->row[FN(PS_SEL_U)], *z = s->row[FN(PS_SEL_Z)];
    for (int64_t k = 0; k < c->kpad; k += W) {
        V o = *(const V *)(y + k);
        if (in->D) o = o + *(const V *)(u + k) * D;
        if (in->z) {
            const V zv = *(const V *)(z + k);
            o = o * (zv * FN(ps_vsigmoid)(zv));
        }
        *(V *)(y + k) = o;
    }
    const ps_selective_fwd_args *f = c->fwd;
    T *out = PS_SEL_ROW_W(f->out, f->out_stride, b, d, t0);
    for (int64_t k = 0; k < len; k++) out[k * f->out_stride[2]] = y[k];
}

/* Work unit u: batch element *b and channels [*d0, *d1), inside one segment (inside
 * one group of each shared B and C). */
static inline void FN(ps_sel_unit)(const CTX *c, int64_t u, int64_t *b, int64_t *d0,
                                   int64_t *d1) {
    const int64_t per_b = c->nseg * c->upseg, sg = (u % per_b) / c->upseg;
    *b = u / per_b;
    *d0 = sg * c->seg + (u % c->upseg) * c->unit;
    *d1 = *d0 + c->unit < (sg + 1) * c->seg ? *d0 + c->unit : (sg + 1) * c->seg;
}

/* Steps t0 .. t0 + len - 1 of variable B and C, for the group of channel d of batch
 * element b: the shared ones (own == 0: once for a unit) or the ones whose groups
 * are single channels (own == 1: for each channel). */
static void FN(ps_sel_pack)(const CTX *c, SCRATCH *s, int64_t own, int64_t b, int64_t d,
                            int64_t t0, int64_t len) {
    const ps_selective_operands *in = c->in;
    if (c->bper && (c->bper == 1) == own)
        FN(ps_sel_pack_chunk)(c, s->bchunk, in->B, in->B_stride, in->B_complex, b,
                              d / c->bper, t0, len);
    if (c->cper && (c->cper == 1) == own)
        FN(ps_sel_pack_chunk)(c, s->cchunk, in->C, in->C_stride, in->C_complex, b,
                              d / c->cper, t0, len);
}

/* Whether the forward walks a span chunk by chunk across the unit's channels: where
 * u, delta or z reach the next channel in fewer elements than the next step (a
 * channel-last view, e.g. a slice of a transposed projection), a chunk's steps of
 * neighbouring channels share cache lines, which a walk down one channel's whole row
 * after another would fetch once per channel. Not when B or C is packed per channel
 * (a group of one channel: packed per channel and span). */
static int FN(ps_sel_chunk_major)(const CTX *c) {
    const ps_selective_operands *in = c->in;
    if (c->bper == 1 || c->cper == 1) return 0;
    const int64_t *rows[3] = {in->u_stride, in->delta_stride, in->z ? in->z_stride : NULL};
    for (int i = 0; i < 3; i++) {
        const int64_t *st = rows[i];
        if (st && st[2] != 1 && llabs(st[1]) < llabs(st[2])) return 1;
    }
    return 0;
}

/* Chunk ch of channel (b, d) from its state h: the checkpoint, then the steps (the
 * span's packed B and C rows start at step ts). */
static void FN(ps_sel_fwd_step_chunk)(const CTX *c, SCRATCH *s, int64_t b, int64_t d,
                                      int64_t ch, int64_t ts, T *h) {
    const ps_selective_fwd_args *f = c->fwd;
    const int64_t S = c->S, K = c->in->chunk, L = c->in->length;
    const int64_t t0 = ch * K, len = L - t0 < K ? L - t0 : K;
    FN(ps_sel_write_row)(PS_SEL_AT_W(f->checkpoints, b * f->checkpoints_stride[0] +
                                                         d * f->checkpoints_stride[1] +
                                                         ch * f->checkpoints_stride[2],
                                     c->cplx),
                         f->checkpoints_stride[3], c->cplx, h, c->in->nstate, c->npad);
    FN(ps_sel_fwd_chunk)(c, s, b, d, t0, len, h, c->bper ? s->bchunk + (t0 - ts) * S : NULL,
                         c->cper ? s->cchunk + (t0 - ts) * S : NULL);
}

static void FN(ps_sel_fwd_member)(const void *vc, int64_t member, int64_t size) {
    const CTX *c = (const CTX *)vc;
    const ps_selective_operands *in = c->in;
    const ps_selective_fwd_args *f = c->fwd;
    SCRATCH s = FN(ps_sel_scratch)(c, member);
    const int64_t S = c->S, N = in->nstate, K = in->chunk, L = in->length, cx = c->cplx;
    for (int64_t u = c->units * member / size; u < c->units * (member + 1) / size; u++) {
        int64_t b, d0, d1;
        FN(ps_sel_unit)(c, u, &b, &d0, &d1);
        for (int64_t d = d0; d < d1; d++)
            FN(ps_sel_read_row)(s.h + (d - d0) * S,
                                in->initial ? PS_SEL_AT(in->initial, b * in->initial_stride[0] +
                                                                         d * in->initial_stride[1],
                                                        cx)
                                            : NULL,
                                in->initial_stride[2], cx, N, c->npad, cx);
        /* a span at a time: its B and C packed once, then each channel's row read
         * from start to end (the prefetch asks for the next chunk's lines); or, where
         * the channels' rows interleave (ps_sel_chunk_major), a chunk at a time for
         * all the unit's channels, which share that chunk's lines */
        for (int64_t sp = 0; sp < c->nchunks; sp += c->span) {
            const int64_t sp1 = sp + c->span < c->nchunks ? sp + c->span : c->nchunks;
            const int64_t ts = sp * K, te = sp1 * K < L ? sp1 * K : L;
            FN(ps_sel_pack)(c, &s, 0, b, d0, ts, te - ts);
            if (FN(ps_sel_chunk_major)(c)) {
                for (int64_t ch = sp; ch < sp1; ch++)
                    for (int64_t d = d0; d < d1; d++)
                        FN(ps_sel_fwd_step_chunk)(c, &s, b, d, ch, ts, s.h + (d - d0) * S);
                continue;
            }
            for (int64_t d = d0; d < d1; d++) {
                T *h = s.h + (d - d0) * S;
                FN(ps_sel_pack)(c, &s, 1, b, d, ts, te - ts);
                for (int64_t ch = sp; ch < sp1; ch++) {
                    const int64_t t0 = ch * K;
                    if (ch + 1 < sp1) {
                        const int64_t t1 = t0 + K;
                        FN(ps_sel_prefetch)(c, 0, b, d, t1, L - t1 < K ? L - t1 : K);
                    } else if (d + 1 < d1) {
                        FN(ps_sel_prefetch)(c, 0, b, d + 1, ts, te - ts < K ? te - ts : K);
                    }
                    FN(ps_sel_fwd_step_chunk)(c, &s, b, d, ch, ts, h);
                }
            }
        }
        for (int64_t d = d0; d < d1; d++)
            FN(ps_sel_write_row)(PS_SEL_AT_W(f->final, b * f->final_stride[0] +
                                                           d * f->final_stride[1],
                                             cx),
                                 f->final_stride[2], cx, s.h + (d - d0) * S, N, c->npad);
    }
}

/* ---- the backward --------------------------------------------------------------- */

/* One channel's chunk (steps t0 .. t0 + len - 1), from the checkpoint of chunk ch;
 * bvar/cvar: the chunk's rows of variable B and C; gbrows/gcrows: the unit's sums of
 * the chunk's variable g_B / g_C (NULL: invariant, summed in the channel's running
 * sums `run`); (pd, pt): the channel and step of the chunk whose rows to prefetch on
 * the way (pd -1: none). */
PS_HOT static void FN(ps_sel_bwd_chunk)(const CTX *c, SCRATCH *s, int64_t b, int64_t d,
                                        int64_t ch, int64_t t0, int64_t len, T *run,
                                        const T *bvar, const T *cvar, T *gbrows, T *gcrows,
                                        int64_t pd, int64_t pt) {
    const ps_selective_operands *in = c->in;
    const ps_selective_bwd_args *g = c->bwd;
    const int64_t S = c->S, N = in->nstate, kpad = c->kpad, cx = c->cplx;
    T D, bias;
    FN(ps_sel_channel_params)(c, s, d, &D, &bias);
    FN(ps_sel_prepass)(c, s, b, d, t0, len, bias);
    const T *bv = c->bper ? bvar : s->binv, *cv = c->cper ? cvar : s->cinv;
    const int64_t bstep = c->bper ? S : 0, cstep = c->cper ? S : 0;
    const T *dt = s->row[FN(PS_SEL_DT)], *du = s->row[FN(PS_SEL_DU)];
    const T *u = s->row[FN(PS_SEL_U)], *x = s->row[FN(PS_SEL_X)];
    const T *z = s->row[FN(PS_SEL_Z)];
    T *y = s->row[FN(PS_SEL_Y)], *gr = s->row[FN(PS_SEL_G)];
    T *gdu = s->row[FN(PS_SEL_GDU)], *gda = s->row[FN(PS_SEL_GDA)];
    T *gh = run, *ga = run + S, *gbinv = run + 2 * S, *gcinv = run + 3 * S;
    T *gdsum = run + 4 * S, *gbsum = gdsum + W;

    /* the chunk's grad_out; h[t0 - 1] from the checkpoint */
    const T *gop = PS_SEL_ROW(g->grad_out, g->grad_out_stride, b, d, t0);
    for (int64_t k = 0; k < len; k++) gr[k] = gop[k * g->grad_out_stride[2]];
    for (int64_t k = len; k < kpad; k++) gr[k] = 0;
    FN(ps_sel_read_row)(s->hs,
                        PS_SEL_AT(g->checkpoints, b * g->checkpoints_stride[0] +
                                                      d * g->checkpoints_stride[1] +
                                                      ch * g->checkpoints_stride[2],
                                  cx),
                        g->checkpoints_stride[3], cx, N, c->npad, cx);

    /* rebuild: the chunk's states, exp(dt A), and y where z needs it; nonpos: every
     * decay of the chunk is at most 1 (a real state) */
    const int nonpos = cx ? 0 : FN(ps_sel_nonpos)(dt, len, s->a, c->npad);
    if (cx) {
        T *h = s->h; /* the forward's unit states, free in the backward */
        memcpy(h, s->hs, (size_t)S * sizeof(T));
        FN(ps_sel_csteps)(c, len, dt, du, s->a, bv, bstep, cv, cstep, h, y, s->hs, s->da);
        for (int64_t k = len; k < kpad; k++) y[k] = 0;
    } else {
        const int64_t nv = c->nv;
        V *hs = (V *)s->hs, *da = (V *)s->da, *p = s->p; /* p unused without z */
#define PS_SEL_REBUILD_CALL(NV)                                                           \
    do {                                                                                  \
        V hl[NV];                                                                         \
        for (int64_t j = 0; j < (NV); j++) hl[j] = hs[j];                                 \
        if (nonpos)                                                                       \
            FN(ps_sel_steps)(len, NV, 1, dt, du, (const V *)s->a, (const V *)bv,          \
                             bstep / W, (const V *)cv, cstep / W, hl, p, hs, da);         \
        else                                                                              \
            FN(ps_sel_steps)(len, NV, 0, dt, du, (const V *)s->a, (const V *)bv,          \
                             bstep / W, (const V *)cv, cstep / W, hl, p, hs, da);         \
    } while (0)
        PS_SEL_BY_NV(nv, PS_SEL_REBUILD_CALL)
#undef PS_SEL_REBUILD_CALL
        if (in->z) {
            for (int64_t t = len; t < kpad; t++) s->p[t] = SPLAT(0);
            FN(ps_sel_lane_sums_rows)(s->p, y, kpad);
        }
    }

    const int64_t plen = in->length - pt < in->chunk ? in->length - pt : in->chunk;
    if (pd >= 0) FN(ps_sel_prefetch)(c, 1, b, pd, pt, plen);

    /* through silu(z) and D: gr becomes the gradient of y; g_z out; g_D summed */
    for (int64_t k = 0; k < kpad; k += W) {
        V gv = *(const V *)(gr + k);
        const V uv = *(const V *)(u + k);
        if (in->z) {
            const V zv = *(const V *)(z + k), sg = FN(ps_vsigmoid)(zv);
            V pre = *(const V *)(y + k);
            if (in->D) pre = pre + uv * D;
            const V one = SPLAT(1);
            *(V *)(y + k) = (gv * pre) * (sg * (one + zv * (one - sg))); /* g_z */
            gv = gv * (zv * sg);
            *(V *)(gr + k) = gv;
        }
        if (in->D) *(V *)gdsum = *(const V *)gdsum + gv * uv;
    }
    if (in->z) {
        T *gz = PS_SEL_ROW_W(g->grad_z, g->grad_z_stride, b, d, t0);
        for (int64_t k = 0; k < len; k++) gz[k * g->grad_z_stride[2]] = y[k];
    }

    /* the adjoint sweep */
    T *gb = gbrows ? gbrows : gbinv, *gc = gcrows ? gcrows : gcinv;
    const int64_t gbstep = gbrows ? S : 0, gcstep = gcrows ? S : 0;
    if (cx) {
        FN(ps_sel_csweep)(c, len, dt, du, gr, s->a, bv, bstep, cv, cstep, s->hs, s->da, gh,
                          ga, gb, gbstep, gc, gcstep, gda, gdu);
        for (int64_t k = len; k < kpad; k++) gda[k] = 0, gdu[k] = 0;
    } else {
        const int64_t nv = c->nv;
        V *ghv = (V *)gh;
#define PS_SEL_SWEEP_CALL(NV)                                                             \
    PS_SEL_STATE_IN_REGISTERS(                                                            \
        NV, ghv, hp,                                                                      \
        FN(ps_sel_sweep)(len, NV, 1, dt, du, gr, (const V *)s->a, (const V *)bv,          \
                         bstep / W, (const V *)cv, cstep / W, (const V *)s->hs,           \
                         (const V *)s->da, hp, (V *)ga, (V *)gb, gbstep / W, (V *)gc,     \
                         gcstep / W, s->pa, s->pb))
        if (nonpos) {
            PS_SEL_BY_NV(nv, PS_SEL_SWEEP_CALL)
        } else {
            FN(ps_sel_sweep_growing)(c, s, len, dt, du, gr, bv, bstep, cv, cstep, gh, ga, gb,
                                     gbstep, gc, gcstep);
        }
#undef PS_SEL_SWEEP_CALL
        for (int64_t t = len; t < kpad; t++)
            s->pa[t] = SPLAT(0), s->pb[t] = SPLAT(0);
        FN(ps_sel_lane_sums_rows)(s->pa, gda, kpad);
        FN(ps_sel_lane_sums_rows)(s->pb, gdu, kpad);
    }

    if (pd >= 0) FN(ps_sel_prefetch)(c, 2, b, pd, pt, plen);

    /* g_u, g_delta (in gdu, gda), g_delta_bias summed */
    for (int64_t k = 0; k < kpad; k += W) {
        const V gduv = *(const V *)(gdu + k);
        V gu = gduv * *(const V *)(dt + k);
        if (in->D) gu = gu + *(const V *)(gr + k) * D;
        V gdt = gduv * *(const V *)(u + k) + *(const V *)(gda + k);
        if (in->softplus) gdt = gdt * FN(ps_sel_softplus_grad)(*(const V *)(x + k));
        if (in->delta_bias) *(V *)gbsum = *(const V *)gbsum + gdt;
        *(V *)(gdu + k) = gu;
        *(V *)(gda + k) = gdt;
    }
    T *gup = PS_SEL_ROW_W(g->grad_u, g->grad_u_stride, b, d, t0);
    T *gxp = PS_SEL_ROW_W(g->grad_delta, g->grad_delta_stride, b, d, t0);
    for (int64_t k = 0; k < len; k++) gup[k * g->grad_u_stride[2]] = gdu[k];
    for (int64_t k = 0; k < len; k++) gxp[k * g->grad_delta_stride[2]] = gda[k];
}

/* The chunk's g_B or g_C of every (batch element, group) of member's share: the
 * sums of the units of the group in unit order (par: the chunk's parity). */
/* A channel's own g_B or g_C rows (span steps ts .. ts + len - 1) out to group d. */
static void FN(ps_sel_store_own)(const CTX *c, int64_t is_c, const T *rows, int64_t b,
                                 int64_t d, int64_t ts, int64_t len) {
    const ps_selective_operands *in = c->in;
    const ps_selective_bwd_args *g = c->bwd;
    const int64_t S = c->S, np = c->npad, dcx = is_c ? in->C_complex : in->B_complex;
    const int64_t *st = is_c ? g->grad_C_stride : g->grad_B_stride;
    for (int64_t n = 0; n < in->nstate; n++) {
        T *out = PS_SEL_AT_W(is_c ? g->grad_C : g->grad_B,
                             b * st[0] + d * st[1] + n * st[2] + ts * st[3], dcx);
        for (int64_t t = 0; t < len; t++) {
            if (dcx) {
                out[2 * t * st[3]] = rows[t * S + n];
                out[2 * t * st[3] + 1] = rows[t * S + np + n];
            } else {
                out[t * st[3]] = rows[t * S + n];
            }
        }
    }
}

/* The span's g_B or g_C of every (batch element, group) of member's share: the
 * sums of the units of the group, in unit order (par: the span's parity; its steps
 * ts .. ts + len - 1). */
static void FN(ps_sel_reduce_span)(const CTX *c, int64_t par, int64_t ts, int64_t len,
                                   int64_t member, int64_t size) {
    const ps_selective_operands *in = c->in;
    const ps_selective_bwd_args *g = c->bwd;
    const int64_t S = c->S, N = in->nstate, np = c->npad, rows = c->span * in->chunk;
    const int64_t gB = c->bshared ? in->B_groups : 0, gC = c->cshared ? in->C_groups : 0;
    const int64_t nb = in->batch * gB * N, items = nb + in->batch * gC * N;
    const int64_t per_unit = c->per_unit;
    for (int64_t it = items * member / size; it < items * (member + 1) / size; it++) {
        const int is_c = it >= nb;
        const int64_t r = is_c ? it - nb : it, groups = is_c ? gC : gB;
        const int64_t n = r % N, grp = (r / N) % groups, b = r / N / groups;
        const int64_t per = is_c ? c->cper : c->bper, spg = per / c->seg;
        const int64_t u0 = (b * c->nseg + grp * spg) * c->upseg, nu = spg * c->upseg;
        const T *base = c->partial + (par * c->units + u0) * per_unit +
                        (is_c && c->bshared ? rows * S : 0);
        const int64_t dcx = is_c ? in->C_complex : in->B_complex;
        const int64_t *st = is_c ? g->grad_C_stride : g->grad_B_stride;
        T *out = PS_SEL_AT_W(is_c ? g->grad_C : g->grad_B,
                             b * st[0] + grp * st[1] + n * st[2] + ts * st[3], dcx);
        for (int64_t t = 0; t < len; t++) {
            T re = 0, im = 0;
            for (int64_t k = 0; k < nu; k++) {
                re = re + base[k * per_unit + t * S + n];
                if (c->cplx) im = im + base[k * per_unit + t * S + np + n];
            }
            if (dcx) {
                out[2 * t * st[3]] = re;
                out[2 * t * st[3] + 1] = im;
            } else {
                out[t * st[3]] = re;
            }
        }
    }
}

static void FN(ps_sel_bwd_member)(const void *vc, int64_t member, int64_t size) {
    const CTX *c = (const CTX *)vc;
    const ps_selective_operands *in = c->in;
    const ps_selective_bwd_args *g = c->bwd;
    SCRATCH s = FN(ps_sel_scratch)(c, member);
    const int64_t S = c->S, N = in->nstate, K = in->chunk, L = in->length, cx = c->cplx;
    const int64_t np = c->npad, rows = c->span * K, per_unit = c->per_unit;
    const int64_t u0 = c->units * member / size, u1 = c->units * (member + 1) / size;
    const int64_t P = PS_SEL_PERSIST(S);

    /* the carried gradient of h starts as grad_final */
    for (int64_t u = u0; u < u1; u++) {
        int64_t b, d0, d1;
        FN(ps_sel_unit)(c, u, &b, &d0, &d1);
        for (int64_t d = d0; d < d1; d++)
            FN(ps_sel_read_row)(c->persist + (b * in->dim + d) * P,
                                PS_SEL_AT(g->grad_final, b * g->grad_final_stride[0] +
                                                             d * g->grad_final_stride[1],
                                          cx),
                                g->grad_final_stride[2], cx, N, np, cx);
    }
    /* spans from the last: each channel of a unit runs the span's chunks from its last
     * (its rows read backwards, a chunk's lines asked for one chunk ahead) */
    const int64_t nspans = (c->nchunks + c->span - 1) / c->span;
    for (int64_t si = nspans - 1; si >= 0; si--) {
        const int64_t sp = si * c->span, sp1 = sp + c->span < c->nchunks ? sp + c->span
                                                                         : c->nchunks;
        const int64_t ts = sp * K, te = sp1 * K < L ? sp1 * K : L, par = si & 1;
        for (int64_t u = u0; u < u1; u++) {
            int64_t b, d0, d1;
            FN(ps_sel_unit)(c, u, &b, &d0, &d1);
            FN(ps_sel_pack)(c, &s, 0, b, d0, ts, te - ts);
            T *part = c->partial ? c->partial + (par * c->units + u) * per_unit : NULL;
            if (part) memset(part, 0, (size_t)per_unit * sizeof(T));
            /* where each chunk's g_B and g_C rows go: the unit's sums (shared), the
             * channel's own rows (one channel a group), or nowhere (invariant: the
             * channel's running sums) */
            T *gbase = c->bshared ? part : c->bper ? s.gbown : NULL;
            T *gcase = c->cshared ? part + (c->bshared ? rows * S : 0) : c->cper ? s.gcown : NULL;
            for (int64_t d = d0; d < d1; d++) {
                FN(ps_sel_pack)(c, &s, 1, b, d, ts, te - ts);
                if (c->bper == 1) memset(s.gbown, 0, (size_t)(rows * S) * sizeof(T));
                if (c->cper == 1) memset(s.gcown, 0, (size_t)(rows * S) * sizeof(T));
                for (int64_t ch = sp1 - 1; ch >= sp; ch--) {
                    const int64_t t0 = ch * K, len = L - t0 < K ? L - t0 : K, o = t0 - ts;
                    int64_t pd = d, pt = t0 - K; /* the chunk after this one */
                    if (ch == sp) pd = d + 1 < d1 ? d + 1 : -1, pt = (sp1 - 1) * K;
                    if (pd >= 0) FN(ps_sel_prefetch)(c, 0, b, pd, pt, L - pt < K ? L - pt : K);
                    FN(ps_sel_bwd_chunk)(c, &s, b, d, ch, t0, len,
                                         c->persist + (b * in->dim + d) * P,
                                         c->bper ? s.bchunk + o * S : NULL,
                                         c->cper ? s.cchunk + o * S : NULL,
                                         gbase ? gbase + o * S : NULL,
                                         gcase ? gcase + o * S : NULL, pd, pt);
                }
                if (c->bper == 1) FN(ps_sel_store_own)(c, 0, s.gbown, b, d, ts, te - ts);
                if (c->cper == 1) FN(ps_sel_store_own)(c, 1, s.gcown, b, d, ts, te - ts);
            }
        }
        if (c->partial) {
            /* every unit's sums of this span are in; the next span writes the other
             * parity, and its barrier comes before this parity is written again */
            ps_team_barrier();
            FN(ps_sel_reduce_span)(c, par, ts, te - ts, member, size);
        }
    }
    for (int64_t u = u0; u < u1; u++) {
        int64_t b, d0, d1;
        FN(ps_sel_unit)(c, u, &b, &d0, &d1);
        if (g->grad_initial == NULL) break;
        for (int64_t d = d0; d < d1; d++)
            FN(ps_sel_write_row)(PS_SEL_AT_W(g->grad_initial, b * g->grad_initial_stride[0] +
                                                                  d * g->grad_initial_stride[1],
                                             cx),
                                 g->grad_initial_stride[2], cx,
                                 c->persist + (b * in->dim + d) * P, N, np);
    }
    ps_team_barrier(); /* every channel's running sums are complete */

    /* sums over the batch, in batch order, per channel of member's share */
    T *acc = s.a; /* S elements of scratch */
    for (int64_t d = in->dim * member / size; d < in->dim * (member + 1) / size; d++) {
        for (int64_t q = 1; q < 4; q++) {
            void *dst = q == 1 ? g->grad_A : q == 2 ? (c->bper ? NULL : g->grad_B)
                                                    : (c->cper ? NULL : g->grad_C);
            if (dst == NULL) continue;
            for (int64_t i = 0; i < S; i++) acc[i] = 0;
            for (int64_t b = 0; b < in->batch; b++) {
                const T *r = c->persist + (b * in->dim + d) * P + q * S;
                for (int64_t i = 0; i < S; i++) acc[i] = acc[i] + r[i];
            }
            const int64_t *st = q == 1 ? g->grad_A_stride : q == 2 ? g->grad_B_stride
                                                                   : g->grad_C_stride;
            const int64_t dcx = q == 1 ? cx : q == 2 ? in->B_complex : in->C_complex;
            FN(ps_sel_write_row)(PS_SEL_AT_W(dst, d * st[0], dcx), st[1], dcx, acc, N, np);
        }
        for (int64_t q = 0; q < 2; q++) {
            T *dst = (T *)(q == 0 ? g->grad_D : g->grad_delta_bias);
            if (dst == NULL) continue;
            T sum = 0;
            for (int64_t b = 0; b < in->batch; b++) {
                const T *r = c->persist + (b * in->dim + d) * P + 4 * S + q * W;
                T lanes = r[0];
                for (int i = 1; i < W; i++) lanes = lanes + r[i];
                sum = sum + lanes;
            }
            dst[d * (q == 0 ? g->grad_D_stride : g->grad_delta_bias_stride)] = sum;
        }
    }
}

/* ---- the entries ------------------------------------------------------------------ */

/* The call's geometry: 0, or non-zero for operands the kernel cannot take. */
static int FN(ps_sel_setup)(CTX *c, const ps_selective_operands *in, int64_t cplx) {
    memset(c, 0, sizeof *c);
    c->in = in;
    c->cplx = cplx;
    if (in->batch < 0 || in->dim < 0 || in->length < 0 || in->nstate < 0 || in->chunk < 1 ||
        in->chunk > PS_SEL_MAX_CHUNK || in->nstate > PS_SEL_MAX_STATE)
        return 1;
    if (in->B_groups < 0 || in->C_groups < 0 || (in->B_complex | in->C_complex) & ~INT64_C(1) ||
        (!cplx && (in->B_complex || in->C_complex)))
        return 1;
    if ((in->B_groups && in->dim % in->B_groups) || (in->C_groups && in->dim % in->C_groups))
        return 1;
    const double elems = (double)in->batch * (double)in->dim * (double)(in->length + 1) *
                         (double)(in->nstate + 1);
    if (elems > 0x1p60) return 1;
    c->npad = (in->nstate + W - 1) / W * W;
    if (c->npad == 0) c->npad = W;
    c->S = cplx ? 2 * c->npad : c->npad;
    c->nv = c->npad / W;
    c->kpad = (in->chunk + W - 1) / W * W;
    c->nchunks = (in->length + in->chunk - 1) / in->chunk;
    c->channels = in->batch * in->dim;
    c->bper = in->B_groups ? in->dim / in->B_groups : 0;
    c->cper = in->C_groups ? in->dim / in->C_groups : 0;
    if (c->channels == 0) return 0;
    /* segments: the largest runs of channels inside one group of each shared B and C
     * (a group of one channel is packed per channel, its gradient written directly) */
    c->bshared = c->bper > 1;
    c->cshared = c->cper > 1;
    int64_t seg = in->dim;
    if (c->bshared) seg = c->bper;
    if (c->cshared) {
        int64_t x = seg, y = c->cper;
        while (y) {
            const int64_t r = x % y;
            x = y, y = r;
        }
        seg = c->bshared ? x : c->cper;
    }
    c->seg = seg;
    c->nseg = in->dim / seg;
    return 0;
}

/* Units of `unit` channels (at most; the last of a segment may be shorter). */
static void FN(ps_sel_set_unit)(CTX *c, int64_t unit, int64_t span) {
    c->span = span < 1 ? 1 : span;
    if (unit > c->seg) unit = c->seg;
    if (unit < 1) unit = 1;
    c->unit = unit;
    c->upseg = (c->seg + unit - 1) / unit;
    c->units = c->in->batch * c->nseg * c->upseg;
}

/* Allocates what the call needs; 0, or 2 when memory is short. */
static int FN(ps_sel_alloc)(CTX *c, int64_t nthreads, T **block) {
    c->scratch_len = (FN(ps_sel_scratch_len)(c) + 15) / 16 * 16; /* 64-byte multiples */
    const int64_t parities = c->span < c->nchunks ? 2 : 1;
    c->per_unit = (c->bshared + c->cshared) * c->span * c->in->chunk * c->S;
    const int64_t partial = c->bwd ? parities * c->units * c->per_unit : 0;
    const int64_t persist = c->bwd ? c->channels * PS_SEL_PERSIST(c->S) : 0;
    const double total = (double)(nthreads * c->scratch_len + partial + persist);
    if (total * sizeof(T) > 0x1p46) return 2;
    const size_t bytes = ((size_t)total * sizeof(T) + 63) / 64 * 64;
    T *p = (T *)aligned_alloc(64, bytes > 0 ? bytes : 64);
    if (p == NULL) return 2;
    c->scratch = p;
    c->partial = partial ? p + nthreads * c->scratch_len : NULL;
    c->persist = persist ? p + nthreads * c->scratch_len + partial : NULL;
    if (persist) memset(c->persist, 0, (size_t)persist * sizeof(T));
    *block = p;
    return 0;
}

/* A fresh (batch, dim, length) output, when contiguous, backed by huge pages: one
 * page fault per 2 MiB as it is first written (parallel.h). */
static void FN(ps_sel_huge)(const CTX *c, void *ptr, const int64_t *st) {
    const ps_selective_operands *in = c->in;
    if (ptr && st[2] == 1 && st[1] == in->length && st[0] == in->dim * in->length)
        ps_prefer_huge_pages(ptr, c->channels * in->length * (int64_t)sizeof(T));
}

/* Threads for the work of a call: one below 2^15 state updates, at most one per
 * unit. */
static int64_t FN(ps_sel_threads)(const CTX *c) {
    const ps_selective_operands *in = c->in;
    int64_t n = in->nthreads;
    if ((double)c->channels * (double)in->length * (double)c->npad < 32768.0) n = 1;
    if (n > PS_MAX_THREADS) n = PS_MAX_THREADS;
    if (n > c->units) n = c->units;
    return n < 1 ? 1 : n;
}

static int FN(ps_sel_fwd)(const ps_selective_fwd_args *f, int64_t cplx) {
    CTX c;
    const ps_selective_operands *in = &f->in;
    int rc = FN(ps_sel_setup)(&c, in, cplx);
    if (rc != 0 || ps_sel_check_fwd(f)) return rc != 0 ? rc : 1;
    c.fwd = f;
    if (c.channels == 0) return 0;
    /* units: up to PS_SEL_FWD_UNIT channels, at least 4 per thread where there are
     * enough channels (a unit's results do not depend on its size) */
    int64_t unit = (c.channels + 4 * in->nthreads - 1) / (4 * (in->nthreads > 0 ? in->nthreads : 1));
    /* spans: the packed B and C of a span fill at most PS_SEL_SPAN_BYTES */
    int64_t span = c.nchunks;
    if (c.bper || c.cper) span = PS_SEL_SPAN_BYTES / (2 * c.S * (int64_t)sizeof(T) * in->chunk);
    FN(ps_sel_set_unit)(&c, unit < PS_SEL_FWD_UNIT ? unit : PS_SEL_FWD_UNIT,
                        span < c.nchunks ? span : c.nchunks);
    const int64_t nthreads = FN(ps_sel_threads)(&c);
    T *block;
    if ((rc = FN(ps_sel_alloc)(&c, nthreads, &block)) != 0) return rc;
    FN(ps_sel_huge)(&c, f->out, f->out_stride);
    ps_parallel_team(nthreads, FN(ps_sel_fwd_member), &c);
    free(block);
    return 0;
}

/* With no channel, the gradients of what channels share are zeros. */
static void FN(ps_sel_zero_sums)(const CTX *c) {
    const ps_selective_operands *in = c->in;
    const ps_selective_bwd_args *g = c->bwd;
    const int64_t N = in->nstate;
    for (int64_t q = 0; q < 2; q++) { /* variable B and C: (batch, G, N, L) */
        const int64_t groups = q == 0 ? in->B_groups : in->C_groups;
        const int64_t dcx = q == 0 ? in->B_complex : in->C_complex;
        const int64_t *st = q == 0 ? g->grad_B_stride : g->grad_C_stride;
        void *dst = q == 0 ? g->grad_B : g->grad_C;
        if (groups == 0 || dst == NULL) continue;
        for (int64_t b = 0; b < in->batch; b++)
            for (int64_t gr = 0; gr < groups; gr++)
                for (int64_t n = 0; n < N; n++)
                    for (int64_t t = 0; t < in->length; t++) {
                        T *e = PS_SEL_AT_W(dst, b * st[0] + gr * st[1] + n * st[2] + t * st[3],
                                           dcx);
                        e[0] = 0;
                        if (dcx) e[1] = 0;
                    }
    }
    for (int64_t d = 0; d < in->dim; d++) {
        for (int64_t q = 0; q < 3; q++) {
            void *dst = q == 0 ? g->grad_A : q == 1 ? (in->B_groups ? NULL : g->grad_B)
                                                    : (in->C_groups ? NULL : g->grad_C);
            if (dst == NULL) continue;
            const int64_t *st = q == 0 ? g->grad_A_stride : q == 1 ? g->grad_B_stride
                                                                   : g->grad_C_stride;
            const int64_t dcx = q == 0 ? c->cplx : q == 1 ? in->B_complex : in->C_complex;
            T *row = PS_SEL_AT_W(dst, d * st[0], dcx);
            for (int64_t n = 0; n < N; n++) {
                row[(dcx ? 2 : 1) * n * st[1]] = 0;
                if (dcx) row[2 * n * st[1] + 1] = 0;
            }
        }
        if (g->grad_D) ((T *)g->grad_D)[d * g->grad_D_stride] = 0;
        if (g->grad_delta_bias) ((T *)g->grad_delta_bias)[d * g->grad_delta_bias_stride] = 0;
    }
}

static int FN(ps_sel_bwd)(const ps_selective_bwd_args *g, int64_t cplx) {
    CTX c;
    const ps_selective_operands *in = &g->in;
    int rc = FN(ps_sel_setup)(&c, in, cplx);
    if (rc != 0 || ps_sel_check_bwd(g)) return rc != 0 ? rc : 1;
    c.bwd = g;
    if (c.channels == 0) {
        FN(ps_sel_zero_sums)(&c);
        return 0;
    }
    /* units from the shapes alone (never the thread count), so that every sum runs
     * in the same order with any number of threads: about PS_SEL_BWD_UNITS of them */
    FN(ps_sel_set_unit)(&c, (c.channels + PS_SEL_BWD_UNITS - 1) / PS_SEL_BWD_UNITS, 1);
    /* spans (a barrier each): as long as the units' sums of variable g_B and g_C fit
     * in PS_SEL_PARTIAL_BYTES (two spans' worth when there is more than one) and the
     * packed B and C in PS_SEL_SPAN_BYTES */
    int64_t span = c.nchunks;
    if (c.bper || c.cper) {
        const double chunk_bytes = (double)c.units * (double)(c.bshared + c.cshared) *
                                   (double)(in->chunk * c.S) * sizeof(T);
        if (chunk_bytes * (double)c.nchunks > PS_SEL_PARTIAL_BYTES)
            span = (int64_t)(PS_SEL_PARTIAL_BYTES / (2.0 * chunk_bytes));
        const int64_t most = PS_SEL_SPAN_BYTES / (2 * c.S * (int64_t)sizeof(T) * in->chunk);
        if (span > most) span = most;
    }
    FN(ps_sel_set_unit)(&c, c.unit, span < c.nchunks ? span : c.nchunks);
    const int64_t nthreads = FN(ps_sel_threads)(&c);
    T *block;
    if ((rc = FN(ps_sel_alloc)(&c, nthreads, &block)) != 0) return rc;
    FN(ps_sel_huge)(&c, g->grad_u, g->grad_u_stride);
    FN(ps_sel_huge)(&c, g->grad_delta, g->grad_delta_stride);
    if (in->z) FN(ps_sel_huge)(&c, g->grad_z, g->grad_z_stride);
    ps_parallel_team(nthreads, FN(ps_sel_bwd_member), &c);
    free(block);
    return 0;
}

PS_API int PS_CAT(ps_selective_fwd, SFX)(const ps_selective_fwd_args *f) {
    return FN(ps_sel_fwd)(f, 0);
}
PS_API int PS_CAT(ps_selective_fwd, CSFX)(const ps_selective_fwd_args *f) {
    return FN(ps_sel_fwd)(f, 1);
}
PS_API int PS_CAT(ps_selective_bwd, SFX)(const ps_selective_bwd_args *g) {
    return FN(ps_sel_bwd)(g, 0);
}
PS_API int PS_CAT(ps_selective_bwd, CSFX)(const ps_selective_bwd_args *g) {
    return FN(ps_sel_bwd)(g, 1);
}

/* The vector functions one by one, for tests of their accuracy:
 * which 0: exp, 1: softplus, 2: log1p (x >= 0), 3: sigmoid, 4: exp for x <= 0 (not
 * NaN). n any; 1 for another `which`. */
PS_API int PS_CAT(ps_selective_math, SFX)(int64_t which, const T *x, T *out, int64_t n) {
    if (which < 0 || which > 4 || n < 0) return 1;
    for (int64_t i = 0; i < n; i += W) {
        V v = SPLAT(0);
        for (int64_t j = 0; j < W && i + j < n; j++) v[j] = x[i + j];
        v = which == 0 ? FN(ps_vexp)(v)
            : which == 1 ? FN(ps_sel_softplus)(v)
            : which == 2 ? FN(ps_vlog1p)(v)
            : which == 3 ? FN(ps_vsigmoid)(v)
                         : FN(ps_vexp_nonpos)(v);
        for (int64_t j = 0; j < W && i + j < n; j++) out[i + j] = v[j];
    }
    return 0;
}

#undef FN
#undef CTX
#undef SCRATCH
#undef PS_SEL_SHUF
#undef PS_SEL_BY_NV
#undef PS_SEL_STATE_IN_REGISTERS
#undef PS_SEL_PERSIST
#undef PS_SEL_AT
#undef PS_SEL_AT_W
#undef PS_SEL_ROW
#undef PS_SEL_ROW_W
