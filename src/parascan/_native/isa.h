/* The instruction-set levels a kernel instantiates its hot code for, and the runtime
 * choice among them: x86-64-v4 (AVX-512, 64-byte vectors), x86-64-v3 (AVX2 and FMA,
 * 32 bytes) and the baseline (16 bytes), on x86-64 with gcc; the baseline alone
 * elsewhere. A kernel includes its instance header once per (type, level), having
 * defined PS_ISA to the level (PS_ISA_V4, PS_ISA_V3, PS_ISA_BASE); isa_traits.h
 * names that level's suffix, vector bytes and target attribute, and PS_ISA_DISPATCH
 * calls the instance the CPU (and the caller's `simd` flag) picks.
 */
#ifndef PARASCAN_ISA_H
#define PARASCAN_ISA_H

#include <stdint.h>

#define PS_ISA_BASE 0
#define PS_ISA_V3 1
#define PS_ISA_V4 2

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PS_ISA_X86 1
#else
#define PS_ISA_X86 0
#endif

/* The level to run: PS_ISA_V4 or PS_ISA_V3 where the CPU has it, else (and always
 * when simd is 0) PS_ISA_BASE. */
static inline int ps_isa_level(int64_t simd) {
#if PS_ISA_X86
    if (!simd) return PS_ISA_BASE;
    __builtin_cpu_init();
    if (__builtin_cpu_supports("x86-64-v4")) return PS_ISA_V4;
    if (__builtin_cpu_supports("x86-64-v3")) return PS_ISA_V3;
#else
    (void)simd;
#endif
    return PS_ISA_BASE;
}

/* return fn_v4(arg), fn_v3(arg) or fn_base(arg), by ps_isa_level(simd). */
#if PS_ISA_X86
#define PS_ISA_DISPATCH(fn, simd, arg)                      \
    switch (ps_isa_level(simd)) {                           \
    case PS_ISA_V4: return fn##_v4(arg);                    \
    case PS_ISA_V3: return fn##_v3(arg);                    \
    default: return fn##_base(arg);                         \
    }
#else
#define PS_ISA_DISPATCH(fn, simd, arg) return fn##_base(arg);
#endif

#endif
