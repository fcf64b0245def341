/* One instantiation of the delta rule's kernel (cpu_kernel.h), for one type and one
 * instruction-set level (_native/isa.h). _native/isa_levels.h includes this header
 * once per level of each type of cpu.c, having defined PS_ISA to the level and, in
 * the type's section, T, TBYTES, TI, TU, SFX (the type, its bytes, the signed and
 * unsigned integers of its width, its suffix f32 or f64) and EXP (its scalar exp); it gets F(name) = name_<SFX>_<level>
 * (ps_delta_fwd_f32_v4, ...), which cpu.c's entries dispatch to. Its end undefines
 * what it defines (_native/isa_instance.h, the level's traits and PS_ISA).
 * Deliberately without an include guard.
 */

/* The vectors of the level: W lanes of T (and of TI, TU for masks and bits). */
#define F(name) PS_CAT(PS_CAT(name, SFX), PS_ISA_SFX)
#define W (PS_ISA_VBYTES / TBYTES)
typedef T F(ps_delta_vt) __attribute__((vector_size(PS_ISA_VBYTES)));
typedef TI F(ps_delta_vti) __attribute__((vector_size(PS_ISA_VBYTES)));
typedef TU F(ps_delta_vtu) __attribute__((vector_size(PS_ISA_VBYTES)));
#define V F(ps_delta_vt)
#define VI F(ps_delta_vti)
#define VU F(ps_delta_vtu)

/* A block of the state's columns: NB vectors, 128 bytes of each state row, on every
 * level (cpu.c: why that width). */
#define NB (128 / PS_ISA_VBYTES)
#define VB (NB * W)
#ifdef PS_ISA_VECTOR
#define ATTR PS_ISA_TARGET __attribute__((optimize("fp-contract=fast")))
#else
#define ATTR
#endif

#include "cpu_kernel.h"

#undef F
#undef W
#undef V
#undef VI
#undef VU
#undef NB
#undef VB
#undef ATTR
