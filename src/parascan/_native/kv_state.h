/* What the CPU kernels of the (K, V) matrix-state families (delta_rule/cpu.c,
 * linear_attention/cpu.c) share outside their instantiations: aligned scratch memory,
 * the check of packed sequences' offsets and the states of sequences with no step.
 * Their instantiated helpers (tiles, rows, gathers) are in kv_tiles.h.
 */
#ifndef PARASCAN_KV_STATE_H
#define PARASCAN_KV_STATE_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* 64-byte aligned memory, the size rounded up as aligned_alloc requires. */
static inline void *ps_kv_alloc(size_t bytes) {
    return aligned_alloc(64, (bytes + 63) / 64 * 64);
}

/* Whether the offsets of packed sequences (nseq + 1 of them, over a batch of one with
 * `length` steps) are unusable: not from 0 to length, or decreasing. No sequence at all
 * (offsets [0]) only when there is no step. */
static inline int ps_kv_bad_offsets(const int64_t *cu, int64_t nseq, int64_t batch,
                                    int64_t length) {
    if (batch != 1 || nseq < (length > 0) || cu[0] != 0 || cu[nseq] != length) return 1;
    for (int64_t s = 0; s < nseq; ++s)
        if (cu[s + 1] < cu[s]) return 1;
    return 0;
}

/* The states of the sequences with no step (rows of `bytes` bytes; cu NULL: the batch's
 * rows, empty when length is 0): dst = src there, zeros without src. The forward's
 * final state is then the initial one, the backward's grad_initial its grad_final. */
static inline void ps_kv_empty_states(const int64_t *cu, int64_t nseq, int64_t batch,
                                      int64_t length, size_t bytes, const void *src,
                                      void *dst) {
    if (!dst) return;
    const int64_t rows = cu ? nseq : batch;
    for (int64_t s = 0; s < rows; ++s) {
        const int empty = cu ? cu[s + 1] == cu[s] : length == 0;
        if (!empty) continue;
        if (src) memcpy((char *)dst + (size_t)s * bytes, (const char *)src + (size_t)s * bytes, bytes);
        else memset((char *)dst + (size_t)s * bytes, 0, bytes);
    }
}

#endif
