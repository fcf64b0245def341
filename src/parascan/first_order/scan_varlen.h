/* Packed sequences (cu_seqlens) for one (semiring, dtype) block: the entries
 * ps_<OP>_fwd_varlen_<SFX> and ps_<OP>_bwd_varlen_<SFX> (ABI in abi.h) run each
 * sequence through the block's plain entry on a view of its steps, with its own
 * initial state (and gradient), scheduled by ps_run_varlen (common.h). Included by
 * scan_instance.h after scan_forward.h and scan_backward.h. */

#define PS_FWD_VARLEN_ENTRY PS_CAT(PS_CAT(PS_CAT(PS_CAT(ps, OP), fwd), varlen), SFX)
#define PS_BWD_VARLEN_ENTRY PS_CAT(PS_CAT(PS_CAT(PS_CAT(ps, OP), bwd), varlen), SFX)

/* The operand at time step t of a time-indexed operand; NULL stays NULL. */
#define PS_AT(ptr, stride, t) ((ptr) ? (const ST *)(ptr) + (t) * (stride)[1] : NULL)

static int FN(fwd_segment)(const void *vp, const ps_varlen_args *v, int64_t s, int64_t nthreads) {
    ps_scan_fwd_args p = *(const ps_scan_fwd_args *)vp;
    const int64_t t0 = v->cu_seqlens[s];
    p.steps = v->cu_seqlens[s + 1] - t0;
    p.gates = PS_AT(p.gates, p.gates_stride, t0);
    p.tokens = PS_AT(p.tokens, p.tokens_stride, t0);
    p.out = (ST *)p.out + t0 * p.out_stride[1];
    if (p.initial) p.initial = (const ST *)p.initial + s * v->initial_seq_stride;
    p.nthreads = nthreads;
    return PS_FWD_ENTRY(&p);
}

static int FN(bwd_segment)(const void *vp, const ps_varlen_args *v, int64_t s, int64_t nthreads) {
    ps_scan_bwd_args p = *(const ps_scan_bwd_args *)vp;
    const int64_t t0 = v->cu_seqlens[s];
    p.steps = v->cu_seqlens[s + 1] - t0;
    p.gates = PS_AT(p.gates, p.gates_stride, t0);
    p.tokens = PS_AT(p.tokens, p.tokens_stride, t0);
    p.out = PS_AT(p.out, p.out_stride, t0);
    p.grad_out = PS_AT(p.grad_out, p.grad_out_stride, t0);
    p.grad_gates = (ST *)p.grad_gates + t0 * p.grad_gates_stride[1];
    p.grad_tokens = (ST *)p.grad_tokens + t0 * p.grad_tokens_stride[1];
    if (p.initial) p.initial = (const ST *)p.initial + s * v->initial_seq_stride;
    p.grad_initial = (ST *)p.grad_initial + s * v->grad_initial_seq_stride;
    p.nthreads = nthreads;
    return PS_BWD_ENTRY(&p);
}

PS_API int PS_FWD_VARLEN_ENTRY(const ps_scan_fwd_args *args, const ps_varlen_args *v) {
    if (args->outer < 0 || args->steps < 0 || args->inner < 0) return -1;
    ps_prefer_huge_pages(args->out, args->outer * args->steps * args->inner * (int64_t)sizeof(ST));
    return ps_run_varlen(args, v, FN(fwd_segment), args->steps, args->outer * args->inner,
                         args->nthreads);
}

PS_API int PS_BWD_VARLEN_ENTRY(const ps_scan_bwd_args *args, const ps_varlen_args *v) {
    if (args->outer < 0 || args->steps < 0 || args->inner < 0) return -1;
    const int64_t bytes = args->outer * args->steps * args->inner * (int64_t)sizeof(ST);
    ps_prefer_huge_pages(args->grad_gates, bytes);
    ps_prefer_huge_pages(args->grad_tokens, bytes);
    return ps_run_varlen(args, v, FN(bwd_segment), args->steps, args->outer * args->inner,
                         args->nthreads);
}

#undef PS_AT
#undef PS_FWD_VARLEN_ENTRY
#undef PS_BWD_VARLEN_ENTRY
