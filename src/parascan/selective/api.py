"""The public selective scan (Mamba-1's), ``selective_scan``, and its validation."""

from __future__ import annotations

import torch
from torch import Tensor

from parascan._core import check_flag, check_shape, check_tensor, describe, resolve
from parascan.selective import autograd as ops

__all__ = ["selective_scan"]

_FN = "parascan.selective_scan"
Opt = Tensor | None


def _bc(fn: str, name: str, m: Tensor, batch: int, dim: int, n: int, length: int) -> Tensor:
    """B or C in canonical form: (dim, N), or (batch, G, N, L)."""
    if m.dim() == 2:
        check_shape(fn, name, m, (dim, n), "(dim, N)")
        return m
    if m.dim() == 3:
        check_shape(fn, name, m, (batch, n, length), "(batch, N, L)")
        return m.unsqueeze(1)
    if m.dim() == 4:
        groups = m.shape[1]
        if groups < 1 or dim % groups:
            raise ValueError(
                f"{fn}: expected {name}'s group count (dim 1 of (batch, G, N, L)) to divide "
                f"dim = {dim}, but got {describe(m)}"
            )
        check_shape(fn, name, m, (batch, groups, n, length), "(batch, G, N, L)")
        return m
    raise ValueError(
        f"{fn}: expected {name} of shape (dim, N), (batch, N, L) or (batch, G, N, L), "
        f"but got {describe(m)}"
    )


def _complex_of(dtype: torch.dtype) -> torch.dtype:
    return torch.complex128 if dtype == torch.float64 else torch.complex64


def selective_scan(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Opt = None,
    z: Opt = None,
    delta_bias: Opt = None,
    delta_softplus: bool = False,
    *,
    initial: Opt = None,
    return_final: bool = False,
    backend: str = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    """Mamba-1's selective scan, the state never materialized over time::

        dt[t] = softplus(delta[t] + delta_bias) if delta_softplus else delta[t] + delta_bias
        h[t]  = exp(dt[t] * A) * h[t-1] + dt[t] * B[t] * u[t]       h[-1] = initial (0)
        y[t]  = sum_n C[t, n] h[t, n] (+ D * u[t]);   out = y * silu(z) when z is given

    ``u``, ``delta``, ``z``: (batch, dim, L). ``A``: (dim, N), real or complex. ``B``,
    ``C``: (dim, N) (time-invariant), (batch, N, L) (shared by all channels) or
    (batch, G, N, L) (G groups, each shared by dim / G channels); complex only with a
    complex ``A``, and then ``y = 2 Re(sum_n C h)``. ``D``, ``delta_bias``: (dim,).
    ``initial``: (batch, dim, N). The state and sums are float32 (float64 when ``u`` is
    float64); the output has ``u``'s dtype. ``return_final=True`` returns ``(out,
    final)``, the last state, differentiable. Differentiable in every tensor; works
    under vmap, torch.func and torch.compile.

    >>> import torch, parascan as ps
    >>> u, delta = torch.randn(2, 8, 100), torch.rand(2, 8, 100)
    >>> A, B, C = -torch.rand(8, 4), torch.randn(2, 4, 100), torch.randn(2, 4, 100)
    >>> ps.selective_scan(u, delta, A, B, C, delta_softplus=True).shape
    torch.Size([2, 8, 100])
    """
    fn = _FN
    u = check_tensor(fn, "u", u)
    if u.dim() != 3:
        raise ValueError(f"{fn}: expected u of shape (batch, dim, L), but got {describe(u)}")
    batch, dim, length = u.shape
    delta = check_tensor(fn, "delta", delta)
    check_shape(fn, "delta", delta, (batch, dim, length), "(batch, dim, L) like u")
    A = check_tensor(fn, "A", A, complex_ok=True)
    if A.dim() != 2 or A.shape[0] != dim:
        raise ValueError(
            f"{fn}: expected A of shape (dim, N) with dim = {dim}, but got {describe(A)}"
        )
    n = A.shape[1]
    named: list[tuple[str, Tensor]] = [("u", u), ("delta", delta), ("A", A)]
    B = check_tensor(fn, "B", B, complex_ok=True)
    C = check_tensor(fn, "C", C, complex_ok=True)
    for name, m in (("B", B), ("C", C)):
        if m.is_complex() and not A.is_complex():
            raise TypeError(
                f"{fn}: expected a real {name} with a real A (a complex {name} needs a complex "
                f"A), but got {name} {describe(m)} and A {describe(A)}"
            )
        named.append((name, m))
    B = _bc(fn, "B", B, batch, dim, n, length)
    C = _bc(fn, "C", C, batch, dim, n, length)
    optional = {"D": D, "z": z, "delta_bias": delta_bias}
    for name, value in optional.items():
        if value is not None:
            t = check_tensor(fn, name, value)
            if name == "z":
                check_shape(fn, name, t, (batch, dim, length), "(batch, dim, L) like u")
            else:
                check_shape(fn, name, t, (dim,), "(dim,)")
            named.append((name, t))
    if initial is not None:
        initial = check_tensor(fn, "initial", initial, complex_ok=True)
        check_shape(fn, "initial", initial, (batch, dim, n), "(batch, dim, N)")
        if initial.is_complex() and not A.is_complex():
            raise TypeError(
                f"{fn}: expected a real initial with a real A, but got {describe(initial)}"
            )
        named.append(("initial", initial))
    device = u.device
    for name, t in named:
        if t.device != device:
            raise ValueError(
                f"{fn}: expected all tensors on one device, but u is on {device} and {name} "
                f"is on {t.device}"
            )
    delta_softplus = check_flag(fn, "delta_softplus", delta_softplus)
    return_final = check_flag(fn, "return_final", return_final)

    cd = torch.float64 if u.dtype == torch.float64 else torch.float32
    sd = _complex_of(cd) if A.is_complex() else cd
    name = resolve(ops.ROW, backend, device, sd, name=fn)

    def real(t: Opt) -> Opt:
        return None if t is None else t.to(cd)

    def either(t: Tensor) -> Tensor:
        return t.to(_complex_of(cd) if t.is_complex() else cd)

    out, final = ops.apply(
        u.to(cd), delta.to(cd), either(A), either(B), either(C), real(D), real(z),
        real(delta_bias), None if initial is None else initial.to(sd), delta_softplus, name,
    )  # fmt: skip
    out = out.to(u.dtype)
    return (out, final) if return_final else out
