/* One type's instances of a kernel, one per instruction-set level (isa.h: x86-64-v4
 * and x86-64-v3 on x86-64 with gcc, and the baseline): the includer defines
 * PS_ISA_INSTANCE to its instance header's name, quoted and relative to this
 * directory (e.g. "../delta_rule/cpu_instance.h"), and the type's macros that header
 * reads; the instance header undefines PS_ISA at its end. Deliberately without an
 * include guard.
 */
#if PS_ISA_X86
#define PS_ISA PS_ISA_V4
#include PS_ISA_INSTANCE
#define PS_ISA PS_ISA_V3
#include PS_ISA_INSTANCE
#endif
#define PS_ISA PS_ISA_BASE
#include PS_ISA_INSTANCE
