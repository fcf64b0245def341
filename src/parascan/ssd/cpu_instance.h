/* One instantiation of the SSD scan's kernel (cpu_kernel.h) and its layer's
 * convolution and norm (cpu_layer.h), for one type and one instruction-set level
 * (_native/isa.h). _native/isa_levels.h includes this header once per level of each
 * type of cpu.c (cpu_levels.h), having defined
 *   PS_ISA                      the level (PS_ISA_V4, PS_ISA_V3, PS_ISA_BASE)
 * and, in its type's section:
 *   T, TBYTES, TI, TU, SFX      the type (float, double), its bytes, the signed and
 *                               unsigned integers of its width, its suffix (f32, f64)
 *   EXP, LO, SCALE_LO, SCALE_HI the scalar exp and the kernel's bounds (cpu_kernel.h)
 * and gets the functions F(name) = name_<SFX>_<level> (ps_ssd_fwd_f32_v4, ...) that
 * cpu.c's entries dispatch to. The end of this header undefines what it defines;
 * _native/isa_instance.h, the level's traits and PS_ISA; the type's section, the rest.
 * Deliberately without an include guard.
 */

/* The vectors of the level: W lanes of T (and of TI, TU for the masks). */
#define F(name) PS_CAT(PS_CAT(name, SFX), PS_ISA_SFX)
#define W (PS_ISA_VBYTES / TBYTES)
typedef T F(ps_ssd_vt) __attribute__((vector_size(PS_ISA_VBYTES)));
typedef TI F(ps_ssd_vti) __attribute__((vector_size(PS_ISA_VBYTES)));
typedef TU F(ps_ssd_vtu) __attribute__((vector_size(PS_ISA_VBYTES)));
#define V F(ps_ssd_vt)
#define VI F(ps_ssd_vti)
#define VU F(ps_ssd_vtu)

/* Vectors of headdim held in registers at once (PB); the functions' attributes:
 * the target, with fused multiply-adds above the baseline. */
#if PS_ISA == PS_ISA_V3
#define PB 3
#else
#define PB 4
#endif
#ifdef PS_ISA_VECTOR
#define ATTR PS_ISA_TARGET __attribute__((optimize("fp-contract=fast")))
#else
#define ATTR
#endif

#include "cpu_kernel.h"
#include "cpu_layer.h"

#undef F
#undef W
#undef V
#undef VI
#undef VU
#undef PB
#undef ATTR
