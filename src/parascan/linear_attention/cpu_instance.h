/* One instantiation of the linear-attention kernel (cpu_kernel.h), for one type and
 * one instruction-set level (_native/isa.h), as delta_rule/cpu_instance.h is for the
 * delta rule's: _native/isa_levels.h includes it once per level of each type of cpu.c,
 * through _native/isa_instance.h (F, W, V, VI, VU, ATTR); the type's section of cpu.c
 * defines T, TBYTES, TI, TU, SFX. The functions are F(name) = name_<SFX>_<level>
 * (ps_la_fwd_f32_v4, ...). Deliberately without an include guard.
 */

/* A register block of the state: RB rows of NB vectors (VB = NB W columns), held in
 * registers over a chunk's steps: 16 of the 32 vector registers with AVX-512, 8 of the
 * 16 on the other levels (the sweeps' other operands take most of the rest). */
#define NB 2
#define VB (NB * W)
#define RB (PS_ISA_VBYTES == 64 ? 8 : 4)

#include "cpu_kernel.h"

#undef NB
#undef VB
#undef RB
