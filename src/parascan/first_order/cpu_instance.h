/* One instantiation block of the first-order scan: the forward (cpu_forward.h) and
 * the fused backward (cpu_backward.h) of one semiring over one dtype, exported as
 * ps_<OP>_fwd_<SFX> and ps_<OP>_bwd_<SFX>, and their packed-sequence entries
 * ps_<OP>_{fwd,bwd}_varlen_<SFX> (cpu_packed.h; ABI in abi.h). cpu.c includes this
 * header once per (semiring, dtype), having defined:
 *   SEMIRING, OP   in its semiring section: linear and linear_scan (cpu_semiring_linear.h),
 *                  or log and log_linear_scan (cpu_semiring_log.h)
 *   PS_DTYPE_*     the block's dtype (dtype_traits.h)
 *   optionally, faster paths for this (semiring, dtype), each named where the
 *   template calls it: PS_FWD_TC_FAST, PS_FWD_ROW_FAST, PS_REDUCE8_FAST and
 *   PS_LONG_SCAN_FAST (cpu_forward.h), PS_BWD_TC_FAST and PS_BWD_ROW_FAST
 *   (cpu_backward.h).
 * The block ends at the end of this header, which undefines every macro a block
 * defines (all but SEMIRING and OP), so that no block inherits from the one before.
 * Deliberately without an include guard.
 */
#include "dtype_traits.h"

/* Names: the templates' internal functions FN(name) = name_<SEMIRING>_<SFX>, and the
 * exported entry points. */
#define FN(name) PS_CAT(PS_CAT(name, SEMIRING), SFX)
#define PS_FWD_ENTRY PS_CAT(PS_CAT(PS_CAT(ps, OP), fwd), SFX)
#define PS_BWD_ENTRY PS_CAT(PS_CAT(PS_CAT(ps, OP), bwd), SFX)

/* ACC's own arithmetic (cpu_common.h), for the backward's chain, which is linear in
 * every semiring: CFMA(a, s, b) = conj(a) s + b, MULC(g, x) = g conj(x); AZERO is 0. */
#define CFMA PS_CAT(ACC_OPS, cfma)
#define MULC PS_CAT(ACC_OPS, mulc)
#define AZERO PS_CAT(ACC_OPS, zero)()

/* The semiring over ACC (semiring_<SEMIRING>.h). */
#define PS_SEMIRING_FN(name) PS_CAT(PS_CAT(ACC_OPS, SEMIRING), name)
#define STEP PS_SEMIRING_FN(step)
#define COMPOSE PS_SEMIRING_FN(compose)
#define ZERO PS_SEMIRING_FN(zero)()
#define ONE PS_SEMIRING_FN(one)()
#define W_STEP PS_SEMIRING_FN(bwd_weight)
#define W_GATE PS_SEMIRING_FN(gate_weight)
#define W_TOKEN PS_SEMIRING_FN(token_weight)
#define TOKEN_WEIGHT_IS_ONE PS_CAT(PS_CAT(ps, SEMIRING), token_weight_is_one)
#define ZERO_GATE_GRAD_FROM_EMPTY PS_CAT(PS_CAT(ps, SEMIRING), zero_gate_grad_from_empty)
#define BWD_WEIGHTS_FIRST PS_CAT(PS_CAT(ps, SEMIRING), bwd_weights_first)

#include "cpu_forward.h"
#include "cpu_backward.h"
#include "cpu_packed.h"

/* The end of the block. */
#undef PS_DTYPE_F32
#undef PS_DTYPE_F64
#undef PS_DTYPE_F16
#undef PS_DTYPE_BF16
#undef PS_DTYPE_C64
#undef PS_DTYPE_C128
#undef SFX
#undef ST
#undef ACC
#undef ACC_OPS
#undef LD
#undef STO
#undef PS_ACC_IS_STORAGE
#undef FN
#undef PS_FWD_ENTRY
#undef PS_BWD_ENTRY
#undef CFMA
#undef MULC
#undef AZERO
#undef PS_SEMIRING_FN
#undef STEP
#undef COMPOSE
#undef ZERO
#undef ONE
#undef W_STEP
#undef W_GATE
#undef W_TOKEN
#undef TOKEN_WEIGHT_IS_ONE
#undef ZERO_GATE_GRAD_FROM_EMPTY
#undef BWD_WEIGHTS_FIRST
#undef PS_FWD_TC_FAST
#undef PS_FWD_ROW_FAST
#undef PS_REDUCE8_FAST
#undef PS_LONG_SCAN_FAST
#undef PS_BWD_TC_FAST
#undef PS_BWD_ROW_FAST
