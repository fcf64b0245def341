/* The decoding step of the selective and SSD scans (ps_selective_step_*): one step of
 * the recurrence on a cached state, in place. Included by cpu_instance.h once per
 * real type, right after cpu_kernel.h, whose vector exp it uses (T, V, W and SFX are
 * the including type's).
 *
 * Summary of algorithm.
 *   Every unit (batch element, head, row of the head; a channel in Mamba-1's layout,
 *   where a head has one row) is independent: its step size
 *       dt' = softplus(dt + dt_bias) (or dt + dt_bias),
 *   then over its N lanes, W at a time,
 *       h = exp(dt' A) h + dt' x B,   y = sum C h,
 *   and out = (y + D x) silu(z). The lanes are gathered through the operands' own
 *   strides into vectors (a decode step's tensors are small views of projections:
 *   nothing is copied), the exp is the scan's vector exp, and the lane sums run in a
 *   fixed order. One step of a model is tens of thousands of lanes, a few
 *   microseconds of work: it runs on the calling thread (no team to wake); steps
 *   with more than PS_STEP_PARALLEL lanes share their units among the threads.
 */
#define FN(name) PS_CAT(name, SFX)

#ifndef PS_STEP_PARALLEL
#define PS_STEP_PARALLEL (1 << 18) /* lanes in a step that shares its units */
#endif

typedef struct {
    const ps_selective_step_args *a;
} FN(ps_step_ctx_t);

#define PS_STEP_AT(ptr, st, i, j, k) \
    ((const T *)(ptr) + (i) * (st)[0] + (j) * (st)[1] + (k) * (st)[2])

/* lanes values of a row with stride st, zeros after them: one unaligned
 * load for a whole packed row, else through an array (no lane inserts) */
PS_MATH V FN(ps_step_load)(const T *row, int64_t st, int64_t lanes) {
    V v;
    if (st == 1 && lanes == W) {
        memcpy(&v, row, sizeof v);
        return v;
    }
    T tmp[W] = {0};
    for (int64_t j = 0; j < lanes; j++) tmp[j] = row[j * st];
    memcpy(&v, tmp, sizeof v);
    return v;
}

/* the first lanes values of v into a row with stride st */
PS_MATH void FN(ps_step_store)(T *row, int64_t st, int64_t lanes, V v) {
    if (st == 1 && lanes == W) {
        memcpy(row, &v, sizeof v);
        return;
    }
    T tmp[W];
    memcpy(tmp, &v, sizeof v);
    for (int64_t j = 0; j < lanes; j++) row[j * st] = tmp[j];
}

/* A block's units' coordinates (batch, head, row, B's and C's groups), lane j for
 * its unit j. */
typedef struct {
    int64_t b[W], h[W], p[W], gb[W], gc[W];
} FN(ps_step_block_t);

/* The per-unit scalars of a block's count units (count <= W) into a vector, lane j
 * for unit j (lanes past count: 0); per_batch: the operand has a batch dimension. */
static inline V FN(ps_step_gather)(const void *ptr, const int64_t *st,
                                   const FN(ps_step_block_t) *k, int64_t count, int per_batch) {
    T tmp[W] = {0};
    for (int64_t j = 0; j < count; j++) {
        tmp[j] = per_batch ? *PS_STEP_AT(ptr, st, k->b[j], k->h[j], k->p[j])
                           : ((const T *)ptr)[k->h[j] * st[0] + k->p[j] * st[1]];
    }
    V v;
    memcpy(&v, tmp, sizeof v);
    return v;
}

/* Lanes per tile of a unit's state: the exps of a block's tile are taken in one
 * loop of independent vectors (a unit's own few are a chain of dependent
 * operations: run alone, they leave the core waiting on latencies). */
#define PS_STEP_TILE 8

PS_HOT static void FN(ps_step_units)(const void *vctx, int64_t begin, int64_t end) {
    const ps_selective_step_args *a = ((const FN(ps_step_ctx_t) *)vctx)->a;
    const int64_t heads = a->heads, P = a->headdim, N = a->nstate;
    const int64_t per_b = heads / a->B_groups, per_c = heads / a->C_groups;
    const int64_t sn = a->state_stride[3], an = a->A_stride[2];
    const int64_t bn = a->B_stride[2], cn = a->C_stride[2];
    /* the units' coordinates are stepped, not divided out of the unit's index: an
     * integer division per unit would cost more than its arithmetic */
    int64_t b = begin / (heads * P), h = (begin / P) % heads, p = begin % P;
    int64_t gb = h / per_b, in_b = h % per_b, gc = h / per_c, in_c = h % per_c;
    FN(ps_step_block_t) k;
    for (int64_t u0 = begin; u0 < end; u0 += W) {
        const int64_t count = end - u0 < W ? end - u0 : W;
        for (int64_t j = 0; j < count; j++) {
            k.b[j] = b, k.h[j] = h, k.p[j] = p, k.gb[j] = gb, k.gc[j] = gc;
            if (++p == P) {
                p = 0;
                if (++in_b == per_b) in_b = 0, gb++;
                if (++in_c == per_c) in_c = 0, gc++;
                if (++h == heads) h = 0, gb = gc = in_b = in_c = 0, b++;
            }
        }
        /* the block's step sizes and drives, W units at a time */
        const V x = FN(ps_step_gather)(a->x, a->x_stride, &k, count, 1);
        V dt = FN(ps_step_gather)(a->dt, a->dt_stride, &k, count, 1);
        if (a->dt_bias)
            dt += FN(ps_step_gather)(a->dt_bias, a->dt_bias_stride, &k, count, 0);
        if (a->softplus) dt = FN(ps_sel_softplus)(dt);
        const V du = dt * x;
        /* A constant along N (Mamba-2's one decay per head, broadcast): one exp per
         * unit, the block's W of them in one vector */
        V scalar_decay = SPLAT(0);
        if (an == 0) {
            T a0[W] = {0};
            for (int64_t j = 0; j < count; j++)
                a0[j] = *PS_STEP_AT(a->A, a->A_stride, k.h[j], k.p[j], 0);
            V av;
            memcpy(&av, a0, sizeof av);
            scalar_decay = FN(ps_vexp)(av * dt);
        }
        V sums[W];
        for (int64_t j = 0; j < W; j++) sums[j] = SPLAT(0);
        for (int64_t n0 = 0; n0 < N; n0 += W * PS_STEP_TILE) {
            const int64_t tile = N - n0 < W * PS_STEP_TILE ? N - n0 : W * PS_STEP_TILE;
            const int64_t nv = (tile + W - 1) / W;
            V decay[W][PS_STEP_TILE];
            if (an == 0) {
                for (int64_t j = 0; j < count; j++)
                    for (int64_t v = 0; v < nv; v++) decay[j][v] = SPLAT(scalar_decay[j]);
            } else {
                for (int64_t j = 0; j < count; j++) {
                    const T *A = PS_STEP_AT(a->A, a->A_stride, k.h[j], k.p[j], 0) + n0 * an;
                    for (int64_t v = 0; v < nv; v++) {
                        const int64_t lanes = tile - v * W < W ? tile - v * W : W;
                        decay[j][v] = FN(ps_step_load)(A + v * W * an, an, lanes) * dt[j];
                    }
                }
                for (int64_t j = 0; j < count; j++)
                    for (int64_t v = 0; v < nv; v++) decay[j][v] = FN(ps_vexp)(decay[j][v]);
            }
            for (int64_t j = 0; j < count; j++) {
                T *state = (T *)a->state + k.b[j] * a->state_stride[0] +
                           k.h[j] * a->state_stride[1] + k.p[j] * a->state_stride[2] + n0 * sn;
                const T *B = PS_STEP_AT(a->B, a->B_stride, k.b[j], k.gb[j], 0) + n0 * bn;
                const T *C = PS_STEP_AT(a->C, a->C_stride, k.b[j], k.gc[j], 0) + n0 * cn;
                for (int64_t v = 0; v < nv; v++) {
                    const int64_t lanes = tile - v * W < W ? tile - v * W : W;
                    const V hv = decay[j][v] * FN(ps_step_load)(state + v * W * sn, sn, lanes) +
                                 FN(ps_step_load)(B + v * W * bn, bn, lanes) * du[j];
                    const V cv = FN(ps_step_load)(C + v * W * cn, cn, lanes);
                    sums[j] += cv * hv; /* lanes past N: C is 0 there, h 0 */
                    FN(ps_step_store)(state + v * W * sn, sn, lanes, hv);
                }
            }
        }
        V y = FN(ps_sel_lane_sums)(sums);
        if (a->D) y += FN(ps_step_gather)(a->D, a->D_stride, &k, count, 0) * x;
        if (a->z) {
            const V z = FN(ps_step_gather)(a->z, a->z_stride, &k, count, 1);
            y = y * (z * FN(ps_vsigmoid)(z));
        }
        for (int64_t j = 0; j < count; j++) {
            *((T *)a->out + k.b[j] * a->out_stride[0] + k.h[j] * a->out_stride[1] +
              k.p[j] * a->out_stride[2]) = y[j];
        }
    }
}

PS_API int PS_CAT(ps_selective_step, SFX)(const ps_selective_step_args *a) {
    if (a->batch < 0 || a->heads < 0 || a->headdim < 0 || a->nstate < 0 || a->B_groups < 1 ||
        a->C_groups < 1 || a->heads % a->B_groups != 0 || a->heads % a->C_groups != 0)
        return 1;
    const int64_t units = a->batch * a->heads * a->headdim;
    if (units == 0) return 0;
    if (!a->state || !a->x || !a->dt || !a->A || !a->B || !a->C || !a->out) return 1;
    FN(ps_step_ctx_t) ctx = {a};
    if ((double)units * (double)a->nstate < PS_STEP_PARALLEL || a->nthreads <= 1)
        FN(ps_step_units)(&ctx, 0, units);
    else
        ps_parallel_for(units, a->nthreads, FN(ps_step_units), &ctx);
    return 0;
}

#undef PS_STEP_AT
#undef PS_STEP_TILE
#undef FN
