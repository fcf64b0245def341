/* One instance of a kernel at the level PS_ISA (isa_levels.h includes this header once
 * per level): the level's traits (isa_traits.h), the names every instance header
 * uses, the includer's instance header PS_ISA_INSTANCE, then all of them and PS_ISA
 * undefined, so that the next level starts clean and the instance header undefines
 * only its own names. The type's section defines T, TBYTES, TI and TU (the type, its
 * bytes, the signed and unsigned integers of its width) and SFX (f32, f64); the
 * instance gets
 *   F(name)      name_<SFX>_<level> (ps_ssd_fwd_f32_v4, ...), its functions' names
 *   W            the lanes of a vector of T at this level
 *   V, VI, VU    vectors of W lanes of T, TI and TU (masks and bits)
 *   ATTR         its functions' attributes: the level's target, with fused
 *                multiply-adds above the baseline
 * and the vector helpers at this level: lane sums and transposes (vector_lanes.h:
 * F(ps_lane_sums), ...) and exp, sigmoid and the rest of vector_math.h (F(ps_vexp),
 * ...). Deliberately without an include guard.
 */
#include "isa_traits.h"
#define F(name) PS_CAT(PS_CAT(name, SFX), PS_ISA_SFX)
#define W (PS_ISA_VBYTES / TBYTES)
typedef T F(ps_isa_vt) __attribute__((vector_size(PS_ISA_VBYTES)));
typedef TI F(ps_isa_vti) __attribute__((vector_size(PS_ISA_VBYTES)));
typedef TU F(ps_isa_vtu) __attribute__((vector_size(PS_ISA_VBYTES)));
#define V F(ps_isa_vt)
#define VI F(ps_isa_vti)
#define VU F(ps_isa_vtu)
#ifdef PS_ISA_VECTOR
#define ATTR PS_ISA_TARGET __attribute__((optimize("fp-contract=fast")))
#else
#define ATTR
#endif

#include "vector_lanes.h"
#define PS_VM_TYPE SFX
#define PS_VM(name) F(name)
#define PS_VM_ATTR ATTR static inline
#include "vector_math.h"
#undef PS_VM_TYPE
#undef PS_VM
#undef PS_VM_ATTR

#include PS_ISA_INSTANCE

#undef F
#undef W
#undef V
#undef VI
#undef VU
#undef ATTR
#undef PS_ISA_SFX
#undef PS_ISA_VBYTES
#undef PS_ISA_TARGET
#undef PS_ISA_VECTOR
#undef PS_ISA
