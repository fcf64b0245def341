"""The public SSD scan: ``ssd_scan`` (Mamba-2's scan, state-space duality)."""

from __future__ import annotations

import math
import numbers

import torch
import torch.nn.functional as F
from torch import Tensor

from parascan._core import (
    check_flag,
    check_packed_state,
    check_shape,
    check_tensor,
    describe,
    real_float,
    resolve,
)
from parascan.ssd import autograd as ssd_ops

__all__ = ["ssd_scan"]

_FN = "parascan.ssd_scan"
_NO_LIMIT = (0.0, math.inf)
Opt = Tensor | None


def _limit(dt_limit: object) -> tuple[float, float]:
    ok = (
        isinstance(dt_limit, tuple | list)
        and len(dt_limit) == 2
        and all(isinstance(v, numbers.Real) and not isinstance(v, bool) for v in dt_limit)
    )
    if ok:
        first: numbers.Real = dt_limit[0]  # type: ignore[index]
        second: numbers.Real = dt_limit[1]  # type: ignore[index]
        if first <= second:  # False with a NaN; exact for ints beyond a float
            return real_float(first), real_float(second)
    raise ValueError(
        f"{_FN}: expected dt_limit to be a pair of numbers (min, max) with min <= max, but got "
        f"{describe(dt_limit)}"
    )


def clamp_to(step: Tensor, limit: tuple[float, float]) -> Tensor:
    """``step.clamp(*limit)``, a bound beyond the largest finite value of ``step``'s
    dtype taken as the infinity of its sign: no finite value of the dtype lies beyond
    it (torch's clamp refuses a bound the dtype cannot hold)."""
    big = torch.finfo(step.dtype).max
    lo, hi = (v if abs(v) <= big else math.copysign(math.inf, v) for v in limit)
    return step.clamp(lo, hi)


def ssd_scan(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    *,
    D: Opt = None,
    z: Opt = None,
    dt_bias: Opt = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = _NO_LIMIT,
    initial: Opt = None,
    return_final: bool = False,
    cu_seqlens: Opt = None,
    backend: str = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    """Mamba-2's scan (state-space duality): one scalar decay per head and a
    (headdim, N) state per head, never materialized over time::

        dt'[t] = clamp(softplus(dt[t] + dt_bias) if dt_softplus else dt[t] + dt_bias,
                       *dt_limit)
        h[t]   = exp(dt'[t] * A) * h[t-1] + dt'[t] * x[t] (outer) B[t]   h[-1] = initial (0)
        y[t]   = h[t] @ C[t] (+ D * x[t]);   out = y * silu(z[t]) when z is given

    As a loop over one batch row, with ``step`` the processed dt' (head ``h`` reads
    group ``h // (heads // groups)`` of B and C)::

        for t in range(L):
            for h in range(heads):
                g = h // (heads // groups)
                s = step[t, h]
                state[h] = exp(s * A[h]) * state[h] + s * outer(x[t, h], B[t, g])
                y[t, h] = state[h] @ C[t, g] + D[h] * x[t, h]

    ``x``, ``z``: (batch, L, heads, headdim). ``dt``: (batch, L, heads). ``A``,
    ``dt_bias``: (heads,). ``B``, ``C``: (batch, L, groups, N), groups dividing heads.
    ``D``: (heads, headdim) or (heads,). softplus is ``log1p(exp(v))``, and ``v``
    itself above 20; the clamp applies only when ``dt_limit`` differs from
    ``(0.0, inf)`` (so the default lets a negative step through, as Mamba-2 does).
    ``initial`` and the final state: (batch, heads, headdim, N).

    ``cu_seqlens`` (int tensor (num_seqs + 1,): 0 first, L last, non-decreasing, empty
    sequences allowed) packs sequences along L of a batch of one: each is scanned as
    if alone, from its own initial state, and ``initial`` and the final state are then
    (num_seqs, heads, headdim, N) (an empty sequence's final state is its initial
    state, or zeros).

    The state and the sums are float32 (float64 when ``x`` is float64), the output
    has ``x``'s dtype, the final state the state's. ``return_final=True`` returns
    ``(out, final)``, differentiable. Differentiable in every tensor; works under vmap,
    torch.func and torch.compile(fullgraph=True), with or without ``cu_seqlens``.

    >>> import torch, parascan as ps
    >>> x, dt = torch.randn(2, 100, 4, 8), torch.rand(2, 100, 4)
    >>> A, B, C = -torch.rand(4), torch.randn(2, 100, 1, 16), torch.randn(2, 100, 1, 16)
    >>> out, final = ps.ssd_scan(x, dt, A, B, C, dt_softplus=True, return_final=True)
    >>> out.shape, final.shape
    (torch.Size([2, 100, 4, 8]), torch.Size([2, 4, 8, 16]))
    """
    x = check_tensor(_FN, "x", x)
    if x.dim() != 4:
        raise ValueError(
            f"{_FN}: expected x of shape (batch, L, heads, headdim), but got {describe(x)}"
        )
    batch, length, heads, headdim = x.shape
    dt = check_tensor(_FN, "dt", dt)
    check_shape(_FN, "dt", dt, (batch, length, heads), "(batch, L, heads)")
    A = check_tensor(_FN, "A", A)
    check_shape(_FN, "A", A, (heads,), "(heads,)")
    B = check_tensor(_FN, "B", B)
    if B.dim() != 4 or B.shape[:2] != (batch, length):
        raise ValueError(
            f"{_FN}: expected B of shape (batch, L, groups, N) with (batch, L) = "
            f"{(batch, length)}, but got {describe(B)}"
        )
    groups, n = B.shape[2], B.shape[3]
    if groups < 1 or heads % groups:
        raise ValueError(
            f"{_FN}: expected B's group count (dim 2 of (batch, L, groups, N)) to divide "
            f"heads = {heads}, but got {describe(B)}"
        )
    C = check_tensor(_FN, "C", C)
    check_shape(_FN, "C", C, (batch, length, groups, n), "(batch, L, groups, N) like B")
    if D is not None:
        D = check_tensor(_FN, "D", D)
        if tuple(D.shape) not in ((heads, headdim), (heads,)):
            raise ValueError(
                f"{_FN}: expected D of shape (heads, headdim) = {(heads, headdim)} or (heads,) "
                f"= {(heads,)}, but got {describe(D)}"
            )
    if z is not None:
        z = check_tensor(_FN, "z", z)
        check_shape(
            _FN, "z", z, (batch, length, heads, headdim), "(batch, L, heads, headdim) like x"
        )
    if dt_bias is not None:
        dt_bias = check_tensor(_FN, "dt_bias", dt_bias)
        check_shape(_FN, "dt_bias", dt_bias, (heads,), "(heads,)")
    cu_seqlens, initial = check_packed_state(
        _FN, ("x", x), cu_seqlens, initial, ((heads, headdim, n), "heads, headdim, N")
    )
    named = [("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D), ("z", z),
             ("dt_bias", dt_bias), ("initial", initial)]  # fmt: skip
    for name, t in named:
        if t is not None and t.device != x.device:
            raise ValueError(
                f"{_FN}: expected all tensors on one device, but x is on {x.device} and {name} "
                f"is on {t.device}"
            )
    dt_softplus = check_flag(_FN, "dt_softplus", dt_softplus)
    return_final = check_flag(_FN, "return_final", return_final)
    limit = _limit(dt_limit)

    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    name = resolve(ssd_ops.ROW, backend, x.device, cd, name=_FN)
    # The step sizes, in differentiable torch ops: the backends see only dt'.
    step = dt.to(cd)
    if dt_bias is not None:
        step = step + dt_bias.to(cd)
    if dt_softplus:
        step = F.softplus(step)  # log1p(exp(v)), and v itself above the threshold 20
    if limit != _NO_LIMIT:
        step = clamp_to(step, limit)
    d = None if D is None else (D if D.dim() == 2 else D[:, None]).to(cd).expand(heads, headdim)
    out, final = ssd_ops.apply(
        x.to(cd), step, A.to(cd), B.to(cd), C.to(cd), d, None if z is None else z.to(cd),
        None if initial is None else initial.to(cd),
        None if cu_seqlens is None else cu_seqlens.to(torch.int64), return_final, name,
    )  # fmt: skip
    out = out.to(x.dtype)
    return (out, final) if return_final else out
