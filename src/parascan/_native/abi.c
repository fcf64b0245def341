/* The ABI facts Python checks once, before it calls any kernel (bindings.py). */
#include "abi.h"

PS_API int64_t ps_abi_version(void) { return PS_ABI_VERSION; }

PS_API int64_t ps_scan_fwd_args_size(void) { return (int64_t)sizeof(ps_scan_fwd_args); }
PS_API int64_t ps_scan_bwd_args_size(void) { return (int64_t)sizeof(ps_scan_bwd_args); }
PS_API int64_t ps_matrix_linear_scan_args_size(void) {
    return (int64_t)sizeof(ps_matrix_linear_scan_args);
}
PS_API int64_t ps_matmul_args_size(void) { return (int64_t)sizeof(ps_matmul_args); }
