/* One instantiation of the selective scan's kernel (cpu_kernel.h) and its decoding
 * step (cpu_step.h), for one real type: cpu.c includes this header once per type,
 * having defined
 *   SFX, CSFX      the suffixes of the real and complex entries (f32 and c64, f64
 *                  and c128)
 *   T, TI, TU, W   the type, the signed and unsigned integers of its width, and the
 *                  lanes of a 32-byte vector of it
 *   EXP, COS, SIN  the scalar libm functions of T
 * The hot functions are compiled for x86-64-v3 and the baseline by PS_HOT
 * (target_clones, common.h), the CPU choosing at load time. The end of this header
 * undefines everything the includer and it define. Deliberately without an include
 * guard.
 */

/* The vector of W T's, and the integer vectors of its lanes' width (masks, bits). */
#define V PS_CAT(ps_sel_v, SFX)
#define VI PS_CAT(ps_sel_vi, SFX)
#define VU PS_CAT(ps_sel_vu, SFX)
typedef T V __attribute__((vector_size(32)));
typedef TI VI __attribute__((vector_size(32)));
typedef TU VU __attribute__((vector_size(32)));

#include "cpu_kernel.h"
#include "cpu_step.h"

#undef SFX
#undef CSFX
#undef T
#undef TI
#undef TU
#undef V
#undef VI
#undef VU
#undef W
#undef EXP
#undef COS
#undef SIN
