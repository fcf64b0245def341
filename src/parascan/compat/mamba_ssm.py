"""Drop-ins for mamba_ssm 2.x's Mamba-1 scan and decoding step::

    from parascan.compat.mamba_ssm import selective_scan_fn, selective_state_update

The same signatures, argument conventions and results as
``mamba_ssm.ops.selective_scan_interface.selective_scan_fn`` (and its reference loop
``selective_scan_ref``) and ``mamba_ssm.ops.triton.selective_state_update``, computed by
:func:`parascan.selective_scan` and :func:`parascan.selective_state_update` on any device
(mamba_ssm's kernels need CUDA; these run on CPU too). The math, for ``u``, ``delta``,
``z`` of shape ``(batch, dim, L)`` and a state ``h`` of shape ``(batch, dim, N)``::

    dt[t] = softplus(delta[t] + delta_bias) if delta_softplus else delta[t] + delta_bias
    h[t]  = exp(dt[t] * A) * h[t-1] + dt[t] * B[t] * u[t]            h[-1] = 0
    y[t]  = sum_n C[t, n] h[t, n]   (2 * Re(...) when A is complex)
    out   = (y + D * u) * silu(z)                                     (each factor when given)

The conventions converted here (the rest is parascan.selective_scan's own):

- ``B`` and ``C`` are ``(dim, N)`` (time-invariant), ``(batch, N, L)`` (shared by every
  channel) or ``(batch, G, N, L)`` (G groups of ``dim // G`` channels). With a complex
  ``A``, a variable (3- or 4-dim) ``B`` or ``C`` is real with its real and imaginary parts
  interleaved along the last dimension, ``(batch, N, 2L)`` or ``(batch, G, N, 2L)``
  (``X[..., 2t]`` real, ``X[..., 2t + 1]`` imaginary); a time-invariant one is complex.
- ``return_last_state=True`` returns ``(out, last_state)`` with ``last_state`` of shape
  ``(batch, dim, N)`` in the state's dtype: float32, or complex64 with a complex ``A``
  (float64 / complex128 for float64 inputs). ``out`` has ``u``'s dtype.

How they differ from mamba_ssm's:

- The gradient of ``last_state`` is propagated (mamba_ssm's ``selective_scan_fn``
  ignores it; its reference loop propagates it, as here).
- Any float dtype, any strides, any device; ``D`` and ``delta_bias`` need not be float32,
  ``N`` is not limited to 256, and ``L == 0`` returns an empty ``out`` (and a zero state).
- A variable ``B``/``C`` given as a complex tensor ``(..., L)`` is taken as it is
  (mamba_ssm requires the interleaved real form).
- ``selective_state_update`` is differentiable (mamba_ssm's Triton kernel has no
  backward); with ``state_batch_indices`` each index may appear at most once.
- ``selective_scan_ref`` is the same computation as ``selective_scan_fn``: in mamba_ssm
  the two differ only in speed and device, and the float64 loops in parascan's tests
  are the references here.

Bad shapes are reported by :func:`parascan.selective_scan`, whose arguments bear the
same names; only the conventions above are checked here.
"""

from __future__ import annotations

import torch
from torch import Tensor

import parascan as ps
from parascan._checks import describe

__all__ = ["selective_scan_fn", "selective_scan_ref", "selective_state_update"]


def _compute_dtype(u: Tensor) -> torch.dtype:
    return torch.float64 if u.dtype == torch.float64 else torch.float32


def _complex_from_interleaved(fn: str, name: str, X: Tensor, u: Tensor) -> Tensor:
    """A variable ``B``/``C`` of a complex-``A`` scan, in parascan's form: mamba_ssm's
    real ``(..., 2L)`` with interleaved real and imaginary parts becomes a complex
    ``(..., L)`` tensor (differentiably: its gradient flows back to the real parts).
    A complex one is taken as it is; a non-float one is left to parascan.selective_scan's
    dtype check."""
    if X.is_complex() or not X.is_floating_point():
        return X
    length = u.shape[-1] if isinstance(u, Tensor) and u.dim() == 3 else None
    if length is None or X.shape[-1] != 2 * length:
        raise ValueError(
            f"{fn}: with a complex A, a variable {name} is real with real and imaginary parts "
            f"interleaved along its last dimension, (batch, N, 2L) or (batch, G, N, 2L) with "
            f"2L = {'2 * u.shape[-1]' if length is None else 2 * length}, but got "
            f"{describe(X)}"
        )
    X = X.to(_compute_dtype(u))
    return torch.complex(X[..., 0::2], X[..., 1::2])


def _selective_scan(
    fn: str,
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None,
    z: Tensor | None,
    delta_bias: Tensor | None,
    delta_softplus: bool,
    return_last_state: bool,
) -> Tensor | tuple[Tensor, Tensor]:
    if not isinstance(A, Tensor):
        raise TypeError(f"{fn}: expected A to be a Tensor (dim, N), but got {describe(A)}")
    if A.is_complex():
        if isinstance(B, Tensor) and B.dim() >= 3:
            B = _complex_from_interleaved(fn, "B", B, u)
        if isinstance(C, Tensor) and C.dim() >= 3:
            C = _complex_from_interleaved(fn, "C", C, u)
    return ps.selective_scan(
        u, delta, A, B, C, D, z, delta_bias, bool(delta_softplus), return_final=return_last_state
    )


def selective_scan_fn(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    delta_bias: Tensor | None = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Mamba-1's selective scan with mamba_ssm's conventions (see the module docstring).

    Args:
        u, delta: ``(batch, dim, L)``.
        A: ``(dim, N)``, real or complex.
        B, C: ``(dim, N)``, ``(batch, N, L)`` or ``(batch, G, N, L)``; with a complex
            ``A``, a variable one is real ``(batch, N, 2L)`` / ``(batch, G, N, 2L)`` with
            real and imaginary parts interleaved.
        D, delta_bias: ``(dim,)`` or None.
        z: ``(batch, dim, L)`` or None: the output is gated by ``silu(z)``.
        delta_softplus: take ``softplus(delta + delta_bias)`` as the step.
        return_last_state: also return the last state ``(batch, dim, N)``.

    Returns:
        ``out`` ``(batch, dim, L)`` in ``u``'s dtype, or ``(out, last_state)``.

    Example:
        >>> import torch
        >>> from parascan.compat.mamba_ssm import selective_scan_fn
        >>> u = torch.ones(1, 1, 3)
        >>> A = torch.full((1, 1), -0.6931471805599453)  # exp(A) = 1/2
        >>> B = C = torch.ones(1, 1)
        >>> selective_scan_fn(u, torch.ones(1, 1, 3), A, B, C)
        tensor([[[1.0000, 1.5000, 1.7500]]])
    """
    return _selective_scan(
        "parascan.compat.mamba_ssm.selective_scan_fn",
        u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state,
    )  # fmt: skip


def selective_scan_ref(
    u: Tensor,
    delta: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    delta_bias: Tensor | None = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """The same computation as :func:`selective_scan_fn` (mamba_ssm's reference loop
    shares its signature, conventions and results; it is only slower)."""
    return _selective_scan(
        "parascan.compat.mamba_ssm.selective_scan_ref",
        u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_last_state,
    )  # fmt: skip


def selective_state_update(
    state: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = False,
    state_batch_indices: Tensor | None = None,
) -> Tensor:
    """One decoding step: advances ``state`` in place and returns the step's output.

    Either layout of mamba_ssm's: ``state`` ``(batch, dim, N)`` with ``x``, ``dt``, ``z``
    ``(batch, dim)``, ``A`` ``(dim, N)``, ``B``, ``C`` ``(batch, N)``, ``D``, ``dt_bias``
    ``(dim,)``; or ``state`` ``(batch, heads, dim, N)`` with ``x``, ``dt``, ``z``
    ``(batch, heads, dim)``, ``A`` ``(heads, dim, N)``, ``B``, ``C``
    ``(batch, groups, N)``, ``D``, ``dt_bias`` ``(heads, dim)``::

        dt    = softplus(dt + dt_bias) if dt_softplus else dt + dt_bias
        state = exp(dt * A) * state + dt * B * x
        out   = (sum_n state * C + D * x) * silu(z)

    ``state_batch_indices`` (``(batch,)`` integers, optional): row ``b`` of ``x`` reads
    and writes ``state[state_batch_indices[b]]`` (a pool of states larger than the
    batch); a negative index marks padding, whose output is 0 and which touches no state.

    Returns:
        ``out`` in ``x``'s shape and dtype.

    Example:
        >>> import torch
        >>> from parascan.compat.mamba_ssm import selective_state_update
        >>> state = torch.ones(1, 1, 1)
        >>> A = torch.full((1, 1), -0.6931471805599453)  # exp(A) = 1/2
        >>> one = torch.ones(1, 1)
        >>> selective_state_update(state, one, one, A, one, one)
        tensor([[1.5000]])
        >>> state
        tensor([[[1.5000]]])
    """
    fn = "parascan.compat.mamba_ssm.selective_state_update"
    if state_batch_indices is None:
        out: Tensor = ps.selective_state_update(
            state, x, dt, A, B, C, D, z, dt_bias, bool(dt_softplus)
        )
        return out
    if not isinstance(state, Tensor) or state.dim() not in (3, 4):
        raise ValueError(
            f"{fn}: expected state of shape (batch, dim, N) or (batch, heads, dim, N), but got "
            f"{describe(state)}"
        )
    if not isinstance(x, Tensor) or x.dim() < 1:
        raise ValueError(f"{fn}: expected x to be a Tensor (batch, ...), but got {describe(x)}")
    idx = state_batch_indices
    if (
        not isinstance(idx, Tensor)
        or idx.dtype.is_floating_point
        or idx.is_complex()
        or idx.dtype == torch.bool
        or tuple(idx.shape) != (x.shape[0],)
    ):
        raise ValueError(
            f"{fn}: expected state_batch_indices to be an integer tensor of shape (batch,) = "
            f"({x.shape[0]},), but got {describe(idx)}"
        )
    idx = idx.to(device=state.device, dtype=torch.long)
    if bool((idx >= state.shape[0]).any()):
        raise ValueError(
            f"{fn}: state_batch_indices must be below the number of states {state.shape[0]}, "
            f"but got {idx.tolist()}"
        )
    valid = idx >= 0
    rows = idx[valid]
    if rows.unique().numel() != rows.numel():
        raise ValueError(
            f"{fn}: state_batch_indices must not repeat a (non-negative) index, but got "
            f"{idx.tolist()}"
        )
    picked = state.index_select(0, idx.clamp(min=0))  # a copy: padding rows read row 0
    out = ps.selective_state_update(picked, x, dt, A, B, C, D, z, dt_bias, bool(dt_softplus))
    state.index_copy_(0, rows, picked[valid])
    mask = valid.to(out.device).reshape((-1,) + (1,) * (out.dim() - 1))
    result: Tensor = torch.where(mask, out, torch.zeros((), dtype=out.dtype, device=out.device))
    return result
