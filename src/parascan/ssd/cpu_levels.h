/* One type's instances of the SSD kernel, one per instruction-set level
 * (_native/isa.h: x86-64-v4 and x86-64-v3 on x86-64 with gcc, and the baseline),
 * through _native/isa_levels.h and cpu_instance.h; then the type's section of cpu.c
 * ends: its macros are undefined. Deliberately without an include guard.
 */
#define PS_ISA_INSTANCE "../ssd/cpu_instance.h"
#include "isa_levels.h"
#undef PS_ISA_INSTANCE
#undef T
#undef TBYTES
#undef TI
#undef TU
#undef EXP
#undef LO
#undef SCALE_LO
#undef SCALE_HI
#undef SFX
