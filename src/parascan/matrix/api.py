"""``parascan.matrix_linear_scan``: x[t] = W[t] @ x[t-1] + b[t] with d x d matrices."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, overload

import torch
from torch import Tensor

from parascan._core import (
    Function,
    accumulate_dtype,
    broadcast_shape,
    check_dtype,
    check_flag,
    check_layout,
    check_same_device,
    describe,
    opaque_to_dynamo,
    resolve,
    tensor_hint,
)
from parascan._higher_order import tangent_mode
from parascan.matrix.autograd import ROW, matrix_linear_scan_op

__all__ = ["matrix_linear_scan"]

_NAME = "parascan.matrix_linear_scan"


def _previous_states(out: Tensor, initial: Tensor | None, reverse: bool) -> Tensor:
    """x[t-1] for every t (x[t+1] when reversed), ``initial`` (or 0) at the start."""
    steps = out.shape[-2]
    start = out.narrow(-2, 0, 1)
    x0 = torch.zeros_like(start) if initial is None else initial.unsqueeze(-2).expand_as(start)
    if reverse:
        return torch.cat([out.narrow(-2, 1, steps - 1), x0], -2)
    return torch.cat([x0, out.narrow(-2, 0, steps - 1)], -2)


def _weight_grad(g: Tensor, x: Tensor, shape: torch.Size) -> Tensor:
    """sum over broadcast batch dims of g[t] x[t]^T, as ``shape``: batched matrix
    products over the summed dims, not a full-batch outer product and a sum."""
    rank = g.dim() - 2
    summed = [i for i in range(rank) if shape[i] == 1 and g.shape[i] != 1]
    if not summed:
        return (g.unsqueeze(-1) * x.unsqueeze(-2)).sum_to_size(shape)
    to_end = list(range(g.dim() - len(summed), g.dim()))
    gs = g.movedim(summed, to_end).flatten(-len(summed))  # (kept..., T, d, S)
    xs = x.movedim(summed, to_end).flatten(-len(summed))
    return (gs @ xs.mT).reshape(shape)


def _gradients(
    weights: Tensor,
    biases_shape: torch.Size,
    out: Tensor,
    initial: Tensor | None,
    grad_out: Tensor,
    reverse: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Gradients of x[t] = W[t] x[t-1] + b[t] from one reverse matrix scan.

    The total gradient reaching x[t] is g[t] = G[t] + W[t+1]^H g[t+1] (t-1 when
    reversed): the same recurrence run the other way over the weights shifted by
    one step and conjugate-transposed (read in place: a strided view). Then
    dL/db = g, dL/dW[t] = g[t] x[t-1]^H, dL/dinitial = W[0]^H g[0]. Written with
    torch ops and this scan, so it is differentiable again (double backward).
    """
    steps = out.shape[-2]
    if steps == 0:
        zero_h = None if initial is None else torch.zeros_like(initial)
        return torch.zeros_like(weights), out.new_zeros(biases_shape), zero_h
    if steps == 1:
        g = grad_out
    else:
        edge, w_start, g_start = (0, 0, 1) if reverse else (steps - 1, 1, 0)
        rest = _apply(
            weights.narrow(-3, w_start, steps - 1).mH, grad_out.narrow(-2, g_start, steps - 1),
            grad_out.select(-2, edge), not reverse, backend,
        )  # fmt: skip
        parts = [grad_out.narrow(-2, edge, 1), rest]
        g = torch.cat(parts if reverse else parts[::-1], -2)
    grad_w = _weight_grad(g, _previous_states(out, initial, reverse).conj(), weights.shape)
    grad_initial = None
    if initial is not None:
        first = steps - 1 if reverse else 0
        w0, g0 = weights.select(-3, first), g.select(-2, first)
        grad_initial = (w0.mH @ g0.unsqueeze(-1)).squeeze(-1).sum_to_size(initial.shape)
    return grad_w, g.sum_to_size(biases_shape), grad_initial


class _MatrixScan(Function):
    """Autograd around the raw op; ``generate_vmap_rule`` gives vmap(grad), jacrev; with
    forward-mode AD."""

    generate_vmap_rule = True

    @staticmethod
    def forward(
        weights: Tensor, biases: Tensor, initial: Tensor | None, reverse: bool, backend: str
    ) -> Tensor:
        out: Tensor = matrix_linear_scan_op(weights, biases, initial, reverse, backend)
        return out

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Tensor) -> None:
        weights, biases, initial, reverse, backend = inputs
        ctx.save_for_backward(weights, output, initial)
        ctx.save_for_forward(weights, output, initial)
        ctx.biases_shape, ctx.reverse, ctx.backend = biases.shape, reverse, backend

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:
        weights, out, initial = ctx.saved_tensors
        dtype = out.dtype
        acc = accumulate_dtype(dtype)  # half types: gradients computed in float32
        grads = _gradients(
            weights.to(acc), ctx.biases_shape, out.to(acc),
            None if initial is None else initial.to(acc), grad_out.to(acc),
            ctx.reverse, ctx.backend,
        )  # fmt: skip
        need = ctx.needs_input_grad[:3]
        wanted: list[Tensor | None] = [
            g.to(dtype) if g is not None and n else None for g, n in zip(grads, need, strict=True)
        ]
        return (*wanted, None, None)

    @staticmethod
    def jvp(
        ctx: Any, weights_t: Tensor | None, biases_t: Tensor | None, initial_t: Tensor | None,
        *_: Any,
    ) -> Tensor:  # fmt: skip
        # dx[t] = W[t] dx[t-1] + (dW[t] x[t-1] + db[t]),  dx[-1] = d initial.
        # Differentiable by an outer forward-mode transform too, in tangent_mode.
        with tangent_mode(ctx.saved_tensors, _NAME) as saved:
            weights, out, initial = saved
            drive = torch.zeros_like(out) if biases_t is None else biases_t + torch.zeros_like(out)
            if weights_t is not None:
                previous = _previous_states(out, initial, ctx.reverse) if out.shape[-2] else out
                drive = drive + (weights_t @ previous.unsqueeze(-1)).squeeze(-1)
            return _apply(weights, drive, initial_t, ctx.reverse, ctx.backend)


@opaque_to_dynamo
def _apply(
    weights: Tensor, biases: Tensor, initial: Tensor | None, reverse: bool, backend: str
) -> Tensor:
    out: Tensor = _MatrixScan.apply(weights, biases, initial, reverse, backend)  # type: ignore[no-untyped-call]
    return out


def _auto_backend(
    device: torch.device, batch: int, steps: int, d: int
) -> Callable[[Sequence[str]], str]:
    """``auto``'s choice among the backends that can run the call: the compiled
    sequential kernel where it can (CPU, real dtypes). Elsewhere the cheaper of the
    sequential loop (``steps`` batched matrix-vector calls, each a fixed launch cost
    plus 2 batch d^2 flops) and the parallel scan of affine maps (about 2 steps batch
    products of 2 d^3 flops in O(sqrt(steps) + log steps) calls), with rough
    per-device constants."""

    def choose(usable: Sequence[str]) -> str:
        if "cpu" in usable:
            return "cpu"
        launch, flops = (2e-5, 2e13) if device.type == "cuda" else (1e-5, 5e10)
        sequential = steps * (2 * launch + 2 * batch * d * d / flops)
        calls = 3 * (4 * min(64, math.isqrt(max(steps, 1))) + 4 * math.log2(max(steps, 2)))
        parallel = calls * launch + 4 * steps * batch * d**3 / flops
        return "torch" if parallel < sequential else "loop"

    return choose


def _validate(
    weights: object, biases: object, initial: object, reverse: object, return_final: object
) -> tuple[Tensor, Tensor, Tensor | None, tuple[int, ...]]:
    """The three inputs, checked, and their broadcast batch shape."""
    if not isinstance(weights, Tensor):
        raise TypeError(
            f"{_NAME}: expected weights to be a Tensor, but got {describe(weights)}"
            f"{tensor_hint(weights)}"
        )
    if not isinstance(biases, Tensor):
        raise TypeError(
            f"{_NAME}: expected biases to be a Tensor, but got {describe(biases)}"
            f"{tensor_hint(biases)}"
        )
    check_layout(_NAME, "weights", weights)
    check_layout(_NAME, "biases", biases)
    if weights.dim() < 3 or weights.shape[-1] != weights.shape[-2]:
        raise ValueError(
            f"{_NAME}: expected weights of shape (*batch, T, d, d), but got {tuple(weights.shape)}"
        )
    d, steps = weights.shape[-1], weights.shape[-3]
    if biases.dim() < 2 or biases.shape[-1] != d or biases.shape[-2] != steps:
        raise ValueError(
            f"{_NAME}: expected biases of shape (*batch, T, d) = (*batch, {steps}, {d}) to "
            f"match weights {tuple(weights.shape)}, but got {tuple(biases.shape)}"
        )
    named = [("weights", weights), ("biases", biases)]
    batches = [("weights batch", weights.shape[:-3]), ("biases batch", biases.shape[:-2])]
    if initial is not None:
        if not isinstance(initial, Tensor):
            raise TypeError(
                f"{_NAME}: expected initial to be a Tensor or None, but got {describe(initial)}"
                f"{tensor_hint(initial)}"
            )
        check_layout(_NAME, "initial", initial)
        if initial.dim() < 1 or initial.shape[-1] not in (1, d):
            raise ValueError(
                f"{_NAME}: expected initial of shape (*batch, d) with d = {d}, but got "
                f"{tuple(initial.shape)}"
            )
        named.append(("initial", initial))
        batches.append(("initial batch", initial.shape[:-1]))
    for name, t in named:
        check_dtype(_NAME, name, t)
    check_same_device(_NAME, named)
    check_flag(_NAME, "reverse", reverse)
    check_flag(_NAME, "return_final", return_final)
    batch = broadcast_shape(_NAME, batches)
    return weights, biases, initial, batch


@overload
def matrix_linear_scan(
    weights: Tensor, biases: Tensor, *, initial: Tensor | None = ..., reverse: bool = ...,
    return_final: Literal[False] = ..., backend: str = ...,
) -> Tensor: ...  # fmt: skip
@overload
def matrix_linear_scan(
    weights: Tensor, biases: Tensor, *, initial: Tensor | None = ..., reverse: bool = ...,
    return_final: Literal[True], backend: str = ...,
) -> tuple[Tensor, Tensor]: ...  # fmt: skip


def matrix_linear_scan(
    weights: Tensor,
    biases: Tensor,
    *,
    initial: Tensor | None = None,
    reverse: bool = False,
    return_final: bool = False,
    backend: str = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    r"""Non-diagonal linear recurrence over the second-to-last dim of ``biases``.

    .. math:: x_t = W_t \, x_{t-1} + b_t, \qquad x_{-1} = \text{initial} \ (\text{default } 0)

    Semantics given by this loop (``reverse=True`` walks ``t`` from T-1 down to 0 and
    reads ``x[t+1]``, with ``x[T] = initial``)::

        x = initial
        for t in range(T):
            x = weights[..., t, :, :] @ x + biases[..., t, :]
            out[..., t, :] = x

    Args:
        weights: ``(*batch, T, d, d)``.
        biases: ``(*batch, T, d)``.
        initial: ``(*batch, d)``, the state before the first step. The batch dims of
            the three broadcast.
        reverse: run time backwards.
        return_final: also return the last state (``out[..., T-1, :]``, or
            ``out[..., 0, :]`` when reversed; ``initial`` or zeros when T == 0).
        backend: ``"auto"``, ``"cpu"`` (a compiled sequential kernel: one
            matrix-vector product per step, streaming the weights at memory speed),
            ``"torch"`` (a parallel scan of affine maps: O(log T) depth, d^3 work
            per step) or ``"loop"`` (batched matrix-vector steps in Python).
            ``"auto"`` takes the kernel on CPU and otherwise chooses by cost.

    Returns:
        ``out`` of shape ``(*batch, T, d)`` in the promoted dtype (half types are
        computed in float32), or ``(out, final)``. Differentiable in all three
        inputs, under vmap, torch.func and torch.compile.

    Example:
        >>> import torch, parascan as ps
        >>> rotate = torch.tensor([[0.0, -1.0], [1.0, 0.0]]).expand(3, 2, 2)
        >>> ps.matrix_linear_scan(rotate, torch.tensor([[1.0, 0.0]]).expand(3, 2))
        tensor([[1., 0.],
                [1., 1.],
                [0., 1.]])
    """
    weights, biases, initial, batch = _validate(weights, biases, initial, reverse, return_final)
    dtype = torch.promote_types(weights.dtype, biases.dtype)
    if initial is not None:  # every pair of FLOAT_DTYPES promotes to one of them
        dtype = torch.promote_types(dtype, initial.dtype)
    steps, d = biases.shape[-2], biases.shape[-1]
    choose = _auto_backend(biases.device, math.prod(batch), steps, d)
    chosen = resolve(ROW, backend, biases.device, dtype, choose)
    # One batch rank for all three (leading size-1 dims, views): the op's vmap rule
    # then puts the vmapped dim in front of every operand and they still broadcast.
    rank = len(batch)
    w = weights.to(dtype).reshape((1,) * (rank - weights.dim() + 3) + weights.shape)
    b = biases.to(dtype).reshape((1,) * (rank - biases.dim() + 2) + biases.shape)
    h = None
    if initial is not None:
        h = initial.to(dtype).reshape((1,) * (rank - initial.dim() + 1) + initial.shape)
        h = h.expand(*h.shape[:-1], d)  # a (…, 1) initial broadcasts along d too
    out = _apply(w, b, h, reverse, chosen)
    if not return_final:
        return out
    if steps:
        final = out.select(-2, 0 if reverse else steps - 1).clone()
    elif h is None:
        final = out.new_zeros((*batch, d))
    else:
        final = h.expand(*batch, d).clone()
    return out, final
