/* The first-order scans' CPU kernels, forward and fused backward, for float16,
 * bfloat16, float32, float64, complex64 and complex128:
 *   linear_scan      out[t] = gates[t] * out[t-1] + tokens[t]             (semiring_linear.h)
 *   log_linear_scan  out[t] = logaddexp(gates[t] + out[t-1], tokens[t])  (semiring_log.h)
 * one algorithm over two semirings. The ABI is in abi.h; the algorithm in
 * scan_forward.h and scan_backward.h; this file instantiates them once per
 * (semiring, dtype) through scan_instance.h, naming the faster x86 paths
 * (scan_x86.h) where linear_scan has them.
 */
#include "common.h"
#include "semiring_linear.h"
#include "semiring_log.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include "scan_x86.h"
#define PS_SCAN_X86
#endif

PS_API int64_t ps_scan_constants(int64_t *out, int64_t n) {
    const int64_t values[] = {PS_BLOCK,     PS_ROWS,       PS_TILE,         PS_LONG_STEPS,
                              PS_LONG_ROWS, PS_LONG_CHUNKS, PS_LONG_MIN_LEN, PS_LONG_CHUNK_BYTES};
    const int64_t count = (int64_t)(sizeof values / sizeof values[0]);
    for (int64_t i = 0; i < n && i < count; i++) out[i] = values[i];
    return count;
}

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
#include "scan_instance.h"

#define PS_DTYPE_F64
#include "scan_instance.h"

#define PS_DTYPE_F16
#ifdef PS_SCAN_X86
#define PS_FWD_TC_FAST ps_fwd_tc_fast_f16
#define PS_BWD_TC_FAST ps_bwd_tc_fast_f16
#define PS_FWD_ROW_FAST ps_fwd_row_f16_fast
#define PS_BWD_ROW_FAST ps_bwd_row_f16_fast
#endif
#include "scan_instance.h"

#define PS_DTYPE_BF16
#ifdef PS_SCAN_X86
#define PS_FWD_TC_FAST ps_fwd_tc_fast_bf16
#define PS_BWD_TC_FAST ps_bwd_tc_fast_bf16
#define PS_FWD_ROW_FAST ps_fwd_row_bf16_fast
#define PS_BWD_ROW_FAST ps_bwd_row_bf16_fast
#endif
#include "scan_instance.h"

#define PS_DTYPE_C64
#ifdef PS_SCAN_X86
#define PS_FWD_TC_FAST ps_fwd_tc_fast_c64
#define PS_BWD_TC_FAST ps_bwd_tc_fast_c64
#endif
#include "scan_instance.h"

#define PS_DTYPE_C128
#include "scan_instance.h"

#undef SEMIRING
#undef OP

/* ---- log_linear_scan -------------------------------------------------------- */
#define SEMIRING log
#define OP log_linear_scan

#define PS_DTYPE_F32
#include "scan_instance.h"

#define PS_DTYPE_F64
#include "scan_instance.h"

#define PS_DTYPE_F16
#include "scan_instance.h"

#define PS_DTYPE_BF16
#include "scan_instance.h"

#define PS_DTYPE_C64
#include "scan_instance.h"

#define PS_DTYPE_C128
#include "scan_instance.h"

#undef SEMIRING
#undef OP
