/* The selective scan's CPU kernel (Mamba-1's scan), forward and fused backward, for a
 * real state (float32, float64) or a complex one (complex64, complex128). The ABI is
 * in abi.h (ps_selective_*), the contract and the math in canonical.py.
 *
 * Summary of algorithm.
 *   Each (batch element, channel) is an independent scan of an N-wide state. Its
 *   steps run in chunks of K (the checkpoint interval): a chunk's u, delta and z are
 *   read once into rows of K values, dt = softplus(delta + bias) and du = dt u are
 *   computed over the row in vectors, then the steps
 *       h = exp(dt A) h + du B[t],   p[t] = C[t] h   (lane by lane)
 *   keep the state in registers, N lanes in nv vectors of W (a real state), with our
 *   own vector exp; the lane sums of the p[t] (y[t]) are taken W steps at a time in a
 *   fixed tree, and out = (y + D u) silu(z) is computed over the row. The state
 *   entering each chunk is stored as its checkpoint. A complex state runs the same
 *   chunks with scalar complex arithmetic (libm exp, cos, sin).
 *
 *   Channels are grouped into work units: runs of channels of one batch element
 *   inside one group of each shared variable B and C (a group of several channels),
 *   so that a unit packs the variable B and C of a span of chunks into contiguous
 *   rows of N once for all its channels (a group of one channel is packed per
 *   channel), and runs each channel through the span's chunks in turn, its rows read
 *   from start to end with the next chunk's lines prefetched.
 *
 *   The backward walks the spans and their chunks from last to first. For each
 *   channel it rebuilds a chunk's states and exp(dt A) from its checkpoint (K + 1
 *   rows of N), then runs the adjoint sweep backwards:
 *       g_h[t] = C[t] g_y[t] + exp(dt[t+1] A) g_h[t+1]   (g_h[L-1] adds grad_final)
 *   and accumulates every gradient on the way. Gradients of operands shared between
 *   channels are summed in an order fixed by the shapes alone: a channel's sums over
 *   time run in its own buffers (g_A, invariant g_B and g_C, g_D, g_delta_bias), then
 *   over the batch in batch order; a shared variable g_B or g_C of a span is summed
 *   per unit, then over the units of a group in unit order, after a barrier (one per
 *   span: the spans are as long as those sums fit PS_SEL_PARTIAL_BYTES). Units are
 *   sized from the shapes (about PS_SEL_BWD_UNITS of them), never from the thread
 *   count: any number of threads gives the same bits. No buffer grows with
 *   batch * dim * length * N: the backward holds one chunk of states per thread, the
 *   unit sums at most PS_SEL_PARTIAL_BYTES (or one chunk of them per unit).
 *
 *   The vector code uses GCC's vector extensions, compiled twice (x86-64-v3 and the
 *   baseline, PS_HOT) with the same operations in the same order; the x86-64-v3 build
 *   contracts multiply-adds into fused ones (the baseline has none), which takes a
 *   fifth off the scan's time (the vector exp is most of it), so the two builds agree
 *   to rounding, not bit for bit. Within a build, the thread count, the strides and the
 *   walk order give the same bits (tested on the build the machine runs).
 */
#include "common.h"

/* This kernel's hot loops and vector math contract multiply-adds into fused ones
 * where the instruction set has them (the x86-64-v3 build; the baseline has none):
 * about a third of the vector exp's operations (setup.py's -ffp-contract=off holds for
 * the other kernels). */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#undef PS_HOT
#define PS_HOT \
    __attribute__((target_clones("arch=x86-64-v3", "default"), optimize("fp-contract=fast")))
#undef PS_MATH
#define PS_MATH static inline __attribute__((always_inline, optimize("fp-contract=fast")))
#endif

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum {
    PS_SEL_MAX_CHUNK = 4096,   /* the largest K */
    PS_SEL_MAX_STATE = 65536,  /* the largest N */
    PS_SEL_FWD_UNIT = 64,      /* the most channels in a forward unit */
    PS_SEL_BWD_UNITS = 64,     /* about this many backward units */
    PS_SEL_SPAN_BYTES = 1 << 18,  /* a span's packed B and C, at most */
    PS_SEL_PARTIAL_BYTES = 1 << 25 /* the backward's unit sums of g_B and g_C, at most */
};

/* 0 when every tensor the kernel reads or writes is there (a NULL pointer is allowed
 * only for an empty tensor, an absent optional operand, or grad_initial). */
static int ps_sel_need(const void *p, double elements) { return p == NULL && elements > 0; }

static int ps_sel_check_operands(const ps_selective_operands *in) {
    const double bd = (double)in->batch * (double)in->dim, n = (double)in->nstate;
    const double steps = bd * (double)in->length;
    const double b = in->B_groups ? (double)in->batch * (double)in->B_groups * n *
                                        (double)in->length
                                  : (double)in->dim * n;
    const double c = in->C_groups ? (double)in->batch * (double)in->C_groups * n *
                                        (double)in->length
                                  : (double)in->dim * n;
    return ps_sel_need(in->u, steps) || ps_sel_need(in->delta, steps) ||
           ps_sel_need(in->A, (double)in->dim * n) || ps_sel_need(in->B, b) ||
           ps_sel_need(in->C, c);
}

static int ps_sel_check_fwd(const ps_selective_fwd_args *f) {
    const ps_selective_operands *in = &f->in;
    const double bd = (double)in->batch * (double)in->dim;
    return ps_sel_check_operands(in) || ps_sel_need(f->out, bd * (double)in->length) ||
           ps_sel_need(f->final, bd * (double)in->nstate) ||
           ps_sel_need(f->checkpoints, bd * (double)in->nstate * (double)in->length);
}

static int ps_sel_check_bwd(const ps_selective_bwd_args *g) {
    const ps_selective_operands *in = &g->in;
    const double bd = (double)in->batch * (double)in->dim, n = (double)in->nstate;
    const double steps = bd * (double)in->length;
    return ps_sel_check_operands(in) || ps_sel_need(g->checkpoints, bd * n * (double)in->length) ||
           ps_sel_need(g->grad_out, steps) || ps_sel_need(g->grad_final, bd * n) ||
           ps_sel_need(g->grad_u, steps) || ps_sel_need(g->grad_delta, steps) ||
           ps_sel_need(g->grad_A, (double)in->dim * n) ||
           ps_sel_need(g->grad_B, in->B ? 1.0 : 0.0) || ps_sel_need(g->grad_C, in->C ? 1.0 : 0.0) ||
           ps_sel_need(g->grad_D, in->D ? 1.0 : 0.0) || ps_sel_need(g->grad_z, in->z ? 1.0 : 0.0) ||
           ps_sel_need(g->grad_delta_bias, in->delta_bias ? 1.0 : 0.0);
}

/* ---- float32 (ps_selective_*_f32, *_c64) ------------------------------------------ */
#define SFX f32
#define CSFX c64
#define T float
#define TI int32_t
#define TU uint32_t
#define W 8
#define EXP expf
#define COS cosf
#define SIN sinf
#include "cpu_instance.h"

/* ---- float64 (ps_selective_*_f64, *_c128) ----------------------------------------- */
#define SFX f64
#define CSFX c128
#define T double
#define TI int64_t
#define TU uint64_t
#define W 4
#define EXP exp
#define COS cos
#define SIN sin
#include "cpu_instance.h"
