"""The selective scan as every backend sees it: canonical, validated operands.

The public function (api.py) validates its arguments, then brings them to this one
form with differentiable torch ops (so autograd handles the casts and the
broadcasts), and the op (autograd.py) hands them to a backend. Each backend of the
selective scan implements the two functions below with these exact conventions;
the float64 loop in the tests is the judge of all of them.

Operands (``cd``, the compute dtype: float64 when ``u`` is float64, else float32;
``sd``, the state dtype: ``cd``, or its complex type when ``A`` is complex):

    u, delta      (batch, dim, L)      cd
    A             (dim, N)             cd or complex(cd)
    B, C          (dim, N)             time-invariant, or
                  (batch, G, N, L)     variable; channel d reads group d // (dim // G)
                                       (G = 1: shared by every channel).
                  cd, or complex(cd) when A is complex. B and C are independent: one
                  may be invariant and the other variable, one real, one complex.
    D             (dim,) cd or None
    z             (batch, dim, L) cd or None
    delta_bias    (dim,) cd or None
    initial       (batch, dim, N) sd or None (zeros)
    softplus      bool

Any strides (a backend that needs contiguity makes its own copies). The math:

    dt[t]   = softplus(delta[t] + delta_bias) if softplus else delta[t] + delta_bias
              softplus(x) = log1p(exp(x)), and x itself where x > 20 (as mamba_ssm)
    h[t]    = exp(dt[t] * A) * h[t-1] + dt[t] * B[t] * u[t]     h[-1] = initial
    y[t]    = sum_n C[t, n] * h[t, n]          real A
            = 2 * Re(sum_n C[t, n] * h[t, n])  complex A
    out[t]  = (y[t] + D * u[t]) * silu(z[t])   (each factor only when given)

forward(...) -> (out, final, checkpoints)
    out          (batch, dim, L) cd
    final        (batch, dim, N) sd: h[L-1] (initial, or zeros, when L == 0)
    checkpoints  (batch, dim, n_chunks, N) sd with n_chunks = ceil(L / K), K =
                 CHECKPOINT_STEPS[backend]: checkpoints[:, :, c] = h[c*K - 1], the
                 state entering chunk c (so checkpoints[:, :, 0] is the initial
                 state). Only that backend's backward reads them.

backward(..., checkpoints, grad_out, grad_final) -> 9 gradients
    grad_out (batch, dim, L) cd; grad_final (batch, dim, N) sd; both always given
    (zeros when unused). Returns the gradients of u, delta, A, B, C, D, z,
    delta_bias, initial, each with its operand's shape and dtype (B and C: summed
    over the batch when invariant, over the channels of each group when variable;
    A, D, delta_bias: summed over batch and time). An operand that is None gets an
    empty tensor (``EMPTY``) in its place. Complex gradients follow torch's
    convention (the conjugate Wirtinger derivative, as autograd computes them).

Neither function allocates a (batch, dim, L, N) tensor: the backward rebuilds
the states of one chunk at a time from its checkpoint.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from parascan._core import Operands

__all__ = ["CHECKPOINT_STEPS", "EMPTY", "OPERANDS", "n_chunks", "state_dtype"]

# The operands, in order: the ops' schemas and the backends' argument counts follow.
OPERANDS = Operands("u delta A B C D? z? delta_bias? initial?")

# Steps between checkpoints, per backend (the fake kernels size checkpoints by it).
CHECKPOINT_STEPS = {"cpu": 64, "triton": 64, "torch": 64, "loop": 64}


def n_chunks(length: int, backend: str) -> int:
    return math.ceil(length / CHECKPOINT_STEPS[backend]) if length > 0 else 0


def state_dtype(A: Tensor, u: Tensor) -> torch.dtype:
    """The state's dtype for canonical ``u`` (float32/64) and ``A``."""
    if A.is_complex():
        return torch.complex128 if u.dtype == torch.float64 else torch.complex64
    return u.dtype


def EMPTY(like: Tensor) -> Tensor:
    """The placeholder gradient of an absent operand."""
    return like.new_empty(0)
