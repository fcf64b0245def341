"""Argument handling of the first-order scans (linear_scan, log_linear_scan, and
their parascan.distributed versions): validation with the caller's name in every
message, broadcasting, the backend (from the op's row of the backend table), the
final state, and the eager fast path that calls a C kernel directly."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from parascan._backends import resolve
from parascan._checks import (
    FLOAT_DTYPES,
    as_operand,
    broadcast_shape,
    check_dtype,
    check_flag,
    check_same_device,
    describe,
    normalize_dim,
    result_dtype,
)
from parascan._native import kernel_library_error
from parascan._op_utils import plain_eager, state_shape
from parascan.first_order import cpu
from parascan.first_order.ops import ROWS
from parascan.first_order.semiring import Semiring

__all__ = ["Prepared", "cpu_fast_path", "final_state", "prepare", "with_final"]


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


def final_state(out: Tensor, p: Prepared, reverse: bool, empty: float) -> Tensor:
    """The last state (``out[T-1]``, or ``out[0]`` reversed) as a new tensor; for
    T == 0 the initial state, or ``empty`` (the state of no steps) without one."""
    steps = out.shape[p.dim]
    if steps == 0:
        if p.initial is None:
            return out.new_full(state_shape(out, p.dim), empty)
        return p.initial.clone()
    return out.select(p.dim, 0 if reverse else steps - 1).clone()


def with_final(
    out: Tensor, p: Prepared, reverse: bool, return_final: bool, empty: float
) -> Tensor | tuple[Tensor, Tensor]:
    """The public return value: ``out`` (0-d for a 0-d call), with the final state
    when asked for."""
    result = out.reshape(()) if p.scalar else out
    if not return_final:
        return result
    final = final_state(out, p, reverse, empty)
    return result, final.reshape(()) if p.scalar else final


def cpu_fast_path(
    ring: Semiring,
    gates: object,
    tokens: object,
    dim: object,
    initial: object,
    reverse: object,
    return_final: object,
    backend: object,
) -> Tensor | None:
    """The cpu kernel of ``ring`` called directly, for the common call that needs
    nothing of the op machinery: plain strided CPU tensors of one shape and dtype
    that need no gradient, no final state. Returns None (take the general path,
    which validates everything and owns every error message) for anything else.
    Every condition here implies that ``prepare`` would accept the call as it is, so
    the same arguments are accepted or rejected whichever path runs. A small scan
    costs microseconds in the kernel, so the tens of microseconds of dispatch are
    what this path saves."""
    if not (
        type(gates) is torch.Tensor
        and type(tokens) is torch.Tensor
        and (initial is None or type(initial) is torch.Tensor)
        and type(dim) is int
        and type(reverse) is bool
        and return_final is False
        and backend in ("auto", "cpu")
        and not tokens.is_nested  # a nested tensor has no .shape
        and not gates.is_nested
        and (initial is None or not initial.is_nested)
    ):
        return None
    dtype, shape = tokens.dtype, tokens.shape
    if (
        not plain_eager()  # first: the bit tests below are not traceable (torch.compile)
        or gates.dtype != dtype
        or gates.shape != shape
        or dtype not in FLOAT_DTYPES
        or tokens.device.type != "cpu"
        or gates.device.type != "cpu"
        or tokens.layout != torch.strided
        or gates.layout != torch.strided
        or not -len(shape) <= dim < len(shape)
        or gates.is_conj()
        or tokens.is_conj()
        or gates.is_neg()
        or tokens.is_neg()
        or (torch.is_grad_enabled() and (gates.requires_grad or tokens.requires_grad))
        or kernel_library_error() is not None
    ):
        return None
    if initial is not None:
        d = dim % len(shape)
        if (
            initial.dtype != dtype
            or initial.device.type != "cpu"
            or initial.layout != torch.strided
            or initial.shape != shape[:d] + shape[d + 1 :]
            or initial.is_conj()
            or initial.is_neg()
            or (torch.is_grad_enabled() and initial.requires_grad)
        ):
            return None
    # Every operand was checked above as check_operands would: verified.
    return cpu.forward(ring, gates, tokens, initial, dim, reverse, True)
