/* The first-order scans' CPU kernels, forward and fused backward, for float16,
 * bfloat16, float32, float64, complex64 and complex128, one algorithm over two
 * semirings:
 *   linear_scan      out[t] = gates[t] * out[t-1] + tokens[t]             (cpu_semiring_linear.h)
 *   log_linear_scan  out[t] = logaddexp(gates[t] + out[t-1], tokens[t])  (cpu_semiring_log.h)
 * The ABI is in abi.h, the algorithm in cpu_forward.h and cpu_backward.h; this file
 * instantiates them once per (semiring, dtype) through cpu_instance.h, naming the
 * faster x86 paths of linear_scan (cpu_x86.h) where they exist.
 */
#include "cpu_common.h"
#include "cpu_semiring_linear.h"
#include "cpu_semiring_log.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include "cpu_x86.h"
#define PS_SCAN_X86
#endif

/* ---- linear_scan ------------------------------------------------------------ */
#define SEMIRING linear
#define OP linear_scan

#define PS_DTYPE_F32
#ifdef PS_SCAN_X86
#define PS_FWD_TC_FAST ps_fwd_tc_fast_f32
#define PS_BWD_TC_FAST ps_bwd_tc_fast_f32
#define PS_REDUCE8_FAST ps_reduce8_f32_fast
#define PS_LONG_SCAN_FAST ps_long_scan_f32_fast
#endif
#include "cpu_instance.h"

#define PS_DTYPE_F64
#include "cpu_instance.h"

#define PS_DTYPE_F16
#ifdef PS_SCAN_X86
#define PS_FWD_TC_FAST ps_fwd_tc_fast_f16
#define PS_BWD_TC_FAST ps_bwd_tc_fast_f16
#define PS_FWD_ROW_FAST ps_fwd_row_f16_fast
#define PS_BWD_ROW_FAST ps_bwd_row_f16_fast
#endif
#include "cpu_instance.h"

#define PS_DTYPE_BF16
#ifdef PS_SCAN_X86
#define PS_FWD_TC_FAST ps_fwd_tc_fast_bf16
#define PS_BWD_TC_FAST ps_bwd_tc_fast_bf16
#define PS_FWD_ROW_FAST ps_fwd_row_bf16_fast
#define PS_BWD_ROW_FAST ps_bwd_row_bf16_fast
#endif
#include "cpu_instance.h"

#define PS_DTYPE_C64
#ifdef PS_SCAN_X86
#define PS_FWD_TC_FAST ps_fwd_tc_fast_c64
#define PS_BWD_TC_FAST ps_bwd_tc_fast_c64
#endif
#include "cpu_instance.h"

#define PS_DTYPE_C128
#include "cpu_instance.h"

#undef SEMIRING
#undef OP

/* ---- log_linear_scan -------------------------------------------------------- */
#define SEMIRING log
#define OP log_linear_scan

#define PS_DTYPE_F32
#include "cpu_instance.h"

#define PS_DTYPE_F64
#include "cpu_instance.h"

#define PS_DTYPE_F16
#include "cpu_instance.h"

#define PS_DTYPE_BF16
#include "cpu_instance.h"

#define PS_DTYPE_C64
#include "cpu_instance.h"

#define PS_DTYPE_C128
#include "cpu_instance.h"

#undef SEMIRING
#undef OP
