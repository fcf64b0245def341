"""The depthwise causal convolution of the Mamba mixers (Mamba-1's and Mamba-2's),
``causal_conv1d``: a torch version (any dtype, device, ``seq_idx``) and the C kernels of
Mamba-2's fused layer (ssd/layer.py) where they can run."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from parascan._core import Function
from parascan.ssd import layer

__all__ = ["causal_conv1d"]


def _shift_masks(seq_idx: Tensor | None, width: int, length: int) -> list[Tensor | None]:
    """For each lag ``s`` in 1 .. width - 1, a ``(batch, L, 1)`` 0/1 mask of the steps
    ``t`` whose input ``t - s`` lies in the same sequence (None without ``seq_idx``: the
    zero padding alone keeps the convolution causal)."""
    if seq_idx is None:
        return [None] * width
    masks: list[Tensor | None] = [None]
    for lag in range(1, width):
        before = torch.zeros_like(seq_idx[:, : min(lag, length)], dtype=torch.bool)
        same = torch.cat([before, seq_idx[:, lag:] == seq_idx[:, : max(length - lag, 0)]], 1)
        masks.append(same[..., None])
    return masks


def _conv_taps(x: Tensor, weight: Tensor, masks: list[Tensor | None], transpose: bool) -> Tensor:
    """``sum_s weight[:, K-1-s] * x[t - s]`` (or, transposed, ``sum_s weight[:, K-1-s] *
    x[t + s]``, the backward's) for ``x`` ``(batch, L, c)``: one multiply-add per lag on
    shifted views, each lag's term zeroed where ``masks`` says the lag crosses a
    sequence boundary."""
    width, length = weight.shape[1], x.shape[1]
    out = x * weight[:, width - 1]
    for lag in range(1, min(width, length + 1)):
        tap = weight[:, width - 1 - lag]
        mask = masks[lag]
        if transpose:  # out[t] += w * x[t + lag], masked by the mask of step t + lag
            src, dst = x[:, lag:], out[:, : length - lag]
        else:  # out[t] += w * x[t - lag], masked by the mask of step t
            src, dst = x[:, : length - lag], out[:, lag:]
        if mask is None:
            dst.addcmul_(src, tap)  # one pass, no temporary
        else:
            dst += src * tap * mask[:, lag:]
    return out


def _pre_activation(
    x: Tensor, weight: Tensor, bias: Tensor | None, masks: list[Tensor | None]
) -> Tensor:
    """The pre-activation: the causal convolution of ``x`` by ``weight`` plus ``bias``."""
    pre = _conv_taps(x, weight.to(x.dtype), masks, transpose=False)
    return pre if bias is None else pre + bias.to(x.dtype)


class _CausalConv1d(Function):
    """Depthwise causal convolution (+ bias, + silu) along dim 1 of ``(batch, L, c)``:
    ``(out, pre)``, ``pre`` the pre-activation the backward reads (not differentiable;
    empty without silu).

    A width-K filter is K shifted multiply-adds, forward and backward (the weight's
    gradient is K products summed over batch and time), cheaper on a CPU than a
    general grouped convolution's backward for the small widths (2 to 4) of Mamba.
    Written with setup_context so that torch.func transforms (grad, vmap, jacrev) run
    it."""

    generate_vmap_rule = True

    @staticmethod
    def forward(
        x: Tensor, weight: Tensor, bias: Tensor | None, seq_idx: Tensor | None, silu: bool
    ) -> tuple[Tensor, Tensor]:
        masks = _shift_masks(seq_idx, weight.shape[1], x.shape[1])
        pre = _pre_activation(x.contiguous(), weight, bias, masks)
        if not silu:
            return pre, pre.new_empty(0)
        return torch.nn.functional.silu(pre), pre

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, Tensor]) -> None:
        x, weight, bias, seq_idx, silu = inputs
        # x as given (a copy made in forward would have no graph for create_graph)
        ctx.save_for_backward(x, weight, bias, seq_idx, output[1])
        ctx.mark_non_differentiable(output[1])
        ctx.set_materialize_grads(False)
        ctx.silu = silu

    @staticmethod
    def backward(ctx: Any, grad: Tensor | None, _: Tensor | None) -> tuple[Tensor | None, ...]:
        x, weight, bias, seq_idx, pre = ctx.saved_tensors
        if grad is None:
            return None, None, None, None, None
        masks = _shift_masks(seq_idx, weight.shape[1], x.shape[1])
        x, grad = x.contiguous(), grad.contiguous()
        if ctx.silu:
            if torch.is_grad_enabled():
                # create_graph: the saved pre-activation has no graph back to x, weight
                # and bias (forward runs without grad), so recompute it with one.
                pre = _pre_activation(x, weight, bias, masks)
            sig = torch.sigmoid(pre)
            grad = grad * sig * (1 + pre * (1 - sig))
        width, length = weight.shape[1], x.shape[1]
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            dx = _conv_taps(grad, weight.to(grad.dtype), masks, transpose=True)
        if ctx.needs_input_grad[1]:
            cols = []
            for k in range(width):
                lag = width - 1 - k
                if lag >= length:
                    cols.append(grad.new_zeros(grad.shape[-1]))
                    continue
                term = grad[:, lag:] * x[:, : length - lag]
                if masks[lag] is not None:
                    term = term * masks[lag][:, lag:]
                cols.append(term.sum((0, 1)))
            dw = torch.stack(cols, 1).to(weight.dtype)
        if bias is not None and ctx.needs_input_grad[2]:
            db = grad.sum((0, 1)).to(bias.dtype)
        return dx, dw, db, None, None


class _NativeCausalConv1d(Function):
    """:class:`_CausalConv1d` without ``seq_idx`` by the C kernels of Mamba-2's layer
    (ssd/layer.py, one piece of the split): one pass each way over ``x`` read
    through its strides (the mixers pass a slice of a projection), where the torch
    version copies it and makes a pass per tap and one for silu."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor | None, silu: bool) -> Tensor:
        out = layer.conv_forward(x, weight, bias, silu, (x.shape[2], 0, 0))[0]
        ctx.save_for_backward(x, weight, bias)
        ctx.silu = silu
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, weight, bias = ctx.saved_tensors
        if torch.is_grad_enabled():
            # create_graph: gradients that can be differentiated again, from the torch
            # version's graph (the C backward is not differentiable).
            inputs = [t for t in (x, weight, bias) if t is not None and t.requires_grad]
            with torch.enable_grad():
                out = _CausalConv1d.apply(x, weight, bias, None, ctx.silu)[0]  # type: ignore[no-untyped-call]
            found = iter(torch.autograd.grad(out, inputs, grad, create_graph=True))
            grads = [
                next(found) if t is not None and t.requires_grad else None
                for t in (x, weight, bias)
            ]
            return grads[0], grads[1], grads[2], None
        empty = grad.new_empty(x.shape[0], x.shape[1], 0)
        grad_x = torch.empty(x.shape, dtype=x.dtype)
        grad_w, grad_b = layer.conv_backward(
            x, weight, bias, ctx.silu, (grad, empty, empty), grad_x
        )
        return grad_x, grad_w, grad_b, None


def causal_conv1d(
    x: Tensor, weight: Tensor, bias: Tensor | None, seq_idx: Tensor | None, silu: bool
) -> Tensor:
    """``out[t] = act(bias + sum_k weight[:, k] * x[t - (K-1) + k])`` for ``x`` ``(batch,
    L, c)`` and ``weight`` ``(c, K)``: zeros before the first step and, with
    ``seq_idx``, before each sequence's first step; ``act`` silu or identity. The C
    kernel where it can run these operands (layer.usable, channels of stride 1, no
    ``seq_idx``), else shifted multiply-adds in torch."""
    out: Tensor
    if (
        seq_idx is None
        and x.dim() == 3
        and (x.stride(2) == 1 or x.shape[2] <= 1)
        and layer.usable(x, weight, bias, width=weight.shape[1])
    ):
        out = _NativeCausalConv1d.apply(x, weight, bias, silu)  # type: ignore[no-untyped-call]
        return out
    out = _CausalConv1d.apply(x, weight, bias, seq_idx, silu)[0]  # type: ignore[no-untyped-call]
    return out
