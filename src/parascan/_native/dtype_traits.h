/* The traits of one dtype, for one instantiation block of a kernel template
 * (first_order/cpu_instance.h). The includer names the dtype with exactly one of
 * PS_DTYPE_F32, PS_DTYPE_F64, PS_DTYPE_F16, PS_DTYPE_BF16, PS_DTYPE_C64 and
 * PS_DTYPE_C128, and gets:
 *   SFX        the entry points' name suffix (f32, ...)
 *   ST         the storage type            ACC  the accumulation type
 *   ACC_OPS    the prefix of ACC's arithmetic in first_order/cpu_common.h (ps_f32: ps_f32_fma, ...)
 *   LD(p)      load *p as ACC              STO(p, v)  store the ACC v to *p
 *   PS_ACC_IS_STORAGE   defined when ACC and ST are one type
 * Half types accumulate in float32. Each set below defines every trait itself, and
 * the block's end undefines them all (cpu_instance.h): no block inherits a trait
 * from the one before. Deliberately without an include guard.
 */
#if defined(SFX) || defined(ST) || defined(ACC) || defined(ACC_OPS) || defined(LD) || \
    defined(STO) || defined(PS_ACC_IS_STORAGE)
#error "dtype_traits.h: the previous instantiation block left its traits defined"
#endif

#if defined(PS_DTYPE_F32)
#define SFX f32
#define ST float
#define ACC float
#define ACC_OPS ps_f32
#define LD(p) (*(p))
#define STO(p, v) (*(p) = (v))
#define PS_ACC_IS_STORAGE

#elif defined(PS_DTYPE_F64)
#define SFX f64
#define ST double
#define ACC double
#define ACC_OPS ps_f64
#define LD(p) (*(p))
#define STO(p, v) (*(p) = (v))
#define PS_ACC_IS_STORAGE

#elif defined(PS_DTYPE_F16)
#define SFX f16
#define ST ps_f16
#define ACC float
#define ACC_OPS ps_f32
#define LD(p) ps_f16_to_f32(*(p))
#define STO(p, v) (*(p) = ps_f32_to_f16(v))

#elif defined(PS_DTYPE_BF16)
#define SFX bf16
#define ST ps_bf16
#define ACC float
#define ACC_OPS ps_f32
#define LD(p) ps_bf16_to_f32(*(p))
#define STO(p, v) (*(p) = ps_f32_to_bf16(v))

#elif defined(PS_DTYPE_C64)
#define SFX c64
#define ST ps_c64
#define ACC ps_c64
#define ACC_OPS ps_c64
#define LD(p) PS_LOAD_COMPLEX(p)
#define STO(p, v) PS_STORE_COMPLEX(p, v)
#define PS_ACC_IS_STORAGE

#elif defined(PS_DTYPE_C128)
#define SFX c128
#define ST ps_c128
#define ACC ps_c128
#define ACC_OPS ps_c128
#define LD(p) PS_LOAD_COMPLEX(p)
#define STO(p, v) PS_STORE_COMPLEX(p, v)
#define PS_ACC_IS_STORAGE

#else
#error "dtype_traits.h: name the dtype with one PS_DTYPE_* macro"
#endif
