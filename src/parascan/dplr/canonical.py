"""The generalized delta rule (diagonal plus rank one, DPLR) as every backend sees it:
canonical, validated operands. The public function (api.py) validates its arguments
and brings them to this one form with differentiable torch ops (the casts to the
compute dtype and ``scale``, folded into q), so that a backend sees only the
recurrence; the float64 loop in the tests is the judge of every backend.

Operands (``cd``, the compute dtype: float64 when ``v`` is float64, else float32;
every operand is in ``cd``):
    q, k, a, b  (batch, L, Hk, K)      q already scaled
    v           (batch, L, Hv, V)      Hv a multiple of Hk: q/k/a/b head i serves the
                                       v heads i * Hv / Hk ... (i + 1) * Hv / Hk - 1
    g           None, (batch, L, Hv) or (batch, L, Hv, K): log decays
    initial     (S, Hv, K, V) or None (zeros); S = batch, or num_seqs when packed
    cu_seqlens  (num_seqs + 1,) int64 or None: packed sequences along L (batch 1)
The math, per sequence (no state crosses a sequence boundary), head h reading head
h // (Hv / Hk) of q, k, a and b::

    S[t] = (Diag(exp(g[t])) + b[t] a[t]^T) S[t-1] + k[t] v[t]^T    S[first - 1] = initial[s]
    o[t] = S[t]^T q[t]

forward(q, k, v, a, b, g, initial, cu_seqlens[, want_final]) -> (out, final, checkpoints)
    out          (batch, L, Hv, V) cd
    final        (S, Hv, K, V) cd: each sequence's last state (its initial state, or
                 zeros, when it is empty); no rows when ``want_final`` is False
    checkpoints  (batch, n_chunks, Hv, K, V) cd, n_chunks = ceil(L / K_c) with
                 K_c = CHECKPOINT_STEPS[backend]: the state entering each chunk
backward(q, k, v, a, b, g, initial, cu_seqlens, checkpoints, grad_out, grad_final)
    -> the gradients of q, k, v, a, b, g, initial (an empty tensor for an absent one);
       a grad_final with no rows stands for zeros.
Neither allocates a (batch, L, Hv, K, V) tensor.
"""

from __future__ import annotations

import math

from parascan._core import Operands

__all__ = ["CHECKPOINT_STEPS", "OPERANDS", "n_chunks"]

# The operands, in order: the ops' schemas and the backends' argument counts follow.
OPERANDS = Operands("q k v a b g? initial? cu_seqlens?")

# Steps between checkpoints, per backend (the fake kernels size checkpoints by it).
CHECKPOINT_STEPS = {"cpu": 64, "torch": 64, "loop": 64}


def n_chunks(length: int, backend: str) -> int:
    """The number of checkpoints of a sequence of ``length`` steps on ``backend``."""
    return math.ceil(length / CHECKPOINT_STEPS[backend]) if length > 0 else 0
