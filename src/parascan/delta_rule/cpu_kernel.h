/* One instantiation of the delta rule's CPU kernel (cpu.c explains the algorithm).
 * Included by cpu_instance.h once per (state type, instruction set) with:
 *   T        the scalar type (float, double); EXP its scalar exp
 *   V        a GCC vector of W T's; VI, VU the integer vectors of the same shape
 *   NB, VB   the vectors and lanes of a column block (VB = NB W)
 *   F(name)  the instantiation's name for `name`
 *   ATTR     the function attributes of the instruction set (target, fused
 *            multiply-adds) or nothing for the portable build
 * Every tensor is contiguous in its canonical shape (delta_rule/cpu.py copies). A
 * column block of a head's (K, V) state is a tile of K rows of VB lanes, row i at
 * tile + i VB (the lanes past V are zeros and stay zeros), so that every product of
 * a step is a vector over the block's columns times a broadcast scalar of k, q or
 * the decay. */

/* The level's vector helpers (F(ps_lane_sums_n), F(ps_vexp), ...) come from
 * _native/isa_instance.h; the tiles, rows, gathers and sequences (F(ps_kv_load_cols),
 * ...) from _native/kv_tiles.h, which the linear-attention kernel shares. */
#include "kv_tiles.h"

#define PS_DELTA_INLINE ATTR static inline __attribute__((always_inline))

/* ---- a chunk's per-step vectors --------------------------------------------------- */

/* What the steps of a chunk need besides the state, for one (batch row, head):
 * per step j and key channel i, k and q, the decay d = exp(g) (1 without a gate),
 * d k and d q (what the state before the step is read with), k . q and beta; the
 * rows of v (and in the backward of grad_out) gathered, and room for the rows of the
 * output (grad_v) before they are scattered. A step's rows are H V elements apart
 * in the tensors: read one at a time inside the sweeps, each would be a cache miss
 * that the step waits for (the gathers' misses overlap). */
typedef struct {
    T *kk, *qq, *dd, *kd, *qd; /* (chunk, K) */
    T *kq, *bt;                /* (chunk,) */
    T *vv, *oo, *go;           /* (chunk, V): v, out (or grad_v), grad_out */
} F(ps_delta_prep);

/* The memory of a prep for chunks of C steps, and the prep laid out in it. */
static inline int64_t F(ps_delta_prep_size)(int64_t C, int64_t K, int64_t Vd) {
    return 5 * C * K + 2 * C + 3 * C * Vd;
}

static inline F(ps_delta_prep) F(ps_delta_prep_at)(T *m, int64_t C, int64_t K, int64_t Vd) {
    T *r = m + 5 * C * K + 2 * C;
    return (F(ps_delta_prep)){m, m + C * K, m + 2 * C * K, m + 3 * C * K, m + 4 * C * K,
                              m + 5 * C * K, m + 5 * C * K + C, r, r + C * Vd, r + 2 * C * Vd};
}

/* Fetch step t's rows of q, k, v and a per-channel g of head h, batch row b, into L2
 * (while the chunk before t's runs, so that preparing t's chunk reads no memory). */
PS_DELTA_INLINE void F(ps_delta_fetch_step)(const ps_delta_args *a, int64_t b, int64_t h,
                                            int64_t t) {
    const int64_t L = a->length, K = a->dk, H = a->heads, Hk = a->kheads;
    const int64_t hk = h / (H / Hk), qk = ((b * L + t) * Hk + hk) * K;
    const int64_t step = (b * L + t) * H + h;
    F(ps_kv_fetch)((const T *)a->q + qk, K, 0);
    F(ps_kv_fetch)((const T *)a->k + qk, K, 0);
    F(ps_kv_fetch)((const T *)a->v + step * a->dv, a->dv, 0);
    if (a->gate == 2) F(ps_kv_fetch)((const T *)a->g + step * K, K, 0);
}

/* The dot products k . k, q . q and k . q of two K-vectors, in W lanes summed at the
 * end: chains of K / W multiply-adds, not K. */
PS_DELTA_INLINE void F(ps_delta_dots)(const T *kk, const T *qq, int64_t K, T *kk_qq_kq) {
    V acc[3] = {(V){0}, (V){0}, (V){0}};
    for (int64_t i = 0; i < K; i += W) {
        const V x = F(ps_kv_load_vec)(kk, i, K), y = F(ps_kv_load_vec)(qq, i, K);
        acc[0] += x * x;
        acc[1] += y * y;
        acc[2] += x * y;
    }
    F(ps_lane_sums_n)(acc, 3, kk_qq_kq);
}

/* The factor that normalizes a row x of K whose sum of squares overflowed (|x| past
 * about 1e19 in float32, 1e154 in float64), times ``factor``, with x divided in place
 * by its largest magnitude m (> 1 there) first: x / sqrt(sum x^2 + 1e-6) is
 * (x / m) / sqrt(sum (x / m)^2 + 1e-6 / m^2), whose sum stays below K. A NaN or an
 * infinity in x gives NaN, as the plain formula's inf / inf does. */
ATTR static T F(ps_delta_rescaled_norm)(T *x, int64_t K, T factor) {
    T m = 0;
    for (int64_t i = 0; i < K; ++i) {
        const T e = x[i] < 0 ? -x[i] : x[i];
        m = e > m || e != e ? e : m; /* a NaN stays */
    }
    T sum = 0;
    for (int64_t i = 0; i < K; ++i) {
        x[i] /= m;
        sum += x[i] * x[i];
    }
    return factor / SQRT(sum + (T)1e-6 / (m * m));
}

/* The forward's raw q and k rows brought to the canonical form as the public function
 * does in torch (ps_delta_args.qk_form, scale_bits): normalized, x * (1 / sqrt(sum x^2
 * + 1e-6)), when qk_form is 2; q times the scale. (The sums are in lanes, so the result
 * may differ from torch's in the last bits.) A sum of squares that overflows (not
 * <= its type's largest value; NaN too) is taken again with the row scaled first: an
 * l2 norm is defined for every finite vector. */
ATTR static void F(ps_delta_normalize)(const ps_delta_args *a, T *kk, T *qq, int64_t K) {
    double scale;
    memcpy(&scale, &a->scale_bits, sizeof scale);
    T rk = 1, rq = (T)scale;
    if (a->qk_form == 2) {
        const T most = sizeof(T) == 4 ? (T)FLT_MAX : (T)DBL_MAX;
        T dots[3];
        F(ps_delta_dots)(kk, qq, K, dots);
        rk = dots[0] <= most ? (T)1 / SQRT(dots[0] + (T)1e-6)
                             : F(ps_delta_rescaled_norm)(kk, K, (T)1);
        rq = dots[1] <= most ? (T)1 / SQRT(dots[1] + (T)1e-6) * (T)scale
                             : F(ps_delta_rescaled_norm)(qq, K, (T)scale);
    }
    for (int64_t i = 0; i < K; ++i) {
        kk[i] *= rk;
        qq[i] *= rq;
    }
}

ATTR static void F(ps_delta_prepare)(const ps_delta_args *a, const F(ps_delta_prep) *p,
                                     int64_t b, int64_t h, int64_t t0, int64_t n) {
    const int64_t L = a->length, K = a->dk, H = a->heads, Hk = a->kheads;
    const int64_t hk = h / (H / Hk);
    const T *q = a->q, *k = a->k, *beta = a->beta, *g = a->g;
    for (int64_t j = 0; j < n; ++j) {
        const int64_t t = t0 + j, step = (b * L + t) * H + h;
        const T *qs = q + ((b * L + t) * Hk + hk) * K, *ks = k + ((b * L + t) * Hk + hk) * K;
        if (j + PS_KV_FETCH_STEPS < n) {
            const int64_t ahead = PS_KV_FETCH_STEPS * Hk * K;
            F(ps_kv_fetch)(qs + ahead, K, 1);
            F(ps_kv_fetch)(ks + ahead, K, 1);
            if (a->gate == 2) F(ps_kv_fetch)(g + (step + PS_KV_FETCH_STEPS * H) * K, K, 1);
        }
        T *kk = p->kk + j * K, *qq = p->qq + j * K, *dd = p->dd + j * K;
        T *kd = p->kd + j * K, *qd = p->qd + j * K;
        memcpy(kk, ks, sizeof(T) * (size_t)K);
        memcpy(qq, qs, sizeof(T) * (size_t)K);
        if (a->qk_form) F(ps_delta_normalize)(a, kk, qq, K);
        p->bt[j] = beta[step];
        if (a->gate == 1) {
            const T d = EXP(g[step]);
            for (int64_t i = 0; i < K; ++i) dd[i] = d;
        } else if (a->gate == 2) {
            const T *gs = g + step * K;
            for (int64_t i = 0; i < K; i += W)
                F(ps_kv_store_vec)(dd, F(ps_vexp)(F(ps_kv_load_vec)(gs, i, K)), i, K);
        } else {
            for (int64_t i = 0; i < K; ++i) dd[i] = 1;
        }
        for (int64_t i = 0; i < K; ++i) {
            kd[i] = dd[i] * kk[i];
            qd[i] = dd[i] * qq[i];
        }
        T dots[3];
        F(ps_delta_dots)(kk, qq, K, dots);
        p->kq[j] = dots[2];
    }
    F(ps_kv_gather)(p->vv, a->dv, a->v, b, h, t0, n, L, H, a->dv);
    if (a->grad_out) F(ps_kv_gather)(p->go, a->dv, a->grad_out, b, h, t0, n, L, H, a->dv);
}

/* ---- the forward's sweeps over a tile --------------------------------------------- */

/* One step's update of the tile, dst = Diag(d) src + k u^T (dst may be src), and
 * (read) the next step's ak = dst^T kd, aq = dst^T qd (with_q) in the same sweep.
 * `gated`, `read` and `with_q` are constants after inlining. */
PS_DELTA_INLINE void F(ps_delta_update)(T *dst, const T *src, const T *dd, const T *kk,
                                        const V *u, const T *kd, const T *qd, int64_t K,
                                        V *ak, V *aq, const int gated, const int read,
                                        const int with_q) {
    V k0[NB], k1[NB], q0[NB], q1[NB];
    for (int n = 0; n < NB; ++n) k0[n] = k1[n] = q0[n] = q1[n] = (V){0};
    int64_t i = 0;
    for (; i + 1 < K; i += 2) {
        const V *s0 = (const V *)(src + i * VB), *s1 = s0 + NB;
        V *d0 = (V *)(dst + i * VB), *d1 = d0 + NB;
        for (int n = 0; n < NB; ++n) {
            const V x0 = (gated ? dd[i] * s0[n] : s0[n]) + kk[i] * u[n];
            const V x1 = (gated ? dd[i + 1] * s1[n] : s1[n]) + kk[i + 1] * u[n];
            d0[n] = x0;
            d1[n] = x1;
            if (read) {
                k0[n] += x0 * kd[i];
                k1[n] += x1 * kd[i + 1];
                if (with_q) {
                    q0[n] += x0 * qd[i];
                    q1[n] += x1 * qd[i + 1];
                }
            }
        }
    }
    if (i < K) {
        const V *s0 = (const V *)(src + i * VB);
        V *d0 = (V *)(dst + i * VB);
        for (int n = 0; n < NB; ++n) {
            const V x0 = (gated ? dd[i] * s0[n] : s0[n]) + kk[i] * u[n];
            d0[n] = x0;
            if (read) {
                k0[n] += x0 * kd[i];
                if (with_q) q0[n] += x0 * qd[i];
            }
        }
    }
    if (read)
        for (int n = 0; n < NB; ++n) {
            ak[n] = k0[n] + k1[n];
            if (with_q) aq[n] = q0[n] + q1[n];
        }
}

/* ---- forward ---------------------------------------------------------------------- */

typedef struct {
    ps_delta_args *a;
    int64_t nvb, split, nc;
} F(ps_delta_fwd_ctx);

/* The steps [t0, t0 + n) (chunk c) of column block vb of head h, batch row b: the
 * tile holds the state entering t0 (or anything, when t0 starts a sequence). `fetch`:
 * the next chunk's rows of the inputs are fetched meanwhile (ps_delta_fetch_step). */
PS_DELTA_INLINE void F(ps_delta_fwd_block)(const ps_delta_args *a, const F(ps_delta_prep) *p,
                                           const F(ps_kv_seqs) *sq, T *tile, int64_t b,
                                           int64_t h, int64_t vb, int64_t c, int64_t t0,
                                           int64_t n, int64_t nc, const int fetch,
                                           const int gated) {
    const int64_t K = a->dk, Vd = a->dv, H = a->heads, c0 = vb * VB;
    const int64_t KV = K * Vd;
    const T *init = a->initial;
    T *fin = a->final;
    int64_t s = F(ps_kv_seq_at)(sq, t0);
    V ak[NB], aq[NB], u[NB], x[NB];
    for (int m = 0; m < NB; ++m) ak[m] = aq[m] = (V){0}; /* read at the first step */
    int fresh = 1; /* ak and aq are to be read from the tile */
    for (int64_t j = 0; j < n; ++j) {
        const int64_t t = t0 + j;
        if (fetch && t + a->chunk < a->length) F(ps_delta_fetch_step)(a, b, h, t + a->chunk);
        if (t == sq->cu[s])
            F(ps_kv_load_cols)(tile, init ? init + (F(ps_kv_state_row)(sq, s) * H + h) * KV
                                             : NULL, K, Vd, c0);
        if (j == 0 && a->checkpoints)
            F(ps_kv_store_cols)((T *)a->checkpoints + ((b * nc + c) * H + h) * KV, tile, K, Vd,
                                   c0);
        if (fresh) F(ps_kv_read)(tile, p->kd + j * K, p->qd + j * K, K, ak, aq, 1);
        F(ps_kv_load_row)(x, p->vv + j * Vd, Vd, c0);
        const T beta = p->bt[j], kq = p->kq[j];
        for (int m = 0; m < NB; ++m) {
            u[m] = beta * (x[m] - ak[m]);
            x[m] = aq[m] + kq * u[m];
        }
        F(ps_kv_store_row)(p->oo + j * Vd, x, Vd, c0);
        const int last = t == sq->cu[s + 1] - 1;
        fresh = last || j + 1 == n;
        if (fresh)
            F(ps_delta_update)(tile, tile, p->dd + j * K, p->kk + j * K, u, NULL, NULL, K, ak,
                               aq, gated, 0, 0);
        else
            F(ps_delta_update)(tile, tile, p->dd + j * K, p->kk + j * K, u, p->kd + (j + 1) * K,
                               p->qd + (j + 1) * K, K, ak, aq, gated, 1, 1);
        if (last) {
            if (fin)
                F(ps_kv_store_cols)(fin + (F(ps_kv_state_row)(sq, s) * H + h) * KV, tile, K,
                                       Vd, c0);
            while (s < sq->nseq - 1 && sq->cu[s + 1] <= t + 1) ++s;
        }
    }
}

/* The decoding step: the single step of a call with L = 1 (not packed, no checkpoints)
 * on whole column block vb of head h, batch row b, read from the initial state and
 * written to the final one (when wanted) in place, without a tile: the tile path's
 * copies in and out would double the passes over the state, which is all this call
 * reads. The same operations in the same order as ps_delta_fwd_block's, so the same
 * bits. */
PS_DELTA_INLINE void F(ps_delta_fwd_single)(const ps_delta_args *a, const F(ps_delta_prep) *p,
                                            int64_t b, int64_t h, int64_t vb, const int gated) {
    typedef V VA __attribute__((aligned(sizeof(T)))); /* the state's rows: any alignment */
    const int64_t K = a->dk, Vd = a->dv, c0 = vb * VB, at = (b * a->heads + h) * K * Vd + c0;
    const T *src = (const T *)a->initial + at, *kd = p->kd, *qd = p->qd;
    V k0[NB], k1[NB], q0[NB], q1[NB], u[NB], x[NB];
    for (int n = 0; n < NB; ++n) k0[n] = k1[n] = q0[n] = q1[n] = (V){0};
    int64_t i = 0;
    for (; i + 1 < K; i += 2) {
        const VA *r0 = (const VA *)(src + i * Vd), *r1 = (const VA *)(src + (i + 1) * Vd);
        for (int n = 0; n < NB; ++n) {
            k0[n] += r0[n] * kd[i];
            k1[n] += r1[n] * kd[i + 1];
            q0[n] += r0[n] * qd[i];
            q1[n] += r1[n] * qd[i + 1];
        }
    }
    if (i < K) {
        const VA *r0 = (const VA *)(src + i * Vd);
        for (int n = 0; n < NB; ++n) {
            k0[n] += r0[n] * kd[i];
            q0[n] += r0[n] * qd[i];
        }
    }
    F(ps_kv_load_row)(x, p->vv, Vd, c0);
    const T beta = p->bt[0], kq = p->kq[0];
    for (int n = 0; n < NB; ++n) {
        u[n] = beta * (x[n] - (k0[n] + k1[n]));
        x[n] = (q0[n] + q1[n]) + kq * u[n];
    }
    F(ps_kv_store_row)(p->oo, x, Vd, c0);
    if (!a->final) return;
    T *dst = (T *)a->final + at;
    if (F(ps_kv_streams)(dst, Vd)) { /* rows aligned to a vector: stored past the caches */
        for (i = 0; i < K; ++i) {
            const VA *r = (const VA *)(src + i * Vd);
            for (int n = 0; n < NB; ++n)
                F(ps_kv_stream)(dst + i * Vd + n * W,
                                   (gated ? p->dd[i] * r[n] : r[n]) + p->kk[i] * u[n]);
        }
        return;
    }
    for (i = 0; i < K; ++i) {
        const VA *r = (const VA *)(src + i * Vd);
        VA *d = (VA *)(dst + i * Vd);
        for (int n = 0; n < NB; ++n) d[n] = (gated ? p->dd[i] * r[n] : r[n]) + p->kk[i] * u[n];
    }
}

ATTR static void F(ps_delta_fwd_task)(const void *vp, int64_t begin, int64_t end) {
    const F(ps_delta_fwd_ctx) *ctx = vp;
    ps_delta_args *a = ctx->a;
    const int64_t L = a->length, K = a->dk, H = a->heads, C = a->chunk;
    const int64_t nvb = ctx->nvb, split = ctx->split;
    const int64_t most = (nvb + split - 1) / split; /* column blocks of a unit, at most */
    const int64_t Cn = L < C ? L : C; /* steps of a chunk, at most */
    T *tiles = ps_kv_alloc(sizeof(T) * (size_t)(most * K * VB));
    T *pm = malloc(sizeof(T) * (size_t)F(ps_delta_prep_size)(Cn, K, a->dv));
    if (!tiles || !pm) {
        free(tiles);
        free(pm);
        __atomic_store_n(&a->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    const F(ps_delta_prep) p = F(ps_delta_prep_at)(pm, Cn, K, a->dv);
    /* the decoding step (ps_delta_fwd_single) */
    const int single = L == 1 && a->initial && !a->cu_seqlens && !a->checkpoints;
    for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t part = unit % split, bh = unit / split, b = bh / H, h = bh % H;
        const int64_t vb0 = part * nvb / split, vb1 = (part + 1) * nvb / split;
        if (vb0 == vb1) continue;
        F(ps_kv_seqs) sq;
        F(ps_kv_seqs_of)(&sq, a->cu_seqlens, a->nseq, a->length, b);
        for (int64_t c = 0; c < ctx->nc; ++c) {
            const int64_t t0 = c * C, n = L - t0 < C ? L - t0 : C;
            F(ps_delta_prepare)(a, &p, b, h, t0, n);
            for (int64_t vb = vb0; vb < vb1; ++vb) {
                if (single && (vb + 1) * VB <= a->dv) { /* a whole block */
                    if (a->gate)
                        F(ps_delta_fwd_single)(a, &p, b, h, vb, 1);
                    else
                        F(ps_delta_fwd_single)(a, &p, b, h, vb, 0);
                    continue;
                }
                T *tile = tiles + (vb - vb0) * K * VB;
                const int fetch = vb == vb0;
                if (a->gate)
                    F(ps_delta_fwd_block)(a, &p, &sq, tile, b, h, vb, c, t0, n, ctx->nc, fetch, 1);
                else
                    F(ps_delta_fwd_block)(a, &p, &sq, tile, b, h, vb, c, t0, n, ctx->nc, fetch, 0);
            }
            const int64_t c1 = vb1 * VB < a->dv ? vb1 * VB : a->dv;
            F(ps_kv_scatter)(a->out, p.oo, a->dv, b, h, t0, n, L, H, a->dv, vb0 * VB, c1);
        }
    }
    free(tiles);
    free(pm);
#ifdef PS_ISA_VECTOR
    _mm_sfence(); /* the streamed stores (ps_kv_stream) done before the call returns */
#endif
}

ATTR static int F(ps_delta_fwd)(ps_delta_args *a) {
    const int64_t units = a->batch * a->heads, nvb = (a->dv + VB - 1) / VB;
    /* fewer heads than threads: each head's column blocks shared out (columns of the
     * state never interact) */
    const int64_t split = ps_split_units(units, nvb, a->nthreads);
    F(ps_delta_fwd_ctx) ctx = {a, nvb, split, (a->length + a->chunk - 1) / a->chunk};
    const int64_t work = a->batch * a->length * a->heads * a->dk * a->dv;
    const int64_t bytes = (int64_t)sizeof(T);
    ps_prefer_huge_pages(a->out, a->batch * a->length * a->heads * a->dv * bytes);
    if (a->checkpoints) ps_prefer_huge_pages(a->checkpoints, ctx.nc * a->batch * a->heads * a->dk * a->dv * bytes);
    if (a->length > 0)
        ps_parallel_for(units * split, ps_threads_for(work, a->nthreads),
                        F(ps_delta_fwd_task), &ctx);
    return a->failed ? -1 : 0;
}

/* ---- backward --------------------------------------------------------------------- */

typedef struct {
    ps_delta_args *a;
    int64_t nvb, nc;
} F(ps_delta_bwd_ctx);

/* A thread's memory for the backward of a unit's chunk. */
typedef struct {
    F(ps_delta_prep) p;
    T *states; /* (chunk, K, VB): the state before each step of the chunk, one block */
    T *dS;     /* (heads of a unit, nvb, K, VB): the gradient of the state, carried from
                * chunk to chunk */
    T *uu, *ww; /* (chunk, VB): u and v - (d k)^T S of each step, one block */
    T *dq, *dk, *dg; /* (chunk, K): the chunk's sums over the blocks */
    T *db, *dgh;     /* (chunk,) */
} F(ps_delta_bwd_buf);

/* dS = sequence s's grad_final (zeros without one), columns [c0, c0 + VB). */
ATTR static void F(ps_delta_grad_final)(const ps_delta_args *a, const F(ps_kv_seqs) *sq,
                                        int64_t s, int64_t h, T *dS, int64_t c0) {
    const int64_t KV = a->dk * a->dv;
    const T *gf = a->grad_final;
    F(ps_kv_load_cols)(dS, gf ? gf + (F(ps_kv_state_row)(sq, s) * a->heads + h) * KV : NULL,
                          a->dk, a->dv, c0);
}

/* One sweep of the adjoint over the rows of a block's dS (K x NB vectors), W rows at
 * a time (their lane sums interleave with the next rows' multiply-adds):
 *   part B of step jb (when jb >= 0), the step's gradient dS after it given dv:
 *     dP = dS - k dv^T,  grad_k += dS u - Diag(d) S_prev dv,
 *     grad_g += rows of dP * Diag(d) S_prev (summed over rows with a gate per head),
 *     dS = Diag(d) dP
 *   then part A of step ja (when ja >= 0), on the result:
 *     dS += q go^T,  du = dS^T k,  grad_q += Diag(d) S_prev go + k (u . go)
 * `gate` is a constant after inlining. */
PS_DELTA_INLINE void F(ps_delta_adjoint)(const F(ps_delta_bwd_buf) *m, V *dS, int64_t K,
                                         int64_t Vd, int64_t c0, int64_t jb_, int64_t ja_, V *du,
                                         const int has_b, const int has_a, const int gate) {
    /* has_b, has_a and gate are constants after inlining: jb < 0 (ja < 0) is no part B (A) */
    const int64_t jb = has_b ? jb_ : -1, ja = has_a ? ja_ : -1;
    const int gated = gate != 0;
    const F(ps_delta_prep) *p = &m->p;
    const int64_t tsz = K * VB;
    const int64_t jB = jb >= 0 ? jb : 0, jA = ja >= 0 ? ja : 0;
    const V *SpB = (const V *)(m->states + jB * tsz), *SpA = (const V *)(m->states + jA * tsz);
    const T *kkB = p->kk + jB * K, *ddB = p->dd + jB * K;
    const T *kkA = p->kk + jA * K, *ddA = p->dd + jA * K, *qqA = p->qq + jA * K;
    const V *uB = (const V *)(m->uu + jB * VB), *uA = (const V *)(m->uu + jA * VB);
    T *dk = m->dk + jB * K, *dg = m->dg + jB * K, *dq = m->dq + jA * K;
    V dv[NB], go[NB], t1[NB], gacc = (V){0};
    T ud = 0;
    if (jb >= 0) F(ps_kv_load_row)(dv, m->p.oo + jB * Vd, Vd, c0); /* its step's dv */
    if (ja >= 0) {
        F(ps_kv_load_row)(go, p->go + jA * Vd, Vd, c0);
        for (int q = 0; q < NB; ++q) {
            t1[q] = uA[q] * go[q];
            du[q] = (V){0};
        }
        ud = F(ps_kv_hsum)(t1);
    }
    for (int64_t i0 = 0; i0 < K; i0 += W) {
        const int64_t cnt = K - i0 < W ? K - i0 : W;
        V rk[W], r4[W], r1[W];
        T sums[W];
        for (int64_t r = 0; r < cnt; ++r) {
            const int64_t i = i0 + r;
            V *row = dS + i * NB;
            V y[NB];
            for (int q = 0; q < NB; ++q) y[q] = row[q];
            if (jb >= 0) {
                const V *sp = SpB + i * NB;
                V a_k = (V){0}, a_t = (V){0}, a_g = (V){0};
                for (int q = 0; q < NB; ++q) {
                    const V dP = y[q] - kkB[i] * dv[q];
                    a_k += y[q] * uB[q];
                    a_t += sp[q] * dv[q];
                    if (gate) a_g += dP * sp[q];
                    y[q] = gated ? ddB[i] * dP : dP;
                }
                rk[r] = gated ? a_k - ddB[i] * a_t : a_k - a_t;
                if (gate == 2) r4[r] = a_g;
                if (gate == 1) gacc += a_g;
            }
            if (ja >= 0) {
                const V *sp = SpA + i * NB;
                V acc = (V){0};
                for (int q = 0; q < NB; ++q) {
                    y[q] += qqA[i] * go[q];
                    du[q] += y[q] * kkA[i];
                    acc += sp[q] * go[q];
                }
                r1[r] = acc;
            }
            for (int q = 0; q < NB; ++q) row[q] = y[q];
        }
        if (jb >= 0) {
            F(ps_lane_sums)(rk, cnt, sums);
            for (int64_t r = 0; r < cnt; ++r) dk[i0 + r] += sums[r];
            if (gate == 2) {
                F(ps_lane_sums)(r4, cnt, sums);
                for (int64_t r = 0; r < cnt; ++r) dg[i0 + r] += ddB[i0 + r] * sums[r];
            }
        }
        if (ja >= 0) {
            F(ps_lane_sums)(r1, cnt, sums);
            for (int64_t r = 0; r < cnt; ++r) {
                const int64_t i = i0 + r;
                dq[i] += (gated ? ddA[i] * sums[r] : sums[r]) + kkA[i] * ud;
            }
        }
    }
    if (gate == 1 && jb >= 0) {
        T r;
        F(ps_lane_sums)(&gacc, 1, &r);
        m->dgh[jB] += ddB[0] * r;
    }
}

/* The end of step j's part A: dv = beta du (the block's columns of grad_v, which part
 * B reads back) and its share of grad_beta, du . (v - x). */
PS_DELTA_INLINE void F(ps_delta_finish)(const F(ps_delta_bwd_buf) *m, int64_t Vd, int64_t c0,
                                        int64_t j, const V *du) {
    const V *w = (const V *)(m->ww + j * VB);
    V dv[NB], t1[NB];
    for (int q = 0; q < NB; ++q) {
        dv[q] = m->p.bt[j] * du[q];
        t1[q] = du[q] * w[q];
    }
    F(ps_kv_store_row)(m->p.oo + j * Vd, dv, Vd, c0);
    m->db[j] += F(ps_kv_hsum)(t1);
}

/* The backward of steps [t0, t0 + n) (chunk c) for column block vb of head h, batch
 * row b: the states are rebuilt from the chunk's checkpoint, then the adjoint runs
 * from the last step to the first, adding the block's share of the gradients of q,
 * k, beta and g into the chunk's sums and writing its columns of grad_v. `gate` is a
 * constant after inlining. */
PS_DELTA_INLINE void F(ps_delta_bwd_block)(const ps_delta_args *a, const F(ps_delta_bwd_buf) *m,
                                           const F(ps_kv_seqs) *sq, int64_t b, int64_t h,
                                           int64_t vb, int64_t c, int64_t t0, int64_t n,
                                           int64_t nc, const int gate) {
    const int64_t K = a->dk, Vd = a->dv, H = a->heads, c0 = vb * VB;
    const int64_t KV = K * Vd, tsz = K * VB;
    const int gated = gate != 0;
    const F(ps_delta_prep) *p = &m->p;
    const T *init = a->initial;
    V ak[NB], x[NB], u[NB];
    for (int q = 0; q < NB; ++q) u[q] = (V){0}; /* set by every step before the next reads it */

    /* the states, forward */
    int64_t s = F(ps_kv_seq_at)(sq, t0);
    F(ps_kv_load_cols)(m->states, (const T *)a->checkpoints + ((b * nc + c) * H + h) * KV, K,
                          Vd, c0);
    for (int64_t j = 0; j < n; ++j) {
        const int64_t t = t0 + j;
        T *st = m->states + j * tsz;
        if (j > 0 && t != sq->cu[s]) {
            F(ps_delta_update)(st, st - tsz, p->dd + (j - 1) * K, p->kk + (j - 1) * K, u,
                               p->kd + j * K, NULL, K, ak, NULL, gated, 1, 0);
        } else {
            if (j > 0)
                F(ps_kv_load_cols)(st, init ? init + (F(ps_kv_state_row)(sq, s) * H + h) * KV
                                               : NULL, K, Vd, c0);
            F(ps_kv_read)(st, p->kd + j * K, NULL, K, ak, NULL, 0);
        }
        F(ps_kv_load_row)(x, p->vv + j * Vd, Vd, c0);
        V *w = (V *)(m->ww + j * VB), *uj = (V *)(m->uu + j * VB);
        for (int q = 0; q < NB; ++q) {
            w[q] = x[q] - ak[q];
            u[q] = p->bt[j] * w[q];
            uj[q] = u[q];
        }
        if (t == sq->cu[s + 1] - 1)
            while (s < sq->nseq - 1 && sq->cu[s + 1] <= t + 1) ++s;
    }

    /* the adjoint, backward: per step j, part A (dS += q go^T, du = dS^T k) and part
     * B (the rest), B of step j and A of step j - 1 in one sweep over the rows */
    V *dS = (V *)(m->dS + ((h % (H / a->kheads)) * ((Vd + VB - 1) / VB) + vb) * tsz);
    V du[NB];
    for (int q = 0; q < NB; ++q) du[q] = (V){0}; /* set by every part A */
    const int64_t last = t0 + n - 1;
    s = F(ps_kv_seq_at)(sq, last);
    if (last == sq->cu[s + 1] - 1) F(ps_delta_grad_final)(a, sq, s, h, (T *)dS, c0);
    F(ps_delta_adjoint)(m, dS, K, Vd, c0, -1, n - 1, du, 0, 1, gate);
    F(ps_delta_finish)(m, Vd, c0, n - 1, du);
    for (int64_t j = n - 1; j >= 0; --j) {
        const int64_t t = t0 + j;
        while (sq->cu[s] > t) --s;
        const int start = t == sq->cu[s];
        if (!start && j > 0) { /* two call sites: each inlined with its own constants */
            F(ps_delta_adjoint)(m, dS, K, Vd, c0, j, j - 1, du, 1, 1, gate);
            F(ps_delta_finish)(m, Vd, c0, j - 1, du);
        } else {
            F(ps_delta_adjoint)(m, dS, K, Vd, c0, j, -1, du, 1, 0, gate);
        }
        if (!start) continue;
        if (a->grad_initial)
            F(ps_kv_store_cols)((T *)a->grad_initial + (F(ps_kv_state_row)(sq, s) * H + h) * KV,
                                   (const T *)dS, K, Vd, c0);
        if (j == 0) continue;
        int64_t before = s; /* step j - 1 ends the sequence before: its grad_final */
        while (sq->cu[before] > t - 1) --before;
        F(ps_delta_grad_final)(a, sq, before, h, (T *)dS, c0);
        F(ps_delta_adjoint)(m, dS, K, Vd, c0, -1, j - 1, du, 0, 1, gate);
        F(ps_delta_finish)(m, Vd, c0, j - 1, du);
    }
}

ATTR static void F(ps_delta_bwd_task)(const void *vp, int64_t begin, int64_t end) {
    const F(ps_delta_bwd_ctx) *ctx = vp;
    ps_delta_args *a = ctx->a;
    const int64_t L = a->length, K = a->dk, H = a->heads, Hk = a->kheads, C = a->chunk;
    const int64_t nvb = ctx->nvb, tsz = K * VB, per = H / Hk;
    F(ps_delta_bwd_buf) m;
    const int64_t prep = F(ps_delta_prep_size)(C, K, a->dv);
    T *pm = malloc(sizeof(T) * (size_t)(prep + 3 * C * K + 2 * C));
    m.states = ps_kv_alloc(sizeof(T) * (size_t)(C * tsz));
    m.dS = ps_kv_alloc(sizeof(T) * (size_t)(per * nvb * tsz));
    m.uu = ps_kv_alloc(sizeof(T) * (size_t)(2 * C * VB));
    if (!pm || !m.states || !m.dS || !m.uu) {
        free(pm); free(m.states); free(m.dS); free(m.uu);
        __atomic_store_n(&a->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    m.ww = m.uu + C * VB;
    m.p = F(ps_delta_prep_at)(pm, C, K, a->dv);
    m.dq = pm + prep;
    m.dk = m.dq + C * K;
    m.dg = m.dk + C * K;
    m.db = m.dg + C * K;
    m.dgh = m.db + C;
    /* A unit is a q/k head with the value heads it serves: their shares of grad_q and
     * grad_k are summed in head order here, the same bits for any thread count. */
    for (int64_t unit = begin; unit < end; ++unit) {
        const int64_t b = unit / Hk, hk = unit % Hk;
        F(ps_kv_seqs) sq;
        F(ps_kv_seqs_of)(&sq, a->cu_seqlens, a->nseq, a->length, b);
        for (int64_t c = ctx->nc - 1; c >= 0; --c) {
            const int64_t t0 = c * C, n = L - t0 < C ? L - t0 : C;
            memset(m.dq, 0, sizeof(T) * (size_t)(2 * C * K));
            for (int64_t h = hk * per; h < (hk + 1) * per; ++h) {
                F(ps_delta_prepare)(a, &m.p, b, h, t0, n);
                memset(m.dg, 0, sizeof(T) * (size_t)(C * K + 2 * C));
                for (int64_t vb = 0; vb < nvb; ++vb) {
                    if (a->gate == 2)
                        F(ps_delta_bwd_block)(a, &m, &sq, b, h, vb, c, t0, n, ctx->nc, 2);
                    else if (a->gate == 1)
                        F(ps_delta_bwd_block)(a, &m, &sq, b, h, vb, c, t0, n, ctx->nc, 1);
                    else
                        F(ps_delta_bwd_block)(a, &m, &sq, b, h, vb, c, t0, n, ctx->nc, 0);
                }
                F(ps_kv_scatter)(a->grad_v, m.p.oo, a->dv, b, h, t0, n, L, H, a->dv, 0, a->dv);
                for (int64_t j = 0; j < n; ++j) {
                    const int64_t step = (b * L + t0 + j) * H + h;
                    ((T *)a->grad_beta)[step] = m.db[j];
                    if (a->gate == 1) ((T *)a->grad_g)[step] = m.dgh[j];
                    if (a->gate == 2)
                        memcpy((T *)a->grad_g + step * K, m.dg + j * K, sizeof(T) * (size_t)K);
                }
            }
            for (int64_t j = 0; j < n; ++j) {
                const int64_t row = ((b * L + t0 + j) * Hk + hk) * K;
                memcpy((T *)a->grad_q + row, m.dq + j * K, sizeof(T) * (size_t)K);
                memcpy((T *)a->grad_k + row, m.dk + j * K, sizeof(T) * (size_t)K);
            }
        }
    }
    free(pm); free(m.states); free(m.dS); free(m.uu);
}

ATTR static int F(ps_delta_bwd)(ps_delta_args *a) {
    const int64_t L = a->length, H = a->heads, K = a->dk, units = a->batch * a->kheads;
    F(ps_delta_bwd_ctx) ctx = {a, (a->dv + VB - 1) / VB, (L + a->chunk - 1) / a->chunk};
    if (L == 0) return 0;
    const int64_t steps = a->batch * L * H, bytes = (int64_t)sizeof(T);
    ps_prefer_huge_pages(a->grad_v, steps * a->dv * bytes);
    ps_prefer_huge_pages(a->grad_q, a->batch * L * a->kheads * K * bytes);
    ps_prefer_huge_pages(a->grad_k, a->batch * L * a->kheads * K * bytes);
    if (a->gate == 2) ps_prefer_huge_pages(a->grad_g, steps * K * bytes);
    ps_parallel_for(units, ps_threads_for(steps * K * a->dv, a->nthreads),
                    F(ps_delta_bwd_task), &ctx);
    return a->failed ? -1 : 0;
}

#undef PS_DELTA_INLINE
