"""The sequential reference of the first-order scans: the ``loop`` backend.

Semantics, as a plain loop over a semiring (semiring.py; ``reverse`` walks t from
T-1 down to 0 and reads x[t+1]):

    x = initial                      # the semiring's zero when None (0, or -inf in log space)
    for t in range(T):
        x = step(gates[t], x, tokens[t])     # gates[t] * x + tokens[t]
        out[t] = x                           # or logaddexp(log_gates[t] + x, log_tokens[t])

The tests keep their own float64 loops as the oracle (tests/oracles.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

from parascan._core import accumulate_dtype
from parascan.first_order.semiring import LINEAR, LOG, Semiring

__all__ = ["linear_loop", "log_loop", "loop"]


def loop(
    ring: Semiring, gates: Tensor, tokens: Tensor, initial: Tensor | None, dim: int, reverse: bool
) -> Tensor:
    """The recurrence of ``ring`` one step at a time. ``gates`` and ``tokens`` share
    one shape; ``initial`` has that shape without ``dim``. Half types accumulate in
    float32. Differentiable with ordinary autograd (it is plain torch)."""
    dtype = tokens.dtype
    acc = accumulate_dtype(dtype)
    a = gates.movedim(dim, 0).to(acc)
    b = tokens.movedim(dim, 0).to(acc)
    state = b.new_full(b.shape[1:], ring.zero) if initial is None else initial.to(acc)
    steps = range(b.shape[0] - 1, -1, -1) if reverse else range(b.shape[0])
    out: list[Tensor] = [state] * b.shape[0]
    for t in steps:
        state = ring.step(a[t], state, b[t])
        out[t] = state
    result = torch.empty(tokens.shape, dtype=dtype, device=tokens.device)
    if out:
        result.copy_(torch.stack(out).movedim(0, dim))
    return result


def linear_loop(
    gates: Tensor, tokens: Tensor, initial: Tensor | None, dim: int, reverse: bool
) -> Tensor:
    """``loop`` in the linear semiring: x[t] = gates[t] * x[t-1] + tokens[t]."""
    return loop(LINEAR, gates, tokens, initial, dim, reverse)


def log_loop(
    log_gates: Tensor, log_tokens: Tensor, initial: Tensor | None, dim: int, reverse: bool
) -> Tensor:
    """``loop`` in the log semiring: h[t] = logaddexp(log_gates[t] + h[t-1], log_tokens[t])
    (complex results: imaginary part in [-pi, pi))."""
    return loop(LOG, log_gates, log_tokens, initial, dim, reverse)
