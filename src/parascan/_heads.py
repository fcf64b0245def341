"""What the scans with a (K, V) matrix state per head share at their public entry: the
delta rule, linear attention and the generalized (DPLR) delta rule all take q and k
(batch, L, Hk, K) and v (batch, L, Hv, V) with grouped value heads, a log decay per
head or per key channel, a state (batch or num_seqs, Hv, K, V) and a scale. The
checks raise the contract's errors naming the public function."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import overload

import torch
from torch import Tensor

from parascan._core import (
    check_packed_state,
    check_same_device,
    check_shape,
    check_tensor,
    describe,
    eager_no_grad,
    finite_float,
)
from parascan._native import kernel_library_error

__all__ = [
    "Heads",
    "as_dtype",
    "check_gate",
    "check_heads",
    "check_scale",
    "check_state",
    "plain_inference",
]


@dataclass(frozen=True)
class Heads:
    """The sizes every operand is checked against."""

    batch: int
    length: int
    hk: int  # query/key heads
    dk: int  # key channels K
    hv: int  # value heads, a multiple of hk
    dv: int  # value channels V


def check_heads(
    fn: str, q: object, k: object, v: object, keyed: tuple[tuple[str, object], ...] = ()
) -> tuple[Tensor, Tensor, Tensor, tuple[Tensor, ...], Heads]:
    """q, k (batch, L, Hk, K) and v (batch, L, Hv, V), Hv a positive multiple of Hk,
    validated; ``keyed``: more (name, operand) pairs shaped like k (DPLR's a and b)."""
    q = check_tensor(fn, "q", q)
    if q.dim() != 4:
        raise ValueError(f"{fn}: expected q of shape (batch, L, Hk, K), but got {describe(q)}")
    batch, length, hk, dk = q.shape
    if hk < 1 or dk < 1:
        raise ValueError(
            f"{fn}: expected q with at least one head and one key channel (Hk, K >= 1), but "
            f"got {describe(q)}"
        )
    k = check_tensor(fn, "k", k)
    check_shape(fn, "k", k, (batch, length, hk, dk), "(batch, L, Hk, K) like q")
    v = check_tensor(fn, "v", v)
    if v.dim() != 4 or v.shape[:2] != (batch, length):
        raise ValueError(
            f"{fn}: expected v of shape (batch, L, Hv, V) with (batch, L) = {(batch, length)}, "
            f"but got {describe(v)}"
        )
    hv, dv = v.shape[2], v.shape[3]
    if hv < 1 or hv % hk:
        raise ValueError(
            f"{fn}: expected v's head count Hv to be a positive multiple of q and k's Hk = "
            f"{hk}, but got {describe(v)}"
        )
    if dv < 1:
        raise ValueError(
            f"{fn}: expected v with at least one value channel (V >= 1), but got {describe(v)}"
        )
    more = []
    for name, t in keyed:
        t = check_tensor(fn, name, t)
        check_shape(fn, name, t, (batch, length, hk, dk), "(batch, L, Hk, K) like q")
        more.append(t)
    return q, k, v, tuple(more), Heads(batch, length, hk, dk, hv, dv)


def check_gate(fn: str, g: object, heads: Heads) -> Tensor | None:
    """The log decay: None, (batch, L, Hv) or (batch, L, Hv, K)."""
    if g is None:
        return None
    g = check_tensor(fn, "g", g)
    b, n, hv, dk = heads.batch, heads.length, heads.hv, heads.dk
    if tuple(g.shape) not in ((b, n, hv), (b, n, hv, dk)):
        raise ValueError(
            f"{fn}: expected g of shape (batch, L, Hv) = {(b, n, hv)} or (batch, L, Hv, K) = "
            f"{(b, n, hv, dk)}, but got {describe(g)}"
        )
    return g


def check_state(
    fn: str, q: Tensor, heads: Heads, cu_seqlens: object, initial: object,
    named: list[tuple[str, Tensor | None]],
) -> tuple[Tensor | None, Tensor | None]:  # fmt: skip
    """``cu_seqlens`` and ``initial`` ((batch or num_seqs, Hv, K, V)) validated, and every
    tensor of ``named`` (with ``initial``) on one device."""
    cu_seqlens, initial = check_packed_state(
        fn, ("q", q), cu_seqlens, initial, ((heads.hv, heads.dk, heads.dv), "Hv, K, V")
    )
    present = [(n, t) for n, t in [*named, ("initial", initial)] if t is not None]
    check_same_device(fn, present)
    return cu_seqlens, initial


def check_scale(fn: str, scale: object, dk: int) -> float:
    """The output's scale: K ** -0.5 when None, else a finite number."""
    if scale is None:
        return 1.0 / math.sqrt(dk)
    value = finite_float(scale)
    if value is None:
        raise TypeError(
            f"{fn}: expected scale to be a finite number or None, but got {describe(scale)}"
        )
    return value


@overload
def as_dtype(t: Tensor, dtype: torch.dtype) -> Tensor: ...
@overload
def as_dtype(t: None, dtype: torch.dtype) -> None: ...
def as_dtype(t: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """``t`` in ``dtype`` (itself when it is already: a decoding step is short enough
    that each ``.to`` call's dispatch shows)."""
    return t if t is None or t.dtype == dtype else t.to(dtype)


def plain_inference(
    fn: str, q: object, keyed: tuple[object, ...], v: object, g: object, scale: object,
    initial: object, return_final: object, cu_seqlens: object, backend: object,
) -> float | None:  # fmt: skip
    """The scale for a family's C kernel (its cpu.infer) when a call of ``fn`` can go to
    it at once, else None (``keyed``: the operands shaped like q: k, and DPLR's a, b):
    an eager call that nothing differentiates (inference, a decoding step), not packed,
    on contiguous CPU tensors of one float32 or float64 dtype whose shapes agree, as a
    generation loop hands them in on every token. These checks imply every check below
    them in the public function, which runs (and raises) when one fails; they skip its
    validation, backend resolution and casts (tens of microseconds a call, more than the
    step itself at small heads)."""
    if (
        # first: torch.compile traces none of the rest (kernel_library_error reads the
        # file system, a graph break under fullgraph=True)
        torch.compiler.is_compiling()
        or cu_seqlens is not None
        or type(backend) is not str
        or backend not in ("auto", "cpu")
        or type(return_final) is not bool
        or not (scale is None or (type(scale) in (float, int) and finite_float(scale) is not None))
        or kernel_library_error() is not None  # no C kernel: the general path picks another
        or type(q) is not Tensor
        or type(v) is not Tensor
        or q.dim() != 4
        or v.dim() != 4
        or v.dtype not in (torch.float32, torch.float64)
    ):
        return None
    batch, length, hk, dk = q.shape
    hv = v.shape[2]
    shapes = [(q, q.shape), *((t, q.shape) for t in keyed), (v, (batch, length, hv, v.shape[3]))]
    if g is not None:
        shapes.append(
            (g, (batch, length, hv) if getattr(g, "ndim", 0) == 3 else (batch, length, hv, dk))
        )
    if initial is not None:
        shapes.append((initial, (batch, hv, dk, v.shape[3])))
    tensors: list[Tensor] = []
    for t, shape in shapes:
        if not (
            type(t) is Tensor
            and t.shape == shape
            and t.dtype == v.dtype
            and t.layout == torch.strided
            and not t.is_nested
            and t.is_cpu
            and t.is_contiguous()
            and not t.is_neg()
        ):
            return None
        tensors.append(t)
    if min(batch, length, hk, dk, hv, v.shape[3]) < 1 or hv % hk or not eager_no_grad(tensors):
        return None
    # scale is None or a finite float or int (checked above): no second check
    return check_scale(fn, scale, dk)
