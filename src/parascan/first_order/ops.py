"""The raw ops of the first-order scans, registered with torch.library, and their
rows of the backend table.

Each semiring (semiring.py) gets two ops, made by one definition (``_define``, on
``define_ops``, which packed.py's ops share):
``parascan::<op>(gates, tokens, initial, dim, reverse, backend)`` and
``parascan::<op>_backward(gates, tokens, out, grad_out, initial, dim, reverse,
backend)`` (tokens None, or not read, where the semiring's backward never reads
them), for ``linear_scan`` and ``log_linear_scan``. They take validated, broadcast
inputs (gates and tokens of one shape and dtype, initial of that shape without
``dim``, or None) and a backend the table resolved. They carry fake kernels
(torch.compile) and vmap rules; they are not differentiable themselves: autograd.py
puts an autograd.Function around them, because ``torch.library.register_autograd``
breaks torch.func on torch 2.13.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor

from parascan._core import (
    FLOAT_DTYPES,
    Backend,
    OpBackends,
    accumulate_dtype,
    batch_first_vmap,
    conj,
    custom_op,
    register,
    resolved,
    resolved_optional,
    state_shape,
)
from parascan.first_order import chunked, cpu, reference, triton
from parascan.first_order.semiring import LINEAR, LOG, SEMIRINGS, Partials, Semiring

__all__ = [
    "ROWS",
    "backward_from_partials",
    "backward_op",
    "backward_tokens",
    "composed_backward",
    "define_ops",
    "empty_gradients",
    "forward_op",
]

ScanFn = Callable[[Tensor, Tensor, "Tensor | None", int, bool], Tensor]

_REAL = tuple(d for d in FLOAT_DTYPES if not d.is_complex)


def _row(ring: Semiring, triton_dtypes: tuple[torch.dtype, ...]) -> OpBackends:
    return register(
        OpBackends(
            op=ring.op,
            backends={
                "cpu": Backend(cpu.forward, cpu.backward),
                "triton": Backend(
                    triton.forward,
                    triton.backward,
                    triton_dtypes,
                    unsupported="complex inputs ({dtype}); use 'torch' or 'loop' (or 'auto')",
                ),
                "torch": Backend(chunked.scan),
                "loop": Backend(reference.loop),
            },
        )
    )


# The backend table's rows of the first-order scans, by semiring name. The Triton
# log-space kernel is real ("auto" takes the torch backend for complex inputs).
ROWS = {"linear": _row(LINEAR, FLOAT_DTYPES), "log": _row(LOG, _REAL)}


def backward_from_partials(
    scan: ScanFn, partials: Partials, grad_out: Tensor, dim: int, reverse: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of a first-order scan from its steps' partial derivatives
    (w, d_a, d_b) = (dx[t]/dx[t-1], dx[t]/da[t], dx[t]/db[t]) (Semiring.partials):
    the gradient reaching x[t] is g[t] = grad_out[t] + conj(w[t+1]) g[t+1], a linear
    scan (``scan``) run the other way (Martin & Cundy, arXiv 1709.04057); then
    dL/da = g conj(d_a), dL/db = g conj(d_b), dL/dinitial = conj(w[0]) g[0]. Torch
    ops only, so it is differentiable whenever ``scan`` is."""
    w, d_gates, d_tokens = partials
    steps = grad_out.shape[dim]
    if steps == 0:
        zeros = torch.zeros_like(grad_out)
        return zeros, zeros.clone(), grad_out.new_zeros(state_shape(grad_out, dim))
    no_gate = torch.zeros_like(w.narrow(dim, 0, 1))  # none past the end
    if reverse:
        w_next = torch.cat([no_gate, w.narrow(dim, 0, steps - 1)], dim)
    else:
        w_next = torch.cat([w.narrow(dim, 1, steps - 1), no_gate], dim)
    g = scan(conj(w_next), grad_out, None, dim, not reverse)
    first = steps - 1 if reverse else 0
    grad_initial = conj(w.select(dim, first)) * g.select(dim, first)
    grad_tokens = g if d_tokens is None else g * conj(d_tokens)
    return g * conj(d_gates), grad_tokens, grad_initial


def composed_backward(
    ring: Semiring, scan: ScanFn, gates: Tensor, tokens: Tensor | None, out: Tensor,
    grad_out: Tensor, initial: Tensor | None, dim: int, reverse: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The gradients of ``ring``'s scan composed of a linear ``scan`` of its partials
    (backward_from_partials; in the log semiring the partials are the step weights,
    read from ``tokens``, which the linear one never reads)."""
    partials = ring.partials(gates, tokens, out, initial, dim, reverse)
    return backward_from_partials(scan, partials, grad_out, dim, reverse)


def backward_tokens(ring: Semiring, tokens: Tensor | None) -> Tensor | None:
    """A backward op's ``tokens`` as its backend takes them: resolved where ``ring``'s
    backward reads them (log), else None."""
    return resolved_optional(tokens) if ring.backward_reads_tokens else None


def empty_gradients(out: Tensor, state: Sequence[int]) -> tuple[Tensor, Tensor, Tensor]:
    """A fake backward's results: the gates' and tokens' gradients of ``out``'s shape,
    the initial state's of shape ``state``."""
    return (
        torch.empty(out.shape, dtype=out.dtype, device=out.device),
        torch.empty(out.shape, dtype=out.dtype, device=out.device),
        torch.empty(state, dtype=out.dtype, device=out.device),
    )


def define_ops(
    name: str, consts: str, forward: Callable[..., Tensor], forward_fake: Callable[..., Tensor],
    backward: Callable[..., tuple[Tensor, Tensor, Tensor]],
    backward_fake: Callable[..., tuple[Tensor, Tensor, Tensor]],
) -> tuple[Any, Any]:  # fmt: skip
    """A first-order scan's ops, from their bodies and fake kernels:
    ``parascan::<name>(gates, tokens, initial, dim, <consts>, backend)`` and
    ``parascan::<name>_backward(gates, tokens, out, grad_out, initial, dim, <consts>,
    backend)`` -> the gradients of gates, tokens and initial; ``consts`` the schema
    of the plain arguments after ``dim``; vmapped by batch_first_vmap."""
    tensors = "Tensor gates, Tensor tokens, Tensor? initial, int dim"
    grads = "Tensor gates, Tensor? tokens, Tensor out, Tensor grad_out, Tensor? initial, int dim"
    return (
        custom_op(
            name, f"({tensors}, {consts}, str backend) -> Tensor", forward, forward_fake,
            batch_first_vmap(tensors=3, outputs=1),
        ),
        custom_op(
            f"{name}_backward", f"({grads}, {consts}, str backend) -> (Tensor, Tensor, Tensor)",
            backward, backward_fake, batch_first_vmap(tensors=5, outputs=3),
        ),
    )  # fmt: skip


def _define(ring: Semiring) -> tuple[Any, Any]:
    """The forward and backward ops of ``ring``, with fake kernels and vmap rules."""
    row = ROWS[ring.name]
    linear_forward = ROWS["linear"].backends
    name = ring.op.removeprefix("parascan.")  # linear_scan: the op parascan::linear_scan

    def forward(
        gates: Tensor, tokens: Tensor, initial: Tensor | None, dim: int, reverse: bool,
        backend: str,
    ) -> Tensor:  # fmt: skip
        return row.backends[backend].forward(  # type: ignore[no-any-return]
            ring, resolved(gates), resolved(tokens), resolved_optional(initial), dim, reverse
        )

    def forward_fake(gates: Tensor, tokens: Tensor, *_: object) -> Tensor:
        torch._check(gates.shape == tokens.shape, lambda: f"parascan::{name}: shape mismatch")
        torch._check(gates.dtype == tokens.dtype, lambda: f"parascan::{name}: dtype mismatch")
        return torch.empty(tokens.shape, dtype=tokens.dtype, device=tokens.device)

    def backward(
        gates: Tensor, tokens: Tensor | None, out: Tensor, grad_out: Tensor,
        initial: Tensor | None, dim: int, reverse: bool, backend: str,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        gates, out, grad_out = resolved(gates), resolved(out), resolved(grad_out)
        tokens, initial = backward_tokens(ring, tokens), resolved_optional(initial)
        fused = row.backends[backend].backward
        if fused is not None:
            return fused(ring, gates, tokens, out, grad_out, initial, dim, reverse)  # type: ignore[no-any-return]
        # Backends without a fused backward: the partials and one reverse linear scan
        # of the same backend, accumulating half types in float32 like the forward.
        acc = accumulate_dtype(out.dtype)
        scan = partial(linear_forward[backend].forward, LINEAR)
        partials = ring.partials(
            gates.to(acc), None if tokens is None else tokens.to(acc), out.to(acc),
            None if initial is None else initial.to(acc), dim, reverse,
        )  # fmt: skip
        grads = backward_from_partials(scan, partials, grad_out.to(acc), dim, reverse)
        return tuple(g.to(out.dtype) for g in grads)  # type: ignore[return-value]

    def backward_fake(
        gates: Tensor, tokens: Tensor | None, out: Tensor, grad_out: Tensor,
        initial: Tensor | None, dim: int, *_: object,
    ) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
        torch._check(gates.shape == out.shape, lambda: f"parascan::{name}_backward: shapes")
        torch._check(grad_out.shape == out.shape, lambda: f"parascan::{name}_backward: shapes")
        return empty_gradients(out, state_shape(out, dim))

    return define_ops(name, "bool reverse", forward, forward_fake, backward, backward_fake)


_OPS = {name: _define(ring) for name, ring in SEMIRINGS.items()}


def forward_op(ring: Semiring) -> Any:
    """``parascan::linear_scan`` or ``parascan::log_linear_scan``."""
    return _OPS[ring.name][0]


def backward_op(ring: Semiring) -> Any:
    """``parascan::linear_scan_backward`` or ``parascan::log_linear_scan_backward``."""
    return _OPS[ring.name][1]
