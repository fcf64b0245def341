"""The public delta-rule scan: ``delta_rule_scan`` (DeltaNet, Gated DeltaNet, Kimi
Delta Attention)."""

from __future__ import annotations

import torch
from torch import Tensor

from parascan._core import (
    check_flag,
    check_shape,
    check_tensor,
    eager_no_grad,
    finite_float,
    resolve,
)
from parascan._heads import as_dtype, check_gate, check_heads, check_scale, check_state
from parascan._native import kernel_library_error
from parascan.delta_rule import autograd as delta_ops
from parascan.delta_rule import cpu as delta_cpu

__all__ = ["delta_rule_scan"]

_FN = "parascan.delta_rule_scan"
Opt = Tensor | None


def _l2norm(x: Tensor, factor: float = 1.0) -> Tensor:
    """x * rsqrt(sum(x * x) + 1e-6) times ``factor``, for every finite x: the sum of
    squares would overflow for |x| past about 1e19 in float32 (every row then 0), so
    each row is scaled before squaring by the power of two s that brings its largest
    magnitude into [1, 2) (s = 1 for rows below 2): (s x) * rsqrt(sum((s x)^2) +
    1e-6 s^2), s a constant to autograd. A power of two scales exactly, so a row gives
    the plain formula's bits wherever that does not overflow. An inf in a row gives the
    plain formula's NaN there and 0 elsewhere; a NaN, a NaN row."""
    m = x.detach().abs().amax(-1, keepdim=True)
    s = torch.ldexp(torch.ones_like(m), -torch.frexp(m)[1].clamp(min=1) + 1)
    y = x * s
    return y * (torch.rsqrt((y * y).sum(-1, keepdim=True) + 1e-6 * (s * s)) * factor)


def delta_rule_scan(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    *,
    g: Opt = None,
    scale: float | None = None,
    qk_l2norm: bool = False,
    initial: Opt = None,
    return_final: bool = False,
    cu_seqlens: Opt = None,
    backend: str = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    """The delta rule with a (K, V) matrix state per value head, never stored over
    time: DeltaNet (``g=None``), Gated DeltaNet (``g`` (batch, L, Hv): one log decay
    per head and step) and Kimi Delta Attention (``g`` (batch, L, Hv, K): one per key
    channel)::

        q, k = (l2norm(q), l2norm(k)) if qk_l2norm    l2norm(x) = x * rsqrt(sum(x * x) + 1e-6)
        S[t] = Diag(exp(g[t])) S[t-1]                 S[-1] = initial (zeros)
        u[t] = beta[t] * (v[t] - S[t]^T k[t])
        S[t] = S[t] + k[t] u[t]^T
        o[t] = scale * S[t]^T q[t]                    scale defaults to K ** -0.5

    ``q``, ``k``: (batch, L, Hk, K); ``v``: (batch, L, Hv, V) with Hv a multiple of Hk
    (q/k head i serves the Hv / Hk consecutive value heads from i * Hv / Hk);
    ``beta``: (batch, L, Hv), any real values. ``initial`` and the final state:
    (batch, Hv, K, V). ``cu_seqlens`` packs sequences along L of a batch of one, as
    for the other scans; ``initial`` and the final state are then (num_seqs, Hv, K, V).

    The state and the sums are float32 (float64 when ``v`` is float64); the output
    has ``v``'s dtype, the final state the state's. ``return_final=True`` returns
    ``(o, final)``, differentiable. Differentiable in q, k, v, beta, g and initial;
    works under vmap, torch.func and torch.compile(fullgraph=True).

    >>> import torch, parascan as ps
    >>> q, k, v = torch.randn(2, 50, 2, 8), torch.randn(2, 50, 2, 8), torch.randn(2, 50, 4, 16)
    >>> beta, g = torch.rand(2, 50, 4), -torch.rand(2, 50, 4)
    >>> o, final = ps.delta_rule_scan(q, k, v, beta, g=g, qk_l2norm=True, return_final=True)
    >>> o.shape, final.shape
    (torch.Size([2, 50, 4, 16]), torch.Size([2, 4, 8, 16]))
    """
    plain = _plain_inference(
        q, k, v, beta, g, scale, qk_l2norm, initial, return_final, cu_seqlens, backend
    )
    if plain is not None:  # the checks below would pass: the kernel at once
        out, final = delta_cpu.infer(q, k, v, beta, g, initial, return_final, plain)
        return (out, final) if return_final else out

    q, k, v, _, heads = check_heads(_FN, q, k, v)
    beta = check_tensor(_FN, "beta", beta)
    check_shape(_FN, "beta", beta, (heads.batch, heads.length, heads.hv), "(batch, L, Hv)")
    g = check_gate(_FN, g, heads)
    named = [("q", q), ("k", k), ("v", v), ("beta", beta), ("g", g)]
    cu_seqlens, initial = check_state(_FN, q, heads, cu_seqlens, initial, named)
    qk_l2norm = check_flag(_FN, "qk_l2norm", qk_l2norm)
    return_final = check_flag(_FN, "return_final", return_final)
    factor = check_scale(_FN, scale, heads.dk)

    cd = torch.float64 if v.dtype == torch.float64 else torch.float32
    name = resolve(delta_ops.ROW, backend, v.device, cd, name=_FN)
    q, k = as_dtype(q, cd), as_dtype(k, cd)
    args = (
        q, k, as_dtype(v, cd), as_dtype(beta, cd), as_dtype(g, cd), as_dtype(initial, cd),
        as_dtype(cu_seqlens, torch.int64),
    )  # fmt: skip
    if name == "cpu" and eager_no_grad([t for t in args if t is not None]):
        # nothing differentiates the call (inference, a decoding step): the kernel
        # directly, q and k normalized and scaled in it, without the op's checkpoints
        # (kept for a backward) or its dispatch
        out, final, _ = delta_cpu.forward(
            *args, want_final=return_final, keep=False, raw=(qk_l2norm, factor)
        )
    else:
        # the normalization and the scale in differentiable torch ops: the backends see
        # only the recurrence
        q, k = (_l2norm(q, factor), _l2norm(k)) if qk_l2norm else (q * factor, k)
        out, final = delta_ops.apply(q, k, *args[2:], return_final, name)
    out = as_dtype(out, v.dtype)
    return (out, final) if return_final else out


def _plain_inference(
    q: object, k: object, v: object, beta: object, g: object, scale: object,
    qk_l2norm: object, initial: object, return_final: object, cu_seqlens: object,
    backend: object,
) -> tuple[int, float] | None:  # fmt: skip
    """``(qk_form, scale)`` for the C kernel (cpu.infer) when a call can go to it at once, else
    None: an eager call that nothing differentiates (inference, a decoding step), not
    packed, on contiguous CPU tensors of one float32 or float64 dtype whose shapes
    agree, as a generation loop hands them in on every token. These checks imply every
    check below them in delta_rule_scan, which runs (and raises) when one fails. The
    general path's validation, backend resolution and casts cost a fifth of a decoding
    step at Qwen3.5's shape (BENCHMARKS.md, "Figures the source cites")."""
    if (
        # first: torch.compile traces none of the rest (kernel_library_error reads the
        # file system, a graph break under fullgraph=True)
        torch.compiler.is_compiling()
        or cu_seqlens is not None
        or type(backend) is not str
        or backend not in ("auto", "cpu")
        or kernel_library_error() is not None  # no C kernel: the general path picks another
        or type(qk_l2norm) is not bool
        or type(return_final) is not bool
        or not (scale is None or (type(scale) in (float, int) and finite_float(scale) is not None))
    ):
        return None
    tensors = [q, k, v, beta] + [t for t in (g, initial) if t is not None]
    if type(v) is not Tensor or v.dtype not in (torch.float32, torch.float64):
        return None
    for t in tensors:
        if (
            type(t) is not Tensor
            or t.dtype != v.dtype
            or t.layout != torch.strided
            or t.is_nested
            or not t.is_cpu
            or not t.is_contiguous()
            or t.is_neg()
        ):
            return None
    assert isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(beta, Tensor)
    if q.dim() != 4 or v.dim() != 4:
        return None
    batch, length, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    if (
        min(batch, length, hk, dk, hv, dv) < 1
        or hv % hk
        or k.shape != q.shape
        or v.shape[:2] != (batch, length)
        or beta.shape != (batch, length, hv)
        or (isinstance(g, Tensor) and g.shape not in ((batch, length, hv), (batch, length, hv, dk)))
        or (isinstance(initial, Tensor) and initial.shape != (batch, hv, dk, dv))
        or not eager_no_grad(tensors)  # type: ignore[arg-type]
    ):
        return None
    # scale is None or a finite float or int (checked above): no second check
    return 2 if qk_l2norm else 1, check_scale(_FN, scale, dk)
