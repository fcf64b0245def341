"""Mamba-2's layer around the SSD scan, fused on the CPU: the depthwise causal
convolution that feeds the scan, the scan, and the gated RMS norm after it, as one
autograd function whose backward writes the gradient of the layer's input projection
in one buffer.

:func:`parascan.compat.mamba_ssm.mamba_split_conv1d_scan_combined` runs it when it
can (:func:`usable`); the math is that function's, with ``d_nonssm`` channels left to
the caller. The input ``zxbcdt`` ``(batch, L, 2 * d_nonssm + dim + conv_dim + heads)``
holds ``(zx0, z, xBC, dt)``; with ``dim = heads * headdim`` and ``conv_dim = dim + 2 *
groups * N``::

    xBC  = act(conv_bias + causal depthwise conv of xBC by conv_weight)   act: silu or id
    x, B, C = split(xBC, (dim, groups * N, groups * N))
    y, final = ssd_scan(x, dt, A, B, C, D=D, dt_bias=dt_bias, dt_softplus=True,
                        dt_limit=dt_limit, initial=initial, return_final=True)
    out  = rmsnorm(y * silu(z)) * weight      (before_gate: rmsnorm(y) * weight * silu(z))

RMS over groups of ``dim // groups`` channels.

Summary of method. Unfused, this is some forty torch ops forward and backward, each a
pass over a ``(batch, L, channels)`` tensor: the convolution's shifted multiply-adds
and their transposes, silu and its derivative, the norm's squares, means and
products, the split's copies and the concatenation of the input's gradient. Here the
convolution and the norm are C kernels of one pass each way (ssd/cpu_layer.h),
the convolution writing the scan's ``x``, ``B`` and ``C`` contiguous (the scan's C
kernel reads them without a copy), and the backward writes the gradients of ``z``,
``xBC`` and ``dt`` straight into the slices of one ``zxbcdt``-shaped gradient. The
scan is the ``cpu`` backend of :func:`parascan.ssd_scan` (cpu.py), called on the
canonical operands directly; the step pipeline (``dt + dt_bias``, softplus, the clamp)
is torch's own ops, so its rounding and its gradient are those of ``ssd_scan``.
"""

from __future__ import annotations

import math
import struct
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from parascan._core import Function, plain_eager, refuse_second_derivatives
from parascan._native import (
    arg_struct,
    check_operands,
    kernel,
    kernel_library_error,
    pointer,
    simd,
)
from parascan.ssd import cpu as ssd_cpu
from parascan.ssd.api import clamp_to

__all__ = [
    "CONV_MAX_WIDTH",
    "conv_backward",
    "conv_forward",
    "norm_backward",
    "norm_forward",
    "split_conv_scan",
    "usable",
]

CONV_MAX_WIDTH = 16  # abi.h: PS_SSD_CONV_MAX_WIDTH
_DTYPES = (torch.float32, torch.float64)
_PLAIN = (Tensor, torch.nn.Parameter)  # not a subclass whose dispatch the kernels skip
_NO_LIMIT = (0.0, math.inf)

Opt = Tensor | None


def _run(entry: str, dtype: torch.dtype, args: Any, what: str) -> None:
    if kernel(entry, dtype)(args) != 0:
        raise RuntimeError(f"parascan: the {entry} CPU kernel failed (out of memory?) on {what}")


def _rows(entry: str, t: Tensor) -> tuple[int, int, int]:
    """A (batch, L, channels) tensor whose channels are contiguous as the struct takes
    it: its data pointer and its (batch, step) strides."""
    if t.dim() != 3 or (t.stride(2) != 1 and t.shape[2] > 1):
        raise RuntimeError(
            f"parascan: internal error: the {entry} CPU kernel reads (batch, L, channels) "
            f"tensors with channels of stride 1, but got shape {tuple(t.shape)}, strides "
            f"{t.stride()}"
        )
    return pointer(t), t.stride(0), t.stride(1)


def conv_forward(
    x: Tensor, weight: Tensor, bias: Opt, silu: bool, split: tuple[int, int, int]
) -> tuple[Tensor, Tensor, Tensor]:
    """``act(bias + causal depthwise conv of x by weight)`` for ``x`` ``(batch, L, c)``
    (channels contiguous, any other strides) and ``weight`` ``(c, K)``, ``K <=
    CONV_MAX_WIDTH``: its channels in three new contiguous pieces of widths ``split``."""
    weight, bias, plain = _conv("ssd_conv_fwd", x, weight, bias, silu, list(split))
    outs = [x.new_empty(x.shape[0], x.shape[1], s) for s in split]
    args = arg_struct("ssd_conv", **plain, out=tuple(pointer(o) for o in outs))
    _run("ssd_conv_fwd", x.dtype, args, f"x {tuple(x.shape)}")
    return outs[0], outs[1], outs[2]


def _conv(
    entry: str, x: Tensor, weight: Tensor, bias: Opt, silu: bool, split: list[int],
    *grads: tuple[Tensor, tuple[int, ...]],
) -> tuple[Tensor, Opt, dict[str, Any]]:  # fmt: skip
    """The convolution's filter and bias made contiguous, every operand checked (with
    ``grads``, more (tensor, shape) pairs), and the struct members both directions fill."""
    batch, length, channels = x.shape
    width = weight.shape[1]
    if not 1 <= width <= CONV_MAX_WIDTH:
        raise RuntimeError(
            f"parascan: internal error: the {entry} CPU kernel takes filters of 1 to "
            f"{CONV_MAX_WIDTH} taps, but got {width}"
        )
    weight = weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    check_operands(entry, x.dtype, (x, (batch, length, channels)), (weight, (channels, width)),
                   (bias, (channels,)), *grads)  # fmt: skip
    if len(split) != 3 or min(split) < 0 or sum(split) != channels:
        raise RuntimeError(
            f"parascan: internal error: the {entry} CPU kernel splits {channels} channels in "
            f"three pieces, but got widths {split}"
        )
    plain = {
        "batch": batch, "length": length, "channels": channels, "width": width,
        "x": _rows(entry, x), "weight": pointer(weight), "bias": pointer(bias), "silu": int(silu),
        "split": tuple(split), "nthreads": torch.get_num_threads(), "simd": int(simd()),
    }  # fmt: skip
    return weight, bias, plain


def conv_backward(
    x: Tensor, weight: Tensor, bias: Opt, silu: bool, grads: tuple[Tensor, Tensor, Tensor],
    grad_x: Tensor,
) -> tuple[Tensor, Opt]:  # fmt: skip
    """The backward of :func:`conv_forward` from the gradients of its three pieces
    (any tensors of their shapes): the gradient of ``x`` written into ``grad_x`` (a
    ``(batch, L, c)`` tensor, channels contiguous: a slice of a larger gradient),
    and the gradients of ``weight`` and ``bias`` (None without one) returned."""
    batch, length, channels = x.shape
    pieces = [g.contiguous() for g in grads]
    split = [g.shape[2] for g in pieces]
    weight, bias, plain = _conv(
        "ssd_conv_bwd", x, weight, bias, silu, split, (grad_x, (batch, length, channels)),
        *((g, (batch, length, s)) for g, s in zip(pieces, split, strict=True)),
    )  # fmt: skip
    grad_weight = torch.empty_like(weight)
    grad_bias = None if bias is None else torch.empty_like(bias)
    args = arg_struct(
        "ssd_conv", **plain, grad_out=tuple(pointer(g) for g in pieces),
        grad_x=_rows("ssd_conv_bwd", grad_x), grad_weight=pointer(grad_weight),
        grad_bias=pointer(grad_bias),
    )  # fmt: skip
    _run("ssd_conv_bwd", x.dtype, args, f"x {tuple(x.shape)}")
    return grad_weight, grad_bias


def norm_forward(
    y: Tensor, z: Tensor, weight: Tensor, eps: float, groups: int, before_gate: bool
) -> tuple[Tensor, Tensor]:
    """The gated RMS norm of ``y`` ``(batch, L, dim)`` by ``z`` (channels contiguous,
    any other strides): ``(out, rstd)``, ``rstd`` ``(batch, L, groups)`` the reciprocal
    RMS of each group, which the backward reads."""
    batch, length, dim = y.shape
    y, weight = y.contiguous(), weight.contiguous()
    check_operands("ssd_norm_fwd", y.dtype, (y, (batch, length, dim)),
                   (z, (batch, length, dim)), (weight, (dim,)))  # fmt: skip
    if groups < 1 or dim % groups:
        raise RuntimeError(
            f"parascan: internal error: the ssd_norm_fwd CPU kernel takes groups dividing "
            f"dim = {dim}, but got {groups}"
        )
    out = torch.empty_like(y)
    rstd = y.new_empty(batch, length, groups)
    (eps_bits,) = struct.unpack("<q", struct.pack("<d", float(eps)))  # eps's float64 bits
    args = arg_struct(
        "ssd_norm", batch=batch, length=length, dim=dim, groups=groups, y=pointer(y),
        z=_rows("ssd_norm_fwd", z), weight=pointer(weight), eps_bits=eps_bits,
        before_gate=int(before_gate), out=pointer(out), rstd=pointer(rstd),
        nthreads=torch.get_num_threads(), simd=int(simd()),
    )  # fmt: skip
    _run("ssd_norm_fwd", y.dtype, args, f"y {tuple(y.shape)}")
    return out, rstd


def norm_backward(
    y: Tensor, z: Tensor, weight: Tensor, rstd: Tensor, grad_out: Tensor, before_gate: bool,
    grad_z: Tensor,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The backward of :func:`norm_forward`: the gradient of ``z`` written into
    ``grad_z`` (channels contiguous: a slice of a larger gradient); the gradients of
    ``y`` and ``weight`` returned."""
    batch, length, dim = y.shape
    groups = rstd.shape[2]
    y, weight, grad_out = y.contiguous(), weight.contiguous(), grad_out.contiguous()
    rstd = rstd.contiguous()
    check_operands(
        "ssd_norm_bwd", y.dtype, (y, (batch, length, dim)), (z, (batch, length, dim)),
        (weight, (dim,)), (rstd, (batch, length, groups)), (grad_out, (batch, length, dim)),
        (grad_z, (batch, length, dim)),
    )  # fmt: skip
    if groups < 1 or dim % groups:
        raise RuntimeError(
            f"parascan: internal error: the ssd_norm_bwd CPU kernel takes groups dividing "
            f"dim = {dim}, but got rstd of shape {tuple(rstd.shape)}"
        )
    grad_y = torch.empty_like(y)
    grad_weight = torch.empty_like(weight)
    args = arg_struct(
        "ssd_norm", batch=batch, length=length, dim=dim, groups=groups, y=pointer(y),
        z=_rows("ssd_norm_bwd", z), weight=pointer(weight), before_gate=int(before_gate),
        rstd=pointer(rstd), grad_out=pointer(grad_out), grad_y=pointer(grad_y),
        grad_z=_rows("ssd_norm_bwd", grad_z), grad_weight=pointer(grad_weight),
        nthreads=torch.get_num_threads(), simd=int(simd()),
    )  # fmt: skip
    _run("ssd_norm_bwd", y.dtype, args, f"y {tuple(y.shape)}")
    return grad_y, grad_weight


def usable(zxbcdt: Tensor, *tensors: Opt, width: int) -> bool:
    """Whether :func:`split_conv_scan` can run these operands: plain CPU tensors (or
    parameters) of one dtype, float32 or float64, a filter of at most CONV_MAX_WIDTH taps, the C
    kernels built, and an eager call (no torch.compile, torch.func transform,
    dispatch mode or forward-mode AD, which the C kernels would not see). The eager
    test comes first: the bit tests after it (``Tensor.is_neg``) are not traceable,
    and under torch.compile the answer is no."""
    dtype = zxbcdt.dtype
    return (
        plain_eager()
        and dtype in _DTYPES
        and 1 <= width <= CONV_MAX_WIDTH
        and all(
            t is None
            or (
                type(t) in _PLAIN
                and t.layout == torch.strided
                and not t.is_neg()
                and not t.is_conj()
                and t.device.type == "cpu"
                and t.dtype == dtype
            )
            for t in (zxbcdt, *tensors)
        )
        and kernel_library_error() is None
    )


class _FirstDerivativesOnly(Function):
    """The gradients of :class:`_SplitConvScan` under ``create_graph``: passed on as
    they are, and a clear error if anything differentiates through them."""

    @staticmethod
    def forward(anchor: Tensor, *grads: Tensor) -> tuple[Tensor, ...]:
        # ``anchor``: an input of the layer that requires grad, so that the outputs do.
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        pass

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        refuse_second_derivatives("parascan.compat.mamba_ssm.mamba_split_conv1d_scan_combined")


class _SplitConvScan(Function):
    """The fused layer (module docstring); ``meta`` holds the sizes and flags."""

    @staticmethod
    def forward(
        ctx: Any, zxbcdt: Tensor, conv_weight: Tensor, conv_bias: Opt, dt_bias: Tensor,
        A: Tensor, D: Tensor, norm_weight: Tensor, initial: Opt, meta: tuple[Any, ...],
    ) -> tuple[Tensor, Tensor]:  # fmt: skip
        heads, headdim, groups, nstate, offset, silu, eps, before_gate, limit = meta
        batch, length, _ = zxbcdt.shape
        dim, conv_dim = heads * headdim, conv_weight.shape[0]
        z = zxbcdt.narrow(2, offset, dim)
        xbc = zxbcdt.narrow(2, offset + dim, conv_dim)
        dt = zxbcdt.narrow(2, offset + dim + conv_dim, heads)
        x, B, C = conv_forward(xbc, conv_weight, conv_bias, silu,
                               (dim, groups * nstate, groups * nstate))  # fmt: skip
        x4 = x.view(batch, length, heads, headdim)
        B4, C4 = B.view(batch, length, groups, nstate), C.view(batch, length, groups, nstate)
        v = dt + dt_bias
        step = F.softplus(v)
        if limit != _NO_LIMIT:
            step = clamp_to(step, limit)
        d = D.reshape(heads, -1).expand(heads, headdim)
        y, final, checkpoints = ssd_cpu.forward(x4, step, A, B4, C4, d, None, initial, None)
        out, rstd = norm_forward(y.view(batch, length, dim), z, norm_weight, eps, groups,
                                 before_gate)  # fmt: skip
        ctx.save_for_backward(zxbcdt, conv_weight, conv_bias, A, D, norm_weight, initial, x4,
                              B4, C4, v, step, y, rstd, checkpoints)  # fmt: skip
        ctx.meta = meta
        ctx.set_materialize_grads(False)
        return out, final

    @staticmethod
    def backward(ctx: Any, grad_out: Opt, grad_final: Opt) -> tuple[Opt, ...]:
        # The C kernels build no graph: with create_graph the gradients pass through
        # _FirstDerivativesOnly, whose own backward refuses (as the unfused path's ops do).
        twice = torch.is_grad_enabled()
        with torch.no_grad():
            grads = _SplitConvScan._backward(ctx, grad_out, grad_final)
        if not twice:
            return grads
        present = [g for g in grads if g is not None]
        anchor = next((t for t in ctx.saved_tensors if t.requires_grad), None)
        if anchor is None:  # only unsaved inputs (dt_bias) differentiable: nothing to tie to
            return grads
        passed = iter(_FirstDerivativesOnly.apply(anchor, *present))  # type: ignore[no-untyped-call]
        return tuple(None if g is None else next(passed) for g in grads)

    @staticmethod
    def _backward(ctx: Any, grad_out: Opt, grad_final: Opt) -> tuple[Opt, ...]:
        (zxbcdt, conv_weight, conv_bias, A, D, norm_weight, initial, x4, B4, C4, v, step, y,
         rstd, checkpoints) = ctx.saved_tensors  # fmt: skip
        heads, headdim, groups, nstate, offset, silu, _eps, before_gate, limit = ctx.meta
        batch, length, _ = zxbcdt.shape
        dim, conv_dim = heads * headdim, conv_weight.shape[0]
        grad = torch.empty_like(zxbcdt, memory_format=torch.contiguous_format)
        if offset:
            grad.narrow(2, 0, offset).zero_()
        tail = offset + dim + conv_dim + heads
        if tail < grad.shape[2]:
            grad.narrow(2, tail, grad.shape[2] - tail).zero_()
        grad_z = grad.narrow(2, offset, dim)
        y3 = y.view(batch, length, dim)
        if grad_out is None:
            grad_y = torch.zeros_like(y3)
            grad_z.zero_()
            grad_norm = torch.zeros_like(norm_weight)
        else:
            z = zxbcdt.narrow(2, offset, dim)
            grad_y, grad_norm = norm_backward(y3, z, norm_weight, rstd, grad_out, before_gate,
                                              grad_z)  # fmt: skip
        if grad_final is None:  # no rows: zeros, which the kernel then never reads
            grad_final = y.new_empty(0, heads, headdim, nstate)
        d = D.reshape(heads, -1).expand(heads, headdim)
        gx, gstep, gA, gB, gC, gD, _, ginit = ssd_cpu.backward(
            x4, step, A, B4, C4, d, None, initial, None, checkpoints,
            grad_y.view(batch, length, heads, headdim), grad_final,
        )  # fmt: skip
        if limit != _NO_LIMIT:  # clamp's gradient: through where lo <= softplus(v) <= hi
            sp = F.softplus(v)
            gstep = gstep * ((sp >= limit[0]) & (sp <= limit[1]))
        gv = torch.ops.aten.softplus_backward(gstep, v, 1.0, 20.0)
        grad.narrow(2, offset + dim + conv_dim, heads).copy_(gv)
        grad_conv_w, grad_conv_b = conv_backward(
            zxbcdt.narrow(2, offset + dim, conv_dim), conv_weight, conv_bias, silu,
            (gx.view(batch, length, dim), gB.view(batch, length, groups * nstate),
             gC.view(batch, length, groups * nstate)),
            grad.narrow(2, offset + dim, conv_dim),
        )  # fmt: skip
        need = ctx.needs_input_grad
        return (
            grad if need[0] else None,
            grad_conv_w if need[1] else None,
            grad_conv_b if need[2] else None,
            gv.sum((0, 1)) if need[3] else None,
            gA if need[4] else None,
            (gD if D.dim() == 2 else gD.sum(1)) if need[5] else None,
            grad_norm if need[6] else None,
            ginit if need[7] and initial is not None else None,
            None,
        )


def split_conv_scan(
    zxbcdt: Tensor, conv_weight: Tensor, conv_bias: Opt, dt_bias: Tensor, A: Tensor, D: Tensor,
    norm_weight: Tensor, initial: Opt, *, heads: int, headdim: int, groups: int, nstate: int,
    offset: int, silu: bool, eps: float, before_gate: bool, dt_limit: tuple[float, float],
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """The fused layer (module docstring) on validated operands that :func:`usable`
    accepts: ``(out, final)``, ``out`` ``(batch, L, heads * headdim)`` the gated norm's
    output and ``final`` ``(batch, heads, headdim, N)`` the scan's last state, both in
    ``zxbcdt``'s dtype and differentiable in every tensor. ``offset`` is where ``z``
    starts in ``zxbcdt``'s last dimension (``2 * d_nonssm``)."""
    if zxbcdt.stride(2) != 1:
        zxbcdt = zxbcdt.contiguous()
    meta = (heads, headdim, groups, nstate, offset, silu, float(eps), before_gate,
            (float(dt_limit[0]), float(dt_limit[1])))  # fmt: skip
    out, final = _SplitConvScan.apply(  # type: ignore[no-untyped-call]
        zxbcdt, conv_weight, conv_bias, dt_bias, A, D, norm_weight, initial, meta
    )
    return out, final
