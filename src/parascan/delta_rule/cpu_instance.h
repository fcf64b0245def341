/* One instantiation of the delta rule's kernel (cpu_kernel.h), for one type and one
 * instruction-set level (_native/isa.h). _native/isa_levels.h includes this header
 * once per level of each type of cpu.c, through _native/isa_instance.h, which
 * defines F, W, V, VI, VU and ATTR (its comment says what they are) and undefines
 * them after; the type's section of cpu.c defines T, TBYTES, TI, TU, SFX and EXP, SQRT
 * (its scalar exp and square root). The functions are F(name) = name_<SFX>_<level>
 * (ps_delta_fwd_f32_v4, ...), which cpu.c's entries dispatch to. Deliberately without
 * an include guard.
 */

/* A block of the state's columns: NB vectors of each state row, 256 bytes with 64-byte
 * vectors (32 registers), 128 bytes on the other levels (16 registers) (cpu.c: why
 * those widths). */
#define NB (PS_ISA_VBYTES == 64 ? 4 : 128 / PS_ISA_VBYTES)
#define VB (NB * W)

#include "cpu_kernel.h"

#undef NB
#undef VB
