/* One type's instances of a kernel, one per instruction-set level (isa.h: x86-64-v4
 * and x86-64-v3 on x86-64 with gcc, and the baseline): the includer defines
 * PS_ISA_INSTANCE to its instance header's name, quoted and relative to this
 * directory (e.g. "../delta_rule/cpu_instance.h"), and the type's macros that header
 * reads; each level's instance is isa_instance.h's, which also undefines the level's
 * traits and PS_ISA. Deliberately without an include guard.
 */
#if PS_ISA_X86
#define PS_ISA PS_ISA_V4
#include "isa_instance.h"
#define PS_ISA PS_ISA_V3
#include "isa_instance.h"
#endif
#define PS_ISA PS_ISA_BASE
#include "isa_instance.h"
