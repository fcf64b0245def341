/* One instantiation of the SSD scan's CPU kernel (cpu.c explains the algorithm).
 * Included by cpu_instance.h once per (state type, instruction set) with:
 *   T        the scalar type (float, double)
 *   V        a GCC vector of W T's; VI the integer vector of the same shape (masks)
 *   W        lanes per vector; PB: vectors of headdim held in registers at once
 *   F(name)  the instantiation's name for `name`
 *   ATTR     the function attributes of the instruction set (target, fused
 *            multiply-adds) or nothing for the portable build
 *   LO       the lowest decay exponent (exp of it is a normal number)
 * Every tensor is contiguous in its canonical shape (ssd/cpu.py copies). The
 * state of a head lives transposed, hT[n][p] for p in headdim (padded with zero
 * lanes to Pv vectors of W), so that every product of a step is a vector over p
 * times a broadcast B[n] or C[n]: no lane sums in the forward at all. */
/* Lane sums and W x W transposes (F(ps_lane_sums), F(ps_lane_sums_n),
 * F(ps_transpose)), exp and sigmoid (F(ps_vexp), F(ps_vsigmoid)): from
 * _native/isa_instance.h. */

/* A (headdim, N) state at src (NULL: zeros) into hT lanes [j0 W, j1 W) (nj = j1 - j0
 * vectors a row), and back: W x W tiles transposed in registers (a checkpoint per K
 * steps and head, a state per packed sequence), the columns past the last whole tile
 * and lanes past headdim one at a time. */
ATTR static void F(ps_ssd_load_state)(V *st, const T *src, int64_t P, int64_t N, int64_t j0,
                                     int64_t nj) {
    for (int64_t i = 0; i < N * nj; ++i) st[i] = (V){0};
    if (!src) return;
    for (int64_t j = 0; j < nj; ++j) {
        const int64_t p0 = (j0 + j) * W, lanes = P - p0 < W ? P - p0 : W;
        int64_t n0 = 0;
        if (lanes == W)
            for (; n0 + W <= N; n0 += W) {
                V v[W];
                for (int l = 0; l < W; ++l) memcpy(&v[l], src + (p0 + l) * N + n0, sizeof(V));
                F(ps_transpose)(v);
                for (int i = 0; i < W; ++i) st[(n0 + i) * nj + j] = v[i];
            }
        for (int64_t l = 0; l < lanes; ++l)
            for (int64_t n = n0; n < N; ++n) st[n * nj + j][l] = src[(p0 + l) * N + n];
    }
}

ATTR static void F(ps_ssd_store_state)(T *dst, const V *st, int64_t P, int64_t N, int64_t j0,
                                      int64_t nj) {
    for (int64_t j = 0; j < nj; ++j) {
        const int64_t p0 = (j0 + j) * W, lanes = P - p0 < W ? P - p0 : W;
        int64_t n0 = 0;
        if (lanes == W)
            for (; n0 + W <= N; n0 += W) {
                V v[W];
                for (int i = 0; i < W; ++i) v[i] = st[(n0 + i) * nj + j];
                F(ps_transpose)(v);
                for (int l = 0; l < W; ++l) memcpy(dst + (p0 + l) * N + n0, &v[l], sizeof(V));
            }
        for (int64_t l = 0; l < lanes; ++l)
            for (int64_t n = n0; n < N; ++n) dst[(p0 + l) * N + n] = st[n * nj + j][l];
    }
}

/* row[j] = src[p] over lanes [j0 W, (j0 + nj) W), zero past P (one copy: the rows
 * then go through vector code only); and back, the lanes past P left out. */
ATTR static void F(ps_ssd_load)(V *row, const T *src, int64_t P, int64_t j0, int64_t nj) {
    const int64_t lo = j0 * W, hi = (j0 + nj) * W < P ? (j0 + nj) * W : P;
    if (hi < (j0 + nj) * W) row[nj - 1] = (V){0};
    if (hi > lo) memcpy(row, src + lo, sizeof(T) * (size_t)(hi - lo));
}

ATTR static void F(ps_ssd_store)(T *dst, const V *row, int64_t P, int64_t j0, int64_t nj) {
    const int64_t lo = j0 * W, hi = (j0 + nj) * W < P ? (j0 + nj) * W : P;
    if (hi > lo) memcpy(dst + lo, row, sizeof(T) * (size_t)(hi - lo));
}

/* The forward step of nb (a constant after inlining) vectors of one head, in full:
 *   hT[n] = a hT[n] + u B[n],   y = sum_n hT[n] C[n]   over n. */
ATTR static inline __attribute__((always_inline)) void F(ps_ssd_fwd_block)(
    V *st, int64_t stride, const V *u, V *y, const T *Bt, const T *Ct, T a, int64_t N,
    const int nb) {
    V uu[4], yy[4]; /* nb <= 4 */
    for (int k = 0; k < nb; ++k) { uu[k] = u[k]; yy[k] = (V){0}; }
    for (int64_t n = 0; n < N; ++n) {
        const T bn = Bt[n], cn = Ct[n];
        V *row = st + n * stride;
        for (int k = 0; k < nb; ++k) {
            const V hv = a * row[k] + uu[k] * bn;
            yy[k] += hv * cn;
            row[k] = hv;
        }
    }
    for (int k = 0; k < nb; ++k) y[k] = yy[k];
}

/* Two steps of nb (<= 4) vectors in one pass over the state (ps_ssd_fwd_task): for
 * step i of the two (w, B, C, d: w0, B0, C0, d0 or w1, B1, C1, d1)
 *   hT[n] = d hT[n] + w B[n]  (full: a constant flag)  or  hT[n] += w B[n],
 *   y = sum_n hT[n] C[n]. */
ATTR static inline __attribute__((always_inline)) void F(ps_ssd_fwd_two)(
    V *st, int64_t stride, const V *w0, const V *w1, V *y0, V *y1, const T *B0,
    const T *C0, const T *B1, const T *C1, T d0, T d1, int64_t N, const int full0,
    const int full1, const int nb) {
    V wa[4], wb[4], ya[4], yb[4];
    for (int k = 0; k < nb; ++k) {
        wa[k] = w0[k];
        wb[k] = w1[k];
        ya[k] = (V){0};
        yb[k] = (V){0};
    }
    for (int64_t n = 0; n < N; ++n) {
        const T b0 = B0[n], c0 = C0[n], b1 = B1[n], c1 = C1[n];
        V *row = st + n * stride;
        for (int k = 0; k < nb; ++k) {
            V h = row[k];
            h = full0 ? d0 * h + wa[k] * b0 : h + wa[k] * b0;
            ya[k] += h * c0;
            h = full1 ? d1 * h + wb[k] * b1 : h + wb[k] * b1;
            yb[k] += h * c1;
            row[k] = h;
        }
    }
    for (int k = 0; k < nb; ++k) { y0[k] = ya[k]; y1[k] = yb[k]; }
}

/* CALL(j, nb) over vectors [0, nj) of a row: blocks of `most` (<= 4) vectors, then one
 * of the rest, nb a constant after inlining. */
#define PS_SSD_BLOCKS(nj, most, CALL)                                   \
    do {                                                                \
        int64_t j_ = 0;                                                 \
        for (; j_ + (most) <= (nj); j_ += (most)) CALL(j_, most);      \
        switch ((nj) - j_) {                                            \
        case 3: CALL(j_, 3); break;                                     \
        case 2: CALL(j_, 2); break;                                     \
        case 1: CALL(j_, 1); break;                                     \
        default: break;                                                 \
        }                                                               \
    } while (0)

/* The backward's rebuild of a step, in place (st: the state before it on entry,
 * after it on return), with y (when wy: only z's gradient reads it) and the lane
 * vectors of grad_C, sc[n] += sum over p of gy[p] h[t][n][p]. */
ATTR static inline __attribute__((always_inline)) void F(ps_ssd_rec_block)(
    V *st, int64_t stride, const V *u, const V *gy, V *y, V *sc, const T *Bt, const T *Ct,
    T a, int64_t N, int first, int wy, const int nb) {
    V uu[PB], gg[PB], yy[PB];
    for (int k = 0; k < nb; ++k) { uu[k] = u[k]; gg[k] = gy[k]; yy[k] = (V){0}; }
    for (int64_t n = 0; n < N; ++n) {
        const T bn = Bt[n], cn = Ct[n];
        V *row = st + n * stride;
        V gc = {0};
        for (int k = 0; k < nb; ++k) {
            const V hv = a * row[k] + uu[k] * bn;
            if (wy) yy[k] += hv * cn; /* y only where z's gradient needs it */
            gc += gg[k] * hv;
            row[k] = hv;
        }
        sc[n] = first ? gc : sc[n] + gc;
    }
    for (int k = 0; k < nb; ++k) y[k] = yy[k];
}

/* The adjoint step of nb vectors: with G the adjoint of the state after step t
 * (g: a[t+1] G[t+1] on entry, or grad_final),
 *   G = g + gy C[n];  sb[n] += sum_p G u;  gu += G B[n];  g = a G.
 * The decay's gradient needs no state here (ps_ssd_bwd_chunk: from the lane sums). */
ATTR static inline __attribute__((always_inline)) void F(ps_ssd_adj_block)(
    V *g, int64_t stride, const V *u, const V *gy, V *gu, V *sb, const T *Bt, const T *Ct,
    T a, int64_t N, int first, const int nb) {
    V uu[PB], gg[PB], gs[PB];
    for (int k = 0; k < nb; ++k) { uu[k] = u[k]; gg[k] = gy[k]; gs[k] = (V){0}; }
    for (int64_t n = 0; n < N; ++n) {
        const T bn = Bt[n], cn = Ct[n];
        V *row = g + n * stride;
        V gb = {0};
        for (int k = 0; k < nb; ++k) {
            const V G = row[k] + gg[k] * cn;
            gb += G * uu[k];
            gs[k] += G * bn;
            row[k] = a * G;
        }
        sb[n] = first ? gb : sb[n] + gb;
    }
    for (int k = 0; k < nb; ++k) gu[k] = gs[k];
}

/* sum_n w[n] v[n] in double (the decay gradient's running sums, ps_ssd_bwd_chunk). */
ATTR static inline double F(ps_ssd_dot)(const T *w, const T *v, int64_t n) {
    double s = 0;
    for (int64_t i = 0; i < n; ++i) s += (double)w[i] * (double)v[i];
    return s;
}

/* <g, h> over a state: g transposed in vectors, h a (headdim, N) state in memory. */
ATTR static inline double F(ps_ssd_state_dot)(const V *g, const T *h, int64_t P, int64_t N,
                                         int64_t pv) {
    double s = 0;
    for (int64_t p = 0; p < P; ++p)
        for (int64_t n = 0; n < N; ++n) s += (double)g[n * pv + p / W][p % W] * h[p * N + n];
    return s;
}

/* q[t] = a[t] <G[t], h[t-1]> from g = a[t+1] G[t+1] (or grad_final) and the saved
 * h[t-1], both N x pv transposed vectors (zero lanes past headdim), taking
 * G[t] = g + gy[t] C[t] as ps_ssd_adj_block does. The sum is scaled by a[t] last: a
 * growing state's a[t] G[t] may overflow where q[t] fits. */
ATTR static inline double F(ps_ssd_exact_q)(const V *g, const V *h, const V *gy, const T *Ct,
                                           T a, int64_t N, int64_t pv) {
    V acc[4] = {{0}, {0}, {0}, {0}}; /* four chains: rows n, n + 1, n + 2, n + 3 */
    int64_t n = 0;
    for (; n + 4 <= N; n += 4)
        for (int k = 0; k < 4; ++k) {
            const T cn = Ct[n + k];
            const V *gr = g + (n + k) * pv, *hr = h + (n + k) * pv;
            for (int64_t j = 0; j < pv; ++j) acc[k] += (gr[j] + gy[j] * cn) * hr[j];
        }
    for (; n < N; ++n)
        for (int64_t j = 0; j < pv; ++j) acc[0] += (g[n * pv + j] + gy[j] * Ct[n]) * h[n * pv + j];
    const V v = (acc[0] + acc[1]) + (acc[2] + acc[3]);
    double s = 0;
    for (int l = 0; l < W; ++l) s += (double)v[l];
    return (double)a * s;
}

/* The decay of step (b, t) of head h: exp(max(dt A, LO)); *slope its derivative's
 * factor (0 where the floor holds). */
ATTR static inline T F(ps_ssd_decay)(T dtv, T A, T *slope) {
    const T e = dtv * A;
    const T a = EXP(e < LO ? LO : e);
    *slope = e < LO ? (T)0 : a;
    return a;
}

/* Ask for the cache lines of a row of P values `ahead` steps later (a unit's rows are
 * heads * headdim apart: further than the hardware prefetchers follow). */
ATTR static inline void F(ps_ssd_prefetch)(const T *row, int64_t P, int write) {
    for (int64_t i = 0; i < P; i += 64 / (int64_t)sizeof(T)) {
        if (write) __builtin_prefetch(row + i, 1, 3); else __builtin_prefetch(row + i, 0, 3);
    }
}

#define PS_SSD_AHEAD 4

/* ---- forward ---------------------------------------------------------------------- */

typedef struct {
    const ps_ssd_args *a;
    int64_t pv, split; /* vectors of headdim; units per head */
} F(ps_ssd_fwd_ctx);

/* Step t of batch row b, its rows of one head, lanes [j0 W, (j0 + nj) W): x into xv
 * and dt x into u; the rows PS_SSD_AHEAD steps on asked for. */
ATTR static inline void F(ps_ssd_fwd_in)(const ps_ssd_args *a, int64_t b, int64_t t, int64_t h,
                                        T dtv, int64_t j0, int64_t nj, V *xv, V *u) {
    const int64_t H = a->heads, P = a->headdim, bt = b * a->length + t;
    const T *xt = (const T *)a->x + (bt * H + h) * P;
    if (t + PS_SSD_AHEAD < a->length) {
        const int64_t ahead = PS_SSD_AHEAD * H * P;
        F(ps_ssd_prefetch)(xt + ahead, P, 0);
        F(ps_ssd_prefetch)((T *)a->out + (bt * H + h) * P + ahead, P, 1);
        if (a->z) F(ps_ssd_prefetch)((const T *)a->z + (bt * H + h) * P + ahead, P, 0);
    }
    F(ps_ssd_load)(xv, xt, P, j0, nj);
    for (int64_t j = 0; j < nj; ++j) u[j] = dtv * xv[j];
}

/* Step bt's output row from y, the state's contraction with C (times yscale):
 * (yscale y + D x) silu(z). zv: scratch. */
ATTR static inline void F(ps_ssd_fwd_out)(const ps_ssd_args *a, int64_t bt, int64_t h,
                                         int64_t j0, int64_t nj, T yscale, V *y,
                                         const V *xv, const V *dv, V *zv) {
    const int64_t H = a->heads, P = a->headdim;
    for (int64_t j = 0; j < nj; ++j) y[j] *= yscale;
    if (a->D)
        for (int64_t j = 0; j < nj; ++j) y[j] += dv[j] * xv[j];
    if (a->z) {
        F(ps_ssd_load)(zv, (const T *)a->z + (bt * H + h) * P, P, j0, nj);
        for (int64_t j = 0; j < nj; ++j) y[j] *= zv[j] * F(ps_vsigmoid)(zv[j]);
    }
    F(ps_ssd_store)((T *)a->out + (bt * H + h) * P, y, P, j0, nj);
}

/* Whether a step may leave the state scaled by `scale` (ps_ssd_fwd_task): 1 / scale
 * far from overflow and from 0 (a NaN fails too, and takes the full step). */
ATTR static inline int F(ps_ssd_scale_ok)(T scale) {
    return scale >= (T)SCALE_LO && scale <= (T)SCALE_HI;
}

/* One unit: its head's lanes [j0 W, j1 W), every sequence of batch row b.
 * The decays are kept out of the state where that is safe: st holds hT / scale, with
 * scale the product of the decays since the state was last true, so that a step is
 *     scale *= a;   hT[n] += (u / scale) B[n];   y = scale sum_n hT[n] C[n]
 * two fused multiply-adds an element against the full step's three operations
 * (hT[n] = a hT[n] + u B[n]). A step runs in full, with the decay scale a, which
 * folds the scale back into the state (scale = 1 after it), where the state it leaves
 * must be true (the step before a checkpoint, a sequence's last) or where the scale
 * would leave [SCALE_LO, SCALE_HI] (a strong decay; 1 / scale must stay finite).
 * Steps go two in one pass over the state (ps_ssd_fwd_two, any of the two scaled or
 * in full), which is what makes the scaled step pay: measured on Zen 5 (AVX-512),
 * a scaled step alone ran slower than a full one, two scaled steps in a pass of two
 * vectors a third faster than two full ones. The steps between checkpoints come in
 * pairs, so a step runs alone only where a checkpoint or a sequence's end follows
 * it, and then in full. */
ATTR static void F(ps_ssd_fwd_task)(const void *vp, int64_t begin, int64_t end) {
    const F(ps_ssd_fwd_ctx) *ctx = vp;
    const ps_ssd_args *a = ctx->a;
    const int64_t L = a->length, H = a->heads, P = a->headdim, N = a->nstate, K = a->chunk;
    const int64_t G = a->groups, nc = (L + K - 1) / K;
    const T *dt = a->dt, *A = a->A, *B = a->B, *C = a->C, *D = a->D;
    const T *init = a->initial;
    T *final = a->final, *ckpt = a->checkpoints;
    const int64_t most = (ctx->pv + ctx->split - 1) / ctx->split;
    V *st = ps_ssd_alloc(sizeof(V) * (size_t)(N * most + 8 * most + 1));
    if (!st) { __atomic_store_n(&((ps_ssd_args *)a)->failed, 1, __ATOMIC_RELAXED); return; }
    /* two steps' rows of dt x (then w), y and x; D; scratch */
    V *u0 = st + N * most, *u1 = u0 + most, *y0 = u1 + most, *y1 = y0 + most;
    V *x0 = y1 + most, *x1 = x0 + most, *dv = x1 + most, *zv = dv + most;
    for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t bh = unit / ctx->split, part = unit % ctx->split;
        const int64_t b = bh / H, h = bh % H, g = h / (H / G);
        const int64_t j0 = part * ctx->pv / ctx->split, j1 = (part + 1) * ctx->pv / ctx->split;
        const int64_t nj = j1 - j0;
        if (nj == 0) continue;
        if (D) F(ps_ssd_load)(dv, D + h * P, P, j0, nj);
        const int64_t local[2] = {0, L};
        const int64_t *cu = a->cu_seqlens ? a->cu_seqlens : local;
        const int64_t nseq = a->cu_seqlens ? a->nseq : 1;
        for (int64_t s = 0; s < nseq; ++s) {
            const int64_t sidx = a->cu_seqlens ? s : b, stop = cu[s + 1];
            F(ps_ssd_load_state)(st, init ? init + (sidx * H + h) * P * N : NULL, P, N, j0, nj);
            T scale = 1; /* st holds hT / scale */
            for (int64_t t = cu[s]; t < stop;) {
                /* scale is 1 here: the step before a checkpoint runs in full */
                if (t % K == 0)
                    F(ps_ssd_store_state)(ckpt + ((b * nc + t / K) * H + h) * P * N, st, P, N,
                                          j0, nj);
                const int64_t bt = b * L + t;
                const T dt0 = dt[bt * H + h];
                T slope;
                T sc0 = scale * F(ps_ssd_decay)(dt0, A[h], &slope);
                const T *B0 = B + (bt * G + g) * N, *C0 = C + (bt * G + g) * N;
                F(ps_ssd_fwd_in)(a, b, t, h, dt0, j0, nj, x0, u0);
                if (t + 1 == stop || (t + 1) % K == 0) { /* alone, in full */
#define PS_SSD_ONE(j, nb) \
    F(ps_ssd_fwd_block)(st + (j), nj, u0 + (j), y0 + (j), B0, C0, sc0, N, nb)
                    PS_SSD_BLOCKS(nj, PB, PS_SSD_ONE);
#undef PS_SSD_ONE
                    F(ps_ssd_fwd_out)(a, bt, h, j0, nj, 1, y0, x0, dv, zv);
                    scale = 1;
                    t += 1;
                    continue;
                }
                /* steps t and t + 1: each scaled (w = u / scale, d unused, y times the
                 * scale) or in full (w = u, d the decay times the scale, y as is) */
                const int full0 = !F(ps_ssd_scale_ok)(sc0);
                const T d0 = sc0;
                if (full0) sc0 = 1;
                else {
                    const T inv = (T)1 / sc0;
                    for (int64_t j = 0; j < nj; ++j) u0[j] *= inv;
                }
                const T dt1 = dt[(bt + 1) * H + h];
                T sc1 = sc0 * F(ps_ssd_decay)(dt1, A[h], &slope);
                const T *B1 = B0 + G * N, *C1 = C0 + G * N;
                F(ps_ssd_fwd_in)(a, b, t + 1, h, dt1, j0, nj, x1, u1);
                const int full1 = t + 2 == stop || (t + 2) % K == 0 || !F(ps_ssd_scale_ok)(sc1);
                const T d1 = sc1;
                if (full1) sc1 = 1;
                else {
                    const T inv = (T)1 / sc1;
                    for (int64_t j = 0; j < nj; ++j) u1[j] *= inv;
                }
#define PS_SSD_TWO(f0, f1, j, nb)                                                          \
    F(ps_ssd_fwd_two)(st + (j), nj, u0 + (j), u1 + (j), y0 + (j), y1 + (j), B0, C0, B1, C1, \
                      d0, d1, N, f0, f1, nb)
#define PS_SSD_CC(j, nb) PS_SSD_TWO(0, 0, j, nb)
#define PS_SSD_CF(j, nb) PS_SSD_TWO(0, 1, j, nb)
#define PS_SSD_FC(j, nb) PS_SSD_TWO(1, 0, j, nb)
#define PS_SSD_FF(j, nb) PS_SSD_TWO(1, 1, j, nb)
                /* two vectors a block: four ran slower */
                if (!full0 && !full1) PS_SSD_BLOCKS(nj, 2, PS_SSD_CC);
                else if (!full0) PS_SSD_BLOCKS(nj, 2, PS_SSD_CF);
                else if (!full1) PS_SSD_BLOCKS(nj, 2, PS_SSD_FC);
                else PS_SSD_BLOCKS(nj, 2, PS_SSD_FF);
#undef PS_SSD_TWO
#undef PS_SSD_CC
#undef PS_SSD_CF
#undef PS_SSD_FC
#undef PS_SSD_FF
                F(ps_ssd_fwd_out)(a, bt, h, j0, nj, sc0, y0, x0, dv, zv);
                F(ps_ssd_fwd_out)(a, bt + 1, h, j0, nj, sc1, y1, x1, dv, zv);
                scale = sc1;
                t += 2;
            }
            if (final) F(ps_ssd_store_state)(final + (sidx * H + h) * P * N, st, P, N, j0, nj);
        }
    }
    free(st);
}

ATTR static int F(ps_ssd_fwd)(ps_ssd_args *a) {
    const int64_t units = a->batch * a->heads, pv = (a->headdim + W - 1) / W;
    /* fewer heads than threads: each head's rows shared out (rows never interact) */
    const int64_t split = ps_split_units(units, pv, a->nthreads);
    F(ps_ssd_fwd_ctx) ctx = {a, pv, split};
    const int64_t work = a->batch * a->length * a->heads * a->headdim * (a->nstate + 1);
    ps_parallel_for(units * split, ps_threads_for(work / 16, a->nthreads), F(ps_ssd_fwd_task),
                    &ctx);
    return a->failed ? -1 : 0;
}

/* ---- backward --------------------------------------------------------------------- */

typedef struct {
    ps_ssd_args *a;
    int64_t pv, nc, span_lo, span_hi; /* the chunks of the current span */
    V *gstate;                        /* (units, N, pv): the adjoint carried between chunks */
    double *carry;                    /* (units,): a[t] <G[t], h[t-1]> of the chunk after */
    double *gA;                       /* (units,): partial sums, in double (terms cancel) */
    T *gD;                            /* (units, pv W): partial sums */
    T *pB, *pC;                       /* (units, span steps, N): per-head grad_B, grad_C */
    int64_t span_steps;
    int64_t next; /* the next unit of the span to take (ps_ssd_bwd_task) */
} F(ps_ssd_bwd_ctx);

/* The packed sequence holding step t: the last s with cu[s] <= t. */
ATTR static inline int64_t F(ps_ssd_seq_of)(const int64_t *cu, int64_t nseq, int64_t t) {
    int64_t lo = 0, hi = nseq; /* cu[lo] <= t < cu[hi] */
    while (hi - lo > 1) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (cu[mid] <= t) lo = mid; else hi = mid;
    }
    return lo;
}

/* Per-thread buffers of the backward (ps_ssd_bwd_task): the rebuilt state, K saved
 * states (ps_ssd_bwd_chunk), 3 K rows (u, gy, x) and 6 single rows (D, z, sigmoid(z),
 * scratch, grad_u, y), the lane sums; the per-step scalars. */
typedef struct {
    V *st, *saved, *rows, *sc;
    T *decay, *live;
    double *cdot, *qend;
    int64_t *sq;
    char *keep;
} F(ps_ssd_bwd_buf);

/* Below this decay a step's q[t] is taken exactly from its saved previous state: the
 * difference <G[t], h[t]> - bdot[t] loses about eps / a[t] of its relative accuracy. */
#define PS_SSD_EXACT_BELOW 0.5
/* Every this many steps of a chunk q[t] is taken exactly too: the running sum's
 * rounding, about eps |G| |h| a step, spans at most this many steps. A's gradient
 * against the float64 loop, float32, 200 seeds at (3, 64 or 200, 3 heads, 17, N 16),
 * its largest error over its largest element: every 64th step exact (the chunk's first
 * only), median 1.0e-6 and max 2.6e-5 (a fuzz case: 7e-5); every 16th, 4.7e-7 and
 * 1.0e-5; every 8th, 2.4e-7 and 4.6e-6 (the torch backend's chunked float32 form is as
 * accurate). An exact step costs a copy of the state in pass 1 and a read of it in
 * pass 2: every 8th made one backward at (1, 2048, 8, 64, N 64), one thread, about 10%
 * slower. */
#define PS_SSD_EXACT_EVERY 8

/* Chunk c of unit (b, h): pass 1 (forward) rebuilds the states from the checkpoint in
 * place, one at a time, with grad_C and grad_z; pass 2 (backward) runs the adjoint
 * recurrence with every other gradient. The decay's gradient needs
 * q[t] = a[t] <G[t], h[t-1]>, which would cost a multiply-add per state element and
 * step and every state of the chunk kept for pass 2. It follows from sums both passes
 * have at hand instead: with cdot[t] = <C[t], grad_C[t]> = <G[t] - a[t+1] G[t+1], h[t]>
 * and bdot[t] = <B[t], grad_B[t]> = <G[t], h[t] - a[t] h[t-1]>,
 *     q[t] = <G[t], h[t]> - bdot[t],   <G[t], h[t]> = q[t+1] + cdot[t],
 * and <G[t], h[t]> = <grad_final, h[t]> + cdot[t] at a sequence's last step. The
 * difference cancels where a[t] h[t-1] is small against B[t] u[t]: there (a sequence's
 * first step, a decay below PS_SSD_EXACT_BELOW) and every PS_SSD_EXACT_EVERY steps
 * from the chunk's first, pass 1 saves h[t-1] and pass 2 takes q[t] exactly, which
 * also restarts the running sum (in double). A's gradient sums q[t] dt[t] in double. */
ATTR static void F(ps_ssd_bwd_chunk)(const F(ps_ssd_bwd_ctx) *ctx, int64_t b, int64_t h,
                                    int64_t c, const F(ps_ssd_bwd_buf) *buf) {
    ps_ssd_args *a = ctx->a;
    const int64_t L = a->length, H = a->heads, P = a->headdim, N = a->nstate, K = a->chunk;
    const int64_t G = a->groups, pv = ctx->pv, unit = b * H + h, g = h / (H / G);
    const T *x = a->x, *dt = a->dt, *A = a->A, *B = a->B, *C = a->C, *D = a->D, *z = a->z;
    const T *init = a->initial, *go = a->grad_out, *gfin = a->grad_final;
    const int64_t t0 = c * K, t1 = t0 + K < L ? t0 + K : L, len = t1 - t0;
    const int64_t local[2] = {0, L};
    const int64_t *cu = a->cu_seqlens ? a->cu_seqlens : local;
    const int64_t nseq = a->cu_seqlens ? a->nseq : 1;
    const int64_t ss = N * pv; /* a state's vectors */
    V *st = buf->st, *sc = buf->sc, *rows = buf->rows, *saved = buf->saved;
    V *u = rows, *gy = rows + K * pv, *xr = rows + 2 * K * pv, *dv = rows + 3 * K * pv;
    V *zv = dv + pv, *ov = zv + pv, *gxv = ov + pv, *gu = gxv + pv, *yv = gu + pv;
    T *decay = buf->decay, *live = buf->live;
    double *cdot = buf->cdot, *qend = buf->qend;
    int64_t *sq = buf->sq;
    char *keep = buf->keep;
    if (D) F(ps_ssd_load)(dv, D + h * P, P, 0, pv);
    T *pB = ctx->pB + (unit * ctx->span_steps + (t0 - ctx->span_lo * K)) * N;
    T *pC = ctx->pC + (unit * ctx->span_steps + (t0 - ctx->span_lo * K)) * N;
    const T *ck = (const T *)a->checkpoints + ((b * ctx->nc + c) * H + h) * P * N;
    F(ps_ssd_load_state)(st, ck, P, N, 0, pv);
    int64_t s = F(ps_ssd_seq_of)(cu, nseq, t0);
    for (int64_t i = 0; i < len; ++i) {
        const int64_t t = t0 + i, bt = b * L + t;
        while (t >= cu[s + 1]) ++s;
        sq[i] = s;
        const int64_t sidx = a->cu_seqlens ? s : b;
        if (i > 0 && t == cu[s])
            F(ps_ssd_load_state)(st, init ? init + (sidx * H + h) * P * N : NULL, P, N, 0, pv);
        const T dtv = dt[bt * H + h];
        T slope;
        decay[i] = F(ps_ssd_decay)(dtv, A[h], &slope);
        live[i] = slope != 0 ? (T)1 : (T)0;
        /* 2: h[t-1] is zeros (a sequence's start without an initial state): q[t] = 0 */
        keep[i] = t == cu[s] && !init ? 2
                  : i % PS_SSD_EXACT_EVERY == 0 || t == cu[s] ||
                        (slope != 0 && decay[i] < (T)PS_SSD_EXACT_BELOW);
        if (keep[i] == 1) memcpy(saved + i * ss, st, sizeof(V) * (size_t)ss);
        const T *xt = x + (bt * H + h) * P, *gt = go + (bt * H + h) * P;
        const T *zt = z ? z + (bt * H + h) * P : NULL;
        if (t + PS_SSD_AHEAD < L) {
            const int64_t ahead = PS_SSD_AHEAD * H * P;
            F(ps_ssd_prefetch)(xt + ahead, P, 0);
            F(ps_ssd_prefetch)(gt + ahead, P, 0);
            if (z) F(ps_ssd_prefetch)(zt + ahead, P, 0);
        }
        F(ps_ssd_load)(xr + i * pv, xt, P, 0, pv);
        for (int64_t jj = 0; jj < pv; ++jj) u[i * pv + jj] = dtv * xr[i * pv + jj];
        F(ps_ssd_load)(gy + i * pv, gt, P, 0, pv);
        if (z) {
            F(ps_ssd_load)(zv, zt, P, 0, pv);
            for (int64_t jj = 0; jj < pv; ++jj) {
                const V sg = F(ps_vsigmoid)(zv[jj]);
                ov[jj] = sg; /* held until y is known */
                gy[i * pv + jj] *= zv[jj] * sg;
            }
        }
        const T *Bt = B + (bt * G + g) * N, *Ct = C + (bt * G + g) * N;
        V *uu = u + i * pv, *gg = gy + i * pv;
        int64_t j = 0;
        for (; j + PB <= pv; j += PB)
            F(ps_ssd_rec_block)(st + j, pv, uu + j, gg + j, yv + j, sc, Bt, Ct, decay[i], N,
                                j == 0, z != NULL, PB);
        switch (pv - j) {
#if PB > 3
        case 3: F(ps_ssd_rec_block)(st + j, pv, uu + j, gg + j, yv + j, sc, Bt, Ct, decay[i], N,
                                    j == 0, z != NULL, 3); break;
#endif
#if PB > 2
        case 2: F(ps_ssd_rec_block)(st + j, pv, uu + j, gg + j, yv + j, sc, Bt, Ct, decay[i], N,
                                    j == 0, z != NULL, 2); break;
#endif
        case 1: F(ps_ssd_rec_block)(st + j, pv, uu + j, gg + j, yv + j, sc, Bt, Ct, decay[i], N,
                                    j == 0, z != NULL, 1); break;
        default: break;
        }
        F(ps_lane_sums_n)(sc, N, pC + i * N);
        cdot[i] = F(ps_ssd_dot)(Ct, pC + i * N, N);
        if (t == cu[s + 1] - 1)
            qend[i] = gfin ? F(ps_ssd_state_dot)(st, gfin + (sidx * H + h) * P * N, P, N, pv) : 0;
        if (z) { /* grad_z = grad_out (y + D x) sigmoid(z) (1 + z (1 - sigmoid(z))) */
            F(ps_ssd_load)(gxv, gt, P, 0, pv);
            const V one = (T)1 - (V){0};
            const V *xi = xr + i * pv;
            for (int64_t jj = 0; jj < pv; ++jj) {
                const V sg = ov[jj];
                V pre = yv[jj];
                if (D) pre += dv[jj] * xi[jj];
                gxv[jj] = gxv[jj] * pre * sg * (one + zv[jj] * (one - sg));
            }
            F(ps_ssd_store)((T *)a->grad_z + (bt * H + h) * P, gxv, P, 0, pv);
        }
    }
    V *gst = ctx->gstate + unit * ss;
    V *gD = (V *)ctx->gD + unit * pv;
    double q = ctx->carry[unit]; /* a[t+1] <G[t+1], h[t]> of the step after */
    for (int64_t i = len - 1; i >= 0; --i) {
        const int64_t t = t0 + i, bt = b * L + t;
        s = sq[i];
        const int64_t sidx = a->cu_seqlens ? s : b;
        const int last = t == cu[s + 1] - 1;
        if (last) F(ps_ssd_load_state)(gst, gfin ? gfin + (sidx * H + h) * P * N : NULL, P, N, 0, pv);
        const T *Bt = B + (bt * G + g) * N, *Ct = C + (bt * G + g) * N;
        V *uu = u + i * pv, *gg = gy + i * pv;
        const double qx = keep[i] == 1
            ? F(ps_ssd_exact_q)(gst, saved + i * ss, gg, Ct, decay[i], N, pv) : 0;
        int64_t j = 0;
        for (; j + PB <= pv; j += PB)
            F(ps_ssd_adj_block)(gst + j, pv, uu + j, gg + j, gu + j, sc, Bt, Ct, decay[i], N,
                                j == 0, PB);
        switch (pv - j) {
#if PB > 3
        case 3: F(ps_ssd_adj_block)(gst + j, pv, uu + j, gg + j, gu + j, sc, Bt, Ct, decay[i], N,
                                    j == 0, 3); break;
#endif
#if PB > 2
        case 2: F(ps_ssd_adj_block)(gst + j, pv, uu + j, gg + j, gu + j, sc, Bt, Ct, decay[i], N,
                                    j == 0, 2); break;
#endif
        case 1: F(ps_ssd_adj_block)(gst + j, pv, uu + j, gg + j, gu + j, sc, Bt, Ct, decay[i], N,
                                    j == 0, 1); break;
        default: break;
        }
        F(ps_lane_sums_n)(sc, N, pB + i * N);
        /* q[t] = <G[t], h[t]> - bdot[t], or exact (qx) */
        q = keep[i] == 2 ? 0
            : keep[i]    ? qx
                         : (last ? qend[i] : q) + cdot[i] - F(ps_ssd_dot)(Bt, pB + i * N, N);
        const T gq = (T)q * live[i];
        const T dtv = dt[bt * H + h];
        T *gx = (T *)a->grad_x + (bt * H + h) * P;
        if (i >= PS_SSD_AHEAD) F(ps_ssd_prefetch)(gx - PS_SSD_AHEAD * H * P, P, 1);
        const V *xi = xr + i * pv;
        V gdtv = {0};
        for (int64_t jj = 0; jj < pv; ++jj) {
            V gxj = dtv * gu[jj];
            if (D) gxj += gg[jj] * dv[jj];
            gxv[jj] = gxj;
            gdtv += gu[jj] * xi[jj];
            gD[jj] += gg[jj] * xi[jj];
        }
        F(ps_ssd_store)(gx, gxv, P, 0, pv);
        T gdt = 0;
        for (int l = 0; l < W; ++l) gdt += gdtv[l];
        ((T *)a->grad_dt)[bt * H + h] = gdt + gq * A[h];
        ctx->gA[unit] += q * live[i] * dtv;
        if (t == cu[s] && a->grad_initial)
            F(ps_ssd_store_state)((T *)a->grad_initial + (sidx * H + h) * P * N, gst, P, N, 0, pv);
    }
    ctx->carry[unit] = q;
}

ATTR static void F(ps_ssd_bwd_task)(const void *vp, int64_t begin, int64_t end) {
    const F(ps_ssd_bwd_ctx) *ctx = vp;
    ps_ssd_args *a = ctx->a;
    const int64_t K = a->chunk, N = a->nstate, pv = ctx->pv;
    const int64_t npad = (N + W - 1) / W * W;
    const size_t vecs = (size_t)((K + 1) * N * pv + (3 * K + 6) * pv + npad + 1);
    V *mem = ps_ssd_alloc(sizeof(V) * vecs);
    double *scal = malloc(sizeof(double) * (size_t)(2 * K) + sizeof(T) * (size_t)(2 * K) +
                          sizeof(int64_t) * (size_t)K + (size_t)K + 64);
    if (!mem || !scal) {
        free(mem); free(scal);
        __atomic_store_n(&a->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    F(ps_ssd_bwd_buf) buf;
    buf.st = mem;
    buf.saved = mem + N * pv;
    buf.rows = mem + (K + 1) * N * pv;
    buf.sc = buf.rows + (3 * K + 6) * pv;
    buf.cdot = scal;
    buf.qend = scal + K;
    buf.sq = (int64_t *)(scal + 2 * K);
    buf.decay = (T *)(buf.sq + K);
    buf.live = buf.decay + K;
    buf.keep = (char *)(buf.live + K);
    /* Units taken one at a time as threads free up: their costs differ (a strong
     * decay's step keeps its state, ps_ssd_bwd_chunk), and in Mamba-2 the decay rates
     * grow with the head index, so fixed ranges would leave one thread the heavy half.
     * Every unit writes only its own sums: the same bits whichever thread runs it. */
    (void)begin;
    (void)end;
    const int64_t units = a->batch * a->heads;
    F(ps_ssd_bwd_ctx) *shared = (F(ps_ssd_bwd_ctx) *)ctx;
    for (int64_t unit; (unit = __atomic_fetch_add(&shared->next, 1, __ATOMIC_RELAXED)) < units;)
        for (int64_t c = ctx->span_hi - 1; c >= ctx->span_lo; --c)
            F(ps_ssd_bwd_chunk)(ctx, unit / a->heads, unit % a->heads, c, &buf);
    free(mem);
    free(scal);
}

/* grad_B and grad_C of steps (b, t) of the span: the heads of each group summed in
 * head order. */
ATTR static void F(ps_ssd_bc_task)(const void *vp, int64_t begin, int64_t end) {
    const F(ps_ssd_bwd_ctx) *ctx = vp;
    const ps_ssd_args *a = ctx->a;
    const int64_t L = a->length, H = a->heads, N = a->nstate, G = a->groups, hg = H / G;
    const int64_t lo = ctx->span_lo * a->chunk, steps = ctx->span_steps;
    const int64_t span = (ctx->span_hi * a->chunk < L ? ctx->span_hi * a->chunk : L) - lo;
    for (int64_t k = begin; k < end; ++k) {
        const int64_t b = k / span, i = k % span, t = lo + i;
        for (int64_t g = 0; g < G; ++g) {
            T *gb = (T *)a->grad_B + ((b * L + t) * G + g) * N;
            T *gc = (T *)a->grad_C + ((b * L + t) * G + g) * N;
            for (int64_t n = 0; n < N; ++n) { gb[n] = 0; gc[n] = 0; }
            for (int64_t h = g * hg; h < (g + 1) * hg; ++h) {
                const T *pb = ctx->pB + ((b * H + h) * steps + i) * N;
                const T *pc = ctx->pC + ((b * H + h) * steps + i) * N;
                for (int64_t n = 0; n < N; ++n) { gb[n] += pb[n]; gc[n] += pc[n]; }
            }
        }
    }
}

ATTR static int F(ps_ssd_bwd)(ps_ssd_args *a) {
    const int64_t L = a->length, H = a->heads, P = a->headdim, N = a->nstate, K = a->chunk;
    const int64_t units = a->batch * H, pv = (P + W - 1) / W, nc = (L + K - 1) / K;
    /* the span's per-head sums of grad_B and grad_C fit PS_SSD_PARTIAL_BYTES */
    const int64_t per_chunk = units * K * N * 2 * (int64_t)sizeof(T);
    int64_t span_chunks = per_chunk > 0 ? PS_SSD_PARTIAL_BYTES / per_chunk : nc;
    if (span_chunks < 1) span_chunks = 1;
    if (span_chunks > nc) span_chunks = nc;
    const int64_t span_steps = span_chunks * K;
    V *gstate = ps_ssd_alloc(sizeof(V) * (size_t)(units * N * pv + 1));
    double *carry = calloc((size_t)(units + 1), sizeof(double));
    double *gA = calloc((size_t)(units + 1), sizeof(double));
    T *gD = ps_ssd_alloc(sizeof(T) * (size_t)(units * pv * W + 1));
    if (gD) memset(gD, 0, sizeof(T) * (size_t)(units * pv * W + 1));
    T *pB = malloc(sizeof(T) * (size_t)(2 * units * span_steps * N + 1));
    int rc = 0;
    if (!gstate || !carry || !gA || !gD || !pB) { rc = -1; goto done; }
    F(ps_ssd_bwd_ctx) ctx = {a, pv, nc, 0, 0, gstate, carry, gA, gD, pB,
                             pB + units * span_steps * N, span_steps, 0};
    const int64_t threads =
        ps_threads_for(a->batch * L * H * P * (N + 1) / 16, a->nthreads);
    for (int64_t hi = nc; hi > 0; hi -= span_chunks) {
        ctx.span_hi = hi;
        ctx.span_lo = hi - span_chunks > 0 ? hi - span_chunks : 0;
        ctx.next = 0; /* each of the (at most) `threads` tasks takes units until none is left */
        ps_parallel_for(units < threads ? units : threads, threads, F(ps_ssd_bwd_task), &ctx);
        const int64_t span = (hi * K < L ? hi * K : L) - ctx.span_lo * K;
        ps_parallel_for(a->batch * span, threads, F(ps_ssd_bc_task), &ctx);
    }
    if (a->failed) { rc = -1; goto done; }
    T *gAo = a->grad_A;
    for (int64_t h = 0; h < H; ++h) {
        double v = 0;
        for (int64_t b = 0; b < a->batch; ++b) v += gA[b * H + h];
        gAo[h] = (T)v;
    }
    if (a->grad_D)
        for (int64_t h = 0; h < H; ++h)
            for (int64_t p = 0; p < P; ++p) {
                T v = 0;
                for (int64_t b = 0; b < a->batch; ++b) v += gD[(b * H + h) * pv * W + p];
                ((T *)a->grad_D)[h * P + p] = v;
            }
    /* the sequences with no steps: their final state is their initial one */
    if (a->grad_initial) {
        const int64_t local[2] = {0, L};
        const int64_t *cu = a->cu_seqlens ? a->cu_seqlens : local;
        const int64_t nseq = a->cu_seqlens ? a->nseq : 1, rows = a->cu_seqlens ? 1 : a->batch;
        const int64_t state = H * P * N;
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t s = 0; s < nseq; ++s)
                if (cu[s] == cu[s + 1]) {
                    const int64_t idx = a->cu_seqlens ? s : r;
                    T *gi = (T *)a->grad_initial + idx * state;
                    if (a->grad_final)
                        memcpy(gi, (const T *)a->grad_final + idx * state, sizeof(T) * (size_t)state);
                    else
                        memset(gi, 0, sizeof(T) * (size_t)state);
                }
    }
done:
    free(gstate);
    free(carry);
    free(gA);
    free(gD);
    free(pB);
    return rc;
}

#undef PS_SSD_AHEAD
#undef PS_SSD_BLOCKS
#undef PS_SSD_EXACT_BELOW
#undef PS_SSD_EXACT_EVERY
