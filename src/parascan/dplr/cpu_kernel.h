/* One instantiation of the generalized delta rule's CPU kernel (cpu.c explains the
 * algorithm). Included by cpu_instance.h once per (state type, instruction set) with:
 *   T        the scalar type (float, double); EXP its scalar exp
 *   V        a GCC vector of W T's; VI, VU the integer vectors of the same shape
 *   NB, VB   the vectors and lanes of a column block (VB = NB W)
 *   F(name)  the instantiation's name for `name`
 *   ATTR     the function attributes of the instruction set (target, fused
 *            multiply-adds) or nothing for the portable build
 * Every tensor is contiguous in its canonical shape (dplr/cpu.py copies). A column
 * block of a head's (K, V) state is a tile of K rows of VB lanes, row i at tile + i VB
 * (the lanes past V are zeros and stay zeros), so that every product of a step is a
 * vector over the block's columns times a broadcast scalar of a, b, k, q or the decay.
 */

/* The level's vector helpers (F(ps_lane_sums), F(ps_vexp), ...) come from
 * _native/isa_instance.h; the tiles, rows, gathers and sequences
 * from _native/kv_tiles.h, which the delta rule's kernel shares. */
#include "kv_tiles.h"

#define PS_DPLR_INLINE ATTR static inline __attribute__((always_inline))

/* ---- a chunk's per-step vectors --------------------------------------------------- */

/* What the steps of a chunk need besides the state, for one (batch row, head): per step
 * j and key channel i, a, b, k, q (times the scale), the decay d = exp(g) (1 without a
 * gate) and d q (what the state before the step is read with for the output); the same
 * in the forward's frames (cpu.c): fa = a lam', fq = d q lam', fb = b / lam, fk = k / lam
 * (lam' the frame's product of decays before the step, lam after it), and fm = lam on
 * every gated step: the next step's lam', the backward's scale of its row sums and, on a
 * step that rebases (flag rb), the multiplier of the state; b . q and k . q; the rows of
 * v (and in the backward of grad_out) gathered, and room for the rows of the output
 * (grad_v) before they are scattered. */
typedef struct {
    T *aa, *bb, *kk, *qq, *dd, *qd; /* (chunk, K) */
    T *fa, *fb, *fk, *fq, *fm;      /* (chunk, K) */
    T *lam;                         /* (K): log lam */
    T *bq, *kq, *rb;                /* (chunk,) */
    T *vv, *oo, *go;                /* (chunk, V): v, out (or grad_v), grad_out */
} F(ps_dplr_prep);

/* The elements of a prep for chunks of C steps; `frames`: with the forward's. */
static inline int64_t F(ps_dplr_prep_size)(int64_t C, int64_t K, int64_t Vd, int frames) {
    return (frames ? 11 : 6) * C * K + K + 3 * C + 3 * C * Vd;
}

static inline F(ps_dplr_prep) F(ps_dplr_prep_at)(T *m, int64_t C, int64_t K, int64_t Vd,
                                                 int frames) {
    F(ps_dplr_prep) p;
    T **rows[11] = {&p.aa, &p.bb, &p.kk, &p.qq, &p.dd, &p.qd, &p.fa, &p.fb, &p.fk, &p.fq, &p.fm};
    const int nrows = frames ? 11 : 6;
    for (int o = 0; o < 11; ++o) *rows[o] = o < nrows ? m + o * C * K : NULL;
    p.lam = m + nrows * C * K;
    p.bq = p.lam + K;
    p.kq = p.bq + C;
    p.rb = p.kq + C;
    p.vv = p.rb + C;
    p.oo = p.vv + C * Vd;
    p.go = p.oo + C * Vd;
    return p;
}

/* The frames' bound on |log lam| (cpu.c): the state in a frame stays within e^16
 * (float32) or e^32 (float64) of the true one. */
#define PS_DPLR_FRAME (TBYTES == 4 ? (T)16 : (T)32)

/* x . y over K, in W lanes summed at the end. */
PS_DPLR_INLINE T F(ps_dplr_dot)(const T *x, const T *y, int64_t K) {
    V acc = (V){0};
    for (int64_t i = 0; i < K; i += W) acc += F(ps_kv_load_vec)(x, i, K) * F(ps_kv_load_vec)(y, i, K);
    T r;
    F(ps_lane_sums)(&acc, 1, &r);
    return r;
}

/* Whether every element of x[0 .. K) is within [-bound, bound] (NaN is not). */
PS_DPLR_INLINE int F(ps_dplr_within)(const T *x, int64_t K, T bound) {
    int ok = 1;
    for (int64_t i = 0; i < K; ++i) ok &= x[i] <= bound && x[i] >= -bound;
    return ok;
}

/* Step j's operands in the forward's frames (cpu.c), from its plain a, b and k at aa, bb
 * and kk, its q (times the scale) and d q prepared, and g at `gs` (the step's decay per
 * head or per channel); `end`: the step ends a sequence or the chunk, and rebases. A frame starts at the chunk's first step and after each
 * step that rebases, with lam' = 1: fa = a and fq = d q, the plain operands' bits. */
PS_DPLR_INLINE void F(ps_dplr_frame)(const ps_dplr_args *a, const F(ps_dplr_prep) *p, int64_t j,
                                     const T *aa, const T *bb, const T *kk, const T *gs,
                                     int end) {
    const int64_t K = a->dk, o = j * K;
    T *fa = p->fa + o, *fb = p->fb + o, *fk = p->fk + o, *fq = p->fq + o, *fm = p->fm + o;
    if (!a->gate) { /* no decay: the plain step, never a frame */
        memcpy(fa, aa, sizeof(T) * (size_t)K);
        memcpy(fb, bb, sizeof(T) * (size_t)K);
        memcpy(fk, kk, sizeof(T) * (size_t)K);
        memcpy(fq, p->qd + o, sizeof(T) * (size_t)K);
        p->rb[j] = 0;
        return;
    }
    const int fresh = j == 0 || p->rb[j - 1] != 0; /* lam' = 1 */
    const T *before = fresh ? NULL : fm - K;        /* lam' of each channel */
    T *lam = p->lam;
    if (fresh)
        for (int64_t i = 0; i < K; ++i) lam[i] = 0;
    if (a->gate == 1) { /* one frame for the head: the scalar exp, as the plain d's */
        lam[0] += gs[0];
        const T e = EXP(lam[0]);
        for (int64_t i = 0; i < K; ++i) fm[i] = e;
    } else {
        for (int64_t i = 0; i < K; i += W) {
            const V x = F(ps_kv_load_vec)(lam, i, K) + F(ps_kv_load_vec)(gs, i, K);
            F(ps_kv_store_vec)(lam, x, i, K);
            F(ps_kv_store_vec)(fm, F(ps_vexp)(x), i, K);
        }
    }
    const T *qq = p->qq + o;
    for (int64_t i = 0; i < K; ++i) {
        fa[i] = before ? aa[i] * before[i] : aa[i];
        fq[i] = fm[i] * qq[i];
    }
    const int rebase = end || !F(ps_dplr_within)(lam, a->gate == 1 ? 1 : K, PS_DPLR_FRAME);
    p->rb[j] = (T)rebase;
    if (rebase) {
        memcpy(fb, bb, sizeof(T) * (size_t)K);
        memcpy(fk, kk, sizeof(T) * (size_t)K);
        return;
    }
    for (int64_t i = 0; i < K; i += W) { /* 1 / lam: a division, cheaper than an exp */
        const V ei = (T)1 / F(ps_kv_load_vec)(fm, i, K);
        F(ps_kv_store_vec)(fb, F(ps_kv_load_vec)(bb, i, K) * ei, i, K);
        F(ps_kv_store_vec)(fk, F(ps_kv_load_vec)(kk, i, K) * ei, i, K);
    }
}

/* Steps [t0, t0 + n) of head h, batch row b: their plain operands, and (frames) those
 * in the frames, with sq the row's sequences; frames = 1 (the forward's) leaves out the
 * plain d and d q of a gate, 2 (the backward's) takes both. */
ATTR static void F(ps_dplr_prepare)(const ps_dplr_args *a, const F(ps_dplr_prep) *p,
                                    const F(ps_kv_seqs) *sq, int64_t b, int64_t h, int64_t t0,
                                    int64_t n, const int frames) {
    const int64_t L = a->length, K = a->dk, H = a->heads, Hk = a->kheads;
    const int64_t hk = h / (H / Hk);
    const T *g = a->g;
    double scale_d;
    memcpy(&scale_d, &a->scale_bits, sizeof scale_d);
    const T scale = (T)scale_d;
    int64_t s = F(ps_kv_seq_at)(sq, t0);
    for (int64_t j = 0; j < n; ++j) {
        const int64_t t = t0 + j, step = (b * L + t) * H + h, row = ((b * L + t) * Hk + hk) * K;
        const T *src[4] = {(const T *)a->a + row, (const T *)a->b + row, (const T *)a->k + row,
                           (const T *)a->q + row};
        T *dst[4] = {p->aa + j * K, p->bb + j * K, p->kk + j * K, p->qq + j * K};
        for (int o = 0; o < 4; ++o) {
            if (j + PS_KV_FETCH_STEPS < n) F(ps_kv_fetch)(src[o] + PS_KV_FETCH_STEPS * Hk * K, K, 1);
            /* the forward reads a, b and k where they are */
            if (frames == 1 && o < 3)
                dst[o] = (T *)src[o]; /* read only */
            else
                memcpy(dst[o], src[o], sizeof(T) * (size_t)K);
        }
        if (a->gate == 2 && j + PS_KV_FETCH_STEPS < n)
            F(ps_kv_fetch)(g + (step + PS_KV_FETCH_STEPS * H) * K, K, 1);
        T *qq = dst[3], *dd = p->dd + j * K, *qd = p->qd + j * K;
        if (scale != 1)
            for (int64_t i = 0; i < K; ++i) qq[i] *= scale;
        if (frames == 1 && a->gate) {
            /* the frames' fm is d at a frame's first step (ps_dplr_frame): d, d q unused */
        } else if (a->gate == 1) {
            const T d = EXP(g[step]);
            for (int64_t i = 0; i < K; ++i) dd[i] = d;
        } else if (a->gate == 2) {
            const T *gs = g + step * K;
            for (int64_t i = 0; i < K; i += W)
                F(ps_kv_store_vec)(dd, F(ps_vexp)(F(ps_kv_load_vec)(gs, i, K)), i, K);
        } else {
            for (int64_t i = 0; i < K; ++i) dd[i] = 1;
        }
        if (frames != 1 || !a->gate)
            for (int64_t i = 0; i < K; ++i) qd[i] = dd[i] * qq[i];
        p->bq[j] = F(ps_dplr_dot)(dst[1], qq, K);
        p->kq[j] = F(ps_dplr_dot)(dst[2], qq, K);
        const int end = t == sq->cu[s + 1] - 1;
        if (frames != 0)
            F(ps_dplr_frame)(a, p, j, dst[0], dst[1], dst[2],
                             a->gate == 2 ? g + step * K : a->gate ? g + step : NULL,
                             end || j == n - 1);
        if (end)
            while (s < sq->nseq - 1 && sq->cu[s + 1] <= t + 1) ++s;
    }
    F(ps_kv_gather)(p->vv, a->dv, a->v, b, h, t0, n, L, H, a->dv);
    if (a->grad_out) F(ps_kv_gather)(p->go, a->dv, a->grad_out, b, h, t0, n, L, H, a->dv);
}

/* ---- the update sweep ------------------------------------------------------------- */

/* A row of one step's update, dst = Diag(d) src + b x^T + k v^T: the one expression the
 * forward, the backward's rebuild and the decoding step share (the same bits). */
#define PS_DPLR_ROW(s, d, bi, x, ki, v) (((gated ? (d) * (s) : (s)) + (bi) * (x)) + (ki) * (v))

/* xa = S^T an and (with_q) xq = S^T qn over a block's columns, S's rows ld elements apart
 * (VB in a tile, V in a state read in place) at any alignment: one chain of multiply-
 * adds per vector, rows in order, the order of the update sweep's reads below (the same
 * bits either way). A step's reads are in that sweep; this one runs where a chunk or a
 * sequence starts. */
PS_DPLR_INLINE void F(ps_dplr_read)(const T *S, int64_t ld, const T *an, const T *qn, int64_t K,
                                    V *xa, V *xq, const int with_q) {
    typedef V VA __attribute__((aligned(sizeof(T))));
    V a0[NB], q0[NB];
    for (int n = 0; n < NB; ++n) a0[n] = q0[n] = (V){0};
    for (int64_t i = 0; i < K; ++i) {
        const VA *r = (const VA *)(S + i * ld);
        for (int n = 0; n < NB; ++n) {
            a0[n] += r[n] * an[i];
            if (with_q) q0[n] += r[n] * qn[i];
        }
    }
    for (int n = 0; n < NB; ++n) {
        xa[n] = a0[n];
        if (with_q) xq[n] = q0[n];
    }
}

/* One step's update of the tile (dst may be src) and (read) the next step's xa = dst^T
 * an, xq = dst^T qn (with_q) in the same sweep. One row at a time, one accumulator per
 * vector: a row's five operations per vector outlast a multiply-add's latency, and the
 * block's operands stay in the 16 vector registers of AVX2 (cpu_instance.h). `gated`,
 * `read` and `with_q` are constants after inlining. */
PS_DPLR_INLINE void F(ps_dplr_update)(T *dst, const T *src, const T *dd, const T *bb,
                                      const T *kk, const V *x, const V *v, const T *an,
                                      const T *qn, int64_t K, V *xa, V *xq, const int gated,
                                      const int read, const int with_q) {
    V a0[NB], q0[NB];
    for (int n = 0; n < NB; ++n) a0[n] = q0[n] = (V){0};
    for (int64_t i = 0; i < K; ++i) {
        const V *s0 = (const V *)(src + i * VB);
        V *d0 = (V *)(dst + i * VB);
        for (int n = 0; n < NB; ++n) {
            const V y = PS_DPLR_ROW(s0[n], dd[i], bb[i], x[n], kk[i], v[n]);
            d0[n] = y;
            if (read) {
                a0[n] += y * an[i];
                if (with_q) q0[n] += y * qn[i];
            }
        }
    }
    if (read)
        for (int n = 0; n < NB; ++n) {
            xa[n] = a0[n];
            if (with_q) xq[n] = q0[n];
        }
}

/* ---- forward ---------------------------------------------------------------------- */

typedef struct {
    ps_dplr_args *a;
    int64_t nvb, split, nc;
} F(ps_dplr_fwd_ctx);

/* The output of a step on a block, o = S[t-1]^T (d q) + (b . q) x + (k . q) v. */
PS_DPLR_INLINE void F(ps_dplr_out)(V *o, const V *xq, const V *x, const V *v, T bq, T kq) {
    for (int m = 0; m < NB; ++m) o[m] = (xq[m] + bq * x[m]) + kq * v[m];
}

/* The steps [t0, t0 + n) (chunk c) of column block vb of head h, batch row b: the tile
 * holds the state entering t0 (or anything, when t0 starts a sequence). */
PS_DPLR_INLINE void F(ps_dplr_fwd_block)(const ps_dplr_args *a, const F(ps_dplr_prep) *p,
                                         const F(ps_kv_seqs) *sq, T *tile, int64_t b, int64_t h,
                                         int64_t vb, int64_t c, int64_t t0, int64_t n,
                                         int64_t nc, const int gated) {
    const int64_t K = a->dk, Vd = a->dv, H = a->heads, c0 = vb * VB, KV = K * Vd;
    const T *init = a->initial;
    T *fin = a->final;
    int64_t s = F(ps_kv_seq_at)(sq, t0);
    V xa[NB], xq[NB], v[NB], o[NB];
    for (int m = 0; m < NB; ++m) xa[m] = xq[m] = (V){0}; /* read at the first step */
    int fresh = 1; /* xa and xq are to be read from the tile */
    for (int64_t j = 0; j < n; ++j) {
        const int64_t t = t0 + j;
        if (t == sq->cu[s])
            F(ps_kv_load_cols)(tile, init ? init + (F(ps_kv_state_row)(sq, s) * H + h) * KV : NULL,
                               K, Vd, c0);
        if (j == 0 && a->checkpoints)
            F(ps_kv_store_cols)((T *)a->checkpoints + ((b * nc + c) * H + h) * KV, tile, K, Vd, c0);
        if (fresh) F(ps_dplr_read)(tile, VB, p->fa + j * K, p->fq + j * K, K, xa, xq, 1);
        F(ps_kv_load_row)(v, p->vv + j * Vd, Vd, c0);
        F(ps_dplr_out)(o, xq, xa, v, p->bq[j], p->kq[j]);
        F(ps_kv_store_row)(p->oo + j * Vd, o, Vd, c0);
        const int last = t == sq->cu[s + 1] - 1;
        fresh = last || j + 1 == n;
        V x[NB];
        for (int m = 0; m < NB; ++m) x[m] = xa[m];
        /* in the step's frame: the multiplier fm (the true state) only where it rebases */
        const T *fm = p->fm + j * K, *fb = p->fb + j * K, *fk = p->fk + j * K;
        const T *an = p->fa + (j + 1) * K, *qn = p->fq + (j + 1) * K;
        if (fresh)
            F(ps_dplr_update)(tile, tile, fm, fb, fk, x, v, NULL, NULL, K, xa, xq, gated, 0, 0);
        else if (gated && p->rb[j] != 0)
            F(ps_dplr_update)(tile, tile, fm, fb, fk, x, v, an, qn, K, xa, xq, 1, 1, 1);
        else
            F(ps_dplr_update)(tile, tile, fm, fb, fk, x, v, an, qn, K, xa, xq, 0, 1, 1);
        if (last) {
            if (fin)
                F(ps_kv_store_cols)(fin + (F(ps_kv_state_row)(sq, s) * H + h) * KV, tile, K, Vd,
                                    c0);
            while (s < sq->nseq - 1 && sq->cu[s + 1] <= t + 1) ++s;
        }
    }
}

/* The decoding step: the single step of a call with L = 1 (not packed, no checkpoints)
 * on whole column block vb of head h, batch row b, read from the initial state and
 * written to the final one (when wanted) in place, without a tile (the tile's copies
 * would double the passes over the state, which is all this call reads). The same
 * operations in the same order as ps_dplr_fwd_block's, so the same bits. */
PS_DPLR_INLINE void F(ps_dplr_fwd_single)(const ps_dplr_args *a, const F(ps_dplr_prep) *p,
                                          int64_t b, int64_t h, int64_t vb, const int gated) {
    typedef V VA __attribute__((aligned(sizeof(T)))); /* the state's rows: any alignment */
    const int64_t K = a->dk, Vd = a->dv, c0 = vb * VB, at = (b * a->heads + h) * K * Vd + c0;
    const T *src = (const T *)a->initial + at;
    V x[NB], xq[NB], v[NB], o[NB];
    F(ps_dplr_read)(src, Vd, p->fa, p->fq, K, x, xq, 1);
    F(ps_kv_load_row)(v, p->vv, Vd, c0);
    F(ps_dplr_out)(o, xq, x, v, p->bq[0], p->kq[0]);
    F(ps_kv_store_row)(p->oo, o, Vd, c0);
    if (!a->final) return;
    T *dst = (T *)a->final + at;
    const T *dd = p->fm, *bb = p->fb, *kk = p->fk; /* a frame's first step: d, b, k */
    if (F(ps_kv_streams)(dst, Vd)) { /* rows aligned to a vector: stored past the caches */
        for (int64_t i = 0; i < K; ++i) {
            const VA *r = (const VA *)(src + i * Vd);
            for (int n = 0; n < NB; ++n)
                F(ps_kv_stream)(dst + i * Vd + n * W, PS_DPLR_ROW(r[n], dd[i], bb[i], x[n], kk[i], v[n]));
        }
        return;
    }
    for (int64_t i = 0; i < K; ++i) {
        const VA *r = (const VA *)(src + i * Vd);
        VA *d = (VA *)(dst + i * Vd);
        for (int n = 0; n < NB; ++n) d[n] = PS_DPLR_ROW(r[n], dd[i], bb[i], x[n], kk[i], v[n]);
    }
}

/* The units a thread runs chunk by chunk together: a chunk's rows of neighbouring heads
 * share their pages and cache lines (a head's rows are H K elements apart from step to
 * step, a new page at RWKV-7's shapes), so that the preparation of a chunk, unit after
 * unit, does not wait on a page walk per row; the units' tiles (a state's worth each)
 * stay in L2. */
#define PS_DPLR_GROUP 16

/* The backward's bytes of a chunk's rebuilt states (cpu.c), which bound how many column
 * blocks a step's sweep takes together (1 MiB: 1.03x faster than 512 KiB at RWKV-7's
 * shape, one and two threads, Zen 1's L2 of 512 KiB notwithstanding). */
#define PS_DPLR_BWD_BYTES ((int64_t)1 << 20)

ATTR static void F(ps_dplr_fwd_task)(const void *vp, int64_t begin, int64_t end) {
    const F(ps_dplr_fwd_ctx) *ctx = vp;
    ps_dplr_args *a = ctx->a;
    const int64_t L = a->length, K = a->dk, H = a->heads, C = a->chunk;
    const int64_t nvb = ctx->nvb, split = ctx->split;
    const int64_t most = (nvb + split - 1) / split; /* column blocks of a unit, at most */
    const int64_t Cn = L < C ? L : C;                /* steps of a chunk, at most */
    const int64_t group = end - begin < PS_DPLR_GROUP ? end - begin : PS_DPLR_GROUP;
    T *tiles = ps_kv_alloc(sizeof(T) * (size_t)(group * most * K * VB));
    T *pm = malloc(sizeof(T) * (size_t)F(ps_dplr_prep_size)(Cn, K, a->dv, 1));
    if (!tiles || !pm) {
        free(tiles);
        free(pm);
        __atomic_store_n(&a->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    const F(ps_dplr_prep) p = F(ps_dplr_prep_at)(pm, Cn, K, a->dv, 1);
    const int single = L == 1 && a->initial && !a->cu_seqlens && !a->checkpoints;
    for (int64_t first = begin; first < end; first += group) {
        const int64_t last = end - first < group ? end : first + group;
        for (int64_t c = 0; c < ctx->nc; ++c) {
            const int64_t t0 = c * C, n = L - t0 < C ? L - t0 : C;
            for (int64_t unit = first; unit < last; ++unit) {
                const int64_t part = unit % split, bh = unit / split, b = bh / H, h = bh % H;
                const int64_t vb0 = part * nvb / split, vb1 = (part + 1) * nvb / split;
                if (vb0 == vb1) continue;
                F(ps_kv_seqs) sq;
                F(ps_kv_seqs_of)(&sq, a->cu_seqlens, a->nseq, a->length, b);
                F(ps_dplr_prepare)(a, &p, &sq, b, h, t0, n, 1);
                for (int64_t vb = vb0; vb < vb1; ++vb) {
                    if (single && (vb + 1) * VB <= a->dv) { /* a whole block */
                        if (a->gate)
                            F(ps_dplr_fwd_single)(a, &p, b, h, vb, 1);
                        else
                            F(ps_dplr_fwd_single)(a, &p, b, h, vb, 0);
                        continue;
                    }
                    T *tile = tiles + ((unit - first) * most + vb - vb0) * K * VB;
                    if (a->gate)
                        F(ps_dplr_fwd_block)(a, &p, &sq, tile, b, h, vb, c, t0, n, ctx->nc, 1);
                    else
                        F(ps_dplr_fwd_block)(a, &p, &sq, tile, b, h, vb, c, t0, n, ctx->nc, 0);
                }
                const int64_t c1 = vb1 * VB < a->dv ? vb1 * VB : a->dv;
                F(ps_kv_scatter)(a->out, p.oo, a->dv, b, h, t0, n, L, H, a->dv, vb0 * VB, c1);
            }
        }
    }
    free(tiles);
    free(pm);
#ifdef PS_ISA_VECTOR
    _mm_sfence(); /* the streamed stores (ps_kv_stream) done before the call returns */
#endif
}

ATTR static int F(ps_dplr_fwd)(ps_dplr_args *a) {
    const int64_t units = a->batch * a->heads, nvb = (a->dv + VB - 1) / VB;
    /* fewer heads than threads: each head's column blocks shared out (columns of the
     * state never interact) */
    const int64_t split = ps_split_units(units, nvb, a->nthreads);
    F(ps_dplr_fwd_ctx) ctx = {a, nvb, split, (a->length + a->chunk - 1) / a->chunk};
    const int64_t work = a->batch * a->length * a->heads * a->dk * a->dv;
    const int64_t bytes = (int64_t)sizeof(T);
    ps_prefer_huge_pages(a->out, a->batch * a->length * a->heads * a->dv * bytes);
    if (a->checkpoints)
        ps_prefer_huge_pages(a->checkpoints, ctx.nc * a->batch * a->heads * a->dk * a->dv * bytes);
    if (a->length > 0)
        ps_parallel_for(units * split, ps_threads_for(work, a->nthreads), F(ps_dplr_fwd_task),
                        &ctx);
    return a->failed ? -1 : 0;
}

/* ---- backward --------------------------------------------------------------------- */

typedef struct {
    ps_dplr_args *a;
    int64_t nvb, nc;
} F(ps_dplr_bwd_ctx);

/* A thread's memory for the backward of a unit's chunk. */
typedef struct {
    F(ps_dplr_prep) p;
    T *states;       /* (chunk, nb, K, VB): the state before each step of the chunk, per
                        block of a group of nb (PS_DPLR_BWD_BYTES) */
    T *dS;           /* (heads of a unit, nvb, K, VB): the gradient of the state, carried */
    T *xx;           /* (chunk, nb, VB): x = a^T S[t-1] of each step, per block */
    V *dx;           /* (2, nb, NB): dx of the step whose part B comes next, and of the one
                        being summed, per block */
    V *rs;           /* (5, K): the rows' sums for grad_a, grad_b, grad_k, grad_q and grad_g
                        over the group's blocks so far, before their lane sums */
    T *xv;           /* (2,): x . go and v . go over the group's blocks so far */
    T *dq, *dk, *da, *db; /* (chunk, K): the unit's sums over blocks and heads */
    T *dg;           /* (chunk, K): the head's sums over blocks */
    T *dgh;          /* (chunk,) */
} F(ps_dplr_bwd_buf);

/* dS = sequence s's grad_final (zeros without one), columns [c0, c0 + VB). */
ATTR static void F(ps_dplr_grad_final)(const ps_dplr_args *a, const F(ps_kv_seqs) *sq, int64_t s,
                                       int64_t h, T *dS, int64_t c0) {
    const int64_t KV = a->dk * a->dv;
    const T *gf = a->grad_final;
    F(ps_kv_load_cols)(dS, gf ? gf + (F(ps_kv_state_row)(sq, s) * a->heads + h) * KV : NULL,
                       a->dk, a->dv, c0);
}

/* lam' of step j, the product of decays its state's frame holds (NULL: 1). */
PS_DPLR_INLINE const T *F(ps_dplr_lam_before)(const F(ps_dplr_prep) *p, int64_t j, int64_t K) {
    return j == 0 || p->rb[j - 1] != 0 ? NULL : p->fm + (j - 1) * K;
}

/* The lane sums of r[0 .. cnt) as one vector's lanes, zeros past cnt (cnt <= W; a
 * full group's count a constant, so without the tail's branches). */
PS_DPLR_INLINE V F(ps_dplr_sums)(const V *r, int64_t cnt) {
    T sums[W];
    if (cnt == W)
        F(ps_lane_sums)(r, W, sums);
    else
        F(ps_lane_sums)(r, cnt, sums);
    return F(ps_kv_load_vec)(sums, 0, cnt);
}

/* One sweep of the adjoint over the rows of block g of a group of nb (dS: its K x NB
 * vectors), dS the gradient of the state after the step. The sums over a row's columns
 * (grad_a, grad_b, grad_k, grad_q, grad_g) are vectors carried in m->rs from the group's
 * first block to its last, which sums their lanes, W rows at a time (interleaved with the
 * next rows' multiply-adds) and adds them into the chunk's sums a vector at a time: one
 * lane-sum tree per row and step for the group, not one per block (1.13x faster at
 * RWKV-7's shape, 4 blocks a group; summing into vectors, not lane by lane, 1.2x). The
 * sweep: 
 *   part B of step jb (when has_b), given its dx (dx_in):
 *     grad_a += S[jb-1] dx,  dS = Diag(d) dS + a dx^T   (the gradient before the step)
 *   then part A of step ja (when has_a), on the result:
 *     dS += q go^T,  dx = dS^T b (dx_out),  grad_v = dS^T k,  grad_b += dS x,
 *     grad_k += dS v,  grad_g += d * rows of dS * S[ja-1] (summed over rows with a
 *     gate per head),  grad_q += Diag(d) S[ja-1] go + b (x . go) + k (v . go)
 * `has_b`, `has_a` and `gate` are constants after inlining. */
PS_DPLR_INLINE void F(ps_dplr_adjoint)(const F(ps_dplr_bwd_buf) *m, V *dS, int64_t K, int64_t Vd,
                                       int64_t c0, int64_t g, int64_t nb, int64_t jb_,
                                       int64_t ja_, const V *dx_in, V *dx_out, const int has_b,
                                       const int has_a, const int gate) {
    const int gated = gate != 0;
    const F(ps_dplr_prep) *p = &m->p;
    const int64_t tsz = K * VB;
    const int64_t jB = has_b ? jb_ : 0, jA = has_a ? ja_ : 0;
    const V *SpB = (const V *)(m->states + (jB * nb + g) * tsz);
    const V *SpA = (const V *)(m->states + (jA * nb + g) * tsz);
    /* the rows' sums: started by the group's first block, summed over lanes by its last */
    const int first = g == 0, last = g == nb - 1;
    V *ra = m->rs, *rb = ra + K, *rk = rb + K, *rq = rk + K, *rg = rq + K;
    const T *aB = p->aa + jB * K, *dB = p->dd + jB * K;
    const T *qA = p->qq + jA * K, *bA = p->bb + jA * K, *kA = p->kk + jA * K;
    /* the states are in the steps' frames: S[jB-1] = Diag(lam') X, d S[jA-1] = Diag(lam) X */
    const T *lB = gated ? F(ps_dplr_lam_before)(p, jB, K) : NULL, *dA = p->fm + jA * K;
    T *gq = m->dq + jA * K, *gk = m->dk + jA * K, *gb = m->db + jA * K, *gg = m->dg + jA * K;
    T *ga = m->da + jB * K;
    V go[NB], x[NB], v[NB], gv[NB], dxo[NB], t1[NB], gacc = (V){0};
    T xg = 0, vg = 0;
    if (has_a) {
        F(ps_kv_load_row)(go, p->go + jA * Vd, Vd, c0);
        F(ps_kv_load_row)(v, p->vv + jA * Vd, Vd, c0);
        const V *xs = (const V *)(m->xx + (jA * nb + g) * VB);
        for (int q = 0; q < NB; ++q) {
            x[q] = xs[q];
            t1[q] = x[q] * go[q];
            gv[q] = dxo[q] = (V){0};
        }
        xg = F(ps_kv_hsum)(t1);
        for (int q = 0; q < NB; ++q) t1[q] = v[q] * go[q];
        vg = F(ps_kv_hsum)(t1);
        if (!first) { /* grad_q's x . go and v . go over the columns of the group's blocks */
            xg += m->xv[0];
            vg += m->xv[1];
        }
        m->xv[0] = xg;
        m->xv[1] = vg;
    }
    for (int64_t i0 = 0; i0 < K; i0 += W) {
        const int64_t cnt = K - i0 < W ? K - i0 : W;
        for (int64_t r = 0; r < cnt; ++r) {
            const int64_t i = i0 + r;
            V *row = dS + i * NB;
            V y[NB];
            for (int q = 0; q < NB; ++q) y[q] = row[q];
            if (has_b) {
                const V *sp = SpB + i * NB;
                V acc = first ? (V){0} : ra[i];
                for (int q = 0; q < NB; ++q) {
                    acc += sp[q] * dx_in[q];
                    y[q] = (gated ? dB[i] * y[q] : y[q]) + aB[i] * dx_in[q];
                }
                ra[i] = acc;
            }
            if (has_a) {
                const V *sp = SpA + i * NB;
                V ab = first ? (V){0} : rb[i], ak = first ? (V){0} : rk[i];
                V aq = first ? (V){0} : rq[i], ag = gate == 2 && !first ? rg[i] : (V){0};
                for (int q = 0; q < NB; ++q) {
                    y[q] += qA[i] * go[q];
                    dxo[q] += y[q] * bA[i];
                    gv[q] += y[q] * kA[i];
                    ab += y[q] * x[q];
                    ak += y[q] * v[q];
                    aq += sp[q] * go[q];
                    if (gate) ag += y[q] * sp[q];
                }
                rb[i] = ab;
                rk[i] = ak;
                rq[i] = aq;
                if (gate == 2) rg[i] = ag;
                if (gate == 1) gacc += ag;
            }
            for (int q = 0; q < NB; ++q) row[q] = y[q];
        }
        /* the rows' sums added into the chunk's, W rows a vector */
        if (!last) continue;
        if (has_b) {
            const V sa = F(ps_dplr_sums)(ra + i0, cnt);
            F(ps_kv_store_vec)(ga, F(ps_kv_load_vec)(ga, i0, K) +
                                       (lB ? F(ps_kv_load_vec)(lB, i0, K) * sa : sa), i0, K);
        }
        if (has_a) {
            const V sb = F(ps_dplr_sums)(rb + i0, cnt), sk = F(ps_dplr_sums)(rk + i0, cnt);
            const V sq = F(ps_dplr_sums)(rq + i0, cnt);
            const V vd = gated ? F(ps_kv_load_vec)(dA, i0, K) : (V){0};
            F(ps_kv_store_vec)(gb, F(ps_kv_load_vec)(gb, i0, K) + sb, i0, K);
            F(ps_kv_store_vec)(gk, F(ps_kv_load_vec)(gk, i0, K) + sk, i0, K);
            F(ps_kv_store_vec)(gq, F(ps_kv_load_vec)(gq, i0, K) +
                                       (((gated ? vd * sq : sq) +
                                         F(ps_kv_load_vec)(bA, i0, K) * xg) +
                                        F(ps_kv_load_vec)(kA, i0, K) * vg), i0, K);
            if (gate == 2)
                F(ps_kv_store_vec)(gg, F(ps_kv_load_vec)(gg, i0, K) +
                                           vd * F(ps_dplr_sums)(rg + i0, cnt), i0, K);
        }
    }
    if (has_a) {
        for (int q = 0; q < NB; ++q) dx_out[q] = dxo[q]; /* (kept in registers, not stored per row) */
        F(ps_kv_store_row)(p->oo + jA * Vd, gv, Vd, c0); /* the block's columns of grad_v */
        if (gate == 1) {
            T r;
            F(ps_lane_sums)(&gacc, 1, &r);
            m->dgh[jA] += dA[0] * r;
        }
    }
}

/* One sweep of the adjoint (F(ps_dplr_adjoint)) for each of a group's nb blocks, dS the
 * first's, dx_in and dx_out (when used) the group's (nb, NB) vectors. */
PS_DPLR_INLINE void F(ps_dplr_adjoint_blocks)(const F(ps_dplr_bwd_buf) *m, V *dS, int64_t K,
                                              int64_t Vd, int64_t vb0, int64_t nb, int64_t jb,
                                              int64_t ja, const V *dx_in, V *dx_out,
                                              const int has_b, const int has_a, const int gate) {
    for (int64_t g = 0; g < nb; ++g)
        F(ps_dplr_adjoint)(m, dS + g * K * NB, K, Vd, (vb0 + g) * VB, g, nb, jb, ja,
                           has_b ? dx_in + g * NB : NULL, has_a ? dx_out + g * NB : NULL, has_b,
                           has_a, gate);
}

/* The backward of steps [t0, t0 + n) (chunk c) for column blocks [vb0, vb0 + nb) of head
 * h, batch row b: each block's states are rebuilt from the chunk's checkpoint, then the
 * adjoint runs from the last step to the first, each step's sweep over the blocks in
 * order (their rows' sums carried from block to block and summed over lanes once),
 * adding the blocks' share of the gradients of q, k, a, b and g into the chunk's sums
 * and writing their columns of grad_v. */
PS_DPLR_INLINE void F(ps_dplr_bwd_blocks)(const ps_dplr_args *a, const F(ps_dplr_bwd_buf) *m,
                                          const F(ps_kv_seqs) *sq, int64_t b, int64_t h,
                                          int64_t vb0, int64_t nb, int64_t c, int64_t t0,
                                          int64_t n, int64_t nc, const int gate) {
    const int64_t K = a->dk, Vd = a->dv, H = a->heads, KV = K * Vd, tsz = K * VB;
    const int gated = gate != 0;
    const F(ps_dplr_prep) *p = &m->p;
    const T *init = a->initial;
    V xa[NB], v[NB];

    /* the states and each step's x, forward, block by block */
    for (int64_t g = 0; g < nb; ++g) {
        const int64_t c0 = (vb0 + g) * VB;
        int64_t s = F(ps_kv_seq_at)(sq, t0);
        F(ps_kv_load_cols)(m->states + g * tsz,
                           (const T *)a->checkpoints + ((b * nc + c) * H + h) * KV, K, Vd, c0);
        for (int64_t j = 0; j < n; ++j) {
            const int64_t t = t0 + j;
            T *st = m->states + (j * nb + g) * tsz;
            if (j > 0 && t != sq->cu[s]) {
                F(ps_kv_load_row)(v, p->vv + (j - 1) * Vd, Vd, c0);
                const int64_t o = (j - 1) * K; /* step j - 1, as the forward ran it */
                const V *x = (const V *)(m->xx + ((j - 1) * nb + g) * VB);
                const T *src = st - nb * tsz;
                if (gated && p->rb[j - 1] != 0)
                    F(ps_dplr_update)(st, src, p->fm + o, p->fb + o, p->fk + o, x, v,
                                      p->fa + j * K, NULL, K, xa, NULL, 1, 1, 0);
                else
                    F(ps_dplr_update)(st, src, p->fm + o, p->fb + o, p->fk + o, x, v,
                                      p->fa + j * K, NULL, K, xa, NULL, 0, 1, 0);
            } else {
                if (j > 0)
                    F(ps_kv_load_cols)(
                        st, init ? init + (F(ps_kv_state_row)(sq, s) * H + h) * KV : NULL, K, Vd,
                        c0);
                F(ps_dplr_read)(st, VB, p->fa + j * K, NULL, K, xa, NULL, 0);
            }
            V *xj = (V *)(m->xx + (j * nb + g) * VB);
            for (int q = 0; q < NB; ++q) xj[q] = xa[q];
            if (t == sq->cu[s + 1] - 1)
                while (s < sq->nseq - 1 && sq->cu[s + 1] <= t + 1) ++s;
        }
    }

    /* the adjoint, backward: B of step j and A of step j - 1 in one sweep over the rows */
    V *dS = (V *)(m->dS + ((h % (H / a->kheads)) * ((Vd + VB - 1) / VB) + vb0) * tsz);
    V *dx[2] = {m->dx, m->dx + nb * NB}; /* as F(ps_dplr_bwd_buf) says */
    int cur = 0;
    for (int64_t q = 0; q < 2 * nb * NB; ++q) m->dx[q] = (V){0}; /* set by every part A */
    const int64_t last = t0 + n - 1;
    int64_t s = F(ps_kv_seq_at)(sq, last);
    if (last == sq->cu[s + 1] - 1)
        for (int64_t g = 0; g < nb; ++g)
            F(ps_dplr_grad_final)(a, sq, s, h, (T *)(dS + g * K * NB), (vb0 + g) * VB);
    F(ps_dplr_adjoint_blocks)(m, dS, K, Vd, vb0, nb, -1, n - 1, NULL, dx[cur], 0, 1, gate);
    for (int64_t j = n - 1; j >= 0; --j) {
        const int64_t t = t0 + j;
        while (sq->cu[s] > t) --s;
        const int start = t == sq->cu[s];
        if (!start && j > 0) { /* two call sites: each inlined with its own constants */
            F(ps_dplr_adjoint_blocks)(m, dS, K, Vd, vb0, nb, j, j - 1, dx[cur], dx[1 - cur], 1,
                                      1, gate);
            cur = 1 - cur;
        } else {
            F(ps_dplr_adjoint_blocks)(m, dS, K, Vd, vb0, nb, j, -1, dx[cur], NULL, 1, 0, gate);
        }
        if (!start) continue;
        for (int64_t g = 0; g < nb && a->grad_initial; ++g)
            F(ps_kv_store_cols)((T *)a->grad_initial + (F(ps_kv_state_row)(sq, s) * H + h) * KV,
                                (const T *)(dS + g * K * NB), K, Vd, (vb0 + g) * VB);
        if (j == 0) continue;
        int64_t before = s; /* step j - 1 ends the sequence before: its grad_final */
        while (sq->cu[before] > t - 1) --before;
        for (int64_t g = 0; g < nb; ++g)
            F(ps_dplr_grad_final)(a, sq, before, h, (T *)(dS + g * K * NB), (vb0 + g) * VB);
        F(ps_dplr_adjoint_blocks)(m, dS, K, Vd, vb0, nb, -1, j - 1, NULL, dx[cur], 0, 1, gate);
    }
}

ATTR static void F(ps_dplr_bwd_task)(const void *vp, int64_t begin, int64_t end) {
    const F(ps_dplr_bwd_ctx) *ctx = vp;
    ps_dplr_args *a = ctx->a;
    const int64_t L = a->length, K = a->dk, H = a->heads, Hk = a->kheads, C = a->chunk;
    const int64_t nvb = ctx->nvb, tsz = K * VB, per = H / Hk;
    const int64_t Cn = L < C ? L : C; /* steps of a chunk, at most */
    F(ps_dplr_bwd_buf) m;
    const int64_t prep = F(ps_dplr_prep_size)(Cn, K, a->dv, 1);
    T *pm = malloc(sizeof(T) * (size_t)(prep + 5 * Cn * K + Cn));
    /* the column blocks swept together: as many as a chunk's states of PS_DPLR_BWD_BYTES
     * hold, at least one */
    const int64_t fit = PS_DPLR_BWD_BYTES / (Cn * tsz * (int64_t)sizeof(T));
    const int64_t nbg = fit < 1 ? 1 : fit < nvb ? fit : nvb;
    m.states = ps_kv_alloc(sizeof(T) * (size_t)(Cn * nbg * tsz));
    const int64_t group = end - begin < PS_DPLR_GROUP ? end - begin : PS_DPLR_GROUP;
    T *dS = ps_kv_alloc(sizeof(T) * (size_t)(group * per * nvb * tsz));
    m.dS = dS;
    m.xx = ps_kv_alloc(sizeof(T) * (size_t)(Cn * nbg * VB));
    m.dx = ps_kv_alloc(sizeof(V) * (size_t)(2 * nbg * NB));
    m.rs = ps_kv_alloc(sizeof(V) * (size_t)(5 * K + 1));
    if (!pm || !m.states || !dS || !m.xx || !m.dx || !m.rs) {
        free(pm);
        free(m.states);
        free(dS);
        free(m.xx);
        free(m.dx);
        free(m.rs);
        __atomic_store_n(&a->failed, 1, __ATOMIC_RELAXED);
        return;
    }
    m.xv = (T *)(m.rs + 5 * K);
    m.p = F(ps_dplr_prep_at)(pm, Cn, K, a->dv, 1);
    m.dq = pm + prep;
    m.dk = m.dq + Cn * K;
    m.da = m.dk + Cn * K;
    m.db = m.da + Cn * K;
    m.dg = m.db + Cn * K;
    m.dgh = m.dg + Cn * K;
    /* A unit is a q/k head with the value heads it serves: their shares of grad_q, grad_k,
     * grad_a and grad_b are summed in head order here, the same bits for any thread
     * count. */
    for (int64_t first = begin; first < end; first += group)
    for (int64_t c = ctx->nc - 1; c >= 0; --c)
        for (int64_t unit = first; unit < (end - first < group ? end : first + group); ++unit) {
            const int64_t b = unit / Hk, hk = unit % Hk;
            const int64_t t0 = c * C, n = L - t0 < C ? L - t0 : C;
            F(ps_kv_seqs) sq;
            F(ps_kv_seqs_of)(&sq, a->cu_seqlens, a->nseq, a->length, b);
            m.dS = dS + (unit - first) * per * nvb * tsz; /* the unit's, carried over chunks */
            memset(m.dq, 0, sizeof(T) * (size_t)(4 * Cn * K));
            for (int64_t h = hk * per; h < (hk + 1) * per; ++h) {
                F(ps_dplr_prepare)(a, &m.p, &sq, b, h, t0, n, 2);
                memset(m.dg, 0, sizeof(T) * (size_t)(Cn * K + Cn));
                for (int64_t vb0 = 0; vb0 < nvb; vb0 += nbg) {
                    const int64_t nb = nvb - vb0 < nbg ? nvb - vb0 : nbg;
                    if (a->gate == 2)
                        F(ps_dplr_bwd_blocks)(a, &m, &sq, b, h, vb0, nb, c, t0, n, ctx->nc, 2);
                    else if (a->gate == 1)
                        F(ps_dplr_bwd_blocks)(a, &m, &sq, b, h, vb0, nb, c, t0, n, ctx->nc, 1);
                    else
                        F(ps_dplr_bwd_blocks)(a, &m, &sq, b, h, vb0, nb, c, t0, n, ctx->nc, 0);
                }
                F(ps_kv_scatter)(a->grad_v, m.p.oo, a->dv, b, h, t0, n, L, H, a->dv, 0, a->dv);
                for (int64_t j = 0; j < n; ++j) {
                    const int64_t step = (b * L + t0 + j) * H + h;
                    if (a->gate == 1) ((T *)a->grad_g)[step] = m.dgh[j];
                    if (a->gate == 2)
                        memcpy((T *)a->grad_g + step * K, m.dg + j * K, sizeof(T) * (size_t)K);
                }
            }
            for (int64_t j = 0; j < n; ++j) {
                const int64_t row = ((b * L + t0 + j) * Hk + hk) * K;
                memcpy((T *)a->grad_q + row, m.dq + j * K, sizeof(T) * (size_t)K);
                memcpy((T *)a->grad_k + row, m.dk + j * K, sizeof(T) * (size_t)K);
                memcpy((T *)a->grad_a + row, m.da + j * K, sizeof(T) * (size_t)K);
                memcpy((T *)a->grad_b + row, m.db + j * K, sizeof(T) * (size_t)K);
            }
        }
    free(pm);
    free(m.states);
    free(dS);
    free(m.xx);
    free(m.dx);
    free(m.rs);
}

ATTR static int F(ps_dplr_bwd)(ps_dplr_args *a) {
    const int64_t L = a->length, H = a->heads, K = a->dk, units = a->batch * a->kheads;
    F(ps_dplr_bwd_ctx) ctx = {a, (a->dv + VB - 1) / VB, (L + a->chunk - 1) / a->chunk};
    if (L == 0) return 0;
    const int64_t steps = a->batch * L * H, bytes = (int64_t)sizeof(T);
    const int64_t rows = a->batch * L * a->kheads * K * bytes;
    ps_prefer_huge_pages(a->grad_v, steps * a->dv * bytes);
    ps_prefer_huge_pages(a->grad_q, rows);
    ps_prefer_huge_pages(a->grad_k, rows);
    ps_prefer_huge_pages(a->grad_a, rows);
    ps_prefer_huge_pages(a->grad_b, rows);
    if (a->gate == 2) ps_prefer_huge_pages(a->grad_g, steps * K * bytes);
    ps_parallel_for(units, ps_threads_for(steps * K * a->dv, a->nthreads), F(ps_dplr_bwd_task),
                    &ctx);
    return a->failed ? -1 : 0;
}

#undef PS_DPLR_ROW
#undef PS_DPLR_GROUP
#undef PS_DPLR_BWD_BYTES
#undef PS_DPLR_INLINE
