"""The SSD scan (Mamba-2) as every backend sees it: canonical, validated operands.

The public function (api.py) validates its arguments and brings them to this one
form with differentiable torch ops: the casts, ``D``'s broadcast over the head's
channels, and the whole step-size pipeline (``dt_bias``, softplus, ``dt_limit``), so
that a backend sees only the final step sizes and autograd carries their gradient
back through that pipeline. The op (autograd.py) hands the operands to a backend;
each backend implements the two functions below with these exact conventions, and
the float64 loop in the tests is the judge of all of them.

Operands (``cd``, the compute dtype: float64 when ``x`` is float64, else float32;
the state, the sums and every operand are in ``cd``):

    x           (batch, L, heads, headdim)   the inputs
    dt          (batch, L, heads)            the final step sizes (dt' of the API)
    A           (heads,)                     one real decay rate per head
    B, C        (batch, L, groups, N)        head h reads group h // (heads // groups)
    D           (heads, headdim) or None
    z           (batch, L, heads, headdim) or None
    initial     (S, heads, headdim, N) or None (zeros); S = batch, or num_seqs when
                packed
    cu_seqlens  (num_seqs + 1,) int64 or None, on the CPU or on x's device: packed
                sequences along L (batch is then 1): offsets, 0 first, L last,
                non-decreasing, empty sequences allowed

Any strides (a backend that needs contiguity makes its own copies). The math, per
sequence (the whole of L for each batch row when not packed; steps cu[s] ..
cu[s+1] - 1 of the one row for packed sequence s):

    h[t]    = exp(dt[t] * A) * h[t-1] + dt[t] * x[t] (outer) B[t]
              h: (heads, headdim, N); h[first - 1] = initial[s] (zeros when None)
    y[t]    = h[t] @ C[t]                      (sum over N)
    out[t]  = (y[t] + D * x[t]) * silu(z[t])   (each factor only when given)

No state crosses a sequence boundary.

forward(x, dt, A, B, C, D, z, initial, cu_seqlens) -> (out, final, checkpoints)
    out          (batch, L, heads, headdim) cd
    final        (S, heads, headdim, N) cd: each sequence's last state (its initial
                 state, or zeros, when it is empty)
    checkpoints  (batch, n_chunks, heads, headdim, N) cd with n_chunks = ceil(L / K),
                 K = CHECKPOINT_STEPS[backend]: checkpoints[:, c] is the state that
                 step c*K updates, i.e. h[c*K - 1] of the sequence holding step c*K,
                 or, where step c*K starts a sequence, that sequence's initial state
                 (zeros when None). The chunks are aligned to L, not to the packed
                 sequences, so the shape is known from the operands' shapes alone
                 (the fake kernels need that). Only that backend's backward reads
                 them.

backward(x, dt, A, B, C, D, z, initial, cu_seqlens, checkpoints, grad_out,
         grad_final) -> 8 gradients
    grad_out (batch, L, heads, headdim) cd; grad_final (S, heads, headdim, N) cd;
    both always given (zeros when unused). Every backend's forward also takes
    ``want_final=False`` (``final`` then has no rows: the C kernel stores none) and
    its backward a grad_final with no rows for zeros (the C kernel reads none; the
    others make the zeros: ``zero_rows_as_zeros``). Returns the gradients of x, dt, A, B, C,
    D, z, initial, each with its operand's shape and dtype (A and D summed over the
    batch and time, B and C over the heads of each group). An operand that is None
    gets an empty tensor (``EMPTY``) in its place.

Neither function allocates a (batch, L, heads, headdim, N) tensor: the forward
keeps one state per chunk, and the backward rebuilds one chunk at a time from its
checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from parascan import _checkpointed
from parascan._core import Operands

__all__ = [
    "CHECKPOINT_STEPS",
    "EMPTY",
    "OPERANDS",
    "drops_final",
    "n_chunks",
    "states",
    "zero_rows_as_zeros",
]

# The operands, in order: the ops' schemas and the backends' argument counts follow.
OPERANDS = Operands("x dt A B C D? z? initial? cu_seqlens?")

# Steps between checkpoints, per backend (the fake kernels size checkpoints by it).
CHECKPOINT_STEPS = {"cpu": 64, "triton": 64, "torch": 256, "loop": 64}


def n_chunks(length: int, backend: str) -> int:
    """The number of checkpoints of a sequence of ``length`` steps on ``backend``."""
    return math.ceil(length / CHECKPOINT_STEPS[backend]) if length > 0 else 0


EMPTY = _checkpointed.EMPTY
states = _checkpointed.states


def drops_final(forward: Callable[..., Any]) -> Callable[..., Any]:
    """A backend's ``forward`` of the operands that also takes ``want_final`` (after
    them, True when not given): without it the final state it computed is dropped (no
    rows)."""
    return _checkpointed.drops_final(forward, OPERANDS)


def zero_rows_as_zeros(backward: Callable[..., Any]) -> Callable[..., Any]:
    """A backend's ``backward`` that also takes a ``grad_final`` with no rows, for
    zeros (its last argument)."""
    return _checkpointed.zero_rows_as_zeros(backward, OPERANDS)
