/* One instantiation of the generalized delta rule's kernel (cpu_kernel.h), for one type
 * and one instruction-set level (_native/isa.h), as delta_rule/cpu_instance.h is for the
 * delta rule's: _native/isa_levels.h includes it once per level of each type of cpu.c,
 * through _native/isa_instance.h (F, W, V, VI, VU, ATTR); the type's section of cpu.c
 * defines T, TBYTES, TI, TU, SFX and EXP (its scalar exp). The functions are F(name) =
 * name_<SFX>_<level> (ps_dplr_fwd_f32_v4, ...). Deliberately without an include guard.
 */

/* A block of the state's columns: 2 vectors of each state row on every level, narrower
 * than the delta rule's: a row of the forward's sweep holds the block's x and v, its two
 * accumulators and five broadcast scalars, which fit AVX2's 16 vector registers at 2
 * vectors a row and not at 4. With 4 (and the delta rule's two accumulators a vector)
 * gcc kept the accumulators on the stack and the forward ran 2.3x the multiply-add limit
 * at RWKV-7's shape (AVX2, Zen 1, one thread), against 2.1x with 2 (and 1.8x once units
 * ran chunk by chunk in groups, cpu_kernel.h). Not measured with AVX-512 (32 registers),
 * where 4 vectors might fit. */
#define NB 2
#define VB (NB * W)

#include "cpu_kernel.h"

#undef NB
#undef VB
