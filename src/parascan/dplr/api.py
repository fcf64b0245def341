"""The public generalized delta rule: ``dplr_delta_rule_scan`` (RWKV-7)."""

from __future__ import annotations

import torch
from torch import Tensor

from parascan._core import check_flag, eager_no_grad, resolve
from parascan._heads import (
    as_dtype,
    check_gate,
    check_heads,
    check_scale,
    check_state,
    plain_inference,
)
from parascan.dplr import autograd as dplr_ops
from parascan.dplr import cpu as dplr_cpu

__all__ = ["dplr_delta_rule_scan"]

_FN = "parascan.dplr_delta_rule_scan"
Opt = Tensor | None


def dplr_delta_rule_scan(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    a: Tensor,
    b: Tensor,
    *,
    g: Opt = None,
    scale: float | None = None,
    initial: Opt = None,
    return_final: bool = False,
    cu_seqlens: Opt = None,
    backend: str = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    """The generalized delta rule: a diagonal-plus-rank-one transition per step, with a
    (K, V) state per value head never stored over time::

        S[t] = (Diag(exp(g[t])) + b[t] a[t]^T) S[t-1] + k[t] v[t]^T    S[-1] = initial (zeros)
        o[t] = scale * S[t]^T q[t]                                    scale defaults to K ** -0.5

    RWKV-7 passes q = r, g = w (its log decay), a = -kk, b = kk * (in-context rate).
    The delta rule is the case b = k, a = -beta * (exp(g) * k), k = beta * k.

    Args:
        q, k, a, b: (batch, L, Hk, K).
        v: (batch, L, Hv, V), Hv a multiple of Hk: head i of q, k, a and b serves the
            Hv / Hk consecutive value heads from i * Hv / Hk.
        g: None, (batch, L, Hv) or (batch, L, Hv, K): log decays (real, normally <= 0).
        scale: multiplies the output; default K ** -0.5.
        initial: (batch, Hv, K, V), the state before the first step (default zeros);
            (num_seqs, Hv, K, V) with ``cu_seqlens``.
        return_final: also return the state after the last step.
        cu_seqlens: (num_seqs + 1,) int offsets of sequences packed along L of a
            batch of one, each scanned from its own state.
        backend: "auto", "cpu", "torch" or "loop" (``parascan.backends()``).

    Returns:
        o (batch, L, Hv, V) in ``v``'s dtype; with ``return_final``, ``(o, final)``,
        ``final`` (batch or num_seqs, Hv, K, V) in the state's dtype, differentiable.

    The state and the sums are float32 (float64 when ``v`` is float64) for float16,
    bfloat16, float32 and float64 inputs. Differentiable in q, k, v, a, b, g and
    initial; works under vmap, torch.func and torch.compile(fullgraph=True). A call
    with L = 1 and a state is a decoding step.

    >>> import torch, parascan as ps
    >>> q, k, v = torch.randn(1, 40, 2, 8), torch.randn(1, 40, 2, 8), torch.randn(1, 40, 2, 8)
    >>> kk = torch.nn.functional.normalize(torch.randn(1, 40, 2, 8), dim=-1)
    >>> a, b = -kk, kk * torch.rand(1, 40, 2, 8)
    >>> g = -torch.rand(1, 40, 2, 8)
    >>> o, final = ps.dplr_delta_rule_scan(q, k, v, a, b, g=g, return_final=True)
    >>> o.shape, final.shape
    (torch.Size([1, 40, 2, 8]), torch.Size([1, 2, 8, 8]))
    """
    keyed = (k, a, b)
    scale_now = plain_inference(
        _FN, q, keyed, v, g, scale, initial, return_final, cu_seqlens, backend
    )
    if scale_now is not None:  # the checks below would pass: the kernel at once
        assert isinstance(q, Tensor) and isinstance(v, Tensor)
        k, a, b = (t for t in keyed if isinstance(t, Tensor))
        out, final = dplr_cpu.infer(q, k, v, a, b, g, initial, return_final, scale_now)
        return (out, final) if return_final else out

    q, k, v, (a, b), heads = check_heads(_FN, q, k, v, (("a", a), ("b", b)))
    g = check_gate(_FN, g, heads)
    named = [("q", q), ("k", k), ("v", v), ("a", a), ("b", b), ("g", g)]
    cu_seqlens, initial = check_state(_FN, q, heads, cu_seqlens, initial, named)
    return_final = check_flag(_FN, "return_final", return_final)
    factor = check_scale(_FN, scale, heads.dk)

    cd = torch.float64 if v.dtype == torch.float64 else torch.float32
    name = resolve(dplr_ops.ROW, backend, v.device, cd, name=_FN)
    rest = (
        as_dtype(k, cd), as_dtype(v, cd), as_dtype(a, cd), as_dtype(b, cd), as_dtype(g, cd),
        as_dtype(initial, cd), as_dtype(cu_seqlens, torch.int64),
    )  # fmt: skip
    q = as_dtype(q, cd)
    if name == "cpu" and eager_no_grad([t for t in (q, *rest) if t is not None]):
        # nothing differentiates the call (inference, a decoding step): the kernel
        # directly, q scaled in it, without the op's checkpoints (kept for a backward) or
        # its dispatch
        out, final, _ = dplr_cpu.forward(
            q, *rest, want_final=return_final, keep=False, scale=factor
        )
    else:
        out, final = dplr_ops.apply(q * factor, *rest, return_final, name)
    out = as_dtype(out, v.dtype)
    return (out, final) if return_final else out
