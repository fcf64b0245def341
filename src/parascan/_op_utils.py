"""Helpers for the raw torch.library ops of the first-order scans."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NoReturn

import torch
from torch import Tensor
from torch.autograd import forward_ad

__all__ = [
    "batch_first",
    "conj",
    "loop_vmap",
    "nested_forward_mode",
    "plain_eager",
    "refuse_second_derivatives",
    "register_batch_first_vmap",
    "resolved",
    "resolved_optional",
    "state_shape",
]


def conj(t: Tensor) -> Tensor:
    # conj_physical, not the lazy conj view: see resolved.
    return t.conj_physical() if t.is_complex() else t


def resolved(t: Tensor) -> Tensor:
    """Materialize lazy conjugate/negative views before backend code sees them.
    Under AOT dispatch (torch.compile) a custom op's body can run with the
    Conjugate key excluded, so a conj view would silently read as unconjugated."""
    return t.resolve_conj().resolve_neg()


def resolved_optional(t: Tensor | None) -> Tensor | None:
    return None if t is None else resolved(t)


def state_shape(t: Tensor, dim: int) -> tuple[int, ...]:
    dim %= t.dim()
    return (*t.shape[:dim], *t.shape[dim + 1 :])


def batch_first(t: Tensor | None, bdim: int | None, size: int) -> Tensor | None:
    """``t`` with its vmapped dim (or a new, expanded one) in front."""
    if t is None:
        return None
    return t.expand(size, *t.shape) if bdim is None else t.movedim(bdim, 0)


def register_batch_first_vmap(
    name: str, op: Callable[..., Any], tensors: int, outputs: int
) -> None:
    """A vmap rule for an op whose first ``tensors`` arguments are tensors (or None)
    of one logical shape (states: without ``dim``), followed by ``dim`` and plain
    arguments. A vmapped dimension becomes a new leading batch dimension of all of
    them (unbatched operands are expanded, no copy), ``dim`` shifts when it counts
    from the front, and every output is batched at 0."""

    def rule(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> tuple[Any, Any]:
        n = info.batch_size
        batched = [
            batch_first(t, d, n) for t, d in zip(args[:tensors], in_dims[:tensors], strict=True)
        ]
        dim = args[tensors]
        result = op(*batched, dim + 1 if dim >= 0 else dim, *args[tensors + 1 :])
        return result, 0 if outputs == 1 else (0,) * outputs

    torch.library.register_vmap(name, rule)


def plain_eager() -> bool:
    """True when the call runs eagerly: no torch.compile, no torch.func transform, no
    dispatch mode, no forward-mode AD level open (dual tensors carry their tangents
    invisibly: a kernel called directly would drop them). Tensor subclasses, fake or
    functional, are ruled out by the caller's exact type checks."""
    return (
        not torch.compiler.is_compiling()
        and not torch._C._are_functorch_transforms_active()
        and torch._C._len_torch_dispatch_stack() == 0
        and forward_ad._current_level < 0
    )


def loop_vmap(op: Callable[..., Any]) -> Callable[..., Any]:
    """A vmap rule that runs ``op`` once per vmapped element and stacks its results
    (every output batched at 0): for ops whose operands' shapes are fixed by a
    contract, so that a vmapped dim has no batch dimension it could always fold into
    (the state-space scans). Each argument with a vmapped dim is sliced; the others,
    plain values included, are passed as they are."""

    def rule(info: Any, in_dims: tuple[Any, ...], *args: Any) -> tuple[Any, Any]:
        results = []
        for i in range(info.batch_size):
            sliced = [
                a if d is None else a.select(d, i) for a, d in zip(args, in_dims, strict=True)
            ]
            results.append(op(*sliced))
        stacked = [torch.stack(parts) for parts in zip(*results, strict=True)]
        if isinstance(results[0], tuple):
            return tuple(stacked), (0,) * len(stacked)
        return stacked, [0] * len(stacked)

    return rule


def refuse_second_derivatives(public: str) -> NoReturn:
    """What the backward of a backward op's autograd.Function does: a clear error
    rather than silently zero second derivatives."""
    raise RuntimeError(
        f"{public}: second derivatives (double backward, hessians) are not implemented; "
        "the first derivatives of every input are"
    )


def _jvp_transforms() -> int:
    """How many torch.func forward-mode transforms (jvp, jacfwd) are open."""
    stack = torch._C._functorch.get_interpreter_stack() or []
    jvp = torch._C._functorch.TransformType.Jvp
    return sum(1 for interpreter in stack if interpreter.key() == jvp)


def nested_forward_mode() -> bool:
    """True when two torch.func forward-mode transforms are open: forward mode over
    forward mode (``jacfwd(jacfwd(f))``, a ``jvp`` of a ``jvp``). torch runs an
    autograd.Function's ``jvp`` with forward grad off, so the outer transform would not
    see the tangents' own computation: their derivatives would silently be zero. (Nested
    dual levels of torch.autograd.forward_ad are refused by torch itself.)"""
    return _jvp_transforms() > 1


def jvp_through(
    forward: Callable[..., tuple[Tensor, ...]],
    primals: tuple[Tensor | None, ...],
    tangents: tuple[Tensor | None, ...],
) -> tuple[Tensor, ...]:
    """The tangents of ``forward(*primals)``'s outputs: forward-mode AD (torch.func.jvp)
    through ``forward``, a function of differentiable torch ops (a ``torch`` backend's
    chunked forward). For the ``jvp`` of an autograd.Function whose own kernels have no
    forward mode. Absent operands stay None; operands that are not floating point (packed
    sequences' offsets) are held fixed; an operand without a tangent gets zeros."""
    moving = [
        i
        for i, p in enumerate(primals)
        if p is not None and (p.is_floating_point() or p.is_complex())
    ]

    def partial(*values: Tensor) -> tuple[Tensor, ...]:
        args = list(primals)
        for i, v in zip(moving, values, strict=True):
            args[i] = v
        return forward(*args)

    directions = tuple(
        torch.zeros_like(primals[i]) if tangents[i] is None else tangents[i].contiguous()  # type: ignore[arg-type,union-attr]
        for i in moving
    )
    # contiguous: a dual's tangent is laid out as its primal, which cannot be an
    # expanded operand (canonical forms broadcast D, for one)
    values = tuple(primals[i].contiguous() for i in moving)  # type: ignore[union-attr]
    if _jvp_transforms() or forward_ad._current_level < 0:
        # torch.func.jvp, jacfwd: functorch's transforms nest (a dual level of
        # torch.autograd.forward_ad under or over vmap or grad takes the duals below:
        # torch.func.jvp would open a second dual level, which torch refuses)
        _, out_tangents = torch.func.jvp(partial, values, directions)  # type: ignore[arg-type]
        return tuple(out_tangents)
    # torch.autograd.forward_ad's dual level is open (and cannot be nested): duals at it
    # (autograd runs a Function's jvp with forward grad off: on again for the duals)
    with forward_ad._set_fwd_grad_enabled(True):
        duals = [
            forward_ad.make_dual(forward_ad.unpack_dual(v).primal, d)  # type: ignore[arg-type]
            for v, d in zip(values, directions, strict=True)
        ]
        outs = partial(*duals)
        # an output built from no dual (L = 0: zeros, an initial state passed through
        # by the op's own rules) has no tangent: zeros, as torch.func.jvp gives
        tangents_out = [forward_ad.unpack_dual(o).tangent for o in outs]
        return tuple(
            torch.zeros_like(o) if t is None else t for o, t in zip(outs, tangents_out, strict=True)
        )
