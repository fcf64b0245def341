"""The ``torch`` backend of the selective scan (canonical.py's contract), and the
checkpointed driver it shares with the ``loop`` backend (reference.py).

Both walk the sequence a chunk of steps at a time, holding one chunk's (batch, dim,
K, N) states at most, never (batch, dim, L, N); they differ in how a chunk's states
are computed (``bind``'s ``states``):

- ``torch`` (any device, fast): a chunk's decays and inputs are built at once and its
  states come from parascan's own first-order ``linear_scan`` along time (the C
  kernel on CPU, Triton on GPU), from the chunk's entering state.
- ``loop`` (the semantics in one loop, reference.py): each step is a few torch ops on
  the (batch, dim, N) state.

Their backward is exact activation checkpointing: for each chunk from the last, the
chunk's forward runs again from its checkpoint under autograd, and
``torch.autograd.grad`` carries the output's and the carried state's gradients to
the chunk's inputs and to the state entering it. The gradient math is therefore the
forward's own, whatever the operands' forms (complex A, invariant or grouped B/C).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from parascan.selective.canonical import CHECKPOINT_STEPS, EMPTY, state_dtype

__all__ = ["States", "backward_torch", "bind", "chunk_forward", "forward_torch"]

Optional = Tensor | None
# (dt, dt * u, A, B, C of one chunk per channel, entering state) -> (y before the
# skip and the gate, last state): how a backend computes a chunk's states
States = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], tuple[Tensor, Tensor]]


def _per_channel(m: Tensor, dim: int) -> Tensor:
    """B or C of one chunk as (batch or 1, dim, K or 1, N): invariant (dim, N) gives
    (1, dim, 1, N); variable (batch, G, N, K) gives each channel its group's rows."""
    if m.dim() == 2:
        return m[None, :, None, :]
    batch, groups, n, k = m.shape
    per_group = m.transpose(-1, -2)[:, :, None]  # (batch, G, 1, K, N)
    return per_group.expand(batch, groups, dim // groups, k, n).reshape(batch, dim, k, n)


def chunk_forward(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Optional, z: Optional,
    delta_bias: Optional, h0: Tensor, softplus: bool, states: States,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """One chunk's (out, last state) from its entering state ``h0``, in torch ops
    (differentiable), its states by ``states``. The chunk's variable B/C are (batch,
    G, N, K), the rest as in canonical.py with K steps."""
    dim = u.shape[1]
    dt = delta if delta_bias is None else delta + delta_bias[:, None]
    if softplus:
        dt = F.softplus(dt)  # threshold 20: x itself above, as the contract says
    y, last = states(dt, dt * u, A, _per_channel(B, dim), _per_channel(C, dim), h0)
    y = 2 * y.real if y.is_complex() else y
    if D is not None:
        y = y + D[:, None] * u
    if z is not None:
        y = y * F.silu(z)
    return y, last


def _torch_states(
    dt: Tensor, dtu: Tensor, A: Tensor, b_full: Tensor, c_full: Tensor, h0: Tensor
) -> tuple[Tensor, Tensor]:
    """The ``torch`` backend's chunk: every step's state at once by ``linear_scan``."""
    # Imported here: the first-order family imports nothing of this one.
    from parascan.first_order import linear_scan

    decay = torch.exp(dt[..., None] * A[:, None, :])  # (batch, dim, K, N)
    states = linear_scan(decay, dtu[..., None] * b_full, dim=2, initial=h0)
    y = (c_full * states).sum(-1)
    # a copy: a view would keep the chunk's (batch, dim, K, N) states alive
    last = states[:, :, -1].clone() if dt.shape[2] else h0
    return y, last


def _time_slice(m: Optional, start: int, stop: int) -> Optional:
    return m if m is None else m[..., start:stop]


def _bc_slice(m: Tensor, start: int, stop: int) -> Tensor:
    return m if m.dim() == 2 else m[..., start:stop]


def _initial_state(u: Tensor, A: Tensor, initial: Optional) -> Tensor:
    batch, dim, _ = u.shape
    dtype = state_dtype(A, u)
    if initial is None:
        return torch.zeros(batch, dim, A.shape[-1], dtype=dtype, device=u.device)
    return initial.to(dtype)


Forward = tuple[Tensor, Tensor, Tensor]


def _forward(
    backend: str, states: States, u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor,
    D: Optional, z: Optional, delta_bias: Optional, initial: Optional, softplus: bool,
) -> Forward:  # fmt: skip
    steps = u.shape[2]
    k = CHECKPOINT_STEPS[backend]
    h = _initial_state(u, A, initial)
    checkpoints, outs = [], []
    # No torch.no_grad here: inside the op autograd does not record anyway, and the
    # forward mode (autograd.py) runs this under reverse mode too (jacrev of jacfwd)
    for start in range(0, steps, k):
        stop = min(start + k, steps)
        checkpoints.append(h)
        y, h = chunk_forward(
            u[..., start:stop], delta[..., start:stop], A, _bc_slice(B, start, stop),
            _bc_slice(C, start, stop), D, _time_slice(z, start, stop), delta_bias, h,
            softplus, states,
        )  # fmt: skip
        outs.append(y)
    out = torch.cat(outs, dim=-1) if outs else u.new_zeros(u.shape)
    ckpt = (
        torch.stack(checkpoints, dim=2)
        if checkpoints
        else h.new_zeros(h.shape[0], h.shape[1], 0, h.shape[2])
    )
    return out, h.clone() if h is initial else h, ckpt


def _backward(
    backend: str, states: States, u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor,
    D: Optional, z: Optional, delta_bias: Optional, initial: Optional, softplus: bool,
    checkpoints: Tensor, grad_out: Tensor, grad_final: Tensor,
) -> tuple[Tensor, ...]:  # fmt: skip
    steps = u.shape[2]
    k = CHECKPOINT_STEPS[backend]
    operands = {"u": u, "delta": delta, "A": A, "B": B, "C": C, "D": D, "z": z,
                "delta_bias": delta_bias}  # fmt: skip
    given = {name: t for name, t in operands.items() if t is not None}
    # the operands along time, sliced by chunk; the others are shared by every step
    timed = {"u", "delta", "z"} | {name for name in ("B", "C") if given[name].dim() != 2}
    grads = {name: torch.zeros_like(t) for name, t in given.items()}
    # a copy: with no steps it becomes d(initial), which may not alias an input of the op
    carry = grad_final.to(state_dtype(A, u), copy=True)
    for chunk in reversed(range(math.ceil(steps / k) if steps else 0)):
        start, stop = chunk * k, min(chunk * k + k, steps)
        primals = {n: t[..., start:stop] if n in timed else t for n, t in given.items()}
        primals["h0"] = checkpoints[:, :, chunk]

        def run(p: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
            return chunk_forward(
                p["u"], p["delta"], p["A"], p["B"], p["C"], p.get("D"), p.get("z"),
                p.get("delta_bias"), p["h0"], softplus, states,
            )  # fmt: skip

        # torch.func.vjp, not torch.autograd.grad: inside a custom op the autograd keys
        # are excluded, and functorch's transform brings its own.
        pullback = torch.func.vjp(run, primals)[1]
        (found,) = pullback((grad_out[..., start:stop], carry))
        carry = found.pop("h0")
        for name, g in found.items():
            if name in timed:
                grads[name][..., start:stop] = g
            else:
                grads[name] += g
    grad_initial = EMPTY(u) if initial is None else carry.to(initial.dtype)
    return (
        grads["u"], grads["delta"], grads["A"], grads["B"], grads["C"], grads.get("D", EMPTY(u)),
        grads.get("z", EMPTY(u)), grads.get("delta_bias", EMPTY(u)), grad_initial,
    )  # fmt: skip


def bind(
    backend: str, states: States
) -> tuple[Callable[..., Forward], Callable[..., tuple[Tensor, ...]]]:
    """(forward, backward) of the backend named ``backend`` whose chunks' states come
    from ``states``."""
    return partial(_forward, backend, states), partial(_backward, backend, states)


forward_torch, backward_torch = bind("torch", _torch_states)
