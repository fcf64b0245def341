/* The ABI facts Python checks once, before it calls any kernel, and the first-order
 * scans' block constants (parascan._native). Here rather than in first_order/cpu.c: a
 * function more in that file changes how gcc compiles its kernels. */
#include "abi.h"
#include "../first_order/cpu_common.h"

PS_API int64_t ps_abi_version(void) { return PS_ABI_VERSION; }

PS_API int64_t ps_scan_fwd_args_size(void) { return (int64_t)sizeof(ps_scan_fwd_args); }
PS_API int64_t ps_scan_bwd_args_size(void) { return (int64_t)sizeof(ps_scan_bwd_args); }
PS_API int64_t ps_matrix_linear_scan_args_size(void) {
    return (int64_t)sizeof(ps_matrix_linear_scan_args);
}
PS_API int64_t ps_varlen_args_size(void) { return (int64_t)sizeof(ps_varlen_args); }
PS_API int64_t ps_matmul_args_size(void) { return (int64_t)sizeof(ps_matmul_args); }
PS_API int64_t ps_selective_fwd_args_size(void) {
    return (int64_t)sizeof(ps_selective_fwd_args);
}
PS_API int64_t ps_selective_bwd_args_size(void) {
    return (int64_t)sizeof(ps_selective_bwd_args);
}
PS_API int64_t ps_selective_step_args_size(void) {
    return (int64_t)sizeof(ps_selective_step_args);
}

PS_API int64_t ps_ssd_args_size(void) { return (int64_t)sizeof(ps_ssd_args); }
PS_API int64_t ps_ssd_conv_args_size(void) { return (int64_t)sizeof(ps_ssd_conv_args); }
PS_API int64_t ps_ssd_norm_args_size(void) { return (int64_t)sizeof(ps_ssd_norm_args); }
PS_API int64_t ps_delta_args_size(void) { return (int64_t)sizeof(ps_delta_args); }
PS_API int64_t ps_linear_attention_args_size(void) {
    return (int64_t)sizeof(ps_linear_attention_args);
}
PS_API int64_t ps_dplr_args_size(void) { return (int64_t)sizeof(ps_dplr_args); }

PS_API int64_t ps_scan_constants(int64_t *out, int64_t n) {
    const int64_t values[] = {PS_BLOCK,     PS_ROWS,       PS_TILE,         PS_LONG_STEPS,
                              PS_LONG_ROWS, PS_LONG_CHUNKS, PS_LONG_MIN_LEN, PS_LONG_CHUNK_BYTES};
    const int64_t count = (int64_t)(sizeof values / sizeof values[0]);
    for (int64_t i = 0; i < n && i < count; i++) out[i] = values[i];
    return count;
}
