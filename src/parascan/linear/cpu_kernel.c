/* linear_scan CPU kernels: x[t] = gates[t] * x[t-1] + tokens[t], forward and
 * fused backward, for float16, bfloat16, float32, float64, complex64 and
 * complex128. Half types accumulate in float32. See cpu_kernel.h for the ABI
 * and scan_forward_impl.h for the algorithm; this file only instantiates it and
 * the backward (cpu_kernel_impl.h). */
#include "cpu_kernel.h"

/* Python checks this size once against its own layout (scan_common.h). */
PS_API int64_t ps_linear_bwd_args_size(void) { return (int64_t)sizeof(ps_linear_bwd_args); }

/* Real types: ACC arithmetic is plain C. conj is the identity. */
#define FMA(a, s, b) ((a) * (s) + (b))
#define CFMA(a, s, b) ((a) * (s) + (b))
#define MULC(g, x) ((g) * (x))

#if defined(__x86_64__) && defined(__GNUC__)
#include "cpu_kernel_x86.h"
#define PS_X86_TC
#define PS_FWD_TC_FAST ps_fwd_tc_fast_f32
#define PS_BWD_TC_FAST ps_bwd_tc_fast_f32
#define PS_REDUCE8_FAST ps_reduce8_f32_fast
#define PS_LONG_SCAN_FAST ps_long_scan_f32_fast
#endif

#define PS_FWD_ENTRY ps_linear_scan_fwd
#define SFX f32
#define ST float
#define ACC float
#define LD(p) (*(p))
#define STO(p, v) (*(p) = (v))
#define ZERO 0.0f
#define ONE 1.0f
#define PS_ACC_IS_STORAGE
#include "scan_forward_impl.h"
#include "cpu_kernel_impl.h"
#undef SFX
#undef ST
#undef ACC
#undef ZERO
#undef ONE
#undef PS_FWD_TC_FAST
#undef PS_BWD_TC_FAST
#undef PS_REDUCE8_FAST
#undef PS_LONG_SCAN_FAST

#define SFX f64
#define ST double
#define ACC double
#define ZERO 0.0
#define ONE 1.0
#include "scan_forward_impl.h"
#include "cpu_kernel_impl.h"
#undef SFX
#undef ST
#undef ACC
#undef LD
#undef STO
#undef ZERO
#undef ONE
#undef PS_ACC_IS_STORAGE

#ifdef PS_X86_TC
#define PS_FWD_TC_FAST ps_fwd_tc_fast_f16
#define PS_BWD_TC_FAST ps_bwd_tc_fast_f16
#define PS_FWD_ROW_FAST ps_fwd_row_f16_fast
#define PS_BWD_ROW_FAST ps_bwd_row_f16_fast
#endif
#define SFX f16
#define ST ps_f16
#define ACC float
#define LD(p) ps_f16_to_f32(*(p))
#define STO(p, v) (*(p) = ps_f32_to_f16(v))
#define ZERO 0.0f
#define ONE 1.0f
#include "scan_forward_impl.h"
#include "cpu_kernel_impl.h"
#undef SFX
#undef ST
#undef LD
#undef STO
#undef ZERO
#undef PS_FWD_TC_FAST
#undef PS_BWD_TC_FAST
#undef PS_FWD_ROW_FAST
#undef PS_BWD_ROW_FAST

#ifdef PS_X86_TC
#define PS_FWD_TC_FAST ps_fwd_tc_fast_bf16
#define PS_BWD_TC_FAST ps_bwd_tc_fast_bf16
#define PS_FWD_ROW_FAST ps_fwd_row_bf16_fast
#define PS_BWD_ROW_FAST ps_bwd_row_bf16_fast
#endif
#define SFX bf16
#define ST ps_bf16
#define LD(p) ps_bf16_to_f32(*(p))
#define STO(p, v) (*(p) = ps_f32_to_bf16(v))
#define ZERO 0.0f
#include "scan_forward_impl.h"
#include "cpu_kernel_impl.h"
#undef SFX
#undef ST
#undef ACC
#undef LD
#undef STO
#undef ZERO
#undef ONE
#undef FMA
#undef CFMA
#undef MULC
#undef PS_FWD_TC_FAST
#undef PS_BWD_TC_FAST
#undef PS_FWD_ROW_FAST
#undef PS_BWD_ROW_FAST

/* Complex types: interleaved (re, im) pairs (arithmetic in scan_common.h). */
#define LD(p) PS_LOAD_COMPLEX(p)
#define STO(p, v) PS_STORE_COMPLEX(p, v)
#define PS_ACC_IS_STORAGE

#ifdef PS_X86_TC
#define PS_FWD_TC_FAST ps_fwd_tc_fast_c64
#define PS_BWD_TC_FAST ps_bwd_tc_fast_c64
#endif
#define SFX c64
#define ST ps_c64
#define ACC ps_c64
#define FMA ps_c64_fma
#define CFMA ps_c64_cfma
#define MULC ps_c64_mulc
#define ZERO ((ps_c64){0.0f, 0.0f})
#define ONE ((ps_c64){1.0f, 0.0f})
#include "scan_forward_impl.h"
#include "cpu_kernel_impl.h"
#undef SFX
#undef ST
#undef ACC
#undef FMA
#undef CFMA
#undef MULC
#undef ZERO
#undef ONE
#undef PS_FWD_TC_FAST
#undef PS_BWD_TC_FAST

#define SFX c128
#define ST ps_c128
#define ACC ps_c128
#define FMA ps_c128_fma
#define CFMA ps_c128_cfma
#define MULC ps_c128_mulc
#define ZERO ((ps_c128){0.0, 0.0})
#define ONE ((ps_c128){1.0, 0.0})
#include "scan_forward_impl.h"
#include "cpu_kernel_impl.h"
