/* One instance of a kernel at the level PS_ISA (isa_levels.h includes this header once
 * per level): the level's traits (isa_traits.h), the includer's instance header
 * PS_ISA_INSTANCE, then the traits and PS_ISA undefined, so that the next level starts
 * clean and the instance header undefines only its own names. Deliberately without an
 * include guard.
 */
#include "isa_traits.h"
#include PS_ISA_INSTANCE
#undef PS_ISA_SFX
#undef PS_ISA_VBYTES
#undef PS_ISA_TARGET
#undef PS_ISA_VECTOR
#undef PS_ISA
