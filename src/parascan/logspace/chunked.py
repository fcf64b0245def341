"""The ``torch`` backend for log_linear_scan: linear_scan's chunked scan (see
parascan.linear.chunked) in the log semiring, where logaddexp is the sum and +
the product: O(T) work, O(sqrt(T)) batched ops, any device."""

from __future__ import annotations

import math

from torch import Tensor

from parascan.linear.chunked import Semiring, scan
from parascan.logspace.reference import logaddexp

__all__ = ["LOG", "forward"]

LOG = Semiring(
    step=lambda a, s, b, out: out.copy_(logaddexp(a + s, b)),
    compose=lambda p, a, out: out.copy_(p + a),
    one=0.0,
    zero=-math.inf,
)


def forward(
    log_gates: Tensor,
    log_tokens: Tensor,
    initial: Tensor | None,
    dim: int,
    reverse: bool,
) -> Tensor:
    """Same contract as ``reference.forward``."""
    return scan(log_gates, log_tokens, initial, dim, reverse, LOG)
