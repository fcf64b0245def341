/* One instantiation of linear attention's CPU kernel (cpu.c explains the algorithm).
 * Included by cpu_instance.h once per (state type, instruction set) with:
 *   T        the scalar type (float, double)
 *   V        a GCC vector of W T's; VI, VU the integer vectors of the same shape
 *   NB, VB   the vectors and lanes of a column block (VB = NB W)
 *   RB       the rows of a register block
 *   F(name)  the instantiation's name for `name`
 *   ATTR     the function attributes of the instruction set (target, fused
 *            multiply-adds) or nothing for the portable build
 * Every tensor is contiguous in its canonical shape (linear_attention/cpu.py copies).
 * A register block is the rows [i0, i0 + RB) and columns [c0, c0 + VB) of a head's
 * (K, V) state as x[RB][NB], zero past K and V (the rows' k, q and factors are zeros
 * there, the columns' v too), so that every product of a step is a vector over the
 * block's columns times a broadcast scalar of k, q or a factor. A chunk's rows of v
 * (and grad_out, and of the output or grad_v) are gathered into buffers of Vw = nvb VB
 * columns, zero past V: the sweeps read whole vectors.
 */

/* The level's vector helpers (F(ps_lane_sums), F(ps_vexp)) come from
 * _native/isa_instance.h; the rows, gathers and sequences (F(ps_kv_load_row), ...)
 * from _native/kv_tiles.h, shared with the delta rule's kernel. */
#include "kv_tiles.h"

#define PS_LA_INLINE ATTR static inline __attribute__((always_inline))

/* The frames' bound on |log lam| (cpu.c): X stays within e^16 (float32) or e^32
 * (float64) of the state. */
#define PS_LA_FRAME (TBYTES == 4 ? (T)16 : (T)32)

/* ---- a chunk's per-step operands -------------------------------------------------- */

/* What the steps of a chunk need besides the state, for one (batch row, head): per step
 * j and key channel i (rows Kp = K rounded up to RB apart, zero past K), k~ = k / lam
 * and q~ = q lam (q times the scale), the rebase factors lam d (zeros on the steps that
 * do not rebase) and, for the backward, lam and 1 / lam; the steps' flags (PS_LA_*); v
 * and grad_out gathered, and the rows of the output (or grad_v). */
typedef struct {
    T *vv, *go, *oo;                   /* (C, Vw) */
    T *kt, *qt, *at, *fe, *fi;         /* (C, Kp) */
    T *lam;                            /* (Kp): log lam of the frame, channel by channel */
    unsigned char *fl;                 /* (C,) */
} F(ps_la_prep);

/* The elements of a prep for chunks of C steps; `backward`: with fe, fi and go. */
static inline int64_t F(ps_la_prep_size)(int64_t C, int64_t Kp, int64_t Vw, int backward) {
    return (backward ? 3 : 2) * C * Vw + (backward ? 5 : 3) * C * Kp + Kp + C;
}

/* A prep laid out in m (zeroed: the rows' entries past K stay zero), vectors first. */
static inline F(ps_la_prep) F(ps_la_prep_at)(T *m, int64_t C, int64_t Kp, int64_t Vw,
                                             int backward) {
    F(ps_la_prep) p;
    p.vv = m;
    p.oo = m + C * Vw;
    p.go = backward ? m + 2 * C * Vw : NULL;
    T *r = m + (backward ? 3 : 2) * C * Vw;
    p.kt = r;
    p.qt = r + C * Kp;
    p.at = r + 2 * C * Kp;
    p.fe = backward ? r + 3 * C * Kp : NULL;
    p.fi = backward ? r + 4 * C * Kp : NULL;
    p.lam = r + (backward ? 5 : 3) * C * Kp;
    p.fl = (unsigned char *)(p.lam + Kp);
    return p;
}

/* Whether every element of x[0 .. K) is within [-bound, bound] (NaN is not). */
PS_LA_INLINE int F(ps_la_within)(const T *x, int64_t K, T bound) {
    int ok = 1;
    for (int64_t i = 0; i < K; ++i) ok &= x[i] <= bound && x[i] >= -bound;
    return ok;
}

/* Steps [t0, t0 + n) of head h, batch row b: their frames and flags, k~, q~ and the
 * factors, and the gathered rows. */
ATTR static void F(ps_la_prepare)(const ps_linear_attention_args *a, const F(ps_la_prep) *p,
                                  const F(ps_kv_seqs) *sq, int64_t b, int64_t h, int64_t t0,
                                  int64_t n, int64_t Kp, int64_t Vw) {
    const int64_t L = a->length, K = a->dk, H = a->heads, Hk = a->kheads;
    const int64_t hk = h / (H / Hk);
    const T *q = a->q, *k = a->k, *g = a->g;
    double scale_d;
    memcpy(&scale_d, &a->scale_bits, sizeof scale_d);
    const T scale = (T)scale_d;
    int64_t s = F(ps_kv_seq_at)(sq, t0);
    for (int64_t j = 0; j < n; ++j) {
        const int64_t t = t0 + j, step = (b * L + t) * H + h;
        const T *qs = q + ((b * L + t) * Hk + hk) * K, *ks = k + ((b * L + t) * Hk + hk) * K;
        if (j + PS_KV_FETCH_STEPS < n) {
            const int64_t ahead = PS_KV_FETCH_STEPS * Hk * K;
            F(ps_kv_fetch)(qs + ahead, K, 1);
            F(ps_kv_fetch)(ks + ahead, K, 1);
            if (a->gate == 2) F(ps_kv_fetch)(g + (step + PS_KV_FETCH_STEPS * H) * K, K, 1);
        }
        const int end = t == sq->cu[s + 1] - 1;
        int fl = (t == sq->cu[s] ? PS_LA_START : 0) | (end ? PS_LA_END : 0);
        T *kt = p->kt + j * Kp, *qt = p->qt + j * Kp, *at = p->at + j * Kp;
        T *fe = p->fe ? p->fe + j * Kp : NULL, *fi = p->fi ? p->fi + j * Kp : NULL;
        T *lam = p->lam;
        int rebase = 1; /* k~ = k, q~ = q (times the scale) */
        if (a->gate) {
            if (j == 0 || (fl & PS_LA_START))
                for (int64_t i = 0; i < K; ++i) lam[i] = 0;
            if (a->gate == 2) {
                const T *gs = g + step * K;
                for (int64_t i = 0; i < K; ++i) lam[i] += gs[i];
            } else {
                const T gh = g[step];
                for (int64_t i = 0; i < K; ++i) lam[i] += gh;
            }
            rebase = end || j == n - 1 || !F(ps_la_within)(lam, K, PS_LA_FRAME);
            for (int64_t i = 0; i < K; i += W) {
                const V x = F(ps_kv_load_vec)(lam, i, K);
                if (rebase) {
                    F(ps_kv_store_vec)(at, F(ps_vexp)(x), i, K);
                    continue;
                }
                const V e = F(ps_vexp)(x), ei = F(ps_vexp)(-x);
                const V kv = F(ps_kv_load_vec)(ks, i, K), qv = F(ps_kv_load_vec)(qs, i, K);
                F(ps_kv_store_vec)(kt, kv * ei, i, K);
                F(ps_kv_store_vec)(qt, (qv * scale) * e, i, K);
                F(ps_kv_store_vec)(at, (V){0}, i, K);
                if (fe) {
                    F(ps_kv_store_vec)(fe, e, i, K);
                    F(ps_kv_store_vec)(fi, ei, i, K);
                }
            }
            if (rebase) {
                fl |= PS_LA_REBASE;
                for (int64_t i = 0; i < K; ++i) lam[i] = 0;
            }
        }
        if (rebase) {
            for (int64_t i = 0; i < K; ++i) {
                kt[i] = ks[i];
                qt[i] = qs[i] * scale;
            }
            if (fe)
                for (int64_t i = 0; i < K; ++i) fe[i] = fi[i] = 1;
        }
        p->fl[j] = (unsigned char)fl;
        if (end)
            while (s < sq->nseq - 1 && sq->cu[s + 1] <= t + 1) ++s;
    }
    F(ps_kv_gather)(p->vv, Vw, a->v, b, h, t0, n, L, H, a->dv);
    if (p->go) F(ps_kv_gather)(p->go, Vw, a->grad_out, b, h, t0, n, L, H, a->dv);
}

/* ---- register blocks -------------------------------------------------------------- */

/* Rows [i0, i0 + RB) of a matrix of `rows` rows ld elements apart (NULL: zeros),
 * columns [c0, c0 + VB) as x, zero past `rows` and past Vd columns; and back, the rows
 * and columns past them left out. The copies go through a buffer: x itself is only
 * assigned, never addressed, so that it stays in registers. */
PS_LA_INLINE void F(ps_la_load)(V x[RB][NB], const T *src, int64_t ld, int64_t rows,
                                int64_t Vd, int64_t i0, int64_t c0) {
    V buf[RB][NB];
    for (int r = 0; r < RB; ++r) {
        if (src && i0 + r < rows) {
            F(ps_kv_load_row)(buf[r], src + (i0 + r) * ld, Vd, c0);
            continue;
        }
        for (int m = 0; m < NB; ++m) buf[r][m] = (V){0};
    }
    for (int r = 0; r < RB; ++r)
        for (int m = 0; m < NB; ++m) x[r][m] = buf[r][m];
}

PS_LA_INLINE void F(ps_la_store)(T *dst, int64_t ld, int64_t rows, int64_t Vd, int64_t i0,
                                 int64_t c0, V x[RB][NB]) {
    V buf[RB][NB];
    for (int r = 0; r < RB; ++r)
        for (int m = 0; m < NB; ++m) buf[r][m] = x[r][m];
    for (int r = 0; r < RB; ++r)
        if (i0 + r < rows) F(ps_kv_store_row)(dst + (i0 + r) * ld, buf[r], Vd, c0);
}

/* One step on a register block: x_r = x_r + kt_r v, after x_r = at_r x_r when the step
 * rebases (at NULL: it does not). The multiply-add is the same on both paths: one fused
 * multiply-add per element on the vector levels. */
PS_LA_INLINE void F(ps_la_step)(V x[RB][NB], const V *v, const T *kt, const T *at) {
    if (at)
        for (int r = 0; r < RB; ++r)
            for (int m = 0; m < NB; ++m) x[r][m] *= at[r];
    for (int r = 0; r < RB; ++r)
        for (int m = 0; m < NB; ++m) x[r][m] += kt[r] * v[m];
}

/* acc += sum_r w_r x_r (rows in order; = when `first`, the first register block). */
PS_LA_INLINE void F(ps_la_rows_into)(V *acc, V x[RB][NB], const T *w, int first) {
    V s[NB];
    for (int m = 0; m < NB; ++m) s[m] = w[0] * x[0][m];
    for (int r = 1; r < RB; ++r)
        for (int m = 0; m < NB; ++m) s[m] += w[r] * x[r][m];
    for (int m = 0; m < NB; ++m) acc[m] = first ? s[m] : acc[m] + s[m];
}

/* p[r C] += sum_m x_r[m] y[m] for each row r (= when `first`, the first column block):
 * a row's products with y over the block's columns as one vector, its lanes summed
 * later (F(ps_la_reduce)). */
PS_LA_INLINE void F(ps_la_dots_into)(V *p, int64_t C, V x[RB][NB], const V *y, int first) {
    for (int r = 0; r < RB; ++r) {
        V s = x[r][0] * y[0];
        for (int m = 1; m < NB; ++m) s += x[r][m] * y[m];
        p[r * C] = first ? s : p[r * C] + s;
    }
}

/* p[r C] += sum_m x_r[m] y_r[m] for each row r (= when `first`). */
PS_LA_INLINE void F(ps_la_dots_of)(V *p, int64_t C, V x[RB][NB], V y[RB][NB], int first) {
    for (int r = 0; r < RB; ++r) {
        V s = x[r][0] * y[r][0];
        for (int m = 1; m < NB; ++m) s += x[r][m] * y[r][m];
        p[r * C] = first ? s : p[r * C] + s;
    }
}

/* out[i0 + r] = the sum of the lanes of p[r C], r < RB. */
PS_LA_INLINE void F(ps_la_reduce_one)(T *out, int64_t i0, const V *p, int64_t C) {
    for (int r0 = 0; r0 < RB; r0 += W) {
        V v[W];
        const int cnt = RB - r0 < W ? RB - r0 : W;
        for (int l = 0; l < cnt; ++l) v[l] = p[(r0 + l) * C];
        F(ps_lane_sums)(v, cnt, out + i0 + r0);
    }
}

/* out[j Kp + i0 + r] = the sum of the lanes of p[r C + j], j < n, r < RB: W steps of a
 * row at a time. */
PS_LA_INLINE void F(ps_la_reduce)(T *out, int64_t Kp, int64_t i0, const V *p, int64_t C,
                                  int64_t n) {
    T sums[W];
    for (int r = 0; r < RB; ++r)
        for (int64_t j = 0; j < n; j += W) {
            const int64_t cnt = n - j < W ? n - j : W;
            F(ps_lane_sums)(p + r * C + j, cnt, sums);
            for (int64_t l = 0; l < cnt; ++l) out[(j + l) * Kp + i0 + r] = sums[l];
        }
}

/* ---- forward ---------------------------------------------------------------------- */

typedef struct {
    ps_linear_attention_args *a;
    int64_t nvb, split, nc, Kp, Vw;
} F(ps_la_fwd_ctx);

/* A chunk's steps [t0, t0 + n) (chunk c, n > 0) on register block (i0, c0) of head h,
 * batch row b; sequence s holds t0. The state entering the chunk is in st (rows ld
 * apart, columns from sc0) unless t0 starts a sequence; it is left there when `keep`
 * (another chunk follows). The outputs' sums are added into the chunk's rows (set by
 * the first register block). */
PS_LA_INLINE void F(ps_la_fwd_rows)(const ps_linear_attention_args *a, const F(ps_la_prep) *p,
                                    const F(ps_kv_seqs) *sq, int64_t s, int64_t b, int64_t h,
                                    int64_t c, int64_t nc, int64_t n, int64_t Kp, int64_t Vw,
                                    int64_t i0, int64_t c0, T *st, int64_t ld, int64_t sc0,
                                    int keep, const int gated) {
    const int64_t K = a->dk, Vd = a->dv, H = a->heads, KV = K * Vd;
    const T *init = a->initial;
    T *fin = a->final;
    V x[RB][NB];
    if (p->fl[0] & PS_LA_START)
        F(ps_la_load)(x, init ? init + (F(ps_kv_state_row)(sq, s) * H + h) * KV : NULL, Vd, K,
                      Vd, i0, c0);
    else
        F(ps_la_load)(x, st, ld, Kp, ld, i0, sc0);
    if (a->checkpoints)
        F(ps_la_store)((T *)a->checkpoints + ((b * nc + c) * H + h) * KV, Vd, K, Vd, i0, c0, x);
    for (int64_t j = 0; j < n; ++j) {
        const int fl = p->fl[j];
        if (j > 0 && (fl & PS_LA_START))
            F(ps_la_load)(x, init ? init + (F(ps_kv_state_row)(sq, s) * H + h) * KV : NULL, Vd,
                          K, Vd, i0, c0);
        const V *v = (const V *)(p->vv + j * Vw + c0);
        const T *kt = p->kt + j * Kp + i0;
        F(ps_la_step)(x, v, kt, gated && (fl & PS_LA_REBASE) ? p->at + j * Kp + i0 : NULL);
        F(ps_la_rows_into)((V *)(p->oo + j * Vw + c0), x, p->qt + j * Kp + i0, i0 == 0);
        if (fl & PS_LA_END) {
            if (fin) F(ps_la_store)(fin + (F(ps_kv_state_row)(sq, s) * H + h) * KV, Vd, K, Vd, i0, c0, x);
            const int64_t t = c * a->chunk + j;
            while (s < sq->nseq - 1 && sq->cu[s + 1] <= t + 1) ++s;
        }
    }
    if (keep) F(ps_la_store)(st, ld, Kp, ld, i0, sc0, x);
}

/* The decoding step: the single step of a call with L = 1 (not packed, no checkpoints)
 * on the whole column blocks [vb0, vb1) of head h, batch row b, read from the initial
 * state and written to the final one (when there is one) in place, register block by
 * register block: the same operations in the same order as ps_la_fwd_rows', so the
 * same bits, without its per-block bookkeeping (a step is a few dozen operations per
 * block). `stream`: the final state is stored past the caches (kv_tiles.h: it is read
 * again only at the next token, after the rest of the model). */
PS_LA_INLINE void F(ps_la_fwd_single)(const ps_linear_attention_args *a, const F(ps_la_prep) *p,
                                      int64_t b, int64_t h, int64_t vb0, int64_t vb1,
                                      int64_t Kp, int stream, const int gated) {
    typedef V VA __attribute__((aligned(sizeof(T)))); /* the state's rows: any alignment */
    const int64_t K = a->dk, Vd = a->dv, at0 = (b * a->heads + h) * K * Vd;
    const T *src = (const T *)a->initial + at0;
    T *dst = a->final ? (T *)a->final + at0 : NULL;
    const T *at = gated && (p->fl[0] & PS_LA_REBASE) ? p->at : NULL;
    for (int64_t i0 = 0; i0 < Kp; i0 += RB)
        for (int64_t vb = vb0; vb < vb1; ++vb) {
            const int64_t c0 = vb * VB;
            V x[RB][NB];
            for (int r = 0; r < RB; ++r)
                for (int q = 0; q < NB; ++q)
                    x[r][q] = i0 + r < K ? ((const VA *)(src + (i0 + r) * Vd + c0))[q] : (V){0};
            F(ps_la_step)(x, (const V *)(p->vv + c0), p->kt + i0, at ? at + i0 : NULL);
            F(ps_la_rows_into)((V *)(p->oo + c0), x, p->qt + i0, i0 == 0);
            if (!dst) continue;
            for (int r = 0; r < RB && i0 + r < K; ++r)
                for (int q = 0; q < NB; ++q) {
                    T *d = dst + (i0 + r) * Vd + c0 + q * W;
                    if (stream)
                        F(ps_kv_stream)(d, x[r][q]);
                    else
                        *(VA *)d = x[r][q];
                }
        }
}

ATTR static void F(ps_la_fwd_task)(const void *vp, int64_t begin, int64_t end) {
    const F(ps_la_fwd_ctx) *ctx = vp;
    ps_linear_attention_args *a = ctx->a;
    const int64_t L = a->length, H = a->heads, C = a->chunk, Kp = ctx->Kp, Vw = ctx->Vw;
    const int64_t nvb = ctx->nvb, split = ctx->split;
    const int64_t most = (nvb + split - 1) / split; /* column blocks of a unit, at most */
    const int64_t Cn = L < C ? L : C;               /* steps of a chunk, at most */
    const int64_t prep = F(ps_la_prep_size)(Cn, Kp, Vw, 0);
    T *pm = ps_kv_alloc(sizeof(T) * (size_t)prep);
    T *st = ps_kv_alloc(sizeof(T) * (size_t)(Kp * most * VB));
    if (!pm || !st) {
        free(pm);
        free(st);
        __atomic_store_n(&a->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    memset(pm, 0, sizeof(T) * (size_t)prep);
    const F(ps_la_prep) p = F(ps_la_prep_at)(pm, Cn, Kp, Vw, 0);
    for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t part = unit % split, bh = unit / split, b = bh / H, h = bh % H;
        const int64_t vb0 = part * nvb / split, vb1 = (part + 1) * nvb / split;
        if (vb0 == vb1) continue;
        const int64_t ld = (vb1 - vb0) * VB, c1 = vb1 * VB < a->dv ? vb1 * VB : a->dv;
        F(ps_kv_seqs) sq;
        F(ps_kv_seqs_of)(&sq, a->cu_seqlens, a->nseq, L, b);
        for (int64_t c = 0; c < ctx->nc; ++c) {
            const int64_t t0 = c * C, n = L - t0 < C ? L - t0 : C;
            F(ps_la_prepare)(a, &p, &sq, b, h, t0, n, Kp, Vw);
            const int64_t s = F(ps_kv_seq_at)(&sq, t0);
            const int keep = c + 1 < ctx->nc;
            /* the decoding step (one step from a state, nothing kept): its final state
             * streamed */
            const int single = L == 1 && a->initial && !a->checkpoints && !a->cu_seqlens;
            const int stream = single && a->final && F(ps_kv_streams)((const T *)a->final, a->dv);
            int64_t vb2 = vb0; /* the decoding step's whole column blocks: [vb0, vb2) */
            if (single) {
                vb2 = vb1 * VB <= a->dv ? vb1 : vb1 - 1;
                if (a->gate)
                    F(ps_la_fwd_single)(a, &p, b, h, vb0, vb2, Kp, stream, 1);
                else
                    F(ps_la_fwd_single)(a, &p, b, h, vb0, vb2, Kp, stream, 0);
            }
            for (int64_t i0 = 0; i0 < Kp; i0 += RB)
                for (int64_t vb = vb2; vb < vb1; ++vb) {
                    if (a->gate)
                        F(ps_la_fwd_rows)(a, &p, &sq, s, b, h, c, ctx->nc, n, Kp, Vw, i0, vb * VB,
                                          st, ld, (vb - vb0) * VB, keep, 1);
                    else
                        F(ps_la_fwd_rows)(a, &p, &sq, s, b, h, c, ctx->nc, n, Kp, Vw, i0, vb * VB,
                                          st, ld, (vb - vb0) * VB, keep, 0);
                }
            F(ps_kv_scatter)(a->out, p.oo, Vw, b, h, t0, n, L, H, a->dv, vb0 * VB, c1);
        }
    }
    free(pm);
    free(st);
#ifdef PS_ISA_VECTOR
    _mm_sfence(); /* the streamed stores (ps_kv_stream) done before the call returns */
#endif
}

ATTR static int F(ps_la_fwd)(ps_linear_attention_args *a) {
    const int64_t units = a->batch * a->heads, nvb = (a->dv + VB - 1) / VB;
    /* fewer heads than threads: each head's column blocks shared out (columns of the
     * state never interact) */
    const int64_t split = ps_split_units(units, nvb, a->nthreads);
    F(ps_la_fwd_ctx) ctx = {a, nvb, split, (a->length + a->chunk - 1) / a->chunk,
                            (a->dk + RB - 1) / RB * RB, nvb * VB};
    const int64_t work = a->batch * a->length * a->heads * a->dk * a->dv;
    const int64_t bytes = (int64_t)sizeof(T);
    ps_prefer_huge_pages(a->out, a->batch * a->length * a->heads * a->dv * bytes);
    if (a->checkpoints)
        ps_prefer_huge_pages(a->checkpoints, ctx.nc * a->batch * a->heads * a->dk * a->dv * bytes);
    if (a->length > 0)
        ps_parallel_for(units * split, ps_threads_for(work, a->nthreads), F(ps_la_fwd_task),
                        &ctx);
    return a->failed ? -1 : 0;
}

/* ---- backward --------------------------------------------------------------------- */

typedef struct {
    ps_linear_attention_args *a;
    int64_t nvb, nc, Kp, Vw;
} F(ps_la_bwd_ctx);

/* A thread's memory for the backward. */
typedef struct {
    F(ps_la_prep) p;
    V *pa, *pb, *ta; /* (RB, C): the rows' vectors of grad q~, grad k~ and the terminal sums */
    T *dq, *dk, *tt; /* (C, Kp): grad q~ (then grad q), grad k~ (then grad k), terminal sums */
    T *cum;          /* (Kp): grad_g of the step after, channel by channel */
    T *dX;           /* (Kp, Vw): the gradient of the state carried from chunk to chunk */
    int64_t C;
} F(ps_la_bwd_buf);

/* Sweep A of chunk c (steps [t0, t0 + n), sequence s holding t0) on register block
 * (i0, c0): the states rebuilt from the checkpoint; each step's products X go into pa,
 * and at a sequence's last step (with a grad_final) and at the chunk's last step those
 * of the gradient carried in with the state into ta. */
PS_LA_INLINE void F(ps_la_rebuild_rows)(const ps_linear_attention_args *a,
                                        const F(ps_la_bwd_buf) *m, const F(ps_kv_seqs) *sq,
                                        int64_t s, int64_t b, int64_t h, int64_t c, int64_t nc,
                                        int64_t n, int64_t Kp, int64_t Vw, int64_t i0,
                                        int64_t c0, const int gated) {
    const int64_t K = a->dk, Vd = a->dv, H = a->heads, KV = K * Vd, C = m->C;
    const F(ps_la_prep) *p = &m->p;
    const T *init = a->initial, *gf = a->grad_final;
    V x[RB][NB], y[RB][NB];
    if (p->fl[0] & PS_LA_START)
        F(ps_la_load)(x, init ? init + (F(ps_kv_state_row)(sq, s) * H + h) * KV : NULL, Vd, K,
                      Vd, i0, c0);
    else
        F(ps_la_load)(x, (const T *)a->checkpoints + ((b * nc + c) * H + h) * KV, Vd, K, Vd,
                      i0, c0);
    for (int64_t j = 0; j < n; ++j) {
        const int fl = p->fl[j];
        if (j > 0 && (fl & PS_LA_START))
            F(ps_la_load)(x, init ? init + (F(ps_kv_state_row)(sq, s) * H + h) * KV : NULL, Vd,
                          K, Vd, i0, c0);
        const T *kt = p->kt + j * Kp + i0;
        const V *v = (const V *)(p->vv + j * Vw + c0);
        F(ps_la_step)(x, v, kt, gated && (fl & PS_LA_REBASE) ? p->at + j * Kp + i0 : NULL);
        F(ps_la_dots_into)(m->pa + j, C, x, (const V *)(p->go + j * Vw + c0), c0 == 0);
        if (fl & PS_LA_END) {
            if (gf) {
                F(ps_la_load)(y, gf + (F(ps_kv_state_row)(sq, s) * H + h) * KV, Vd, K, Vd, i0,
                              c0);
                F(ps_la_dots_of)(m->ta + j, C, x, y, c0 == 0);
            }
            const int64_t t = c * a->chunk + j;
            while (s < sq->nseq - 1 && sq->cu[s + 1] <= t + 1) ++s;
        } else if (j == n - 1) { /* the chunk's end: the gradient carried in */
            F(ps_la_load)(y, m->dX, Vw, Kp, Vw, i0, c0);
            F(ps_la_dots_of)(m->ta + j, C, x, y, c0 == 0);
        }
    }
}

/* Sweep B of the chunk (steps [t0, t0 + n), sequence s holding its last step) on
 * register block (i0, c0): the adjoint from the last step to the first, dX carried in
 * m->dX; each step's products dX v into pb, its rows of grad_v added into p->oo. */
PS_LA_INLINE void F(ps_la_adjoint_rows)(const ps_linear_attention_args *a,
                                        const F(ps_la_bwd_buf) *m, const F(ps_kv_seqs) *sq,
                                        int64_t s, int64_t h, int64_t t0, int64_t n, int64_t Kp,
                                        int64_t Vw, int64_t i0, int64_t c0, const int gated) {
    const int64_t K = a->dk, Vd = a->dv, H = a->heads, KV = K * Vd, C = m->C;
    const F(ps_la_prep) *p = &m->p;
    const T *gf = a->grad_final;
    T *gi = a->grad_initial;
    V d[RB][NB];
    F(ps_la_load)(d, m->dX, Vw, Kp, Vw, i0, c0);
    for (int64_t j = n - 1; j >= 0; --j) {
        const int fl = p->fl[j];
        while (sq->cu[s] > t0 + j) --s;
        if (fl & PS_LA_END)
            F(ps_la_load)(d, gf ? gf + (F(ps_kv_state_row)(sq, s) * H + h) * KV : NULL, Vd, K,
                          Vd, i0, c0);
        const T *qt = p->qt + j * Kp + i0, *kt = p->kt + j * Kp + i0;
        const V *go = (const V *)(p->go + j * Vw + c0), *v = (const V *)(p->vv + j * Vw + c0);
        for (int r = 0; r < RB; ++r)
            for (int q = 0; q < NB; ++q) d[r][q] += qt[r] * go[q];
        F(ps_la_dots_into)(m->pb + j, C, d, v, c0 == 0);
        F(ps_la_rows_into)((V *)(p->oo + j * Vw + c0), d, kt, i0 == 0);
        if (gated && (fl & PS_LA_REBASE)) {
            const T *at = p->at + j * Kp + i0;
            for (int r = 0; r < RB; ++r)
                for (int q = 0; q < NB; ++q) d[r][q] *= at[r];
        }
        if ((fl & PS_LA_START) && gi)
            F(ps_la_store)(gi + (F(ps_kv_state_row)(sq, s) * H + h) * KV, Vd, K, Vd, i0, c0, d);
    }
    F(ps_la_store)(m->dX, Vw, Kp, Vw, i0, c0, d);
}

/* The chunk's gradients of head h from the sweeps' sums: grad q and grad k out of the
 * frames, grad_g by its sums from each sequence's and the chunk's last step, grad_q and
 * grad_k into their rows (the first head of a q/k head sets them, the others add, in
 * head order), grad_v scattered. */
ATTR static void F(ps_la_finish)(const ps_linear_attention_args *a, const F(ps_la_bwd_buf) *m,
                                 int64_t b, int64_t h, int64_t t0, int64_t n, int64_t Kp,
                                 int64_t Vw) {
    const int64_t L = a->length, K = a->dk, H = a->heads, Hk = a->kheads, hk = h / (H / Hk);
    const F(ps_la_prep) *p = &m->p;
    const int first = h % (H / Hk) == 0;
    for (int64_t j = n - 1; j >= 0; --j) {
        const int64_t t = t0 + j, row = ((b * L + t) * Hk + hk) * K, step = (b * L + t) * H + h;
        T *dq = m->dq + j * Kp, *dk = m->dk + j * Kp, *cum = m->cum;
        if (a->gate) {
            const T *fe = p->fe + j * Kp, *fi = p->fi + j * Kp, *tt = m->tt + j * Kp;
            const T *qs = (const T *)a->q + row, *ks = (const T *)a->k + row;
            const int fl = p->fl[j];
            /* the sum starts at the step that ends a sequence (from grad_final * S, zeros
             * without a grad_final) or the chunk (from the carried gradient * S) */
            const int from = (fl & PS_LA_END) || j == n - 1;
            const int zero = (fl & PS_LA_END) && !a->grad_final;
            for (int64_t i = 0; i < K; ++i) {
                dq[i] *= fe[i];
                dk[i] *= fi[i];
                const T before = from ? (zero ? (T)0 : tt[i]) : cum[i];
                cum[i] = before + (qs[i] * dq[i] - ks[i] * dk[i]);
            }
            if (a->gate == 2) {
                memcpy((T *)a->grad_g + step * K, cum, sizeof(T) * (size_t)K);
            } else {
                T sum = 0;
                for (int64_t i = 0; i < K; ++i) sum += cum[i];
                ((T *)a->grad_g)[step] = sum;
            }
        }
        T *gq = (T *)a->grad_q + row, *gk = (T *)a->grad_k + row;
        if (first) {
            memcpy(gq, dq, sizeof(T) * (size_t)K);
            memcpy(gk, dk, sizeof(T) * (size_t)K);
        } else {
            for (int64_t i = 0; i < K; ++i) {
                gq[i] += dq[i];
                gk[i] += dk[i];
            }
        }
    }
    F(ps_kv_scatter)(a->grad_v, p->oo, Vw, b, h, t0, n, L, H, a->dv, 0, a->dv);
}

ATTR static void F(ps_la_bwd_task)(const void *vp, int64_t begin, int64_t end) {
    const F(ps_la_bwd_ctx) *ctx = vp;
    ps_linear_attention_args *a = ctx->a;
    const int64_t L = a->length, H = a->heads, Hk = a->kheads, C0 = a->chunk;
    const int64_t Kp = ctx->Kp, Vw = ctx->Vw, nvb = ctx->nvb, per = H / Hk;
    const int64_t C = L < C0 ? L : C0; /* steps of a chunk, at most */
    const int64_t prep = F(ps_la_prep_size)(C, Kp, Vw, 1);
    const int64_t vecs = 3 * RB * C, rest = 3 * C * Kp + Kp;
    F(ps_la_bwd_buf) m;
    T *pm = ps_kv_alloc(sizeof(T) * (size_t)prep);
    V *pv = ps_kv_alloc(sizeof(V) * (size_t)vecs);
    T *rm = ps_kv_alloc(sizeof(T) * (size_t)rest);
    m.dX = ps_kv_alloc(sizeof(T) * (size_t)(Kp * Vw));
    if (!pm || !pv || !rm || !m.dX) {
        free(pm);
        free(pv);
        free(rm);
        free(m.dX);
        __atomic_store_n(&a->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    memset(pm, 0, sizeof(T) * (size_t)prep);
    memset(rm, 0, sizeof(T) * (size_t)rest);
    memset(m.dX, 0, sizeof(T) * (size_t)(Kp * Vw));
    m.p = F(ps_la_prep_at)(pm, C, Kp, Vw, 1);
    m.pa = pv;
    m.pb = pv + RB * C;
    m.ta = pv + 2 * RB * C;
    m.dq = rm;
    m.dk = rm + C * Kp;
    m.tt = rm + 2 * C * Kp;
    m.cum = rm + 3 * C * Kp;
    m.C = C;
    /* A unit is a q/k head with the value heads it serves: their shares of grad_q and
     * grad_k are summed in head order, the same bits for any thread count. */
    for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t b = unit / Hk, hk = unit % Hk;
        F(ps_kv_seqs) sq;
        F(ps_kv_seqs_of)(&sq, a->cu_seqlens, a->nseq, L, b);
        for (int64_t h = hk * per; h < (hk + 1) * per; ++h)
            for (int64_t c = ctx->nc - 1; c >= 0; --c) {
                const int64_t t0 = c * C0, n = L - t0 < C0 ? L - t0 : C0;
                F(ps_la_prepare)(a, &m.p, &sq, b, h, t0, n, Kp, Vw);
                const int64_t s0 = F(ps_kv_seq_at)(&sq, t0), s1 = F(ps_kv_seq_at)(&sq, t0 + n - 1);
                for (int64_t i0 = 0; i0 < Kp; i0 += RB) {
                    for (int64_t vb = 0; vb < nvb; ++vb) {
                        if (a->gate)
                            F(ps_la_rebuild_rows)(a, &m, &sq, s0, b, h, c, ctx->nc, n, Kp, Vw, i0,
                                                  vb * VB, 1);
                        else
                            F(ps_la_rebuild_rows)(a, &m, &sq, s0, b, h, c, ctx->nc, n, Kp, Vw, i0,
                                                  vb * VB, 0);
                    }
                    for (int64_t vb = 0; vb < nvb; ++vb) {
                        if (a->gate)
                            F(ps_la_adjoint_rows)(a, &m, &sq, s1, h, t0, n, Kp, Vw, i0, vb * VB, 1);
                        else
                            F(ps_la_adjoint_rows)(a, &m, &sq, s1, h, t0, n, Kp, Vw, i0, vb * VB, 0);
                    }
                    F(ps_la_reduce)(m.dq, Kp, i0, m.pa, C, n);
                    F(ps_la_reduce)(m.dk, Kp, i0, m.pb, C, n);
                    /* the sums that start grad_g's: at the steps that end a sequence (with a
                     * grad_final) and at the chunk's last step */
                    for (int64_t j = 0; a->gate && j < n; ++j) {
                        const int end = m.p.fl[j] & PS_LA_END;
                        if ((end && a->grad_final) || (!end && j == n - 1))
                            F(ps_la_reduce_one)(m.tt + j * Kp, i0, m.ta + j, C);
                    }
                }
                F(ps_la_finish)(a, &m, b, h, t0, n, Kp, Vw);
            }
    }
    free(pm);
    free(pv);
    free(rm);
    free(m.dX);
}

ATTR static int F(ps_la_bwd)(ps_linear_attention_args *a) {
    const int64_t L = a->length, H = a->heads, K = a->dk, units = a->batch * a->kheads;
    const int64_t nvb = (a->dv + VB - 1) / VB;
    F(ps_la_bwd_ctx) ctx = {a, nvb, (L + a->chunk - 1) / a->chunk, (K + RB - 1) / RB * RB,
                            nvb * VB};
    if (L == 0) return 0;
    const int64_t steps = a->batch * L * H, bytes = (int64_t)sizeof(T);
    ps_prefer_huge_pages(a->grad_v, steps * a->dv * bytes);
    ps_prefer_huge_pages(a->grad_q, a->batch * L * a->kheads * K * bytes);
    ps_prefer_huge_pages(a->grad_k, a->batch * L * a->kheads * K * bytes);
    if (a->gate == 2) ps_prefer_huge_pages(a->grad_g, steps * K * bytes);
    ps_parallel_for(units, ps_threads_for(steps * K * a->dv, a->nthreads), F(ps_la_bwd_task),
                    &ctx);
    return a->failed ? -1 : 0;
}

#undef PS_LA_INLINE
#undef PS_LA_FRAME
