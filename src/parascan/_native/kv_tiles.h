/* The helpers of the CPU kernels that keep a head's (K, V) matrix state as column
 * blocks of NB vectors (delta_rule/cpu_kernel.h, linear_attention/cpu_kernel.h): a
 * block's rows to and from tensors and tiles, lane sums of a row, the gathers of a
 * chunk's rows of an input, prefetches, packed sequences and the decoding step's
 * streamed stores. A template: a kernel includes it inside each of its instantiations
 * (_native/isa_instance.h), having defined T, TBYTES, V, W, F and ATTR (as there) and
 * NB, VB (the vectors and lanes of its column block, VB = NB W); the functions are
 * F(ps_kv_<name>). Deliberately without an include guard.
 */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h> /* the decoding step's non-temporal stores */
#endif

#define PS_KV_INLINE ATTR static inline __attribute__((always_inline))
/* the tiles' copies, which a kernel without tiles (linear attention's) leaves unused */
#define PS_KV_MAYBE_UNUSED __attribute__((unused))

/* ---- tiles and rows --------------------------------------------------------------- */

/* Columns [c0, c0 + VB) of the (K, Vd) matrix src (NULL: zeros) into a tile, zero
 * past Vd; and back, the lanes past Vd left out. A whole block's row is a copy of
 * constant size (vector moves, no call: a decoding step copies a few thousand rows). */
ATTR PS_KV_MAYBE_UNUSED static void F(ps_kv_load_cols)(T *tile, const T *src, int64_t K, int64_t Vd, int64_t c0) {
    const int64_t w = Vd - c0 < VB ? Vd - c0 : VB;
    for (int64_t i = 0; i < K; ++i) {
        T *row = tile + i * VB;
        if (src && w == VB) {
            memcpy(row, src + i * Vd + c0, sizeof(T) * VB);
            continue;
        }
        if (src) memcpy(row, src + i * Vd + c0, sizeof(T) * (size_t)w);
        for (int64_t l = src ? w : 0; l < VB; ++l) row[l] = 0;
    }
}

ATTR PS_KV_MAYBE_UNUSED static void F(ps_kv_store_cols)(T *dst, const T *tile, int64_t K, int64_t Vd,
                                        int64_t c0) {
    const int64_t w = Vd - c0 < VB ? Vd - c0 : VB;
    if (w == VB)
        for (int64_t i = 0; i < K; ++i) memcpy(dst + i * Vd + c0, tile + i * VB, sizeof(T) * VB);
    else
        for (int64_t i = 0; i < K; ++i)
            memcpy(dst + i * Vd + c0, tile + i * VB, sizeof(T) * (size_t)w);
}

/* One row's block of columns [c0, c0 + VB) as NB vectors, zero past Vd; and back. */
PS_KV_INLINE void F(ps_kv_load_row)(V *x, const T *src, int64_t Vd, int64_t c0) {
    const int64_t w = Vd - c0 < VB ? Vd - c0 : VB;
    if (w == VB) {
        memcpy(x, src + c0, sizeof(T) * VB);
        return;
    }
    for (int n = 0; n < NB; ++n) x[n] = (V){0};
    memcpy(x, src + c0, sizeof(T) * (size_t)w);
}

PS_KV_INLINE void F(ps_kv_store_row)(T *dst, const V *x, int64_t Vd, int64_t c0) {
    const int64_t w = Vd - c0 < VB ? Vd - c0 : VB;
    if (w == VB)
        memcpy(dst + c0, x, sizeof(T) * VB);
    else
        memcpy(dst + c0, x, sizeof(T) * (size_t)w);
}

/* The sum of the lanes of x[0] + ... + x[NB - 1]. */
PS_KV_INLINE T F(ps_kv_hsum)(const V *x) {
    V s = x[0];
    for (int n = 1; n < NB; ++n) s += x[n];
    T r;
    F(ps_lane_sums)(&s, 1, &r);
    return r;
}

/* How many steps ahead a chunk's preparation fetches the rows of its inputs: a head's
 * rows are H K (or H V) elements apart from step to step, further than the hardware
 * prefetchers look, and each would otherwise be a cache miss waited for. */
#define PS_KV_FETCH_STEPS 4

/* Fetch the n elements at x into the cache (L1 when `near`, else L2). */
PS_KV_INLINE void F(ps_kv_fetch)(const T *x, int64_t n, const int near) {
    for (int64_t i = 0; i < n; i += 64 / (int64_t)sizeof(T))
        if (near)
            __builtin_prefetch(x + i, 0, 3);
        else
            __builtin_prefetch(x + i, 0, 2);
    if (near)
        __builtin_prefetch(x + n - 1, 0, 3);
    else
        __builtin_prefetch(x + n - 1, 0, 2);
}

/* Rows [t0, t0 + n) of head h, batch row b, of the (batch, L, H, Vd) tensor src into
 * dst (n rows, ld elements apart), or back, columns [c0, c1). */
ATTR static void F(ps_kv_gather)(T *dst, int64_t ld, const T *src, int64_t b, int64_t h,
                                 int64_t t0, int64_t n, int64_t L, int64_t H, int64_t Vd) {
    for (int64_t j = 0; j < n; ++j) {
        if (j + PS_KV_FETCH_STEPS < n)
            F(ps_kv_fetch)(src + ((b * L + t0 + j + PS_KV_FETCH_STEPS) * H + h) * Vd, Vd, 1);
        memcpy(dst + j * ld, src + ((b * L + t0 + j) * H + h) * Vd, sizeof(T) * (size_t)Vd);
    }
}

ATTR static void F(ps_kv_scatter)(T *dst, const T *src, int64_t ld, int64_t b, int64_t h,
                                  int64_t t0, int64_t n, int64_t L, int64_t H, int64_t Vd,
                                  int64_t c0, int64_t c1) {
    for (int64_t j = 0; j < n; ++j)
        memcpy(dst + ((b * L + t0 + j) * H + h) * Vd + c0, src + j * ld + c0,
               sizeof(T) * (size_t)(c1 - c0));
}

/* Elements [i, i + W) of x as a vector, zeros past K; and back, the lanes past K left
 * out (a whole vector is a move of constant size, no call). */
PS_KV_INLINE V F(ps_kv_load_vec)(const T *x, int64_t i, int64_t K) {
    V v = (V){0};
    if (K - i >= W)
        memcpy(&v, x + i, sizeof v);
    else
        memcpy(&v, x + i, sizeof(T) * (size_t)(K - i));
    return v;
}

PS_KV_INLINE void F(ps_kv_store_vec)(T *x, V v, int64_t i, int64_t K) {
    if (K - i >= W)
        memcpy(x + i, &v, sizeof v);
    else
        memcpy(x + i, &v, sizeof(T) * (size_t)(K - i));
}

/* ak = S^T kd and (with_q) aq = S^T qd over a tile's columns (K rows of VB lanes): two
 * sets of accumulators (even and odd rows), so that 4 NB chains of multiply-adds
 * overlap. A kernel's update sweeps that read the next step's ak and aq as they write a
 * row (delta_rule/, dplr/) sum in this same order: the same bits either way. */
PS_KV_INLINE void F(ps_kv_read)(const T *tile, const T *kd, const T *qd, int64_t K, V *ak,
                                V *aq, const int with_q) {
    V k0[NB], k1[NB], q0[NB], q1[NB];
    for (int n = 0; n < NB; ++n) k0[n] = k1[n] = q0[n] = q1[n] = (V){0};
    int64_t i = 0;
    for (; i + 1 < K; i += 2) {
        const V *r0 = (const V *)(tile + i * VB), *r1 = r0 + NB;
        for (int n = 0; n < NB; ++n) {
            k0[n] += r0[n] * kd[i];
            k1[n] += r1[n] * kd[i + 1];
            if (with_q) {
                q0[n] += r0[n] * qd[i];
                q1[n] += r1[n] * qd[i + 1];
            }
        }
    }
    if (i < K) {
        const V *r0 = (const V *)(tile + i * VB);
        for (int n = 0; n < NB; ++n) {
            k0[n] += r0[n] * kd[i];
            if (with_q) q0[n] += r0[n] * qd[i];
        }
    }
    for (int n = 0; n < NB; ++n) {
        ak[n] = k0[n] + k1[n];
        if (with_q) aq[n] = q0[n] + q1[n];
    }
}

/* ---- sequences -------------------------------------------------------------------- */

/* The sequences of a batch row: packed ones (cu_seqlens), or the row itself as one
 * sequence [0, L) whose states are row b's. */
typedef struct {
    const int64_t *cu;
    int64_t nseq, packed, b;
    int64_t whole[2];
} F(ps_kv_seqs);

PS_KV_INLINE void F(ps_kv_seqs_of)(F(ps_kv_seqs) *s, const int64_t *cu_seqlens, int64_t nseq,
                                   int64_t length, int64_t b) {
    s->packed = cu_seqlens != NULL;
    s->whole[0] = 0;
    s->whole[1] = length;
    s->cu = s->packed ? cu_seqlens : s->whole;
    s->nseq = s->packed ? nseq : 1;
    s->b = b;
}

/* The row of initial, final and their gradients that sequence s owns. */
PS_KV_INLINE int64_t F(ps_kv_state_row)(const F(ps_kv_seqs) *s, int64_t seq) {
    return s->packed ? seq : s->b;
}

/* The sequence holding step t (0 <= t < L): the last s with cu[s] <= t. */
ATTR static int64_t F(ps_kv_seq_at)(const F(ps_kv_seqs) *s, int64_t t) {
    int64_t lo = 0, hi = s->nseq - 1;
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (s->cu[mid] <= t) lo = mid; else hi = mid - 1;
    }
    return lo;
}

/* Non-temporal stores for the decoding step's final state, on the vector levels
 * (x86-64 only): written through the caches, each line of the state is first read for
 * ownership, and the state is read again only at the next token, after the rest of the
 * model (its weights, far more than the caches hold) has gone through them. At
 * Qwen3.5's shape the step went from 3.0-3.8x to 2.3-2.8x torch.add over the state (2
 * threads, alternated runs, BENCHMARKS.md). A state read again at once (a chain of
 * steps with nothing between them) then comes from memory instead of the caches.
 * ps_kv_streams: whether the rows of Vd elements from dst are all vector-aligned. */
PS_KV_INLINE int F(ps_kv_streams)(const T *dst, int64_t Vd) {
#ifdef PS_ISA_VECTOR
    return ((uintptr_t)dst % PS_ISA_VBYTES) == 0 && (Vd * TBYTES) % PS_ISA_VBYTES == 0;
#else
    (void)dst, (void)Vd;
    return 0;
#endif
}

PS_KV_INLINE void F(ps_kv_stream)(T *dst, V x) {
#if defined(PS_ISA_VECTOR) && PS_ISA_VBYTES == 64 && TBYTES == 4
    _mm512_stream_ps(dst, (__m512)x);
#elif defined(PS_ISA_VECTOR) && PS_ISA_VBYTES == 64
    _mm512_stream_pd(dst, (__m512d)x);
#elif defined(PS_ISA_VECTOR) && TBYTES == 4
    _mm256_stream_ps(dst, (__m256)x);
#elif defined(PS_ISA_VECTOR)
    _mm256_stream_pd(dst, (__m256d)x);
#else
    *(V *)dst = x;
#endif
}

#undef PS_KV_INLINE
#undef PS_KV_MAYBE_UNUSED
