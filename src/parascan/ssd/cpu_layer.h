/* The Mamba-2 layer's neighbours of the SSD scan, one instantiation: the depthwise
 * causal convolution (+ bias, + silu) that feeds the scan and the gated RMS norm that
 * follows it, forward and backward (the math and the ABI: abi.h, ps_ssd_conv_args and
 * ps_ssd_norm_args). Included by cpu.c after cpu_kernel.h, with the same T, V, VI, W,
 * ATTR and F, and its vector exp (ps_vexp, ps_vsigmoid).
 *
 * Summary of algorithm.
 *   Both are a few arithmetic operations per element, so their cost is memory traffic
 *   and, unfused, the passes of the torch ops that spell them (ten to twenty each, a
 *   (batch, L, channels) tensor read and written per pass, forward and backward). Here
 *   each is one pass over its inputs and outputs, vectors along the channels.
 *
 *   Convolution: tiles of PS_SSD_CONV_STEPS steps by PS_SSD_CONV_CHANNELS channels of a
 *   batch row, the tile's filter taps held as vectors. The forward writes each output
 *   row into the piece (x, B or C) that holds its channels. The backward recomputes the
 *   pre-activation (width multiply-adds) instead of storing it, forms the gradient
 *   through silu for the tile's steps and the width - 1 after it (the taps of the last
 *   steps read them), then the gradient of x (the transposed filter) and the tile's
 *   partial sums of the gradients of the weight and bias; the partials are summed over
 *   the tiles of each channel block in order (time, then batch), so the bits do not
 *   depend on the thread count.
 *
 *   Norm: one row (a batch row's step) at a time: u, the group's sum of squares, then
 *   the output; the backward recomputes silu(z) and u from y, z and the stored 1/rms,
 *   takes the group's <dout weight, n> and writes grad_y and grad_z in the same pass.
 *   grad_weight is summed per tile of PS_SSD_NORM_ROWS rows, then over the tiles in
 *   order. */

#ifndef PS_SSD_LAYER_CONSTANTS
#define PS_SSD_LAYER_CONSTANTS
#define PS_SSD_CONV_STEPS 64
#define PS_SSD_CONV_CHANNELS 64 /* a multiple of every W */
#define PS_SSD_NORM_ROWS 16
#endif

/* n (< W: the rest zero) or W elements at p, as a vector; and back. */
ATTR static inline V F(ps_layer_load)(const T *p, int64_t n) {
    V v = {0};
    if (n >= W)
        memcpy(&v, p, sizeof v);
    else if (n > 0)
        memcpy(&v, p, sizeof(T) * (size_t)n);
    return v;
}

ATTR static inline void F(ps_layer_store)(T *p, V v, int64_t n) {
    if (n >= W)
        memcpy(p, &v, sizeof v);
    else if (n > 0)
        memcpy(p, &v, sizeof(T) * (size_t)n);
}

ATTR static inline T F(ps_layer_lane_sum)(V v) {
    T s = 0;
    for (int l = 0; l < W; ++l) s += v[l];
    return s;
}

/* ---- the causal convolution --------------------------------------------------------- */

/* The tile's filter taps (taps[k * NV + j] lanes: weight[c0 + j W + l, k], zero past
 * the channels) and bias (zero when absent). */
ATTR static void F(ps_conv_taps)(const ps_ssd_conv_args *a, int64_t c0, int64_t nc, V *taps,
                                 V *bias) {
    const T *w = (const T *)a->weight, *b = (const T *)a->bias;
    const int64_t K = a->width, NV = PS_SSD_CONV_CHANNELS / W;
    for (int64_t k = 0; k < K; ++k)
        for (int64_t j = 0; j < NV; ++j) {
            V v = {0};
            for (int l = 0; l < W; ++l) {
                const int64_t c = j * W + l;
                if (c < nc) v[l] = w[(c0 + c) * K + k];
            }
            taps[k * NV + j] = v;
        }
    for (int64_t j = 0; j < NV; ++j) bias[j] = b ? F(ps_layer_load)(b + c0 + j * W, nc - j * W)
                                                 : (V){0};
}

/* pre[t] over the tile's channel vectors j < nv. */
ATTR static inline V F(ps_conv_pre)(const ps_ssd_conv_args *a, const T *xrow0, int64_t t,
                                    int64_t j, int64_t nc, const V *taps, const V *bias) {
    const int64_t K = a->width, NV = PS_SSD_CONV_CHANNELS / W;
    V acc = bias[j];
    for (int64_t k = 0; k < K; ++k) {
        const int64_t s = t - K + 1 + k;
        if (s >= 0) acc += taps[k * NV + j] * F(ps_layer_load)(xrow0 + s * a->x_stride[1] + j * W,
                                                               nc - j * W);
    }
    return acc;
}

/* The tile's channels [c0, c0 + nc) of row (b, t) between the pieces and row[]. */
ATTR static void F(ps_conv_scatter)(const ps_ssd_conv_args *a, int64_t b, int64_t t, int64_t c0,
                                    int64_t nc, const T *row) {
    int64_t start = 0;
    for (int p = 0; p < 3; ++p) {
        const int64_t width = a->split[p], lo = c0 > start ? c0 : start;
        const int64_t hi = c0 + nc < start + width ? c0 + nc : start + width;
        if (hi > lo)
            memcpy((T *)a->out[p] + (b * a->length + t) * width + (lo - start), row + (lo - c0),
                   sizeof(T) * (size_t)(hi - lo));
        start += width;
    }
}

ATTR static void F(ps_conv_gather)(const ps_ssd_conv_args *a, int64_t b, int64_t t, int64_t c0,
                                   int64_t nc, T *row) {
    int64_t start = 0;
    for (int p = 0; p < 3; ++p) {
        const int64_t width = a->split[p], lo = c0 > start ? c0 : start;
        const int64_t hi = c0 + nc < start + width ? c0 + nc : start + width;
        if (hi > lo)
            memcpy(row + (lo - c0),
                   (const T *)a->grad_out[p] + (b * a->length + t) * width + (lo - start),
                   sizeof(T) * (size_t)(hi - lo));
        start += width;
    }
}

/* The tiling: a batch row's L steps in ntb blocks of PS_SSD_CONV_STEPS, its CH
 * channels in ncb blocks of PS_SSD_CONV_CHANNELS; the tiles are numbered (batch, time
 * block, channel block), channel block fastest. */
typedef struct {
    int64_t L, CH, ntb, ncb;
} F(ps_conv_grid);

ATTR static inline F(ps_conv_grid) F(ps_conv_grid_of)(const ps_ssd_conv_args *a) {
    const int64_t L = a->length, CH = a->channels;
    return (F(ps_conv_grid)){L, CH, (L + PS_SSD_CONV_STEPS - 1) / PS_SSD_CONV_STEPS,
                             (CH + PS_SSD_CONV_CHANNELS - 1) / PS_SSD_CONV_CHANNELS};
}

/* Tile i: batch row b, time block tb (steps [t0, t1)), channels [c0, c0 + nc) in nv
 * vectors. */
typedef struct {
    int64_t b, tb, c0, nc, nv, t0, t1;
} F(ps_conv_tile);

ATTR static inline F(ps_conv_tile) F(ps_conv_tile_at)(const F(ps_conv_grid) *g, int64_t i) {
    const int64_t b = i / (g->ntb * g->ncb), tb = i / g->ncb % g->ntb, cb = i % g->ncb;
    const int64_t c0 = cb * PS_SSD_CONV_CHANNELS;
    const int64_t nc = g->CH - c0 < PS_SSD_CONV_CHANNELS ? g->CH - c0 : PS_SSD_CONV_CHANNELS;
    const int64_t t0 = tb * PS_SSD_CONV_STEPS;
    const int64_t t1 = t0 + PS_SSD_CONV_STEPS < g->L ? t0 + PS_SSD_CONV_STEPS : g->L;
    return (F(ps_conv_tile)){b, tb, c0, nc, (nc + W - 1) / W, t0, t1};
}

ATTR static void F(ps_conv_fwd_tiles)(const void *ctx, int64_t begin, int64_t end) {
    const ps_ssd_conv_args *a = (const ps_ssd_conv_args *)ctx;
    enum { NV = PS_SSD_CONV_CHANNELS / W };
    const F(ps_conv_grid) grid = F(ps_conv_grid_of)(a);
    V taps[PS_SSD_CONV_MAX_WIDTH * NV], bias[NV];
    V row[NV];
    for (int64_t i = begin; i < end; ++i) {
        const F(ps_conv_tile) tile = F(ps_conv_tile_at)(&grid, i);
        const T *xrow0 = (const T *)a->x + tile.b * a->x_stride[0] + tile.c0;
        F(ps_conv_taps)(a, tile.c0, tile.nc, taps, bias);
        for (int64_t t = tile.t0; t < tile.t1; ++t) {
            for (int64_t j = 0; j < tile.nv; ++j) {
                const V pre = F(ps_conv_pre)(a, xrow0, t, j, tile.nc, taps, bias);
                row[j] = a->silu ? pre * F(ps_vsigmoid)(pre) : pre;
            }
            F(ps_conv_scatter)(a, tile.b, t, tile.c0, tile.nc, (const T *)row);
        }
    }
}

/* The backward of a tile: grad_x for its steps, and into part (the tile's (width + 1,
 * channels) block of partial sums: width rows of grad_weight's columns, then
 * grad_bias) its sums. */
typedef struct {
    const ps_ssd_conv_args *a;
    T *part;
} F(ps_conv_bwd_ctx);

ATTR static void F(ps_conv_bwd_tiles)(const void *ctx, int64_t begin, int64_t end) {
    const ps_ssd_conv_args *a = ((const F(ps_conv_bwd_ctx) *)ctx)->a;
    T *part = ((const F(ps_conv_bwd_ctx) *)ctx)->part;
    enum { NV = PS_SSD_CONV_CHANNELS / W, ROWS = PS_SSD_CONV_STEPS + PS_SSD_CONV_MAX_WIDTH - 1 };
    const F(ps_conv_grid) grid = F(ps_conv_grid_of)(a);
    const int64_t L = grid.L, CH = grid.CH, K = a->width;
    V taps[PS_SSD_CONV_MAX_WIDTH * NV], bias[NV];
    V gp[ROWS * NV]; /* the gradient of pre for steps t0 .. te - 1 */
    V gw[PS_SSD_CONV_MAX_WIDTH * NV], gb[NV];
    V grow[NV];
    for (int64_t j = 0; j < NV; ++j) grow[j] = (V){0}; /* lanes past the channels stay 0 */
    for (int64_t i = begin; i < end; ++i) {
        const F(ps_conv_tile) tile = F(ps_conv_tile_at)(&grid, i);
        const int64_t b = tile.b, c0 = tile.c0, nc = tile.nc, nv = tile.nv;
        const int64_t t0 = tile.t0, t1 = tile.t1;
        const int64_t te = t1 + K - 1 < L ? t1 + K - 1 : L;
        const T *xrow0 = (const T *)a->x + b * a->x_stride[0] + c0;
        T *gx0 = (T *)a->grad_x + b * a->grad_x_stride[0] + c0;
        F(ps_conv_taps)(a, c0, nc, taps, bias);
        for (int64_t t = t0; t < te; ++t) {
            F(ps_conv_gather)(a, b, t, c0, nc, (T *)grow);
            for (int64_t j = 0; j < nv; ++j) {
                V g = grow[j];
                if (a->silu) {
                    const V pre = F(ps_conv_pre)(a, xrow0, t, j, nc, taps, bias);
                    const V s = F(ps_vsigmoid)(pre);
                    g = g * (s * ((T)1 + pre * ((T)1 - s)));
                }
                gp[(t - t0) * NV + j] = g;
            }
        }
        for (int64_t j = 0; j < NV; ++j) gb[j] = (V){0};
        for (int64_t k = 0; k < K * NV; ++k) gw[k] = (V){0};
        for (int64_t t = t0; t < t1; ++t)
            for (int64_t j = 0; j < nv; ++j) {
                const V g = gp[(t - t0) * NV + j];
                gb[j] += g;
                V dx = {0};
                for (int64_t k = 0; k < K; ++k) {
                    const int64_t s = t - K + 1 + k; /* the input tap k of step t reads */
                    if (s >= 0)
                        gw[k * NV + j] += g * F(ps_layer_load)(xrow0 + s * a->x_stride[1] + j * W,
                                                               nc - j * W);
                    const int64_t u = t + K - 1 - k; /* the step whose tap k reads x[t] */
                    if (u < te) dx += taps[k * NV + j] * gp[(u - t0) * NV + j];
                }
                F(ps_layer_store)(gx0 + t * a->grad_x_stride[1] + j * W, dx, nc - j * W);
            }
        T *dst = part + (b * grid.ntb + tile.tb) * (K + 1) * CH + c0;
        for (int64_t j = 0; j < nv; ++j) {
            for (int64_t k = 0; k < K; ++k) F(ps_layer_store)(dst + k * CH + j * W, gw[k * NV + j],
                                                              nc - j * W);
            F(ps_layer_store)(dst + K * CH + j * W, gb[j], nc - j * W);
        }
    }
}

ATTR static int F(ps_ssd_conv_fwd)(ps_ssd_conv_args *a) {
    const F(ps_conv_grid) grid = F(ps_conv_grid_of)(a);
    const int64_t tiles = a->batch * grid.ntb * grid.ncb;
    ps_parallel_for(tiles, a->nthreads, F(ps_conv_fwd_tiles), a);
    return 0;
}

ATTR static int F(ps_ssd_conv_bwd)(ps_ssd_conv_args *a) {
    const F(ps_conv_grid) grid = F(ps_conv_grid_of)(a);
    const int64_t CH = grid.CH, K = a->width;
    const int64_t rows = a->batch * grid.ntb, tiles = rows * grid.ncb;
    T *part = NULL;
    if (rows * CH > 0) {
        part = (T *)ps_ssd_alloc(sizeof(T) * (size_t)(rows * (K + 1) * CH));
        if (!part) {
            a->failed = 1;
            return -1;
        }
    }
    const F(ps_conv_bwd_ctx) ctx = {a, part};
    ps_parallel_for(tiles, a->nthreads, F(ps_conv_bwd_tiles), &ctx);
    /* The partial sums of every (batch, time block) in order, then to (channels, width). */
    T *gw = (T *)a->grad_weight, *gb = (T *)a->grad_bias;
    for (int64_t c = 0; c < CH; ++c) {
        for (int64_t k = 0; k <= K; ++k) {
            T s = 0;
            for (int64_t r = 0; r < rows; ++r) s += part[(r * (K + 1) + k) * CH + c];
            if (k < K)
                gw[c * K + k] = s;
            else if (gb)
                gb[c] = s;
        }
    }
    free(part);
    return 0;
}

/* ---- the gated RMS norm ------------------------------------------------------------- */

typedef struct {
    const ps_ssd_norm_args *a;
    T *part; /* backward: per tile of rows, the partial sums of grad_weight */
    T eps;
} F(ps_norm_ctx);

ATTR static void F(ps_norm_fwd_rows)(const void *ctx, int64_t begin, int64_t end) {
    const ps_ssd_norm_args *a = ((const F(ps_norm_ctx) *)ctx)->a;
    const T eps = ((const F(ps_norm_ctx) *)ctx)->eps;
    const int64_t D = a->dim, G = a->groups, gs = D / G, L = a->length;
    const T *w = (const T *)a->weight;
    T *rstd = (T *)a->rstd;
    for (int64_t r = begin; r < end; ++r) {
        const T *y = (const T *)a->y + r * D;
        const T *z = (const T *)a->z + r / L * a->z_stride[0] + r % L * a->z_stride[1];
        T *out = (T *)a->out + r * D;
        for (int64_t g = 0; g < G; ++g) {
            const int64_t lo = g * gs, hi = lo + gs;
            V ss = {0};
            for (int64_t c = lo; c < hi; c += W) {
                V u = F(ps_layer_load)(y + c, hi - c);
                if (!a->before_gate) {
                    const V zv = F(ps_layer_load)(z + c, hi - c);
                    u *= zv * F(ps_vsigmoid)(zv);
                }
                ss += u * u;
            }
            const T inv = (T)1 / (T)sqrt((double)(F(ps_layer_lane_sum)(ss) / (T)gs + eps));
            rstd[r * G + g] = inv;
            for (int64_t c = lo; c < hi; c += W) {
                const V zv = F(ps_layer_load)(z + c, hi - c);
                const V sz = zv * F(ps_vsigmoid)(zv);
                V o = F(ps_layer_load)(y + c, hi - c);
                if (!a->before_gate) o *= sz;
                o = o * inv * F(ps_layer_load)(w + c, hi - c);
                if (a->before_gate) o *= sz;
                F(ps_layer_store)(out + c, o, hi - c);
            }
        }
    }
}

/* Tiles of PS_SSD_NORM_ROWS rows; the tile's grad_weight partial sums in part. */
ATTR static void F(ps_norm_bwd_tiles)(const void *ctx, int64_t begin, int64_t end) {
    const ps_ssd_norm_args *a = ((const F(ps_norm_ctx) *)ctx)->a;
    T *part = ((const F(ps_norm_ctx) *)ctx)->part;
    const int64_t D = a->dim, G = a->groups, gs = D / G, L = a->length;
    const int64_t rows = a->batch * L;
    const T *w = (const T *)a->weight, *rstd = (const T *)a->rstd;
    for (int64_t i = begin; i < end; ++i) {
        T *gw = part + i * D;
        memset(gw, 0, sizeof(T) * (size_t)D);
        const int64_t r1 = (i + 1) * PS_SSD_NORM_ROWS < rows ? (i + 1) * PS_SSD_NORM_ROWS : rows;
        for (int64_t r = i * PS_SSD_NORM_ROWS; r < r1; ++r) {
            const int64_t b = r / L, t = r % L;
            const T *y = (const T *)a->y + r * D, *go = (const T *)a->grad_out + r * D;
            const T *z = (const T *)a->z + b * a->z_stride[0] + t * a->z_stride[1];
            T *gy = (T *)a->grad_y + r * D;
            T *gz = (T *)a->grad_z + b * a->grad_z_stride[0] + t * a->grad_z_stride[1];
            for (int64_t g = 0; g < G; ++g) {
                const int64_t lo = g * gs, hi = lo + gs;
                const T inv = rstd[r * G + g];
                /* pass 1: <dn, n> over the group, dn = d out / d n (n = u rstd) */
                V dot = {0};
                for (int64_t c = lo; c < hi; c += W) {
                    const V zv = F(ps_layer_load)(z + c, hi - c);
                    const V sz = zv * F(ps_vsigmoid)(zv);
                    const V yv = F(ps_layer_load)(y + c, hi - c);
                    const V n = (a->before_gate ? yv : yv * sz) * inv;
                    V dn = F(ps_layer_load)(go + c, hi - c) * F(ps_layer_load)(w + c, hi - c);
                    if (a->before_gate) dn *= sz;
                    dot += dn * n;
                }
                const T mean = F(ps_layer_lane_sum)(dot) / (T)gs;
                /* pass 2: du = rstd (dn - n <dn, n> / gs), then grad_y, grad_z, grad_weight */
                for (int64_t c = lo; c < hi; c += W) {
                    const V zv = F(ps_layer_load)(z + c, hi - c);
                    const V s = F(ps_vsigmoid)(zv);
                    const V sz = zv * s, dsz = s * ((T)1 + zv * ((T)1 - s));
                    const V yv = F(ps_layer_load)(y + c, hi - c);
                    const V gov = F(ps_layer_load)(go + c, hi - c);
                    const V wv = F(ps_layer_load)(w + c, hi - c);
                    const V n = (a->before_gate ? yv : yv * sz) * inv;
                    V dn = gov * wv;
                    if (a->before_gate) dn *= sz;
                    const V du = (dn - n * mean) * inv;
                    V dy, dz, dw;
                    if (a->before_gate) {
                        dy = du;
                        dz = gov * n * wv * dsz;
                        dw = gov * n * sz;
                    } else {
                        dy = du * sz;
                        dz = du * yv * dsz;
                        dw = gov * n;
                    }
                    F(ps_layer_store)(gy + c, dy, hi - c);
                    F(ps_layer_store)(gz + c, dz, hi - c);
                    F(ps_layer_store)(gw + c, F(ps_layer_load)(gw + c, hi - c) + dw, hi - c);
                }
            }
        }
    }
}

ATTR static int F(ps_ssd_norm_fwd)(ps_ssd_norm_args *a) {
    double eps;
    memcpy(&eps, &a->eps_bits, sizeof eps);
    const F(ps_norm_ctx) ctx = {a, NULL, (T)eps};
    ps_parallel_for(a->batch * a->length, a->nthreads, F(ps_norm_fwd_rows), &ctx);
    return 0;
}

ATTR static int F(ps_ssd_norm_bwd)(ps_ssd_norm_args *a) {
    const int64_t D = a->dim, rows = a->batch * a->length;
    const int64_t tiles = (rows + PS_SSD_NORM_ROWS - 1) / PS_SSD_NORM_ROWS;
    T *gw = (T *)a->grad_weight;
    if (tiles * D == 0) {
        if (D) memset(gw, 0, sizeof(T) * (size_t)D);
        return 0;
    }
    T *part = (T *)ps_ssd_alloc(sizeof(T) * (size_t)(tiles * D));
    if (!part) {
        a->failed = 1;
        return -1;
    }
    const F(ps_norm_ctx) ctx = {a, part, 0};
    ps_parallel_for(tiles, a->nthreads, F(ps_norm_bwd_tiles), &ctx);
    memcpy(gw, part, sizeof(T) * (size_t)D);
    for (int64_t i = 1; i < tiles; ++i)
        for (int64_t c = 0; c < D; ++c) gw[c] += part[i * D + c];
    free(part);
    return 0;
}
