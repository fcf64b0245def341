/* The traits of one instruction-set level (isa.h), for one instantiation of a
 * kernel: the includer defines PS_ISA (PS_ISA_V4, PS_ISA_V3 or PS_ISA_BASE) and
 * gets
 *   PS_ISA_SFX      the instances' name suffix: v4, v3, base
 *   PS_ISA_VBYTES   the bytes of a vector: 64, 32, 16
 *   PS_ISA_TARGET   the target attribute (nothing for the baseline)
 *   PS_ISA_VECTOR   defined for the levels above the baseline (they have fused
 *                   multiply-adds)
 * isa_instance.h undefines them (and PS_ISA) after the instance. Deliberately without
 * an include guard.
 */
#if defined(PS_ISA_SFX) || defined(PS_ISA_VBYTES) || defined(PS_ISA_TARGET) || \
    defined(PS_ISA_VECTOR)
#error "isa_traits.h: the previous instantiation left its traits defined"
#endif

#if PS_ISA == PS_ISA_V4
#define PS_ISA_SFX v4
#define PS_ISA_VBYTES 64
#define PS_ISA_TARGET __attribute__((target("arch=x86-64-v4")))
#define PS_ISA_VECTOR
#elif PS_ISA == PS_ISA_V3
#define PS_ISA_SFX v3
#define PS_ISA_VBYTES 32
#define PS_ISA_TARGET __attribute__((target("arch=x86-64-v3")))
#define PS_ISA_VECTOR
#elif PS_ISA == PS_ISA_BASE
#define PS_ISA_SFX base
#define PS_ISA_VBYTES 16
#define PS_ISA_TARGET
#else
#error "isa_traits.h: define PS_ISA to PS_ISA_V4, PS_ISA_V3 or PS_ISA_BASE"
#endif
