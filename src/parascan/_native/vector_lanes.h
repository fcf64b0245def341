/* Lane sums and in-register transposes of GCC vectors, for the kernels that keep
 * state rows as vectors (ssd/cpu_kernel.h, delta_rule/cpu_kernel.h). A template: a
 * kernel includes it inside each of its instantiations, having defined
 *   T, V, VI, W   the element type, a GCC vector of W of them, the integer vector of
 *                 the same shape (shuffle masks)
 *   F(name)       the instantiation's name for `name`
 *   ATTR          the functions' attributes (the instruction set's target)
 * and gets F(ps_lane_sums) (W vectors' sums at once), F(ps_lane_sums_n) (any count)
 * and F(ps_transpose) (a W x W tile in place). Its macros are undefined at its end.
 * Deliberately without an include guard.
 */

#define LANE_LO(s, i) \
    ((i) % (2 * (s)) < (s) ? (i) / (2 * (s)) * 2 * (s) + (i) % (2 * (s)) \
                          : W + (i) / (2 * (s)) * 2 * (s) + (i) % (2 * (s)) - (s))
#define LANE_HI(s, i) \
    ((i) % (2 * (s)) < (s) ? (i) / (2 * (s)) * 2 * (s) + (s) + (i) % (2 * (s)) \
                          : W + (i) / (2 * (s)) * 2 * (s) + (i) % (2 * (s)))
#if W == 16
#define LANES(M, s) M(s, 0), M(s, 1), M(s, 2), M(s, 3), M(s, 4), M(s, 5), M(s, 6), M(s, 7), \
    M(s, 8), M(s, 9), M(s, 10), M(s, 11), M(s, 12), M(s, 13), M(s, 14), M(s, 15)
#elif W == 8
#define LANES(M, s) M(s, 0), M(s, 1), M(s, 2), M(s, 3), M(s, 4), M(s, 5), M(s, 6), M(s, 7)
#elif W == 4
#define LANES(M, s) M(s, 0), M(s, 1), M(s, 2), M(s, 3)
#elif W == 2
#define LANES(M, s) M(s, 0), M(s, 1)
#endif
/* One level of the lane-sum tree: pairs of lanes s apart summed, a's sums in the
 * low half of each block of 2s lanes and b's in the high half. */
#define LEVEL(a, b, s) \
    (__builtin_shuffle((a), (b), (VI){LANES(LANE_LO, s)}) + \
     __builtin_shuffle((a), (b), (VI){LANES(LANE_HI, s)}))

/* dst[i] = the sum of the lanes of v[i], i < count <= W: W vectors summed at once by
 * a tree of shuffles (log2 W levels of W / 2 ... 1 pairs of neighbours), vector i's bits
 * becoming the lane's bits, so lane i of the root holds v[i]'s sum. The levels go from
 * lanes 1 apart to W / 2 apart: only the last level's one pair crosses the 128-bit
 * halves of a vector, which costs several shuffles within them on AMD Zen 1 (1.04x
 * faster DPLR backward there than the widest level first). */
ATTR static inline __attribute__((always_inline)) void F(ps_lane_sums)(const V *v,
                                                                            int64_t count,
                                                                            T *dst) {
    V r[W];
    for (int i = 0; i < W; ++i) r[i] = i < count ? v[i] : (V){0};
    for (int j = 0; j < W / 2; ++j) r[j] = LEVEL(r[2 * j], r[2 * j + 1], 1);
#if W >= 4
    for (int j = 0; j < W / 4; ++j) r[j] = LEVEL(r[2 * j], r[2 * j + 1], 2);
#endif
#if W >= 8
    for (int j = 0; j < W / 8; ++j) r[j] = LEVEL(r[2 * j], r[2 * j + 1], 4);
#endif
#if W >= 16
    r[0] = LEVEL(r[0], r[1], 8);
#endif
    memcpy(dst, &r[0], sizeof(T) * (size_t)count); /* one vector store when count is W */
}

ATTR static inline void F(ps_lane_sums_n)(const V *v, int64_t n, T *dst) {
    for (int64_t i = 0; i < n; i += W) F(ps_lane_sums)(v + i, n - i < W ? n - i : W, dst + i);
}

/* Lane i of v[r] as lane r of v[i], r, i < W, in place: log2 W levels, each swapping
 * the off-diagonal s x s blocks of every 2s x 2s block of the tile (a lane's bit s
 * exchanged with its row's), two two-vector shuffles per pair of rows. */
#define TR_LO(s, i) ((i) & (s) ? W + (i) - (s) : (i))
#define TR_HI(s, i) ((i) & (s) ? W + (i) : (i) + (s))
#define TR_LEVEL(v, s)                                                          \
    for (int r = 0; r < W; ++r)                                                 \
        if (!(r & (s))) {                                                       \
            const V lo_ = __builtin_shuffle(v[r], v[r + (s)], (VI){LANES(TR_LO, s)}); \
            v[r + (s)] = __builtin_shuffle(v[r], v[r + (s)], (VI){LANES(TR_HI, s)}); \
            v[r] = lo_;                                                         \
        }
ATTR static inline __attribute__((always_inline)) void F(ps_transpose)(V *v) {
    TR_LEVEL(v, 1)
#if W >= 4
    TR_LEVEL(v, 2)
#endif
#if W >= 8
    TR_LEVEL(v, 4)
#endif
#if W >= 16
    TR_LEVEL(v, 8)
#endif
}

#undef LANE_LO
#undef LANE_HI
#undef LANES
#undef LEVEL
#undef TR_LO
#undef TR_HI
#undef TR_LEVEL
