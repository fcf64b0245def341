"""Drop-ins for flash-linear-attention 0.6's ops: the same signatures, layouts and
results, computed by parascan on any device. One module per fla op folder, so that
``fla.ops.X.f`` is ``parascan.compat.fla.X.f``; this package exports every drop-in::

    from parascan.compat.fla import chunk_gated_delta_rule
    from parascan.compat.fla.gated_delta_rule import chunk_gated_delta_rule  # the same

    hgrn                    chunk_hgrn, fused_recurrent_hgrn
    delta_rule              chunk_delta_rule, fused_recurrent_delta_rule
    gated_delta_rule        chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    kda                     chunk_kda, fused_recurrent_kda
    gla                     chunk_gla, fused_recurrent_gla
    simple_gla              chunk_simple_gla, fused_recurrent_simple_gla
    linear_attn             chunk_linear_attn, fused_recurrent_linear_attn,
                            fused_chunk_linear_attn
    retention               chunk_retention, fused_recurrent_retention
    lightning_attn          chunk_lightning_attn, fused_recurrent_lightning_attn
    generalized_delta_rule  chunk_dplr_delta_rule, fused_recurrent_dplr_delta_rule
    rwkv7                   chunk_rwkv7, fused_recurrent_rwkv7

Not provided from those folders: ``fla.ops.delta_rule.fused_chunk_delta_rule``, the
``chunk_gdn`` and ``fused_recurrent_gdn`` aliases and the ``naive_*`` references of
``fla.ops.gated_delta_rule``; ``fla.ops.gla.fused_chunk_gla`` (its original only raises
NotImplementedError); ``fused_chunk_simple_gla``, ``parallel_simple_gla``,
``fused_chunk_retention``, ``parallel_retention``; the IPLR ops
(``chunk_iplr_delta_rule``, ``fused_recurrent_iplr_delta_rule``) of
``fla.ops.generalized_delta_rule``; ``fla.ops.rwkv7.fused_mul_recurrent_rwkv7`` and
RWKV-7's layer helpers (channel mixing, ``fused_addcmul``, ``fused_k_rwkv7``, the gate
output correction); the ``naive`` modules. Errors name the drop-in as this package exports it
(``parascan.compat.fla.chunk_kda: ...``). (A new op folder: a module of its own, with
its ``__all__``, imported below, its functions added to ``__all__`` and to this list;
what its drop-ins share with these, the checks of the options that the originals take
alike, is in ``_common``.)

**HGRN** (``hgrn``). The same signatures and results, ``h[t] = exp(g[t]) * h[t-1] + x[t]``
over ``(B, T, D)`` tensors (``g`` the log of the forget gate, e.g. ``logsigmoid``),
returning ``(o, final)`` with ``o[t] = h[t]``; computed by :func:`parascan.linear_scan`
along dim 1, on any device and dtype (half types accumulate in float32, with the gate's
exp taken in float32, as the originals do). Packed variable-length batches take
``cu_seqlens`` (B == 1, one initial and final state per sequence) in both functions; in
the originals only ``fused_recurrent_hgrn`` does. Differentiable in ``x``, ``g`` and
``initial_state`` (``chunk_hgrn``'s original returns no gradient for the initial state).

**Delta rule** (DeltaNet ``delta_rule``, Gated DeltaNet ``gated_delta_rule``, Kimi Delta
Attention ``kda``): ``chunk_delta_rule``, ``fused_recurrent_delta_rule``,
``chunk_gated_delta_rule``, ``fused_recurrent_gated_delta_rule``, ``chunk_kda`` and
``fused_recurrent_kda`` with the signatures (parameter names, order, defaults, the
options read from ``**kwargs``), layouts and results of flash-linear-attention 0.6's,
computed by :func:`parascan.delta_rule_scan` on any device. ``q``, ``k``:
``(B, T, H, K)``; ``v``: ``(B, T, HV, V)`` with HV a multiple of H (value head ``i``
reads q/k head ``i // (HV // H)``); the state of each sequence and value head is a
``(K, V)`` matrix::

    q, k = l2norm(q), l2norm(k)              with use_qk_l2norm_in_kernel (eps 1e-6)
    S = Diag(exp(g)) S                       S: initial_state, or zeros
    u = beta * (v - S^T k);  S = S + k u^T   beta per head, or per value channel
    o = scale * S^T q                        scale defaults to K ** -0.5

``g`` is absent (delta rule), one log decay per head (gated delta rule) or per key
channel (KDA); ``fused_recurrent_gated_delta_rule`` also takes ``gk`` (per key channel)
and ``gv`` (per value channel), applied in turn. The options that the originals fuse
into their kernels are computed here with torch ops before the scan, so they are
differentiable: ``use_gate_in_kernel`` (the gated delta rule's
``g = -exp(A_log) * softplus(g + dt_bias)``; KDA's, per key channel with ``dt_bias`` of
HV * K elements, or ``lower_bound * sigmoid(exp(A_log) * (g + dt_bias))`` when
``lower_bound`` is set), ``use_beta_sigmoid_in_kernel`` (``beta = sigmoid(beta)``, times 2
with ``allow_neg_eigval``), in float32 (float64 for a float64 ``v``), softplus linear
above 20 as the kernels' is.

States: ``initial_state`` and the final state ``(N, HV, K, V)``, ``(N, HV, V, K)`` with
``state_v_first=True`` (or the deprecated ``transpose_state_layout``), N the batch or the
number of ``cu_seqlens`` sequences (packed along T of a batch of one); the final state is
float32 (float64 for a float64 ``v``). ``o``: ``(B, T, HV, V)`` in ``q``'s dtype
(``chunk_*``, ``fused_recurrent_delta_rule``) or ``v``'s (``fused_recurrent_gated_delta_rule``,
``fused_recurrent_kda``), as the originals return it.

How the delta-rule drop-ins differ from the originals:

- All six are differentiable in every tensor argument (``A_log``, ``dt_bias`` and the
  initial state included), and through the final state; the originals'
  ``fused_recurrent_gated_delta_rule`` and ``fused_recurrent_kda`` have no backward.
- Accepted where the originals assert or fail: any real float dtype and device, any T
  (0 included), any K >= 1 (the chunked originals assert K <= 256; K = 0 raises, as
  ``ps.delta_rule_scan`` does); a float32 ``chunk_delta_rule`` (its original asserts q is
  not float32); grouped value heads in the DeltaNet pair (their originals have none), and
  a default ``beta`` of one per value head (``fused_recurrent_gated_delta_rule``'s
  original makes one per q/k head); ``initial_state`` of any float dtype (``chunk_kda``'s
  original asserts float32). q, k and v of different dtypes are taken by all but
  ``chunk_delta_rule``, as by their originals, which do not check them. An empty packed
  sequence's final state is its initial state (``fused_recurrent_kda``'s original leaves
  it unwritten).
- Options that only steer the originals' kernels are checked as the originals check them
  and otherwise ignored, since the results do not depend on them: ``chunk_size``,
  ``cu_seqlens_cpu`` (it must hold ``cu_seqlens``' offsets), ``chunk_indices``,
  ``safe_gate``, ``disable_recompute``, ``use_graph`` (``chunk_kda``'s; with it a
  ``max_num_seqs`` must be ``cu_seqlens``' count); ``head_first=False`` is accepted.
- Refused as the originals assert, with an error naming the function (a ValueError or
  TypeError, where the original's is an AssertionError): ``fused_recurrent_delta_rule``'s
  ``scale <= 0``, ``chunk_delta_rule``'s q, k and v of different dtypes, a beta other
  than ``(B, T, HV)`` where the original takes no per-channel beta, KDA's g and beta
  shapes, ``return_intermediate_states`` outside inference mode or with
  ``disable_recompute``, ``use_gate_in_kernel`` without ``A_log`` in
  ``chunk_gated_delta_rule``.
- Refused, with an error naming the function: ``head_first=True`` (the originals raise
  too), ``cp_context`` (context parallelism), keyword arguments the original does not
  read (it ignores them silently), ``use_gate_in_kernel`` without ``A_log`` and without
  ``lower_bound`` in ``fused_recurrent_kda`` (the original's kernel then uses a gate
  of ``-e * softplus(g + dt_bias)``, as if ``A_log`` were 1).
- A per-value-channel ``beta`` ``(B, T, HV, V)`` or a ``gv`` runs each value channel as a
  value head of its own, with the decays repeated per channel: ``(B, T, HV * V, K)``
  numbers when per key channel decays (``gk``, KDA's ``g``) come with them.

**Linear attention** (Gated Linear Attention ``gla``, ``simple_gla``, ``linear_attn``,
RetNet's ``retention``, Lightning attention ``lightning_attn``): the eleven drop-ins
listed above, with the signatures (parameter names, order, defaults, the options read
from ``**kwargs``), layouts and results of flash-linear-attention 0.6's, computed by
:func:`parascan.linear_attention_scan` on any device. ``q``, ``k``: ``(B, T, H, K)``;
``v``: ``(B, T, H, V)`` (one value head per q/k head, as the originals take them); the
state of each sequence and head is a ``(K, V)`` matrix::

    S = Diag(exp(gk)) S Diag(exp(gv))        the log decays below, or none
    S = S + k v^T                            S: initial_state, or zeros
    o = scale * S^T q                        scale defaults to K ** -0.5

``chunk_gla``'s ``g`` and ``fused_recurrent_gla``'s ``gk`` are per key channel
``(B, T, H, K)``, the latter's ``gv`` per value channel ``(B, T, H, V)`` (both
optional); ``simple_gla``'s ``g`` ``(B, T, H)`` and ``g_gamma`` ``(H,)`` are per head
(either, both: their sum, or neither); ``linear_attn`` has none; ``retention``'s fixed
decays are ``log(1 - 2 ** (-5 - h))`` for head ``h``, ``lightning_attn``'s
``-8 / H * (1 - layer_idx / num_layers) * h``. ``reverse`` (the ``fused_recurrent_*``
ones) scans each sequence from its last step to its first: the final state is then the
one after its first step. ``linear_attn``'s ``normalize``
divides ``o`` by ``scale * q . z + 1e-10``, ``z`` the keys summed so far (from the end
with ``reverse``), starting from the ``z_state`` ``(N, 1, H, K)`` of an
``initial_state`` pair ``(kv_state, z_state)``, and returns ``(o, (final_state,
z_state))``, ``final_state`` None without ``output_final_state``, as the originals do.

States: ``initial_state`` and the final state ``(N, H, K, V)``, ``(N, H, V, K)`` with
``state_v_first`` (``chunk_gla``, ``fused_recurrent_gla``, ``chunk_simple_gla``,
``fused_recurrent_simple_gla``, ``fused_recurrent_retention``; the deprecated
``transpose_state_layout`` where the original reads it), N the batch or the number of
``cu_seqlens`` sequences; the final state is float32 (float64 for a float64 ``v``),
``z_state`` in k's dtype. ``o``: ``(B, T, H, V)`` in ``v``'s dtype (``chunk_gla``,
``fused_chunk_linear_attn``) or ``q``'s (the others), promoted with ``q``'s and ``k``'s
by ``normalize``, as the originals return it.

**Generalized delta rule** (``generalized_delta_rule``'s DPLR ops, RWKV-7 ``rwkv7``):
``chunk_dplr_delta_rule``, ``fused_recurrent_dplr_delta_rule``, ``chunk_rwkv7`` and
``fused_recurrent_rwkv7``, computed by :func:`parascan.dplr_delta_rule_scan`. ``q``,
``k``, ``a``, ``b``, ``gk``: ``(B, T, H, K)``, ``v``: ``(B, T, H, V)``, states as
above (no ``state_v_first``)::

    S = (Diag(exp(gk)) + b a^T) S + k v^T    S: initial_state, or zeros
    o = scale * S^T q                        scale defaults to K ** -0.5

``fused_recurrent_dplr_delta_rule`` takes ``reverse`` as above. RWKV-7's are these
with its names, ``r`` for ``q`` and ``w`` (its log decay) for
``gk``, in its order ``(r, w, k, v, a, b)``; ``a`` and ``b`` are passed on as given (the
RWKV-7 layer passes ``-kk`` and ``kk * a``). Their defaults are the originals':
``chunk_rwkv7``'s ``scale=1.0``, ``fused_recurrent_rwkv7``'s ``scale=None`` and
``output_final_state=True``. ``o`` has ``q``'s (``r``'s) dtype from the chunked ones,
``v``'s from the fused recurrent ones; the final state is float32 (float64 for a float64
``v``).

How the linear-attention and generalized-delta-rule drop-ins differ from the originals:

- All are differentiable in every tensor argument (``g_gamma``, ``z_state`` and the
  initial states included), and through the final states; the originals of
  ``fused_recurrent_dplr_delta_rule`` and ``fused_recurrent_rwkv7`` have no backward,
  and simple GLA's return no gradient for ``g_gamma``.
- Accepted where the originals assert or fail: any real float dtype and device, any T
  (0 included), any K >= 1; ``initial_state`` of any float dtype (``chunk_gla``'s
  original asserts float32); q, k and v of different dtypes. An empty packed sequence's
  final state is its initial state (and its ``z_state`` its initial one, as in the
  originals); with ``normalize`` and T = 0 unpacked, ``z_state`` is the initial one
  ``(B, 1, H, K)`` (the originals' is empty, ``(B, 0, H, K)``).
- Computed in float32 (float64 for a float64 ``v``) throughout: retention's and
  Lightning's decays are float64 for a float64 ``v`` (float32 in the originals), and
  ``normalize`` divides the float32 sums (the originals round ``o`` to q's dtype first).
- Options that only steer the originals' kernels are checked and otherwise ignored,
  since the results do not depend on them: ``chunk_size`` (the simple-GLA, retention
  and Lightning ones: None or a power of two, as the originals check it; DPLR's and
  RWKV-7's: None or a power of two >= 16, which their kernels tile by), ``cu_seqlens_cpu``
  (it must hold ``cu_seqlens``' offsets), ``safe_gate``, ``disable_recompute``,
  ``lower_bound`` (negative, as the originals raise; not checked against ``gk``);
  ``head_first=False`` is accepted where the original takes ``**kwargs`` (the
  originals raise for any ``head_first``). ``chunk_dplr_delta_rule``'s original warns
  about float32 inputs; the drop-in does not.
- Refused, with an error naming the function (a ValueError or TypeError): v with other
  than one head per q/k head or with V = 0 (the originals assert or misread it),
  ``head_first=True``, ``cp_context`` (context parallelism), keyword arguments the
  original does not read (it ignores them silently), an ``initial_state`` pair without
  ``normalize`` or of other than two items, ``lightning_attn``'s ``layer_idx`` or
  ``num_layers`` not an int, or ``num_layers < 1`` (the originals divide by it).
- ``fused_recurrent_gla``'s ``gv`` runs each value channel as a head of its own, with
  the decays repeated per channel: ``(B, T, H * V, K)`` numbers with ``gk``.
"""

from __future__ import annotations

from parascan.compat.fla.delta_rule import chunk_delta_rule, fused_recurrent_delta_rule
from parascan.compat.fla.gated_delta_rule import (
    chunk_gated_delta_rule,
    fused_recurrent_gated_delta_rule,
)
from parascan.compat.fla.generalized_delta_rule import (
    chunk_dplr_delta_rule,
    fused_recurrent_dplr_delta_rule,
)
from parascan.compat.fla.gla import chunk_gla, fused_recurrent_gla
from parascan.compat.fla.hgrn import chunk_hgrn, fused_recurrent_hgrn
from parascan.compat.fla.kda import chunk_kda, fused_recurrent_kda
from parascan.compat.fla.lightning_attn import (
    chunk_lightning_attn,
    fused_recurrent_lightning_attn,
)
from parascan.compat.fla.linear_attn import (
    chunk_linear_attn,
    fused_chunk_linear_attn,
    fused_recurrent_linear_attn,
)
from parascan.compat.fla.retention import chunk_retention, fused_recurrent_retention
from parascan.compat.fla.rwkv7 import chunk_rwkv7, fused_recurrent_rwkv7
from parascan.compat.fla.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla

__all__ = [
    "chunk_delta_rule",
    "chunk_dplr_delta_rule",
    "chunk_gated_delta_rule",
    "chunk_gla",
    "chunk_hgrn",
    "chunk_kda",
    "chunk_lightning_attn",
    "chunk_linear_attn",
    "chunk_retention",
    "chunk_rwkv7",
    "chunk_simple_gla",
    "fused_chunk_linear_attn",
    "fused_recurrent_delta_rule",
    "fused_recurrent_dplr_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "fused_recurrent_gla",
    "fused_recurrent_hgrn",
    "fused_recurrent_kda",
    "fused_recurrent_lightning_attn",
    "fused_recurrent_linear_attn",
    "fused_recurrent_retention",
    "fused_recurrent_rwkv7",
    "fused_recurrent_simple_gla",
]

# doctest.testmod(parascan.compat.fla) runs the drop-ins' examples too, although their
# modules are the op folders' (doctest otherwise takes only what this module defines).
__test__ = {name: globals()[name] for name in __all__}
