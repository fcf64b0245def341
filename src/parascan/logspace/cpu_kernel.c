/* log_linear_scan CPU kernels: h[t] = logaddexp(gates[t] + h[t-1], tokens[t]),
 * forward and fused backward, for float16, bfloat16, float32, float64, complex64
 * and complex128. Half types compute in float32. The forward is the shared scan
 * template (scan_forward_impl.h) in the log semiring, where logaddexp is the sum
 * and + the product: its tiles, threads and long-sequence chunking carry over.
 * See cpu_kernel.h for the ABI, logmath.h for the arithmetic. */
#include "cpu_kernel.h"

#include "logmath.h"

PS_API int64_t ps_log_bwd_args_size(void) { return (int64_t)sizeof(ps_log_bwd_args); }

#define PS_FWD_ENTRY ps_log_scan_fwd

/* Real types. In the log semiring the empty state is -inf and the identity 0. */
#define ADD(a, b) ((a) + (b))
#define COMPOSE(a, q) ((a) + (q)) /* gates compose by adding their logs */
#define CFMA(a, s, b) ((a) * (s) + (b))
#define MULC(g, x) ((g) * (x))

#define SFX f32
#define ST float
#define ACC float
#define LD(p) (*(p))
#define STO(p, v) (*(p) = (v))
#define FMA(a, s, b) ps_logaddexp_f32((a) + (s), (b))
#define WEIGHT(x, h) ps_log_weight_f32((x), (h))
#define ZERO (-INFINITY)
#define ONE 0.0f
#define ZERO_WEIGHT 0.0f
#define PS_ACC_IS_STORAGE
#include "scan_forward_impl.h"
#include "cpu_kernel_impl.h"
#undef SFX
#undef ST

#define SFX f64
#define ST double
#undef ACC
#define ACC double
#undef FMA
#undef WEIGHT
#undef ONE
#undef ZERO_WEIGHT
#define FMA(a, s, b) ps_logaddexp_f64((a) + (s), (b))
#define WEIGHT(x, h) ps_log_weight_f64((x), (h))
#define ONE 0.0
#define ZERO_WEIGHT 0.0
#include "scan_forward_impl.h"
#include "cpu_kernel_impl.h"
#undef SFX
#undef ST
#undef ACC
#undef LD
#undef STO
#undef FMA
#undef WEIGHT
#undef ONE
#undef ZERO_WEIGHT
#undef PS_ACC_IS_STORAGE

#define ACC float
#define FMA(a, s, b) ps_logaddexp_f32((a) + (s), (b))
#define WEIGHT(x, h) ps_log_weight_f32((x), (h))
#define ONE 0.0f
#define ZERO_WEIGHT 0.0f

#define SFX f16
#define ST ps_f16
#define LD(p) ps_f16_to_f32(*(p))
#define STO(p, v) (*(p) = ps_f32_to_f16(v))
#include "scan_forward_impl.h"
#include "cpu_kernel_impl.h"
#undef SFX
#undef ST
#undef LD
#undef STO

#define SFX bf16
#define ST ps_bf16
#define LD(p) ps_bf16_to_f32(*(p))
#define STO(p, v) (*(p) = ps_f32_to_bf16(v))
#include "scan_forward_impl.h"
#include "cpu_kernel_impl.h"
#undef SFX
#undef ST
#undef ACC
#undef LD
#undef STO
#undef ZERO
#undef ONE
#undef ZERO_WEIGHT
#undef FMA
#undef WEIGHT
#undef ADD
#undef COMPOSE
#undef CFMA
#undef MULC

/* Complex types: the arithmetic of logmath.h, in double for both widths. */
#define PS_LOG_COMPLEX_OPS(T, R)                                                  \
    static inline T T##_add(T a, T b) { return (T){a.re + b.re, a.im + b.im}; }   \
    static inline T T##_logstep(T a, T s, T b) {                                  \
        double hr, hi;                                                            \
        ps_clogaddexp((double)a.re + s.re, (double)a.im + s.im, b.re, b.im, &hr, &hi); \
        return (T){(R)hr, (R)hi};                                                 \
    }                                                                             \
    static inline T T##_weight(T x, T h) {                                        \
        double wr, wi;                                                            \
        ps_clog_weight(x.re, x.im, h.re, h.im, &wr, &wi);                         \
        return (T){(R)wr, (R)wi};                                                 \
    }
PS_LOG_COMPLEX_OPS(ps_c64, float)
PS_LOG_COMPLEX_OPS(ps_c128, double)

#define LD(p) PS_LOAD_COMPLEX(p)
#define STO(p, v) PS_STORE_COMPLEX(p, v)
#define PS_ACC_IS_STORAGE

#define SFX c64
#define ST ps_c64
#define ACC ps_c64
#define ADD ps_c64_add
#define COMPOSE ps_c64_add
#define FMA ps_c64_logstep
#define WEIGHT ps_c64_weight
#define CFMA ps_c64_cfma
#define MULC ps_c64_mulc
#define ZERO ((ps_c64){-INFINITY, 0.0f})
#define ONE ((ps_c64){0.0f, 0.0f})
#define ZERO_WEIGHT ((ps_c64){0.0f, 0.0f})
#include "scan_forward_impl.h"
#include "cpu_kernel_impl.h"
#undef SFX
#undef ST
#undef ACC
#undef ADD
#undef COMPOSE
#undef FMA
#undef WEIGHT
#undef CFMA
#undef MULC
#undef ZERO
#undef ONE
#undef ZERO_WEIGHT

#define SFX c128
#define ST ps_c128
#define ACC ps_c128
#define ADD ps_c128_add
#define COMPOSE ps_c128_add
#define FMA ps_c128_logstep
#define WEIGHT ps_c128_weight
#define CFMA ps_c128_cfma
#define MULC ps_c128_mulc
#define ZERO ((ps_c128){-INFINITY, 0.0})
#define ONE ((ps_c128){0.0, 0.0})
#define ZERO_WEIGHT ((ps_c128){0.0, 0.0})
#include "scan_forward_impl.h"
#include "cpu_kernel_impl.h"
