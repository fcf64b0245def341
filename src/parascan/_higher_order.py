"""Second (and higher) derivatives through parascan's autograd.Functions.

Forward mode over forward mode (``tangent_mode``). torch runs an autograd.Function's
``jvp`` staticmethod with forward grad off. Under one forward-mode transform that is
what a jvp wants: the tangent is computed from the primals and is not differentiated
again. Under two (``jacfwd(jacfwd(f))``, a ``jvp`` of a ``jvp``, a ``jvp`` of a
``vmap`` of a ``jvp``) the outer transform has to see how the inner tangent depends on
the inputs; with forward grad off it saw none of it, and the second derivatives came
out silently wrong (only the primal path was differentiated). The first-order and
matrix scans compute their tangents with torch ops and their own differentiable scans,
so they run their ``jvp`` in ``tangent_mode``: with one forward-mode transform open it
changes nothing; with two or more it turns forward grad back on and hands out the
saved tensors without their tangent at the innermost forward level (the one whose
``jvp`` this is: a tangent computed from tensors that carry their own tangent at that
level would be a tangent of a tangent, which torch refuses, and the scan's Function
would call this ``jvp`` again, without end). Their tangents at the outer levels stay,
so the tangent's computation is differentiated there: the torch ops by torch, the
scans by their own Functions, whose ``jvp`` runs in this mode again one level down.

Reverse mode over a backward that is not differentiable (``once_differentiable``, for
parascan.distributed's Functions, whose backward exchanges gradients between ranks):
as torch's decorator of that name, with parascan's error, tied to what the gradients
were computed from. torch's raised only where a second derivative reached its own new
leaves: ``torch.autograd.grad`` of a second derivative through the saved tensors (the
gradients of ``out.sum()`` times the inputs, say) skipped it and came out silently
without this Function's part.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn, cast

import torch
from torch import Tensor
from torch.autograd import forward_ad

from parascan._core import Function, nested_forward_mode, refuse_second_derivatives

__all__ = ["once_differentiable", "tangent_mode"]

_functorch = torch._C._functorch


def _without_tangent(t: Any, level: int, public: str) -> Any:
    """``t`` without its tangent at ``level``, keeping those of the levels below and
    the batch dims of the vmaps above."""
    if t is None:
        return None
    outer = _functorch.maybe_get_level(t)
    if outer < level:  # not wrapped at ``level``: no tangent there
        return t
    if outer == level:
        return forward_ad.unpack_dual(t).primal
    if _functorch.is_batchedtensor(t):
        # unpacked inside the vmap's batched tensor (a vmap has no rule for it)
        inner, bdim = _functorch._unwrap_batched(t, outer)
        return _functorch._add_batch_dim(
            _without_tangent(inner, level, public), cast(int, bdim), outer
        )
    # another transform's wrapper above the jvp (none is known to reach here): its
    # tangent cannot be taken off without losing that transform's record
    refuse_second_derivatives(public)


@contextmanager
def tangent_mode(saved: tuple[Any, ...], public: str) -> Iterator[tuple[Any, ...]]:
    """The context of a Function's ``jvp`` (see the module's doc), given its saved
    tensors (``ctx.saved_tensors``) and the public function's name (for an error);
    yields the tensors the tangent is computed from."""
    if not nested_forward_mode():
        yield saved
        return
    # The innermost forward-mode transform's level: the one whose ``jvp`` runs. (A vmap
    # may sit above it: torch runs the ``jvp`` of a vmapped Function under a vmap of its own.)
    stack = _functorch.get_interpreter_stack() or []
    level = max(i.level() for i in stack if i.key() == _functorch.TransformType.Jvp)
    stripped = tuple(_without_tangent(t, level, public) for t in saved)
    with forward_ad._set_fwd_grad_enabled(True):
        yield stripped


class _Refused(Function):
    """The first-order gradients ``results`` (computed without grad) as a function of
    the ``operands`` they were computed from: the identity forward, parascan's
    second-derivative error backward."""

    @staticmethod
    def forward(public: str, count: int, *tensors: Tensor) -> tuple[Tensor, ...]:
        return tuple(t.detach() for t in tensors[:count])

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.public = inputs[0]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> NoReturn:
        refuse_second_derivatives(ctx.public)


def once_differentiable(
    public: Callable[[Any], str],
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """A decorator for the ``backward`` of an autograd.Function whose backward is not
    differentiable: it runs without grad, and under ``create_graph`` its gradients
    become a function of the incoming gradients and the saved tensors that require
    grad, whose own backward raises parascan's second-derivative error (naming
    ``public(ctx)``); why not torch's decorator: see the module's doc."""

    def decorate(backward: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(backward)
        def wrapper(ctx: Any, *grads: Any) -> Any:
            with torch.no_grad():
                outputs = backward(ctx, *grads)
            if not torch.is_grad_enabled():
                return outputs
            operands = [
                t for t in (*grads, *ctx.saved_tensors) if isinstance(t, Tensor) and t.requires_grad
            ]
            results = outputs if isinstance(outputs, tuple) else (outputs,)
            moving = [i for i, r in enumerate(results) if isinstance(r, Tensor)]
            if not operands or not moving:
                return outputs
            guarded = _Refused.apply(  # type: ignore[no-untyped-call]
                public(ctx), len(moving), *[results[i] for i in moving], *operands
            )
            out = list(results)
            for i, g in zip(moving, guarded, strict=True):
                out[i] = g
            return tuple(out) if isinstance(outputs, tuple) else out[0]

        return wrapper

    return decorate
