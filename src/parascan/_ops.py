"""The core of parascan's ops: the op builder and the helpers every family's ops share.

- ``custom_op``: a torch.library op from its schema, body, fake kernel and vmap rule;
- ``checkpointed_scan``: the ops and autograd.Functions of a scan that keeps states
  every K steps for its backward (the state-space scans), from a family's declaration
  (``CheckpointedScan``);
- helpers: lazy views resolved before a kernel reads them, vmap rules, the eager
  check, forward mode through a ``torch`` backend, the second-derivative error.

autograd.Functions and not ``torch.library.register_autograd``: on torch 2.13 the latter
breaks ``torch.func.grad`` and makes ``torch.func.jvp`` return zeros silently.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch import Tensor
from torch.autograd import forward_ad

Opt = Tensor | None

__all__ = [
    "CheckpointedScan",
    "batch_first",
    "batch_first_vmap",
    "checkpointed_scan",
    "conj",
    "custom_op",
    "loop_vmap",
    "nested_forward_mode",
    "plain_eager",
    "refuse_second_derivatives",
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


def batch_first_vmap(tensors: int, outputs: int) -> Callable[[Any], Callable[..., Any]]:
    """The vmap rule (given the op: ``custom_op``'s ``vmap``) of an op whose first
    ``tensors`` arguments are tensors (or None) of one logical shape (states: without
    ``dim``), followed by ``dim`` and plain arguments. A vmapped dimension becomes a
    new leading batch dimension of all of them (unbatched operands are expanded, no
    copy), ``dim`` shifts when it counts from the front, and every output is batched
    at 0."""

    def rule_of(op: Any) -> Callable[..., Any]:
        def rule(info: Any, in_dims: tuple[int | None, ...], *args: Any) -> tuple[Any, Any]:
            n = info.batch_size
            batched = [
                batch_first(t, d, n) for t, d in zip(args[:tensors], in_dims[:tensors], strict=True)
            ]
            dim = args[tensors]
            result = op(*batched, dim + 1 if dim >= 0 else dim, *args[tensors + 1 :])
            return result, 0 if outputs == 1 else (0,) * outputs

        return rule

    return rule_of


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
        out_tangents = torch.func.jvp(partial, values, directions)[1]
        return tuple(out_tangents)
    # torch.autograd.forward_ad's dual level is open (and cannot be nested): duals at it
    # (autograd runs a Function's jvp with forward grad off: on again for the duals)
    with forward_ad._set_fwd_grad_enabled(True):
        duals = [
            forward_ad.make_dual(forward_ad.unpack_dual(v).primal, d)
            for v, d in zip(values, directions, strict=True)
        ]
        outs = partial(*duals)
        # an output built from no dual (L = 0: zeros, an initial state passed through
        # by the op's own rules) has no tangent: zeros, as torch.func.jvp gives
        tangents_out = [forward_ad.unpack_dual(o).tangent for o in outs]
        return tuple(
            torch.zeros_like(o) if t is None else t for o, t in zip(outs, tangents_out, strict=True)
        )


# --- The op builder ----------------------------------------------------------------------


def custom_op(
    name: str,
    schema: str,
    impl: Callable[..., Any],
    fake: Callable[..., Any],
    vmap: Callable[[Any], Callable[..., Any]] | None = None,
) -> Any:
    """The torch.library op ``parascan::<name>`` of ``schema`` (torch's schema language,
    e.g. ``"(Tensor x, Tensor? D, bool flag, str backend) -> Tensor[]"``): ``impl`` its
    body, ``fake`` its fake kernel (torch.compile), ``vmap`` the op's vmap rule given
    the op (default: one call per vmapped element, ``loop_vmap``). Both functions take
    the schema's arguments positionally."""
    op = torch.library.custom_op(f"parascan::{name}", impl, mutates_args=(), schema=schema)
    op.register_fake(fake)
    torch.library.register_vmap(f"parascan::{name}", (vmap or loop_vmap)(op))
    return op


def _contiguous(ts: Any) -> tuple[Tensor, ...]:
    return tuple(t.contiguous() for t in ts)


@dataclass(frozen=True)
class CheckpointedScan:
    """A scan whose forward returns ``(out, final, checkpoints)`` (the states every K
    steps, which its backward reads) and whose backward returns the gradients of its
    leading operands: the state-space scans (selective_scan, ssd_scan). What a family
    declares; :func:`checkpointed_scan` makes its ops and Functions.

    The ops take ``tensors`` (schema, e.g. ``"Tensor u, Tensor? D"``), then ``consts``
    (plain arguments, e.g. ``"bool softplus"``), then the backend's name; the backward
    op takes the tensors, ``checkpoints, grad_out, grad_final``, the consts and the
    backend, and returns ``grads`` gradients, of the first ``grads`` tensors (empty for
    an absent one). Every tensor reaches ``forward``/``backward`` with lazy conjugate and
    negative views resolved, and every result leaves contiguous, as the fake kernels say
    (torch.compile's graphs assert the strides they report)."""

    # the op's row of the backend table (parascan._checks.OpBackends): its public
    # name (for errors: "parascan.ssd_scan") and its backends, each one's
    # forward(*tensors, *consts) -> (out, final, checkpoints) and
    # backward(*tensors, [*consts,] checkpoints, grad_out, grad_final) -> gradients;
    # forward mode differentiates the "torch" backend's forward
    row: Any
    name: str  # the ops: parascan::<name>, parascan::<name>_backward
    tensors: str
    consts: str
    grads: int
    # (*tensors, *consts, backend) -> empty (out, final, checkpoints): the fake kernel
    forward_shapes: Callable[..., tuple[Tensor, Tensor, Tensor]]
    # (tensors, consts) -> the grad_final standing for one that is None (grad_out's is
    # zeros like the first tensor's)
    zero_final: Callable[..., Tensor]
    # whether the backends' backward takes the consts (after the tensors)
    backward_consts: bool = True


@dataclass(frozen=True)
class _Built:
    """A CheckpointedScan's ops and counts, as the Functions below read them."""

    spec: CheckpointedScan
    tensors: int
    consts: int
    forward: Any  # the registered overloads (torch.compile traces these)
    backward: Any
    # the Functions of this arity (_fixed_arity): scan, scan with jvp, backward, backward
    # with jvp
    functions: tuple[Any, Any, Any, Any]


# The built scans by op name. The Functions are module-level classes that take the name
# as their last argument and look the scan up here: torch.compile traces a Function
# reached through a module's globals, not one made inside a function.
_SCANS: dict[str, _Built] = {}


def checkpointed_scan(spec: CheckpointedScan) -> Callable[..., tuple[Tensor, Tensor]]:
    """``apply(*tensors, *consts, backend) -> (out, final)``, differentiable (reverse
    and forward mode, vmap, torch.compile) through two new torch.library ops. Second
    derivatives raise parascan's error."""
    n_tensors = spec.tensors.count("Tensor")
    n_consts = len([c for c in spec.consts.split(",") if c.strip()])
    consts = f", {spec.consts}" if n_consts else ""

    def forward_impl(*args: Any) -> tuple[Tensor, ...]:
        *operands, backend = args
        resolved_args = [resolved_optional(t) for t in operands[:n_tensors]]
        return _contiguous(
            spec.row.backends[backend].forward(*resolved_args, *operands[n_tensors:])
        )

    forward_op = custom_op(
        spec.name,
        f"({spec.tensors}{consts}, str backend) -> (Tensor, Tensor, Tensor)",
        forward_impl,
        spec.forward_shapes,
    )

    def backward_impl(*args: Any) -> list[Tensor]:
        tensors = [resolved_optional(t) for t in args[:n_tensors]]
        checkpoints, grad_out, grad_final = args[n_tensors : n_tensors + 3]
        *plain, backend = args[n_tensors + 3 :]
        grads = spec.row.backends[backend].backward(
            *tensors, *(plain if spec.backward_consts else ()), checkpoints,
            resolved(grad_out), resolved(grad_final),
        )  # fmt: skip
        return list(_contiguous(grads))  # not in the operands' layouts: as the fake

    def backward_fake(*args: Any) -> list[Tensor]:
        first = args[0]
        return [
            t.new_empty(t.shape) if t is not None else first.new_empty(0)
            for t in args[: spec.grads]
        ]

    backward_op = custom_op(
        f"{spec.name}_backward",
        f"({spec.tensors}, Tensor checkpoints, Tensor grad_out, Tensor grad_final{consts}, "
        "str backend) -> Tensor[]",
        backward_impl,
        backward_fake,
    )
    arity = n_tensors + n_consts + 2  # the tensors, consts, backend and name
    _SCANS[spec.name] = _Built(
        spec,
        n_tensors,
        n_consts,
        getattr(torch.ops.parascan, spec.name).default,
        getattr(torch.ops.parascan, f"{spec.name}_backward").default,
        (
            _fixed_arity(_Scan, spec.name, arity),
            _fixed_arity(_ScanForwardMode, spec.name, arity),
            _fixed_arity(_Backward, spec.name, n_tensors + 3 + n_consts + 2),
            _fixed_arity(_BackwardForwardMode, spec.name, n_tensors + 3 + n_consts + 2),
        ),
    )
    name = spec.name

    def apply(*args: Any) -> tuple[Tensor, Tensor]:
        functions = _SCANS[name].functions
        fn = functions[0] if torch.compiler.is_compiling() else functions[1]
        out, final, _ = fn.apply(*args, name)
        return out, final

    apply.forward_op = forward_op  # type: ignore[attr-defined]
    apply.backward_op = backward_op  # type: ignore[attr-defined]
    return apply


def _fixed_arity(base: type, name: str, arity: int) -> Any:
    """``base`` with a ``forward`` that says it takes ``arity`` arguments: torch.compile
    counts a Function's parameters to tell ``forward(ctx, ...)`` from ``forward(...)``."""
    generic = base.forward  # type: ignore[attr-defined]

    def forward(*args: Any) -> Any:
        return generic(*args)

    kind = inspect.Parameter.POSITIONAL_ONLY
    forward.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(f"arg{i}", kind) for i in range(arity)]
    )
    return type(f"{base.__name__}_{name}", (base,), {"forward": staticmethod(forward)})


class _Backward(torch.autograd.Function):
    """A scan's backward op as a function of its own, so that torch.func transforms can
    run it (they track the backward's operations); differentiating it again raises."""

    generate_vmap_rule = True

    @staticmethod
    def forward(*args: Any) -> tuple[Tensor, ...]:
        *operands, name = args
        return tuple(_SCANS[name].backward(*operands))

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.name = inputs[-1]

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        refuse_second_derivatives(_SCANS[ctx.name].spec.row.op)


class _BackwardForwardMode(_Backward):
    """Forward mode over the backward (jacfwd of jacrev: hessians) raises the same
    error; apart, as dynamo cannot trace a Function with jvp."""

    @staticmethod
    def jvp(ctx: Any, *tangents: Any) -> Any:
        refuse_second_derivatives(_SCANS[ctx.name].spec.row.op)


def _save(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
    name = inputs[-1]
    n_tensors = _SCANS[name].tensors
    # The same tensors for backward and forward mode: under vmap (generate_vmap_rule)
    # torch keeps the vmapped dims of the last call's tensors only and reads them for
    # both; a shorter save_for_forward broke every backward through a vmapped scan
    # (grad of vmap; jacrev of jacfwd, whose jvp vmaps the primals too, of a non-linear
    # f) with torch's internal "flat_bdims must not be None".
    ctx.save_for_backward(*inputs[:n_tensors], output[2])
    ctx.save_for_forward(*inputs[:n_tensors], output[2])
    ctx.consts, ctx.backend, ctx.name = inputs[n_tensors:-2], inputs[-2], name
    # an unused output's gradient arrives as None, not as a tensor of zeros to fill (the
    # checkpoints' are large); backward makes what it needs
    ctx.set_materialize_grads(False)


class _Scan(torch.autograd.Function):
    """A checkpointed scan (its name the last argument): (out, final, checkpoints)."""

    generate_vmap_rule = True

    @staticmethod
    def forward(*args: Any) -> tuple[Tensor, Tensor, Tensor]:
        *operands, name = args
        result: tuple[Tensor, Tensor, Tensor] = _SCANS[name].forward(*operands)
        return result

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
        _save(ctx, inputs, output)
        ctx.mark_non_differentiable(output[2])

    @staticmethod
    def backward(ctx: Any, grad_out: Opt, grad_final: Opt, _: Opt) -> tuple[Opt, ...]:
        built = _SCANS[ctx.name]
        *tensors, checkpoints = ctx.saved_tensors
        if grad_out is None:
            grad_out = torch.zeros_like(tensors[0])
        if grad_final is None:
            grad_final = built.spec.zero_final(tensors, ctx.consts)
        fn = built.functions[2] if torch.compiler.is_compiling() else built.functions[3]
        grads = fn.apply(
            *tensors, checkpoints, grad_out, grad_final, *ctx.consts, ctx.backend, ctx.name
        )
        need = ctx.needs_input_grad
        return (
            *(g if need[i] and tensors[i] is not None else None for i, g in enumerate(grads)),
            *(None for _ in range(built.tensors - built.spec.grads + built.consts + 2)),
        )


class _ScanForwardMode(_Scan):
    """_Scan with forward-mode AD (torch.func.jvp, jacfwd). Kept apart because dynamo
    cannot trace an autograd.Function that defines ``jvp``."""

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: tuple[Tensor, ...]) -> None:
        # The checkpoints stay differentiable here, with a zero tangent (jvp): under vmap,
        # torch's generated rule passes mark_non_differentiable the batched output, which
        # marks nothing, and then fails on a None tangent (jvp, jacfwd of a vmapped
        # scan). Nothing reads them outside the op; backward gets None for them.
        _save(ctx, inputs, output)

    @staticmethod
    def jvp(ctx: Any, *tangents: Opt) -> tuple[Opt, ...]:
        # The kernels have no forward mode: the tangents come from forward-mode AD
        # through the torch backend's forward, at the primal point the scan ran at.
        built = _SCANS[ctx.name]

        def forward(*ops: Opt) -> tuple[Tensor, Tensor]:
            out, final, _ = built.spec.row.backends["torch"].forward(*ops, *ctx.consts)
            return out, final

        if nested_forward_mode():  # forward over forward: see nested_forward_mode
            refuse_second_derivatives(built.spec.row.op)
        *operands, checkpoints = ctx.saved_tensors
        t_out, t_final = jvp_through(forward, tuple(operands), tangents[: built.tensors])
        return t_out, t_final, torch.zeros_like(checkpoints)
