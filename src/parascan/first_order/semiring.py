"""The two semirings of the first-order scans, defined once.

A first-order scan walks ``x[t] = a[t] (x) x[t-1] (+) b[t]`` along one dim. Both public
scans are this one algorithm over a different semiring:

=================  ========================  ===============================
semiring           step a (x) s (+) b         one (identity gate), zero (no state)
=================  ========================  ===============================
``LINEAR``         ``a * s + b``              1, 0
``LOG``            ``logaddexp(a + s, b)``    0, -inf
=================  ========================  ===============================

Every backend reads its semiring from here: the reference loop and the chunked torch
backend call ``step``/``step_``/``compose_``; the C kernels are instantiated per
``name`` (``scan_forward(name, ...)``); the Triton kernels take ``code`` as their
``MODE``; parascan.distributed composes shards with ``step`` and ``total``. The
gradients of both come from one formula over the step's partial derivatives
(``partials``; see ops.py).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

__all__ = [
    "LINEAR",
    "LOG",
    "SEMIRINGS",
    "Partials",
    "PartialsFn",
    "Semiring",
    "log_weight",
    "logaddexp",
    "previous_states",
]


def logaddexp(u: Tensor, v: Tensor) -> Tensor:
    """log(exp(u) + exp(v)), real or complex. For complex tensors: the principal
    value (imaginary part in [-pi, pi)), -inf + 0j for log 0, computed from the
    argument with the larger real part so that exp never overflows."""
    if not u.is_complex():
        return torch.logaddexp(u, v)
    first = u.real >= v.real
    hi, lo = torch.where(first, u, v), torch.where(first, v, u)
    usable = hi.real.isfinite() & (lo.real != -math.inf)
    w = torch.exp(torch.where(usable, lo - hi, torch.zeros_like(hi)))
    out = hi + torch.where(usable, _log1p_unit_disk(w), torch.zeros_like(hi))
    phase = torch.remainder(out.imag + math.pi, 2 * math.pi) - math.pi
    phase = torch.where(out.real == -math.inf, torch.zeros_like(phase), phase)
    return torch.complex(out.real, phase)


def _log1p_unit_disk(w: Tensor) -> Tensor:
    """log(1 + w) for complex |w| <= 1, from real functions: torch's vectorized
    complex log1p returns NaN for subnormal inputs (torch 2.13, CPU). Its real part,
    log |1 + w|, is log1p(2 re + |w|^2) / 2 near w = 0, and log hypot(1 + re, im) for
    re <= -1/2 (1 + re is exact there, where the first form cancels: two nearly
    opposite terms lost up to 30x float32's precision on a GPU)."""
    re, im = w.real, w.imag
    near = re > -0.5
    zero = torch.zeros_like(re)
    small = 0.5 * torch.log1p(torch.where(near, re * (2 + re) + im * im, zero))
    large = torch.log(torch.hypot(torch.where(near, zero + 1, 1 + re), torch.where(near, zero, im)))
    return torch.complex(torch.where(near, small, large), torch.atan2(im, 1 + re))


def log_weight(x: Tensor, h: Tensor) -> Tensor:
    """exp(x - h), the derivative of h = logaddexp(x, y) in x; 0 where h is log 0
    (x and y both -inf: no gradient flows through log(0 + 0)). Differentiable
    without NaN (the -inf case is masked before the exp)."""
    dead = (h.real if h.is_complex() else h) == -math.inf
    return torch.exp(torch.where(dead, torch.full_like(h, -math.inf), x - h))


def previous_states(
    out: Tensor, initial: Tensor | None, dim: int, reverse: bool, empty: float = 0.0,
    cu_seqlens: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """x[t-1] for every t (x[t+1] when reversed), the initial state (or ``empty``,
    the state before any step) at the start: the states each step's gate acts on.
    With ``cu_seqlens`` (packed sequences, packed.py) every sequence starts from its
    own: ``initial`` then has ``out``'s shape with ``dim`` of size num_seqs."""
    steps = out.shape[dim]
    if steps == 0:
        return out
    if cu_seqlens is not None:
        return _packed_previous_states(out, initial, dim, reverse, empty, cu_seqlens)
    if initial is None:
        x0 = torch.full_like(out.narrow(dim, 0, 1), empty)
    else:
        x0 = initial.unsqueeze(dim)
    if reverse:
        return torch.cat([out.narrow(dim, 1, steps - 1), x0], dim)
    return torch.cat([x0, out.narrow(dim, 0, steps - 1)], dim)


def _packed_previous_states(
    out: Tensor, initial: Tensor | None, dim: int, reverse: bool, empty: float,
    cu_seqlens: Tensor,
) -> Tensor:  # fmt: skip
    """previous_states of packed sequences: the states shifted by one step, then each
    non-empty sequence's first step in scan order given its initial state (or
    ``empty``)."""
    shifted = previous_states(out, None, dim, reverse, empty)
    cu = cu_seqlens.to(device=out.device, dtype=torch.int64)
    lo, hi = cu[:-1], cu[1:]
    seqs = torch.nonzero(hi > lo).flatten()
    first = (hi - 1 if reverse else lo).index_select(0, seqs)
    if initial is None:
        shape = list(out.shape)
        shape[dim] = seqs.numel()
        starts = out.new_full(shape, empty)
    else:
        starts = initial.index_select(dim, seqs)
    return shifted.index_copy(dim, first, starts)


# The partial derivatives of every step x[t] = a[t] (x) x[t-1] (+) b[t]:
# (d x[t] / d x[t-1], d x[t] / d a[t], d x[t] / d b[t]); None stands for 1.
Partials = tuple[Tensor, Tensor, "Tensor | None"]


class PartialsFn(Protocol):
    def __call__(
        self, gates: Tensor, tokens: Tensor | None, out: Tensor, initial: Tensor | None,
        dim: int, reverse: bool, cu_seqlens: Tensor | None = None, /,
    ) -> Partials: ...  # fmt: skip


@dataclass(frozen=True)
class Semiring:
    """The algebra of a first-order scan. ``step(a, s, b)`` is the next state from
    gate a, state s and token b (``step_`` writes it into ``out``); ``compose_(p, a,
    out)`` writes the gate of two steps in a row; ``total(gates, dim)`` composes all
    gates along ``dim``; ``one`` is the identity gate, ``zero`` the state of no steps;
    ``partials`` gives the derivatives of every step from the forward's output (the
    gradients of both semirings follow from them by one formula: ops.py)."""

    name: str  # the C kernels' key: scan_forward(name, ...)
    code: int  # the Triton kernels' MODE (backward: BACKWARD + code), the distributed header's op
    op: str  # the public function
    operands: tuple[str, str]  # the public names of a and b
    one: float
    zero: float
    step: Callable[[Tensor, Tensor, Tensor], Tensor]
    step_: Callable[[Tensor, Tensor, Tensor, Tensor], object]
    compose_: Callable[[Tensor, Tensor, Tensor], object]
    total: Callable[[Tensor, int], Tensor]
    backward_reads_tokens: bool  # whether partials (and the fused backward) read b
    # every step's Partials, from the forward's output (packed: see previous_states)
    partials: PartialsFn


def _linear_partials(
    gates: Tensor, tokens: Tensor | None, out: Tensor, initial: Tensor | None, dim: int,
    reverse: bool, cu_seqlens: Tensor | None = None,
) -> Partials:  # fmt: skip
    """(a[t], x[t-1], 1)."""
    return gates, previous_states(out, initial, dim, reverse, 0.0, cu_seqlens), None


def _log_partials(
    log_gates: Tensor, log_tokens: Tensor | None, out: Tensor, initial: Tensor | None, dim: int,
    reverse: bool, cu_seqlens: Tensor | None = None,
) -> Partials:  # fmt: skip
    """(wu, wu, wb) with wu = exp(log a[t] + h[t-1] - h[t]), wb = exp(log b[t] - h[t])
    (0 where h[t] is log 0)."""
    if log_tokens is None:
        raise RuntimeError("parascan: internal error: the log semiring's partials read b")
    h_prev = previous_states(out, initial, dim, reverse, -math.inf, cu_seqlens)
    wu = log_weight(log_gates + h_prev, out)
    return wu, wu, log_weight(log_tokens, out)


def _ordered_product(gates: Tensor, dim: int) -> Tensor:
    """The gates' product along ``dim``. torch.prod's vectorized reduction groups the
    factors by lanes, whose partial products can overflow where a running product does
    not (1e20, 1e-20, ...): where its result is not finite, the running product
    (cumprod's last, from the first step; a temporary the size of ``gates``, so not by
    default) decides."""
    total = torch.prod(gates, dim)
    if gates.shape[dim] and not bool(torch.isfinite(total).all()):
        total = torch.cumprod(gates, dim).select(dim, -1)
    return total


LINEAR = Semiring(
    name="linear",
    code=0,
    op="parascan.linear_scan",
    operands=("gates", "tokens"),
    one=1.0,
    zero=0.0,
    step=lambda a, s, b: a * s + b,
    step_=lambda a, s, b, out: torch.addcmul(b, a, s, out=out),
    compose_=lambda p, a, out: torch.mul(p, a, out=out),
    total=_ordered_product,
    backward_reads_tokens=False,
    partials=_linear_partials,
)

LOG = Semiring(
    name="log",
    code=1,
    op="parascan.log_linear_scan",
    operands=("log_gates", "log_tokens"),
    one=0.0,
    zero=-math.inf,
    step=lambda a, s, b: logaddexp(a + s, b),
    step_=lambda a, s, b, out: out.copy_(logaddexp(a + s, b)),
    compose_=lambda p, a, out: out.copy_(p + a),
    total=torch.sum,
    backward_reads_tokens=True,
    partials=_log_partials,
)

SEMIRINGS = {ring.name: ring for ring in (LINEAR, LOG)}
