"""Drop-ins for mamba_ssm 2.x's scans (Mamba-1's selective scan, Mamba-2's chunked
SSD scan) and decoding step::

    from parascan.compat.mamba_ssm import (
        mamba_chunk_scan_combined, selective_scan_fn, selective_state_update,
    )

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

``mamba_chunk_scan_combined`` (``mamba_ssm.ops.triton.ssd_combined``) is Mamba-2's scan
by :func:`parascan.ssd_scan`; its conventions are in its own docstring.
"""

from __future__ import annotations

import math
import operator
from bisect import bisect_right
from itertools import pairwise

import torch
from torch import Tensor

import parascan as ps
from parascan._core import (
    check_cu_seqlens,
    check_flag,
    check_in_place,
    check_tensor,
    describe,
    finite_float,
    short_repr,
    tensor_hint,
)
from parascan.compat._checks import errors_as, is_integer_tensor
from parascan.mixer.conv import causal_conv1d
from parascan.ssd import layer as ssd_layer
from parascan.ssd.api import _limit

__all__ = [
    "mamba_chunk_scan_combined",
    "mamba_split_conv1d_scan_combined",
    "selective_scan_fn",
    "selective_scan_ref",
    "selective_state_update",
]


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
    fn: str, u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None,
    z: Tensor | None, delta_bias: Tensor | None, delta_softplus: bool, return_last_state: bool,
) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
    """selective_scan_fn's body, its errors naming ``fn``."""
    if not isinstance(A, Tensor):
        raise TypeError(
            f"{fn}: expected A to be a Tensor (dim, N), but got {describe(A)}{tensor_hint(A)}"
        )
    if A.is_complex():
        if isinstance(B, Tensor) and B.dim() >= 3:
            B = _complex_from_interleaved(fn, "B", B, u)
        if isinstance(C, Tensor) and C.dim() >= 3:
            C = _complex_from_interleaved(fn, "C", C, u)
    delta_softplus = check_flag(fn, "delta_softplus", delta_softplus)
    return_last_state = check_flag(fn, "return_last_state", return_last_state)
    with errors_as(fn, "parascan.selective_scan"):
        return ps.selective_scan(
            u, delta, A, B, C, D, z, delta_bias, delta_softplus, return_final=return_last_state
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
    dt_softplus = check_flag(fn, "dt_softplus", dt_softplus)
    if isinstance(state, Tensor):
        check_in_place(fn, "state", state)
    if state_batch_indices is None:
        with errors_as(fn, "parascan.selective_state_update"):
            out: Tensor = ps.selective_state_update(
                state, x, dt, A, B, C, D, z, dt_bias, dt_softplus
            )
        return out
    if not isinstance(state, Tensor) or state.dim() not in (3, 4):
        raise ValueError(
            f"{fn}: expected state of shape (batch, dim, N) or (batch, heads, dim, N), but got "
            f"{describe(state)}{tensor_hint(state)}"
        )
    if not isinstance(x, Tensor) or x.dim() < 1:
        raise ValueError(
            f"{fn}: expected x to be a Tensor (batch, ...), but got {describe(x)}{tensor_hint(x)}"
        )
    idx = state_batch_indices
    if not is_integer_tensor(idx) or tuple(idx.shape) != (x.shape[0],):
        raise ValueError(
            f"{fn}: expected state_batch_indices to be an integer tensor of shape (batch,) = "
            f"({x.shape[0]},), but got {describe(idx)}{tensor_hint(idx)}"
        )
    idx = idx.to(device=state.device, dtype=torch.long)
    if bool((idx >= state.shape[0]).any()):
        raise ValueError(
            f"{fn}: state_batch_indices must be below the number of states {state.shape[0]}, "
            f"but got {short_repr(idx.tolist())}"
        )
    valid = idx >= 0
    rows = idx[valid]
    if rows.unique().numel() != rows.numel():
        raise ValueError(
            f"{fn}: state_batch_indices must not repeat a (non-negative) index, but got "
            f"{short_repr(idx.tolist())}"
        )
    if state.shape[0]:
        picked = state.index_select(0, idx.clamp(min=0))  # a copy: padding rows read row 0
    else:  # no state at all, so every index is padding (checked above): rows of zeros
        picked = state.new_zeros(idx.numel(), *state.shape[1:])
    with errors_as(fn, "parascan.selective_state_update"):
        out = ps.selective_state_update(picked, x, dt, A, B, C, D, z, dt_bias, dt_softplus)
    state.index_copy_(0, rows, picked[valid])
    mask = valid.to(out.device).reshape((-1,) + (1,) * (out.dim() - 1))
    result: Tensor = torch.where(mask, out, torch.zeros((), dtype=out.dtype, device=out.device))
    return result


# --- Mamba-2: the chunked SSD scan --------------------------------------------------------

_CHUNK = "parascan.compat.mamba_ssm.mamba_chunk_scan_combined"


def _real(fn: str, name: str, value: object) -> Tensor:
    """``value`` if it is a strided tensor of a real floating dtype, else a TypeError
    naming ``fn`` (an integer one would be cast silently by the ops it meets). A
    non-tensor and a non-strided one share this module's message; the dtype is the
    core's check."""
    if not isinstance(value, Tensor) or value.layout != torch.strided or value.is_nested:
        raise TypeError(
            f"{fn}: expected {name} to be a strided Tensor, but got {describe(value)}"
            f"{tensor_hint(value)}"
        )
    return check_tensor(fn, name, value)


def _positive_index(value: object) -> int | None:
    """``value`` as an int when it is a positive whole number: a Python int or another
    integer with ``__index__`` (numpy's, a model config's); not a bool (Python's or
    numpy's) nor a tensor (a bool or meta one would pass or fail as no int does); else
    None."""
    if isinstance(value, (bool, Tensor)) or type(value).__name__ in ("bool", "bool_"):
        return None
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None
    return number if number >= 1 else None


def _check_chunk_size(fn: str, chunk_size: object) -> None:
    """mamba_ssm's block length: not used here, but a positive int as there."""
    if _positive_index(chunk_size) is None:
        raise ValueError(
            f"{fn}: expected chunk_size to be a positive int, but got {describe(chunk_size)}"
        )


def _check_seq_idx(fn: str, seq_idx: Tensor | None, batch: int, length: int) -> None:
    """``seq_idx`` None, or the sequence ids ``(batch, seqlen)`` of the scan (and of
    the layer's convolution before it)."""
    if seq_idx is not None and (
        not is_integer_tensor(seq_idx) or tuple(seq_idx.shape) != (batch, length)
    ):
        raise ValueError(
            f"{fn}: expected seq_idx to be an integer tensor of shape (batch, seqlen) = "
            f"{(batch, length)}, but got {describe(seq_idx)}{tensor_hint(seq_idx)}"
        )


def _sequence_starts(fn: str, seq_idx: Tensor | None, batch: int, length: int) -> list[int]:
    """Where the scan's sequences start in the (batch * L) flattened steps: each row's
    first step, and with ``seq_idx`` every step whose id differs from the step before
    it in the same row. A row of length 0 is one empty sequence."""
    starts = [b * length for b in range(batch)]
    _check_seq_idx(fn, seq_idx, batch, length)
    if seq_idx is None:
        return starts
    changes = (seq_idx[:, 1:] != seq_idx[:, :-1]).nonzero()  # (row, t - 1), row-major
    inner = (changes[:, 0] * length + changes[:, 1] + 1).tolist()
    return sorted(starts + inner)


def mamba_chunk_scan_combined(
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    D: Tensor | None = None,
    z: Tensor | None = None,
    dt_bias: Tensor | None = None,
    initial_states: Tensor | None = None,
    seq_idx: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    return_final_states: bool = False,
    return_varlen_states: bool = False,
    state_dtype: torch.dtype | None = None,
) -> Tensor | tuple[Tensor, ...]:
    """Mamba-2's scan with mamba_ssm 2.x's signature, conventions and results, by
    :func:`parascan.ssd_scan` (on any device)::

        dt'  = clamp(softplus(dt + dt_bias) if dt_softplus else dt + dt_bias, *dt_limit)
        h[t] = exp(dt'[t] * A) * h[t-1] + dt'[t] * x[t] (outer) B[t]    per head
        out  = (h[t] @ C[t] + D * x[t]) * silu(z[t])                    (each when given)

    Args:
        x, z: ``(batch, seqlen, nheads, headdim)``.
        dt: ``(batch, seqlen, nheads)``. A, dt_bias: ``(nheads,)``.
        B, C: ``(batch, seqlen, ngroups, dstate)``, head h reading group
            ``h // (nheads // ngroups)``.
        chunk_size: mamba_ssm's block length; accepted and not used (the result does
            not depend on it; parascan picks its own blocking).
        D: ``(nheads, headdim)`` or ``(nheads,)``.
        initial_states: ``(batch, nheads, headdim, dstate)``: the state entering each
            row's first sequence.
        seq_idx: ``(batch, seqlen)`` integers: a new sequence starts wherever the id
            changes along a row (mamba_ssm's kernels expect the non-decreasing ids that
            packing gives), and no state crosses from one sequence into the next; a
            sequence after the first in its row starts from zeros.
        cu_seqlens: ``(num_seqs + 1,)`` offsets, read only for ``return_varlen_states``
            (batch 1).
        return_final_states: also return the state after each row's last step
            ``(batch, nheads, headdim, dstate)``.
        return_varlen_states: also return the state at the end of each sequence of
            ``cu_seqlens``, ``(num_seqs, nheads, headdim, dstate)``; every offset of
            ``cu_seqlens`` inside the row must start a sequence of the scan (pass the
            ``seq_idx`` of the same packing: mamba_ssm keeps sequences apart only
            through ``seq_idx``). An empty sequence's state is zeros (the initial
            state at offset 0).
        state_dtype: the dtype of the returned states (default: ``C``'s).

    Returns:
        ``out`` (``x``'s shape and dtype), then ``final_states`` if asked, then
        ``varlen_states`` if asked: ``out``, ``(out, final_states)``,
        ``(out, varlen_states)`` or ``(out, final_states, varlen_states)``.

    How it differs from mamba_ssm's: any device and float dtype; every returned state
    is differentiable (mamba_ssm raises on a backward through ``varlen_states``); the
    float32 sums do not depend on ``chunk_size``.

    Example:
        >>> import torch
        >>> from parascan.compat.mamba_ssm import mamba_chunk_scan_combined
        >>> x, dt = torch.ones(1, 3, 1, 1), torch.ones(1, 3, 1)
        >>> A = torch.full((1,), -0.6931471805599453)  # exp(A) = 1/2
        >>> B = C = torch.ones(1, 3, 1, 1)
        >>> mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size=256).flatten()
        tensor([1.0000, 1.5000, 1.7500])
    """
    fn = _CHUNK
    _check_chunk_size(fn, chunk_size)
    _check_state_dtype(fn, state_dtype)
    if not isinstance(x, Tensor) or x.dim() != 4:
        raise ValueError(
            f"{fn}: expected x of shape (batch, seqlen, nheads, headdim), but got {describe(x)}"
            f"{tensor_hint(x)}"
        )
    dt_softplus = check_flag(fn, "dt_softplus", dt_softplus)
    return_final_states = check_flag(fn, "return_final_states", return_final_states)
    return_varlen_states = check_flag(fn, "return_varlen_states", return_varlen_states)
    batch, length, heads, headdim = x.shape

    def scan(
        x: Tensor, dt: Tensor, B: Tensor, C: Tensor, z: Tensor | None, initial: Tensor | None,
        cu_seqlens: Tensor | None, finals: bool,
    ) -> tuple[Tensor, Tensor | None]:  # fmt: skip
        with errors_as(fn, "parascan.ssd_scan", {"initial": "initial_states"}):
            result = ps.ssd_scan(
                x, dt, A, B, C, D=D, z=z, dt_bias=dt_bias, dt_softplus=dt_softplus,
                dt_limit=dt_limit, initial=initial, return_final=finals, cu_seqlens=cu_seqlens,
            )  # fmt: skip
        if finals:  # only when asked: the scan then stores a state per sequence
            assert isinstance(result, tuple)
            return result
        assert isinstance(result, Tensor)
        return result, None

    if seq_idx is None and not return_varlen_states:
        out, final = scan(x, dt, B, C, z, initial_states, None, return_final_states)
        if not return_final_states:
            return out
        assert final is not None
        return out, _state(final, C, state_dtype)
    if return_varlen_states:
        if cu_seqlens is None:
            raise ValueError(f"{fn}: return_varlen_states=True needs cu_seqlens, but got None")
        if batch != 1:
            raise ValueError(
                f"{fn}: return_varlen_states reads cu_seqlens along the seqlen of a batch of "
                f"one: expected batch 1, but got x {describe(x)}"
            )
    starts = _sequence_starts(fn, seq_idx, batch, length)
    if initial_states is not None:
        _real(fn, "initial_states", initial_states)
    if isinstance(initial_states, Tensor):
        # the whole shape here: the scan sees it packed, one state per sequence
        n = B.shape[3] if isinstance(B, Tensor) and B.dim() == 4 else None
        want = (batch, heads, headdim, n)
        got = tuple(initial_states.shape)
        if len(got) != 4 or got[:3] != want[:3] or (n is not None and got[3] != n):
            raise ValueError(
                f"{fn}: expected initial_states of shape (batch, nheads, headdim, dstate) = "
                f"{want if n is not None else (*want[:3], 'dstate')}, but got "
                f"{describe(initial_states)}"
            )
    # the operands' shapes here, as the user passed them: the scan sees them packed
    for name, t, want_shape, dims in (
        ("dt", dt, (batch, length, heads), "(batch, seqlen, nheads)"),
        ("B", B, (batch, length, *(B.shape[2:] if isinstance(B, Tensor) else ())),
         "(batch, seqlen, ngroups, dstate)"),
        ("C", C, tuple(B.shape) if isinstance(B, Tensor) else None,
         "(batch, seqlen, ngroups, dstate) like B"),
        ("z", z, tuple(x.shape), "(batch, seqlen, nheads, headdim) like x"),
    ):  # fmt: skip
        if isinstance(t, Tensor) and want_shape is not None and tuple(t.shape) != want_shape:
            raise ValueError(f"{fn}: expected {name} of shape {dims} = {want_shape}, but got "
                             f"{describe(t)}")  # fmt: skip
    # The rows laid end to end as one packed row: sequence i covers steps
    # starts[i] .. starts[i + 1] - 1, and row b's first sequence is firsts[b].
    total = batch * length
    bounds = [*starts, total]
    firsts = [starts.index(b * length) for b in range(batch)] if length else list(range(batch))
    lasts = [*(f - 1 for f in firsts[1:]), len(starts) - 1] if batch else []
    cu = torch.tensor(bounds, dtype=torch.int64)

    def flat(t: Tensor) -> Tensor:
        if isinstance(t, Tensor) and t.dim() >= 2 and tuple(t.shape[:2]) == (batch, length):
            return t.reshape(1, total, *t.shape[2:])
        return t  # a wrong shape: parascan.ssd_scan names it

    initial = None
    if isinstance(initial_states, Tensor):
        initial = initial_states.new_zeros(len(starts), *initial_states.shape[1:])
        rows = torch.tensor(firsts, dtype=torch.int64, device=initial.device)  # [] for batch 0
        initial = initial.index_copy(0, rows, initial_states)
    out, finals = scan(flat(x), flat(dt), flat(B), flat(C), None if z is None else flat(z),
                       initial, cu, return_final_states or return_varlen_states)  # fmt: skip
    out = out.reshape(batch, length, heads, headdim)
    results: list[Tensor] = [out]
    if return_final_states:
        assert finals is not None
        rows = torch.tensor(lasts, dtype=torch.int64, device=finals.device)
        results.append(_state(finals[rows], C, state_dtype))  # index_select refuses 0 rows
    if return_varlen_states:
        assert cu_seqlens is not None and finals is not None
        offsets = check_cu_seqlens(fn, cu_seqlens, length, x.device).tolist()
        inside = [o for o in offsets if 0 < o < length and o not in starts]
        if inside:
            raise ValueError(
                f"{fn}: every offset of cu_seqlens must start a sequence of the scan (where "
                f"seq_idx changes): pass the seq_idx of the same packing, but cu_seqlens "
                f"offsets {inside} are inside a sequence (seq_idx "
                f"{'None' if seq_idx is None else 'differs'})"
            )
        # the bank: every sequence's final state, then zeros, then the initial state
        bank = [finals, finals.new_zeros(1, *finals.shape[1:])]
        if initial is not None:
            bank.append(initial[:1].to(finals.dtype))
        picks = []
        for lo, hi in pairwise(offsets):
            if hi > lo:
                picks.append(bisect_right(starts, hi - 1) - 1)
            else:
                at_start = lo == 0 and initial is not None
                picks.append(len(starts) + (1 if at_start else 0))
        chosen = torch.cat(bank).index_select(0, torch.tensor(picks, device=finals.device))
        results.append(_state(chosen, C, state_dtype))
    return results[0] if len(results) == 1 else tuple(results)


def _check_state_dtype(fn: str, state_dtype: object) -> None:
    """``state_dtype`` None or a floating or complex dtype (an integer one would round the
    states)."""
    if state_dtype is not None and (
        not isinstance(state_dtype, torch.dtype)
        or not (state_dtype.is_floating_point or state_dtype.is_complex)
    ):
        raise TypeError(
            f"{fn}: expected state_dtype to be None or a floating or complex torch.dtype, but got "
            f"{describe(state_dtype)}"
        )


def _named_limit(fn: str, dt_limit: object) -> tuple[float, float]:
    """ssd_scan's check of ``dt_limit``, its error under ``fn``'s name."""
    with errors_as(fn, "parascan.ssd_scan"):
        return _limit(dt_limit)


def _state(state: Tensor, C: Tensor, state_dtype: torch.dtype | None) -> Tensor:
    """A returned state in mamba_ssm's dtype: ``state_dtype``, else ``C``'s."""
    return state.to(state_dtype if state_dtype is not None else C.dtype)


# --- Mamba-2's fused training layer: split, convolution, scan, gated norm, projection --------


_SPLIT = "parascan.compat.mamba_ssm.mamba_split_conv1d_scan_combined"


def _gated_rms_norm(
    y: Tensor, z: Tensor, weight: Tensor, eps: float, groups: int, before_gate: bool
) -> Tensor:
    """RMS norm over groups of ``dim // groups`` channels, gated by ``silu(z)`` after
    (``before_gate``) or before the norm, in float32 (float64 for float64 input)."""
    dtype = _compute_dtype(y)
    y, gate = y.to(dtype), torch.nn.functional.silu(z.to(dtype))
    if not before_gate:
        y = y * gate
    grouped = y.unflatten(-1, (groups, -1))
    rstd = torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    out: Tensor = (grouped * rstd).flatten(-2) * weight.to(dtype)
    if before_gate:
        out = out * gate
    return out


def mamba_split_conv1d_scan_combined(
    zxbcdt: Tensor,
    conv1d_weight: Tensor,
    conv1d_bias: Tensor | None,
    dt_bias: Tensor,
    A: Tensor,
    D: Tensor,
    chunk_size: int,
    initial_states: Tensor | None = None,
    seq_idx: Tensor | None = None,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    return_final_states: bool = False,
    activation: str | None = "silu",
    rmsnorm_weight: Tensor | None = None,
    rmsnorm_eps: float = 1e-6,
    outproj_weight: Tensor | None = None,
    outproj_bias: Tensor | None = None,
    headdim: int | None = None,
    ngroups: int = 1,
    norm_before_gate: bool = True,
    state_dtype: torch.dtype | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """A whole Mamba-2 layer after its input projection, with mamba_ssm 2.x's signature
    and results (its fused training kernel), on any device. With ``dim = nheads *
    headdim`` and ``conv_dim = dim + 2 * ngroups * dstate``, ``zxbcdt`` is split along
    its last dimension into ``(zx0, z, xBC, dt)`` of widths ``(2 * d_nonssm, dim,
    conv_dim, nheads)``, then::

        xBC      = act(conv1d_bias + causal depthwise conv of xBC by conv1d_weight)
        x, B, C  = split(xBC, (dim, ngroups * dstate, ngroups * dstate))
        y        = mamba_chunk_scan_combined(x, dt, A, B, C, D=D, dt_bias=dt_bias,
                                             dt_softplus=True, dt_limit=dt_limit,
                                             z=z if rmsnorm_weight is None else None)
        y        = rmsnorm(y) * silu(z) if norm_before_gate else rmsnorm(y * silu(z))
                   (times rmsnorm_weight; RMS over groups of dim // ngroups channels;
                   only when rmsnorm_weight is given)
        out      = cat(silu(zx0[:d_nonssm]) * zx0[d_nonssm:], y) @ outproj_weight.T
                   + outproj_bias       (the swish-gated part only when d_nonssm > 0;
                                         the projection only when outproj_weight is given)

    ``act`` is silu for ``activation`` ``"silu"`` or ``"swish"``, the identity for None.
    The convolution is causal (zeros before the first step) and, with ``seq_idx``
    ``(batch, seqlen)``, reads nothing across a change of id, where the scan restarts
    too. On the CPU, in float32 or float64 with a norm and no ``seq_idx`` (eager, not
    under torch.compile or a torch.func transform), the convolution, scan and gated
    norm run fused (:mod:`parascan.ssd.layer`: C kernels for the convolution and the
    norm, the scan's C kernel, and a backward that writes ``zxbcdt``'s gradient in one
    buffer); otherwise the convolution is K shifted multiply-adds (K the filter width),
    forward and backward, and the scan is :func:`parascan.ssd_scan` (backend
    ``"auto"``). Both give the same results to rounding.

    Args:
        zxbcdt: ``(batch, seqlen, 2 * d_nonssm + 2 * dim + 2 * ngroups * dstate + nheads)``.
        conv1d_weight: ``(conv_dim, width)``; conv1d_bias: ``(conv_dim,)`` or None.
        dt_bias, A: ``(nheads,)``. D: ``(nheads, headdim)`` or ``(nheads,)`` (then
            ``headdim`` must be given).
        chunk_size: accepted and not used (the result does not depend on it).
        initial_states: ``(batch, nheads, headdim, dstate)`` or None.
        rmsnorm_weight: ``(dim,)`` or None; outproj_weight ``(out_dim, dim + d_nonssm)``,
            outproj_bias ``(out_dim,)``.
        state_dtype: the dtype of the returned final states (default: ``C``'s, that
            is ``zxbcdt``'s).

    Returns:
        ``out`` ``(batch, seqlen, out_dim)`` (``(batch, seqlen, dim + d_nonssm)``
        without a projection), or ``(out, final_states)`` with ``return_final_states``.

    How it differs from mamba_ssm's: any device and float dtype; the norm is computed
    in float32 (float64 for float64 input); the gradient of ``final_states`` is
    propagated.
    """
    fn = _SPLIT
    zxbcdt = _real(fn, "zxbcdt", zxbcdt)
    if zxbcdt.dim() != 3:
        raise ValueError(
            f"{fn}: expected zxbcdt of shape (batch, seqlen, channels), but got {describe(zxbcdt)}"
        )
    return_final_states = check_flag(fn, "return_final_states", return_final_states)
    if activation not in (None, "silu", "swish"):
        raise ValueError(
            f"{fn}: expected activation None, 'silu' or 'swish', but got {describe(activation)}"
        )
    _check_chunk_size(fn, chunk_size)
    _check_state_dtype(fn, state_dtype)
    norm_before_gate = check_flag(fn, "norm_before_gate", norm_before_gate)
    eps = finite_float(rmsnorm_eps)
    if not isinstance(rmsnorm_eps, (int, float)) or eps is None or eps < 0:
        raise ValueError(f"{fn}: expected rmsnorm_eps to be a finite number >= 0, but got "
                         f"{describe(rmsnorm_eps)}")  # fmt: skip
    if _real(fn, "D", D).dim() not in (1, 2):
        raise ValueError(f"{fn}: expected D of shape (nheads,) or (nheads, headdim), but got "
                         f"{describe(D)}")  # fmt: skip
    if D.dim() == 2:
        nheads, headdim = D.shape
    elif headdim is None:
        raise ValueError(f"{fn}: D is (nheads,), so headdim must be given, but got None")
    elif (index := _positive_index(headdim)) is None:
        raise ValueError(
            f"{fn}: expected headdim to be a positive int, but got {describe(headdim)}"
        )
    else:
        nheads, headdim = D.shape[0], index
    groups = _positive_index(ngroups)
    if groups is None or nheads % groups:
        raise ValueError(
            f"{fn}: expected ngroups to be a positive int dividing nheads = {nheads}, but got "
            f"{describe(ngroups)}"
        )
    ngroups = groups
    if _real(fn, "conv1d_weight", conv1d_weight).dim() != 2 or conv1d_weight.shape[1] < 1:
        raise ValueError(
            f"{fn}: expected conv1d_weight of shape (conv_dim, width), but got "
            f"{describe(conv1d_weight)}"
        )
    batch, length, channels = zxbcdt.shape
    dim = nheads * headdim
    conv_dim = conv1d_weight.shape[0]
    dstate = (conv_dim - dim) // (2 * ngroups)
    nonssm2 = channels - 2 * dim - 2 * ngroups * dstate - nheads
    if dstate < 1 or conv_dim != dim + 2 * ngroups * dstate or nonssm2 < 0 or nonssm2 % 2:
        raise ValueError(
            f"{fn}: expected conv1d_weight (dim + 2 * ngroups * dstate, width) and zxbcdt "
            f"(batch, seqlen, 2 * d_nonssm + 2 * dim + 2 * ngroups * dstate + nheads) with "
            f"dim = nheads * headdim = {dim}, ngroups = {ngroups}, but got conv1d_weight "
            f"{describe(conv1d_weight)} and zxbcdt {describe(zxbcdt)}"
        )
    d_nonssm = nonssm2 // 2
    if outproj_weight is None and outproj_bias is not None:
        raise ValueError(f"{fn}: outproj_bias is given without outproj_weight")
    out_dim = (
        outproj_weight.shape[0]
        if isinstance(outproj_weight, Tensor) and outproj_weight.dim() > 0
        else None
    )
    optional = (
        ("conv1d_bias", conv1d_bias, (conv_dim,), "(conv_dim,)"),
        ("dt_bias", dt_bias, (nheads,), "(nheads,)"),
        ("A", A, (nheads,), "(nheads,)"),
        ("initial_states", initial_states, (batch, nheads, headdim, dstate),
         "(batch, nheads, headdim, dstate)"),
        ("rmsnorm_weight", rmsnorm_weight, (dim,), "(nheads * headdim,)"),
        ("outproj_weight", outproj_weight, (out_dim, dim + d_nonssm),
         "(out_dim, nheads * headdim + d_nonssm)"),
        ("outproj_bias", outproj_bias, (out_dim,), "(out_dim,) with outproj_weight's out_dim"),
    )  # fmt: skip
    for name, value, shape, what in optional:
        if value is None:  # dt_bias too: mamba_ssm takes None (no bias)
            continue
        if tuple(_real(fn, name, value).shape) != shape:
            raise ValueError(f"{fn}: expected {name} of shape {what} = {shape}, but got "
                             f"{describe(value)}")  # fmt: skip
    for name, t in (("conv1d_weight", conv1d_weight), ("D", D), *(x[:2] for x in optional)):
        if t is not None and t.device != zxbcdt.device:
            raise ValueError(f"{fn}: expected all tensors on one device, but zxbcdt is on "
                             f"{zxbcdt.device} and {name} is on {t.device}")  # fmt: skip
    zx0, z, xBC, dt = zxbcdt.split([nonssm2, dim, conv_dim, nheads], dim=-1)
    _check_seq_idx(fn, seq_idx, batch, length)
    # On the CPU, the convolution, scan and gated norm fused (parascan.ssd.layer).
    if (
        rmsnorm_weight is not None
        and seq_idx is None
        and _fusable(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, rmsnorm_weight,
                     initial_states, nheads, headdim, ngroups, dstate)
    ):  # fmt: skip
        y, final = ssd_layer.split_conv_scan(
            zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, rmsnorm_weight, initial_states,
            heads=nheads, headdim=headdim, groups=ngroups, nstate=dstate, offset=nonssm2,
            silu=activation is not None, eps=rmsnorm_eps, before_gate=norm_before_gate,
            dt_limit=_named_limit(fn, dt_limit),
        )  # fmt: skip
        final = _state(final, zxbcdt, state_dtype)
    else:
        with errors_as(fn, _CHUNK):
            y, final = _split_conv_scan_unfused(
                zxbcdt, z, xBC, dt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                initial_states, seq_idx, dt_limit, activation, rmsnorm_weight, rmsnorm_eps,
                nheads, headdim, ngroups, dstate, norm_before_gate, state_dtype,
            )  # fmt: skip
    if d_nonssm:
        left, right = zx0.split([d_nonssm, d_nonssm], dim=-1)
        y = torch.cat([torch.nn.functional.silu(left) * right, y], dim=-1)
    if outproj_weight is not None:  # in y's dtype, as every other operand is taken
        bias = None if outproj_bias is None else outproj_bias.to(y.dtype)
        y = torch.nn.functional.linear(y, outproj_weight.to(y.dtype), bias)
    return (y, final) if return_final_states else y


def _fusable(
    zxbcdt: Tensor, conv1d_weight: Tensor, conv1d_bias: Tensor | None, dt_bias: Tensor,
    A: Tensor, D: Tensor, rmsnorm_weight: Tensor, initial_states: Tensor | None, nheads: int,
    headdim: int, ngroups: int, dstate: int,
) -> bool:  # fmt: skip
    """Whether the fused CPU layer (parascan.ssd.layer) takes these operands: its
    devices, dtypes and filter width, and every shape as the layer expects it (any
    other goes the unfused way, whose checks name what is wrong)."""
    tensors = (conv1d_bias, dt_bias, A, D, rmsnorm_weight, initial_states)
    if dt_bias is None or not all(t is None or isinstance(t, Tensor) for t in tensors):
        return False
    dim, conv_dim = nheads * headdim, conv1d_weight.shape[0]
    shapes_ok = (
        (conv1d_bias is None or tuple(conv1d_bias.shape) == (conv_dim,))
        and tuple(dt_bias.shape) == (nheads,)
        and tuple(A.shape) == (nheads,)
        and tuple(rmsnorm_weight.shape) == (dim,)
        and dim % ngroups == 0
        and (
            initial_states is None
            or tuple(initial_states.shape) == (zxbcdt.shape[0], nheads, headdim, dstate)
        )
    )
    return shapes_ok and ssd_layer.usable(
        zxbcdt, conv1d_weight, *tensors, width=conv1d_weight.shape[1]
    )


def _split_conv_scan_unfused(
    zxbcdt: Tensor, z: Tensor, xBC: Tensor, dt: Tensor, conv1d_weight: Tensor,
    conv1d_bias: Tensor | None, dt_bias: Tensor, A: Tensor, D: Tensor, chunk_size: int,
    initial_states: Tensor | None, seq_idx: Tensor | None, dt_limit: tuple[float, float],
    activation: str | None, rmsnorm_weight: Tensor | None, rmsnorm_eps: float, nheads: int,
    headdim: int, ngroups: int, dstate: int, norm_before_gate: bool,
    state_dtype: torch.dtype | None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The layer from the convolution to the gated norm in torch ops and
    :func:`parascan.ssd_scan` (any device, dtype and ``seq_idx``): ``(y, final)``."""
    xBC = causal_conv1d(xBC, conv1d_weight, conv1d_bias, seq_idx, activation is not None)
    dim = nheads * headdim
    x, B, C = xBC.split([dim, ngroups * dstate, ngroups * dstate], dim=-1)
    gate = z.unflatten(-1, (nheads, headdim))
    result = mamba_chunk_scan_combined(
        x.unflatten(-1, (nheads, headdim)), dt, A, B.unflatten(-1, (ngroups, dstate)),
        C.unflatten(-1, (ngroups, dstate)), chunk_size, D=D,
        z=gate if rmsnorm_weight is None else None, dt_bias=dt_bias,
        initial_states=initial_states, seq_idx=seq_idx, dt_softplus=True, dt_limit=dt_limit,
        return_final_states=True, state_dtype=state_dtype,
    )  # fmt: skip
    assert isinstance(result, tuple)
    y, final = result[0].flatten(-2), result[1]
    if rmsnorm_weight is not None:
        y = _gated_rms_norm(y, z, rmsnorm_weight, rmsnorm_eps, ngroups, norm_before_gate)
        y = y.to(zxbcdt.dtype)
    return y, final
