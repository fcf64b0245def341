/* One instantiation of the SSD scan's kernel (cpu_kernel.h) and its layer's
 * convolution and norm (cpu_layer.h), for one type and one instruction-set level
 * (_native/isa.h). _native/isa_levels.h includes this header once per level of each
 * type of cpu.c (cpu_levels.h), through _native/isa_instance.h, which defines F, W,
 * V, VI, VU and ATTR (its comment says what they are) and undefines them after. The
 * type's section of cpu.c defines
 *   T, TBYTES, TI, TU, SFX      the type (float, double), its bytes, the signed and
 *                               unsigned integers of its width, its suffix (f32, f64)
 *   EXP, LO, SCALE_LO, SCALE_HI the scalar exp and the kernel's bounds (cpu_kernel.h)
 * The functions are F(name) = name_<SFX>_<level> (ps_ssd_fwd_f32_v4, ...), which
 * cpu.c's entries dispatch to; cpu_levels.h undefines the type's macros. Deliberately
 * without an include guard.
 */

/* Vectors of headdim held in registers at once. */
#if PS_ISA == PS_ISA_V3
#define PB 3
#else
#define PB 4
#endif

#include "cpu_kernel.h"
#include "cpu_layer.h"

#undef PB
