"""The public first-order scans, ``linear_scan`` (the linear semiring) and
``log_linear_scan`` (the log semiring), and their argument handling, shared with their
parascan.distributed versions: validation with the caller's name in every message,
broadcasting, the backend (from the op's row of the backend table), the final state,
and the eager fast path that calls a C or Triton kernel directly."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, overload

import torch
from torch import Tensor

from parascan._core import (
    FLOAT_DTYPES,
    as_operand,
    broadcast_shape,
    check_dtype,
    check_flag,
    check_same_device,
    describe,
    normalize_dim,
    plain_eager,
    resolve,
    result_dtype,
    state_shape,
    unavailable_reason,
)
from parascan._native import bindings, kernel_library_error
from parascan.first_order import packed
from parascan.first_order.autograd import apply
from parascan.first_order.ops import ROWS
from parascan.first_order.semiring import LINEAR, LOG, Semiring

__all__ = [
    "Prepared",
    "fast_path",
    "linear_scan",
    "log_linear_scan",
    "prepare",
    "with_final",
]


@dataclass(frozen=True)
class Prepared:
    """Validated operands: ``gates`` and ``tokens`` expanded to one shape and dtype,
    ``initial`` expanded to the state shape (or None), ``dim`` negative (it then
    survives new leading batch dims), and the backend resolved."""

    gates: Tensor
    tokens: Tensor
    initial: Tensor | None
    dim: int
    backend: str
    scalar: bool  # a 0-d call, computed as length 1 and returned 0-d


def prepare(
    ring: Semiring,
    gates: object,
    tokens: object,
    dim: object,
    initial: object,
    reverse: object,
    return_final: object,
    backend: object,
    name: str | None = None,
) -> Prepared:
    """Validate a scan of ``ring``; raises TypeError/ValueError/IndexError/RuntimeError
    naming ``name`` (the public function, ``ring.op`` by default) and the offending
    argument before any kernel runs."""
    name = ring.op if name is None else name
    gname, tname = ring.operands
    tokens = as_operand(name, tname, tokens, allow_number=False)
    gates = as_operand(name, gname, gates, allow_number=True, like=tokens)
    check_dtype(name, gname, gates)
    check_dtype(name, tname, tokens)
    named = [(gname, gates), (tname, tokens)]
    if initial is not None:
        initial = as_operand(name, "initial", initial, allow_number=True, like=tokens)
        check_dtype(name, "initial", initial)
        named.append(("initial", initial))
    check_same_device(name, named)
    shape = broadcast_shape(name, [(gname, gates.shape), (tname, tokens.shape)])
    scalar = len(shape) == 0
    if scalar:  # like torch.cumsum, a 0-d input is a sequence of length 1
        shape = (1,)
    d = normalize_dim(name, dim, len(shape))
    dtype = result_dtype(name, gates, tokens)
    state_shape = shape[:d] + shape[d + 1 :]
    if initial is not None:
        assert isinstance(initial, Tensor)
        if initial.is_complex() and not dtype.is_complex:
            raise TypeError(
                f"{name}: expected a real initial for a real result ({dtype}), "
                f"but got {initial.dtype}"
            )
        if len(initial.shape) > len(state_shape) or (
            broadcast_shape(name, [("result without dim", state_shape), ("initial", initial.shape)])
            != state_shape
        ):
            raise ValueError(
                f"{name}: expected initial broadcastable to the result's shape without dim "
                f"{state_shape}, but got {describe(initial)}"
            )
        initial = initial.to(dtype).expand(state_shape)
    reverse = check_flag(name, "reverse", reverse)
    return_final = check_flag(name, "return_final", return_final)
    chosen = resolve(ROWS[ring.name], backend, tokens.device, dtype, name=name)
    return Prepared(
        gates.to(dtype).expand(shape),
        tokens.to(dtype).expand(shape),
        initial,
        d - len(shape),
        chosen,
        scalar,
    )


def with_final(
    out: Tensor, p: Prepared, reverse: bool, return_final: bool, empty: float
) -> Tensor | tuple[Tensor, Tensor]:
    """The public return value: ``out`` (0-d for a 0-d call), and when asked for the
    final state as a new tensor: the last state (``out[T-1]``, or ``out[0]``
    reversed); for T == 0 the initial state, or ``empty`` (the state of no steps)
    without one."""
    result = out.reshape(()) if p.scalar else out
    if not return_final:
        return result
    steps = out.shape[p.dim]
    if steps:
        final = out.select(p.dim, 0 if reverse else steps - 1).clone()
    elif p.initial is None:
        final = out.new_full(state_shape(out, p.dim), empty)
    else:
        final = p.initial.clone()
    return result, final.reshape(()) if p.scalar else final


def _direct_backend(
    ring: Semiring, backend: object, device: torch.device, dtype: torch.dtype
) -> str | None:
    """The backend a direct call runs ("cpu" or "triton", as ``resolve`` would pick it
    for these arguments), or None when the general path decides."""
    if device.type == "cpu" and backend in ("auto", "cpu"):
        return "cpu" if kernel_library_error() is None else None
    if backend == "triton" or (backend == "auto" and device.type == "cuda"):
        entry = ROWS[ring.name].backends.get("triton")
        if entry is None or dtype not in entry.dtypes:
            return None
        return "triton" if unavailable_reason("triton", device) is None else None
    return None


def fast_path(
    ring: Semiring,
    gates: object,
    tokens: object,
    dim: object,
    initial: object,
    reverse: object,
    return_final: object,
    backend: object,
) -> Tensor | tuple[Tensor, Tensor] | None:
    """The kernel of ``ring`` called directly, for the common call that needs nothing
    of the op machinery: plain strided tensors of one shape, dtype and device that
    need no gradient (and the final state, when asked for, of at least one step: a
    copy of the last output, as with_final takes it), on the C kernel (CPU tensors,
    ``auto`` or ``cpu``) or the Triton kernels (CUDA tensors, ``auto`` where it picks
    them, or ``triton``). Returns None (take the general path, which validates
    everything and owns every error message) for anything else. Every condition here
    implies that ``prepare`` would accept the call as it is and pick the same backend,
    so the same arguments are accepted or rejected, with the same result, whichever
    path runs. A small scan costs microseconds in the kernel, so the tens of
    microseconds of dispatch are what this path saves; on a GPU, a host slower than
    the kernel leaves the device waiting (the host's time per call through the op and
    in the kernels' launch, measured on an H200's host: BENCHMARKS.md, "Figures the
    source cites")."""
    if not (
        type(gates) is torch.Tensor
        and type(tokens) is torch.Tensor
        and (initial is None or type(initial) is torch.Tensor)
        and type(dim) is int
        and type(reverse) is bool
        and type(return_final) is bool
        and backend in ("auto", "cpu", "triton")
        and not tokens.is_nested  # a nested tensor has no .shape
        and not gates.is_nested
        and (initial is None or not initial.is_nested)
    ):
        return None
    dtype, shape, device = tokens.dtype, tokens.shape, tokens.device
    if (
        not plain_eager()  # first: the bit tests below are not traceable (torch.compile)
        or gates.dtype != dtype
        or gates.shape != shape
        or dtype not in FLOAT_DTYPES
        or gates.device != device
        or tokens.layout != torch.strided
        or gates.layout != torch.strided
        or not -len(shape) <= dim < len(shape)
        or gates.is_conj()
        or tokens.is_conj()
        or gates.is_neg()
        or tokens.is_neg()
        or (torch.is_grad_enabled() and (gates.requires_grad or tokens.requires_grad))
    ):
        return None
    chosen = _direct_backend(ring, backend, device, dtype)
    if chosen is None:
        return None
    d = dim % len(shape)
    if initial is not None and (
        initial.dtype != dtype
        or initial.device != device
        or initial.layout != torch.strided
        or initial.shape != shape[:d] + shape[d + 1 :]
        or initial.is_conj()
        or initial.is_neg()
        or (torch.is_grad_enabled() and initial.requires_grad)
    ):
        return None
    if return_final and shape[d] == 0:
        return None  # the final state of no steps: with_final's
    # Every operand was checked above as check_operands would: verified.
    if chosen == "cpu":
        out = bindings.scan_forward(ring.name, gates, tokens, initial, dim, reverse, True)
    else:
        from parascan.first_order import triton as triton_backend

        out = triton_backend.forward(ring, gates, tokens, initial, d, reverse)
    if not return_final:
        return out
    return out, out.select(d, 0 if reverse else shape[d] - 1).clone()


def scan(
    ring: Semiring, gates: object, tokens: object, dim: int, initial: object, reverse: bool,
    return_final: bool, backend: str, cu_seqlens: Tensor | None,
) -> Tensor | tuple[Tensor, Tensor]:  # fmt: skip
    """The public functions' body: ``ring``'s first-order scan with their arguments."""
    if cu_seqlens is not None:
        p = prepare(ring, gates, tokens, dim, None, reverse, return_final, backend)
        return packed.scan(ring, p, initial, bool(reverse), bool(return_final), cu_seqlens)
    if not torch.compiler.is_compiling():
        fast = fast_path(ring, gates, tokens, dim, initial, reverse, return_final, backend)
        if fast is not None:
            return fast
    p = prepare(ring, gates, tokens, dim, initial, reverse, return_final, backend)
    out = apply(ring.name, p.gates, p.tokens, p.initial, p.dim, reverse, p.backend)
    return with_final(out, p, reverse, return_final, ring.zero)


@overload
def linear_scan(
    gates: Tensor | float,
    tokens: Tensor,
    dim: int,
    *,
    initial: Tensor | float | None = ...,
    reverse: bool = ...,
    return_final: Literal[False] = ...,
    backend: str = ...,
    cu_seqlens: Tensor | None = ...,
) -> Tensor: ...
@overload
def linear_scan(
    gates: Tensor | float,
    tokens: Tensor,
    dim: int,
    *,
    initial: Tensor | float | None = ...,
    reverse: bool = ...,
    return_final: Literal[True],
    backend: str = ...,
    cu_seqlens: Tensor | None = ...,
) -> tuple[Tensor, Tensor]: ...


def linear_scan(
    gates: Tensor | float,
    tokens: Tensor,
    dim: int,
    *,
    initial: Tensor | float | None = None,
    reverse: bool = False,
    return_final: bool = False,
    backend: str = "auto",
    cu_seqlens: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    r"""First-order linear recurrence along ``dim``.

    .. math:: x_t = a_t \, x_{t-1} + b_t, \qquad x_{-1} = \text{initial} \ (\text{default } 0)

    Semantics given by this loop (``reverse=True`` walks ``t`` from T-1 down to 0 and
    reads ``x[t+1]``, with ``x[T] = initial``)::

        x = initial
        for t in range(T):
            x = gates[t] * x + tokens[t]
            out[t] = x

    Args:
        gates: the multipliers ``a``; a tensor or a Python number, broadcast with
            ``tokens``.
        tokens: the inputs ``b``.
        dim: the time dimension of the broadcast result (negative counts from the end).
        initial: the state before the first step, broadcastable to the result's shape
            without ``dim``.
        reverse: run time backwards.
        return_final: also return the last state (``out[T-1]``, or ``out[0]`` when
            reversed; ``initial`` or zeros when T == 0).
        backend: ``"auto"``, ``"cpu"``, ``"triton"``, ``"torch"`` or ``"loop"``; see
            :func:`parascan.backends`.
        cu_seqlens: packed variable-length sequences: an int32/int64 tensor of
            ``num_seqs + 1`` offsets along ``dim`` (0 first, the length last,
            non-decreasing). Each sequence ``cu_seqlens[s] .. cu_seqlens[s+1] - 1`` is
            scanned as if alone (``reverse`` within it; no state or gradient crosses a
            boundary). ``initial`` and ``final`` then hold one state per sequence, with a
            leading ``num_seqs`` dim in place of the batch: the result's leading dim must
            be 1 (or ``dim`` 0), e.g. ``(1, T, D)`` along dim 1 takes and returns
            ``(num_seqs, D)`` states. An empty sequence's final state is its initial one.

    Returns:
        ``out``, contiguous, with the broadcast shape and dtype
        ``torch.result_type(gates, tokens)``; or ``(out, final)``. float16 and bfloat16
        accumulate in float32. Differentiable in gates, tokens and initial (gradients
        are reduced to each input's shape), under vmap, torch.func and torch.compile.

    Example:
        >>> import torch, parascan as ps
        >>> ps.linear_scan(torch.tensor([1.0, 0.5, 2.0]), torch.tensor([1.0, 1.0, 1.0]), 0)
        tensor([1.0000, 1.5000, 4.0000])
        >>> ps.linear_scan(0.5, torch.ones(3), 0, reverse=True)
        tensor([1.7500, 1.5000, 1.0000])
        >>> out, final = ps.linear_scan(0.5, torch.ones(2, 3), 1, initial=torch.tensor([0.0, 4.0]),
        ...                             return_final=True)
        >>> out
        tensor([[1.0000, 1.5000, 1.7500],
                [3.0000, 2.5000, 2.2500]])
        >>> final
        tensor([1.7500, 2.2500])
        >>> ps.linear_scan(0.5, torch.ones(1, 5), 1, cu_seqlens=torch.tensor([0, 2, 5]))
        tensor([[1.0000, 1.5000, 1.0000, 1.5000, 1.7500]])
    """
    return scan(LINEAR, gates, tokens, dim, initial, reverse, return_final, backend, cu_seqlens)


@overload
def log_linear_scan(
    log_gates: Tensor | float,
    log_tokens: Tensor,
    dim: int,
    *,
    initial: Tensor | float | None = ...,
    reverse: bool = ...,
    return_final: Literal[False] = ...,
    backend: str = ...,
    cu_seqlens: Tensor | None = ...,
) -> Tensor: ...
@overload
def log_linear_scan(
    log_gates: Tensor | float,
    log_tokens: Tensor,
    dim: int,
    *,
    initial: Tensor | float | None = ...,
    reverse: bool = ...,
    return_final: Literal[True],
    backend: str = ...,
    cu_seqlens: Tensor | None = ...,
) -> tuple[Tensor, Tensor]: ...


def log_linear_scan(
    log_gates: Tensor | float,
    log_tokens: Tensor,
    dim: int,
    *,
    initial: Tensor | float | None = None,
    reverse: bool = False,
    return_final: bool = False,
    backend: str = "auto",
    cu_seqlens: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    r"""First-order linear recurrence computed in log space, returning ``log x``.

    .. math:: h_t = \operatorname{logaddexp}(\log a_t + h_{t-1}, \log b_t), \qquad
              h_{-1} = \text{initial} \ (\text{default } -\infty)

    so ``h = log x`` for ``x[t] = a[t] x[t-1] + b[t]``, without ever leaving log
    space: no overflow for huge values, no cancellation of a running cumsum (it
    stays accurate at any length), and exact, finite gradients where a gate or a
    token is zero (``-inf``). ``reverse=True`` walks time backwards.

    Args:
        log_gates: ``log a``; a tensor or a Python number, broadcast with
            ``log_tokens``.
        log_tokens: ``log b``.
        dim: the time dimension of the broadcast result (negative counts from the end).
        initial: ``log x[-1]``, broadcastable to the result's shape without ``dim``.
        reverse: run time backwards.
        return_final: also return the last state (``-inf`` or ``initial`` when T == 0).
        backend: ``"auto"``, ``"cpu"``, ``"torch"`` or ``"loop"``; see
            :func:`parascan.backends`.
        cu_seqlens: packed sequences, as for :func:`parascan.linear_scan` (``initial``
            and ``final`` per sequence, log 0 for an empty one without ``initial``).

    Returns:
        ``h`` (contiguous, broadcast shape, dtype ``torch.result_type``), or
        ``(h, final)``. Real inputs give a real result. Complex inputs give the
        principal complex log (imaginary part in [-pi, pi)): for real recurrences
        with negative numbers pass ``torch.log(v.to(torch.complex64))`` and read
        ``torch.exp(h).real``. Half types compute in float32. Differentiable in
        every input (where the result is log 0 the gradient is 0), under vmap,
        torch.func and torch.compile.

    Example:
        >>> import torch, parascan as ps
        >>> a, b = torch.tensor([0.5, 0.5, 0.5]), torch.tensor([1.0, 2.0, 0.0])
        >>> ps.log_linear_scan(a.log(), b.log(), 0).exp()
        tensor([1.0000, 2.5000, 1.2500])
        >>> neg = torch.tensor([1.0, -3.0]).to(torch.complex64).log()
        >>> ps.log_linear_scan(torch.zeros(2), neg, 0).exp().real
        tensor([ 1., -2.])
    """
    return scan(
        LOG, log_gates, log_tokens, dim, initial, reverse, return_final, backend, cu_seqlens
    )
