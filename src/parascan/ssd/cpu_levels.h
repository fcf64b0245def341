/* One type's instances of the SSD kernel, one per instruction-set level
 * (_native/isa.h: x86-64-v4 and x86-64-v3 on x86-64 with gcc, and the baseline),
 * through cpu_instance.h; then the type's section of cpu.c ends: its macros are
 * undefined. Deliberately without an include guard.
 */
#if PS_ISA_X86
#define PS_ISA PS_ISA_V4
#include "cpu_instance.h"
#define PS_ISA PS_ISA_V3
#include "cpu_instance.h"
#endif
#define PS_ISA PS_ISA_BASE
#include "cpu_instance.h"
#undef T
#undef TBYTES
#undef TI
#undef TU
#undef EXP
#undef LO
#undef SCALE_LO
#undef SCALE_HI
#undef SFX
