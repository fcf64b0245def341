/* One instantiation of the generalized delta rule's kernel (cpu_kernel.h), for one type
 * and one instruction-set level (_native/isa.h), as delta_rule/cpu_instance.h is for the
 * delta rule's: _native/isa_levels.h includes it once per level of each type of cpu.c,
 * through _native/isa_instance.h (F, W, V, VI, VU, ATTR); the type's section of cpu.c
 * defines T, TBYTES, TI, TU, SFX and EXP (its scalar exp). The functions are F(name) =
 * name_<SFX>_<level> (ps_dplr_fwd_f32_v4, ...). Deliberately without an include guard.
 */

/* A block of the state's columns: NB vectors of each state row, as the delta rule's
 * (delta_rule/cpu.c: why those widths): 256 bytes with 64-byte vectors (32 registers),
 * 128 bytes on the other levels (16 registers). */
#define NB (PS_ISA_VBYTES == 64 ? 4 : 128 / PS_ISA_VBYTES)
#define VB (NB * W)

#include "cpu_kernel.h"

#undef NB
#undef VB
