"""The raw linear_scan ops, registered with torch.library.

``parascan::linear_scan`` and ``parascan::linear_scan_backward`` take already
validated, broadcast inputs (gates and tokens of one shape and dtype, initial of
that shape without ``dim``, or None) and a concrete backend name. They carry fake
kernels (torch.compile) and vmap rules; they are not differentiable themselves:
``api.py`` puts an autograd.Function around them, because
``torch.library.register_autograd`` breaks torch.func on torch 2.13.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from parascan._checks import accumulate_dtype
from parascan.linear import chunked, cpu, reference

__all__ = [
    "backward_via_scan",
    "linear_scan_backward_op",
    "linear_scan_op",
    "previous_states",
]

ScanFn = Callable[[Tensor, Tensor, "Tensor | None", int, bool], Tensor]

_FORWARD: dict[str, ScanFn] = {
    "cpu": cpu.forward,
    "torch": chunked.forward,
    "loop": reference.forward,
}


def backward_via_scan(
    scan: ScanFn,
    gates: Tensor,
    out: Tensor,
    grad_out: Tensor,
    initial: Tensor | None,
    dim: int,
    reverse: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of linear_scan from one reverse scan (Martin & Cundy, arXiv 1709.04057).

    With x[t] = a[t] x[t-1] + b[t] and G = dL/dx, the total gradient reaching x[t] is
    g[t] = G[t] + conj(a[t+1]) g[t+1], itself a linear scan run the other way over
    the gates shifted by one step. Then dL/db = g, dL/da[t] = g[t] conj(x[t-1]) and
    dL/dinitial = conj(a[0]) g[0]. Written with torch ops only, so it is
    differentiable whenever ``scan`` is.
    """
    steps = out.shape[dim]
    if steps == 0:
        return torch.zeros_like(out), torch.zeros_like(out), out.new_zeros(_state_shape(out, dim))
    no_gate = torch.zeros_like(gates.narrow(dim, 0, 1))
    if reverse:
        a_next = torch.cat([no_gate, gates.narrow(dim, 0, steps - 1)], dim)
    else:
        a_next = torch.cat([gates.narrow(dim, 1, steps - 1), no_gate], dim)
    first = steps - 1 if reverse else 0
    g = scan(_conj(a_next), grad_out, None, dim, not reverse)
    grad_initial = _conj(gates.select(dim, first)) * g.select(dim, first)
    return g * _conj(previous_states(out, initial, dim, reverse)), g, grad_initial


def previous_states(out: Tensor, initial: Tensor | None, dim: int, reverse: bool) -> Tensor:
    """x[t-1] for every t (x[t+1] when reversed), the initial state (or zeros) at
    the start: the states each step's gate multiplies."""
    steps = out.shape[dim]
    if steps == 0:
        return out
    x0 = torch.zeros_like(out.narrow(dim, 0, 1)) if initial is None else initial.unsqueeze(dim)
    if reverse:
        return torch.cat([out.narrow(dim, 1, steps - 1), x0], dim)
    return torch.cat([x0, out.narrow(dim, 0, steps - 1)], dim)


def _conj(t: Tensor) -> Tensor:
    # conj_physical, not the lazy conj view: see _resolved.
    return t.conj_physical() if t.is_complex() else t


def _resolved(t: Tensor) -> Tensor:
    """Materialize lazy conjugate/negative views before backend code sees them.
    Under AOT dispatch (torch.compile) a custom op's body can run with the
    Conjugate key excluded, so a conj view would silently read as unconjugated."""
    return t.resolve_conj().resolve_neg()


def _resolved_optional(t: Tensor | None) -> Tensor | None:
    return None if t is None else _resolved(t)


def _state_shape(t: Tensor, dim: int) -> tuple[int, ...]:
    dim %= t.dim()
    return (*t.shape[:dim], *t.shape[dim + 1 :])


@torch.library.custom_op("parascan::linear_scan", mutates_args=())
def linear_scan_op(
    gates: Tensor, tokens: Tensor, initial: Tensor | None, dim: int, reverse: bool, backend: str
) -> Tensor:
    """x[t] = gates[t] * x[t-1] + tokens[t] along ``dim``; a new contiguous tensor."""
    return _FORWARD[backend](
        _resolved(gates), _resolved(tokens), _resolved_optional(initial), dim, reverse
    )


@linear_scan_op.register_fake
def _(
    gates: Tensor, tokens: Tensor, initial: Tensor | None, dim: int, reverse: bool, backend: str
) -> Tensor:
    torch._check(gates.shape == tokens.shape, lambda: "parascan::linear_scan: shape mismatch")
    torch._check(gates.dtype == tokens.dtype, lambda: "parascan::linear_scan: dtype mismatch")
    return torch.empty(tokens.shape, dtype=tokens.dtype, device=tokens.device)


@torch.library.custom_op("parascan::linear_scan_backward", mutates_args=())
def linear_scan_backward_op(
    gates: Tensor,
    out: Tensor,
    grad_out: Tensor,
    initial: Tensor | None,
    dim: int,
    reverse: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_gates, grad_tokens, grad_initial) of linear_scan, given its output."""
    gates, out, grad_out = _resolved(gates), _resolved(out), _resolved(grad_out)
    initial = _resolved_optional(initial)
    if backend == "cpu":
        return cpu.backward(gates, out, grad_out, initial, dim, reverse)
    # Backends without a fused backward: one reverse scan, accumulating half types
    # in float32 like the forward does.
    acc = accumulate_dtype(out.dtype)
    grads = backward_via_scan(
        _FORWARD[backend],
        gates.to(acc),
        out.to(acc),
        grad_out.to(acc),
        None if initial is None else initial.to(acc),
        dim,
        reverse,
    )
    return tuple(g.to(out.dtype) for g in grads)  # type: ignore[return-value]


@linear_scan_backward_op.register_fake
def _(
    gates: Tensor,
    out: Tensor,
    grad_out: Tensor,
    initial: Tensor | None,
    dim: int,
    reverse: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor]:
    torch._check(gates.shape == out.shape, lambda: "parascan::linear_scan_backward: shapes")
    torch._check(grad_out.shape == out.shape, lambda: "parascan::linear_scan_backward: shapes")
    return (
        torch.empty(out.shape, dtype=out.dtype, device=out.device),
        torch.empty(out.shape, dtype=out.dtype, device=out.device),
        torch.empty(_state_shape(out, dim), dtype=out.dtype, device=out.device),
    )


# vmap: every operand of one call has the same logical shape (initial: without
# ``dim``), so a vmapped dimension becomes a new leading batch dimension of all of
# them; unbatched operands are expanded (no copy). ``dim`` is shifted when it counts
# from the front; negative dims are unaffected by a leading dimension.


def _batch_first(t: Tensor | None, bdim: int | None, size: int) -> Tensor | None:
    if t is None:
        return None
    return t.expand(size, *t.shape) if bdim is None else t.movedim(bdim, 0)


def _shift(dim: int) -> int:
    return dim + 1 if dim >= 0 else dim


@torch.library.register_vmap("parascan::linear_scan")
def _(info, in_dims, gates, tokens, initial, dim, reverse, backend):  # type: ignore[no-untyped-def]
    n = info.batch_size
    gd, td, id_ = in_dims[:3]
    out = linear_scan_op(
        _batch_first(gates, gd, n),
        _batch_first(tokens, td, n),
        _batch_first(initial, id_, n),
        _shift(dim),
        reverse,
        backend,
    )
    return out, 0


@torch.library.register_vmap("parascan::linear_scan_backward")
def _(info, in_dims, gates, out, grad_out, initial, dim, reverse, backend):  # type: ignore[no-untyped-def]
    n = info.batch_size
    grads = linear_scan_backward_op(
        _batch_first(gates, in_dims[0], n),
        _batch_first(out, in_dims[1], n),
        _batch_first(grad_out, in_dims[2], n),
        _batch_first(initial, in_dims[3], n),
        _shift(dim),
        reverse,
        backend,
    )
    return grads, (0, 0, 0)
