"""Hugging Face transformers' recurrent models (Mamba-1 and -2, the gated delta rule, KDA,
short convolutions, Griffin, RWKV-4, MiniMax), computing their scans with parascan::

    import parascan.integrations.transformers as parascan_hf

    parascan_hf.patch()      # the names it replaced, e.g.
                             # 'transformers.models.mamba.modeling_mamba.mamba_selective_scan'
    model = MambaForCausalLM(config)          # before or after patch(): both work
    model(input_ids, labels=input_ids).loss.backward()
    model.generate(input_ids, max_new_tokens=64)
    parascan_hf.unpatch()    # the originals again

    with parascan_hf.patch("mamba2", "qwen3_5"):   # those models' modules alone, for a block
        ...

Without mamba_ssm (on CPU, or on a GPU where it is not installed), transformers runs a
Mamba layer's scan as a Python loop over the tokens, materializing a (batch, dim, L, N)
tensor and keeping every step for the backward, and a Mamba-2 layer's scan as a chunked
torch computation that pads L to the chunk size and keeps every chunk's (chunk, chunk)
decay matrices and per-chunk states for the backward. ``patch()`` replaces, in each
modeling module of a Mamba mixer, the module-level functions the mixers call, as Liger
Kernel's ``apply_liger_kernel_to_*`` do for other models; each replacement's docstring
says more.

Mamba-1 (``mamba``, ``falcon_mamba`` and the hybrids whose modules carry the same
functions, ``jamba`` and ``zamba`` in transformers 5.23 and 5.24):

- ``mamba_selective_scan``, the full-sequence scan (prefill, training, evaluation):
  :func:`selective_scan`, by :func:`parascan.compat.mamba_ssm.selective_scan_fn`; its
  last state, the cache's recurrent (ssm) state, is float32 as unpatched.
- ``mamba_selective_state_update``, the decoding step (one token with a cache):
  :func:`selective_state_update`, advancing the cached state in place as the original.
- ``mamba_inner_fn``, the fused training kernel that transformers uses when mamba_ssm is
  installed: :func:`no_fused_inner` declines (as the original does without mamba_ssm),
  so that training runs the mixer's unfused path, whose scan is parascan's.

Mamba-2 (``mamba2`` and the hybrids whose modules carry the same functions: ``bamba``,
``falcon_h1``, ``granitemoehybrid``, ``nemotron_h`` and ``zamba2`` in transformers 5.23 and
5.24):

- ``mamba2_chunk_scan``, the full-sequence scan: :func:`chunk_scan`, by
  :func:`parascan.compat.mamba_ssm.mamba_chunk_scan_combined` (so :func:`parascan.ssd_scan`
  with ``backend="auto"``); it keeps packed sequences (``seq_idx`` or ``cu_seqlens``)
  apart, which transformers refuses unpatched without mamba_ssm.
- ``mamba2_selective_state_update``, the decoding step in the multi-head layout:
  :func:`multihead_state_update`.
- ``mamba2_split_conv1d_scan_combined``, the fused training path (a mixer in training
  mode without a cache; the original declines without mamba_ssm): :func:`split_conv_scan`,
  by :func:`parascan.compat.mamba_ssm.mamba_split_conv1d_scan_combined` (on the CPU in
  float32 or float64 the convolution, scan and gated norm fused: :mod:`parascan.ssd.layer`).
- ``apply_mask_to_padding_states``: :func:`mask_padding`, the same result; it keeps the
  attention mask, and when that mask pads a step the fused training path declines (see
  :func:`split_conv_scan`).

The gated delta rule (the modules that define ``torch_chunk_gated_delta_rule``:
``qwen3_next``, ``qwen3_5``, ``qwen3_5_moe``, ``qwen4_exp``, ``lara_mini`` and
``olmo_hybrid`` in transformers 5.24):

- ``torch_chunk_gated_delta_rule`` and ``torch_recurrent_gated_delta_rule`` (the torch
  fallbacks used without flash-linear-attention): :func:`chunk_gated_delta_rule` and
  :func:`recurrent_gated_delta_rule`, by :func:`parascan.delta_rule_scan`; they keep
  packed sequences (``cu_seq_lens_q``, passed down as ``cu_seqlens``) apart, which the
  fallbacks refuse; packed sequences with a cache (``use_cache=True``) raise at once, as
  the cache keeps one state per batch row (pass ``use_cache=False`` to train or prefill
  packed, or give each sequence its own row to decode).
- ``causal_conv1d_fn``: :func:`causal_conv1d_packed_q`, which also reads the packed
  sequences from ``cu_seq_lens_q``; ``causal_conv1d_update`` as below.

Kimi Delta Attention (the modules that define ``chunk_kimi_delta_attention``:
``kimi_linear``, ``glm5_next`` and ``bailing_hybrid`` in transformers 5.24):

- ``chunk_kimi_delta_attention`` and ``recurrent_kimi_delta_attention`` (the torch
  fallbacks used without flash-linear-attention): :func:`chunk_kimi_delta_attention` and
  :func:`recurrent_kimi_delta_attention`, by :func:`parascan.delta_rule_scan` with the
  per-key-channel decay; they keep packed sequences (``cu_seq_lens_q``, which these
  layers pass down under that name) apart, which the fallbacks silently do not; with
  a cache they raise, as above.
- ``causal_conv1d_fn``: :func:`causal_conv1d_packed_q`; ``causal_conv1d_update`` as below.

Short convolutions (the modules that define ``causal_conv1d_fn`` and none of the
functions above: ``lfm2``, ``lfm2_moe``, ``lfm3``, ``inkling``, ``inkling2`` and
``inkling2_loop`` in transformers 5.24, whose gated short-convolution blocks or
per-projection convolutions call it):

- ``causal_conv1d_fn``: :func:`causal_conv1d_packed_q`, which keeps packed sequences
  apart where the layer passes them (LFM2's pass the attention keywords, so
  ``cu_seq_lens_q``, which the fallback silently ignores; Inkling 2's pass ``seq_idx``,
  which the fallback refuses; Inkling's pass neither); ``causal_conv1d_update`` as
  below. (Inkling 2's dynamic convolutions, whose taps depend on the token, are computed
  in their layers' own code and stay unpatched.)

Griffin's RG-LRU (``recurrent_gemma``, tested with transformers 5.23 and 5.24):

- ``RecurrentGemmaRglru._rnn_scan``, a Python loop over the tokens (a method, patched
  on the class): :func:`rg_lru_scan`, by :func:`parascan.linear_scan` with the gates
  zeroed at the document boundaries (``position_ids == 0``) as the loop zeroes them.

RWKV-4 (``rwkv``, tested with transformers 5.23 and 5.24):

- ``rwkv_linear_attention_cpu``, its WKV attention as a Python loop over the tokens with
  a running maximum for stability (what transformers runs without its CUDA kernel, and
  for a single token always): :func:`rwkv_linear_attention`, two first-order scans, one
  in log space, that need no maximum; its state keeps transformers' layout.

MiniMax's lightning attention (``minimax``, tested with transformers 5.23 and 5.24):

- ``MiniMaxLightningAttention.forward``, whose recurrence (a per-head constant decay
  over a (head_dim, head_dim) state) runs as a Python loop over blocks, and over the
  tokens with a cache: :func:`lightning_attention_forward`, the same layer with the
  recurrence by :func:`parascan.ssd_scan` (a step of 1, ``A = -slope_rate``, ``B`` the
  keys, ``C`` the queries). Without a cache it keeps packed sequences
  (``cu_seq_lens_q``, batch 1) apart, which the original silently does not; with a
  cache they raise, as above.

All families, where their modules define them:

- ``causal_conv1d_fn``, the depthwise causal convolution before the scan: a few shifted
  multiply-adds (forward and backward) on the mixer's strided input, instead of a grouped
  ``conv1d`` that first copies it; :func:`causal_conv1d` in the Mamba-2 modules reads no
  input across a ``seq_idx`` (or ``cu_seqlens``) boundary, and
  :func:`causal_conv1d_one_sequence` in the Mamba-1 modules, whose scan takes no
  sequence ids, raises on packed sequences (as unpatched, without causal_conv1d).
- ``causal_conv1d_update``, its decoding step: :func:`causal_conv1d_update`, a product
  and a sum over the filter's width instead of a grouped ``conv1d`` (a fifth of a
  decoding step's time on a CPU); an activation other than silu (or none) is left to
  transformers' own functions.

Everything else (the input projection; outside training, the gated norm and output
projection; the cache's bookkeeping) is the model's own code, unchanged; so are its
quirks (a Mamba-1 prompt continued with several tokens at once restarts the scan from a
zero state, as unpatched). In float32 the logits, gradients, caches and greedy
generations equal the unpatched ones to rounding; in half precision parascan takes the
step in float32 where transformers' Mamba-1 loop rounds it to the model's dtype first.

Supported: transformers 5.15.0 and later (tested with 5.15.0, 5.20.0, 5.23.0 and 5.24.0
for Mamba-1, 5.23.0 and 5.24.0 for Mamba-2): from 5.15 on, these mixers call the scan
through those module functions. ``patch()`` checks the installed version, that each
module defines the functions with the expected parameters, and that a mixer's
``forward`` calls them; otherwise it raises :class:`UnsupportedVersionError`, naming the
version and what is missing, and patches nothing. The Mamba-2 modules are patched where
they define ``mamba2_chunk_scan`` (a transformers whose Mamba-2 modules compute the scan
elsewhere keeps them unpatched, and its Mamba-1 models are still patched).
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import re
import sys
import threading
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from parascan._core import check_in_place, describe
from parascan.compat import mamba_ssm
from parascan.compat._checks import is_integer_tensor
from parascan.delta_rule.api import delta_rule_scan as ps_delta_rule_scan
from parascan.first_order.api import linear_scan as ps_linear_scan
from parascan.first_order.api import log_linear_scan as ps_log_linear_scan
from parascan.integrations._patching import (
    Family,
    Function,
    Patched,
    Patches,
    calls,
    leading_params,
    modules_defining,
    owner_of,
)
from parascan.mixer import conv
from parascan.ssd.api import ssd_scan as ps_ssd_scan

__all__ = ["MIN_VERSION", "UnsupportedVersionError", "patch", "patched", "unpatch"]

MIN_VERSION = "5.15.0"
TESTED_VERSIONS = "5.15.0, 5.20.0, 5.23.0 and 5.24.0"
_FN = "parascan.integrations.transformers.patch"


class UnsupportedVersionError(RuntimeError):
    """The installed transformers does not have the functions ``patch()`` replaces."""


# --- the replacements ------------------------------------------------------------------------


def _reject_extras(fn: str, kwargs: dict[str, Any]) -> None:
    given = sorted(k for k, v in kwargs.items() if v is not None)
    if given:
        raise ValueError(
            f"{fn}: parascan's replacement takes no {', '.join(given)} (the Mamba-1 mixers pass "
            f"none); call unpatch() to use transformers' own function"
        )


def selective_scan(
    hidden_states: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    z: Tensor | None = None,
    delta_bias: Tensor | None = None,
    delta_softplus: bool = False,
    return_last_state: bool = False,
    use_mambapy: bool = False,
    use_associative_scan: bool = False,
    **kwargs: Any,
) -> Tensor | tuple[Tensor, Tensor]:
    """Replaces transformers' ``mamba_selective_scan`` (same parameters): the scan by
    :func:`parascan.compat.mamba_ssm.selective_scan_fn`. ``use_mambapy`` and
    ``use_associative_scan`` choose among transformers' own loops; they change nothing
    here."""
    _reject_extras("mamba_selective_scan", kwargs)
    return mamba_ssm.selective_scan_fn(
        hidden_states, dt, A, B, C, D, z, delta_bias, delta_softplus, return_last_state
    )


def selective_state_update(
    state: Tensor,
    hidden_states: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = False,
    z: Tensor | None = None,
    **kwargs: Any,
) -> Tensor:
    """Replaces transformers' ``mamba_selective_state_update`` (same parameters, which
    differ in order from mamba_ssm's): one decoding step by
    :func:`parascan.compat.mamba_ssm.selective_state_update`, ``state`` updated in place."""
    _reject_extras("mamba_selective_state_update", kwargs)
    return mamba_ssm.selective_state_update(
        state, hidden_states, dt, A, B, C, D, z, dt_bias, dt_softplus
    )


def chunk_scan(
    hidden_states: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    chunk_size: int,
    D: Tensor | None = None,
    dt_bias: Tensor | None = None,
    initial_states: Tensor | None = None,
    dt_softplus: bool = False,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    return_final_states: bool = False,
    **kwargs: Any,
) -> Tensor | tuple[Tensor, ...]:
    """Replaces transformers' ``mamba2_chunk_scan`` (same parameters): the scan by
    :func:`parascan.compat.mamba_ssm.mamba_chunk_scan_combined`, the final state in
    float32 (float64 for a float64 model) as the original returns it.

    Of the other keyword arguments the mixers pass down, ``z`` gates the output and
    ``seq_idx`` (batch, L) or ``cu_seqlens`` (batch 1) mark packed sequences, whose
    states restart at each boundary; the rest (the model's attention keywords) are
    not the scan's and are dropped, as transformers' kernel dispatch drops them."""
    seq_idx = _packed_ids("mamba2_chunk_scan", kwargs, hidden_states)
    return mamba_ssm.mamba_chunk_scan_combined(
        hidden_states, dt, A, B, C, chunk_size, D=D, z=kwargs.get("z"), dt_bias=dt_bias,
        initial_states=initial_states, seq_idx=seq_idx, dt_softplus=dt_softplus,
        dt_limit=dt_limit, return_final_states=return_final_states,
        state_dtype=torch.float64 if hidden_states.dtype == torch.float64 else torch.float32,
    )  # fmt: skip


def split_conv_scan(
    zxbcdt: Tensor,
    conv1d_weight: Tensor,
    conv1d_bias: Tensor | None,
    dt_bias: Tensor,
    A: Tensor,
    D: Tensor,
    chunk_size: int,
    initial_states: Tensor | None = None,
    dt_limit: tuple[float, float] = (0.0, math.inf),
    return_final_states: bool = False,
    activation: str | None = "silu",
    rmsnorm_weight: Tensor | None = None,
    rmsnorm_eps: float | None = 1e-6,
    outproj_weight: Tensor | None = None,
    outproj_bias: Tensor | None = None,
    headdim: int | None = None,
    ngroups: int = 1,
    norm_before_gate: bool = True,
    **kwargs: Any,
) -> Tensor | tuple[Tensor, Tensor]:
    """Replaces transformers' ``mamba2_split_conv1d_scan_combined`` (same parameters):
    the mixer's whole training path after its input projection (convolution, scan,
    gated norm, output projection) by
    :func:`parascan.compat.mamba_ssm.mamba_split_conv1d_scan_combined`.

    ``seq_idx`` (batch, L) or ``cu_seqlens`` (batch 1) among the other keywords mark
    packed sequences (neither the convolution nor the scan crosses a boundary); the
    rest (the model's attention keywords) are dropped. ``rmsnorm_eps`` None (a mixer
    without the norm) is not read.

    After a padded attention mask (see :func:`mask_padding`) it declines (returns None),
    and the mixer runs its unfused path, patched: that path zeroes the convolution's
    output at the padded steps again before the scan, which this fused path, as
    mamba_ssm's kernel, does not (with a convolution bias, left padding then reaches
    the scan's state and the real tokens' outputs)."""
    if _take_padded(zxbcdt):
        return None  # type: ignore[return-value]
    seq_idx = _packed_ids("mamba2_split_conv1d_scan_combined", kwargs, zxbcdt)
    return mamba_ssm.mamba_split_conv1d_scan_combined(
        zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
        initial_states=initial_states, seq_idx=seq_idx, dt_limit=dt_limit,
        return_final_states=return_final_states, activation=activation,
        rmsnorm_weight=rmsnorm_weight, rmsnorm_eps=1e-6 if rmsnorm_eps is None else rmsnorm_eps,
        outproj_weight=outproj_weight, outproj_bias=outproj_bias, headdim=headdim,
        ngroups=ngroups, norm_before_gate=norm_before_gate,
    )  # fmt: skip


_PADDING = threading.local()


def _take_padded(zxbcdt: Tensor) -> bool:
    """Whether the attention mask of this thread's last :func:`mask_padding` call pads a
    step of the batch ``zxbcdt`` (batch, L, ...) is for; read once. Only here is the
    mask read (a device sync; under torch.compile any mask counts as padded, a value
    the graph cannot depend on), so evaluation and decoding never pay for it."""
    mask = getattr(_PADDING, "mask", None)
    _PADDING.mask = None
    if mask is None or tuple(mask.shape) != tuple(zxbcdt.shape[:2]):
        return False
    return torch.compiler.is_compiling() or not bool(mask.all())


def mask_padding(hidden_states: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """Replaces transformers' ``apply_mask_to_padding_states`` (same parameters and
    result: the original's), keeping the mask for :func:`split_conv_scan`: the Mamba-2
    mixers call this on their input just before their fused training path, which
    declines when the mask pads a step."""
    _PADDING.mask = attention_mask if isinstance(attention_mask, Tensor) else None
    return _transformers_own("apply_mask_to_padding_states", hidden_states, attention_mask)


def _packed_ids(fn: str, kwargs: dict[str, Any], x: Tensor) -> Tensor | None:
    """The sequence ids ``(batch, L)`` of packed sequences that a mixer passes down as
    ``seq_idx``, or as ``cu_seqlens`` (offsets along L of a batch of one), or None. The
    callee checks their shape against its own L."""
    seq_idx, cu_seqlens = kwargs.get("seq_idx"), kwargs.get("cu_seqlens")
    if seq_idx is not None or cu_seqlens is None:
        return seq_idx
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or x.shape[0] != 1:
        raise ValueError(
            f"{fn}: parascan's replacement reads cu_seqlens as (num_seqs + 1,) offsets along L "
            f"of a batch of one, but got cu_seqlens {describe(cu_seqlens)} with an input of "
            f"shape {tuple(x.shape)}"
        )
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device=x.device, dtype=torch.int64)
    ids = torch.arange(lengths.numel(), device=x.device)
    return torch.repeat_interleave(ids, lengths)[None]


def _refuse_packed_cache(fn: str, cu_seqlens: object, what: str) -> None:
    """Refuses packed sequences (``cu_seqlens``, num_seqs + 1 offsets along L of a batch
    of one) that come with a cache (``what``), before the layer stores anything: a cache
    keeps one state per batch row, so the delta-rule layers would store num_seqs states
    in a cache of one row, for the next decoding step to fail on, and the lightning
    layer the last sequence's, while the model's attention layers cache the keys of
    every packed sequence in that row: no decoding step could continue the sequences.
    One sequence is a batch row of its own: allowed. Only the offsets' count is read
    (no device sync)."""
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1:
        return  # the scan's own check names what it expected
    count = cu_seqlens.numel() - 1
    if count != 1:
        raise ValueError(
            f"{fn}: parascan's replacement got {count} packed sequences (the model's "
            f"cu_seq_lens_q) in a batch of one together with {what}: a cache keeps one state "
            "per batch row, not one per packed sequence, so decoding could not continue "
            "them. Pass use_cache=False to train on or prefill packed sequences (a config's "
            "use_cache=True makes a cache by default, in training too), or give each "
            "sequence a batch row of its own (padded, with an attention mask) to decode "
            "with a cache"
        )


def multihead_state_update(
    state: Tensor,
    hidden_states: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Tensor | None = None,
    dt_bias: Tensor | None = None,
    dt_softplus: bool = False,
    z: Tensor | None = None,
    **kwargs: Any,
) -> Tensor:
    """Replaces transformers' ``mamba2_selective_state_update`` (same parameters): one
    decoding step in the multi-head layout by
    :func:`parascan.compat.mamba_ssm.selective_state_update`, ``state`` (batch, heads,
    headdim, N) updated in place. ``state_batch_indices`` is honoured; the mixers' other
    keywords are dropped, as transformers' kernel dispatch drops them."""
    return mamba_ssm.selective_state_update(
        state, hidden_states, dt, A, B, C, D, z, dt_bias, dt_softplus,
        state_batch_indices=kwargs.get("state_batch_indices"),
    )  # fmt: skip


_CONV_ACTIVATIONS = (None, "silu", "swish")


def _original(name: str, owner: object = None) -> Callable[..., Any]:
    """transformers' own function (or method, ``"Class.method"``) ``name`` that the
    patch replaced: for a method, that of the patched class ``owner`` is an instance of
    (the first patched one in its MRO: a subclass may live in another module); for a
    function, any patched module's (they are the same code)."""
    for cls in type(owner).__mro__ if owner is not None else ():
        found = _ORIGINALS.get((cls.__module__, name))
        if found is not None:
            return found
    for (_, fn_name), original in _ORIGINALS.items():
        if fn_name == name:
            return original
    raise RuntimeError(f"{name}: parascan's replacement is called while nothing is patched")


def _transformers_own(name: str, *args: Any) -> Tensor:
    """transformers' own function ``name`` called on ``args``: a convolution for an
    activation the replacement does not compute, or the padding mask that mask_padding
    applies unchanged."""
    result: Tensor = _original(name)(*args)
    return result


_CONV_FN = "causal_conv1d_fn"


def causal_conv1d(
    hidden_states: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    activation: str | None = None,
    **kwargs: Any,
) -> Tensor:
    """Replaces transformers' ``causal_conv1d_fn`` in the Mamba-2 modules (same
    parameters): the depthwise causal convolution of ``hidden_states`` (batch, channels,
    L) with ``weight`` (channels, K), plus ``bias`` and silu, as K shifted multiply-adds
    along L (forward and backward) instead of a grouped ``conv1d`` that first copies its
    strided input (the mixers pass a slice of the transposed input projection). The
    result is (batch, channels, L) with the channels contiguous, the layout the mixers'
    next projection reads.

    ``seq_idx`` (batch, L) or ``cu_seqlens`` (batch 1) among the keywords mark packed
    sequences: no step reads an input of an earlier sequence, as the scan after it
    restarts at each boundary (the mixers pass the same keywords to both). With a
    cache, the cached steps continue each row's first sequence: exact when it had at
    least K - 1 steps before the cut (see :func:`_conv_ids`). The other keywords are
    the mixers' own and are dropped, as the original drops them."""
    seq_idx = _packed_ids(_CONV_FN, kwargs, hidden_states)
    if activation not in _CONV_ACTIVATIONS:
        if seq_idx is not None:
            raise ValueError(
                f"{_CONV_FN}: parascan's replacement keeps packed sequences apart for the "
                f"activations {_CONV_ACTIVATIONS[1:]} or None only, but got {activation!r}"
            )
        return _transformers_own(_CONV_FN, hidden_states, weight, bias, activation)
    x = hidden_states.to(weight.dtype).transpose(1, 2)
    if seq_idx is not None:
        seq_idx = _conv_ids(seq_idx, x)
    out = conv.causal_conv1d(x, weight, bias, seq_idx, activation is not None)
    return out.transpose(1, 2).to(hidden_states.dtype)


def _conv_ids(seq_idx: Tensor, x: Tensor) -> Tensor:
    """``seq_idx`` (batch, L) for the convolution's input ``x`` (batch, P + L, channels):
    the P cached steps a mixer puts before its new ones take the id of each row's first
    step (they continue that row's first sequence). The cache keeps no ids: when the
    sequence continued had fewer than K - 1 steps before the cut (K the filter width),
    some cached steps belong to the sequence before it and are read as this one's, as
    a decoding step after a packed prefill reads them too. A ``seq_idx`` shorter than
    the input without a cache is taken the same way."""
    batch, steps = x.shape[:2]
    if (
        not is_integer_tensor(seq_idx)
        or seq_idx.dim() != 2
        or seq_idx.shape[0] != batch
        or not 1 <= seq_idx.shape[1] <= steps
    ):
        raise ValueError(
            f"{_CONV_FN}: expected seq_idx to be an integer tensor of shape (batch, L) = "
            f"{(batch, steps)} (or the new steps' (batch, L - P) after P cached ones), but "
            f"got {describe(seq_idx)}"
        )
    seq_idx = seq_idx.to(x.device)
    cached = steps - seq_idx.shape[1]
    if cached:
        seq_idx = torch.cat([seq_idx[:, :1].expand(batch, cached), seq_idx], dim=1)
    return seq_idx


def causal_conv1d_one_sequence(
    hidden_states: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    activation: str | None = None,
    **kwargs: Any,
) -> Tensor:
    """Replaces transformers' ``causal_conv1d_fn`` in the Mamba-1 modules: as
    :func:`causal_conv1d`, except that packed sequences (``seq_idx`` or ``cu_seqlens``)
    raise, as unpatched transformers raises without the causal_conv1d package: the
    Mamba-1 mixers do not pass them to their scan, which would carry the state across
    the boundary the convolution stops at."""
    given = [name for name in ("seq_idx", "cu_seqlens") if kwargs.get(name) is not None]
    if given:
        raise ValueError(
            f"{_CONV_FN}: the Mamba-1 mixers cannot keep packed sequences apart (their scan, "
            f"mamba_selective_scan, takes no seq_idx), so parascan's replacement refuses "
            f"{' and '.join(given)}, as transformers does without causal_conv1d"
        )
    return causal_conv1d(hidden_states, weight, bias, activation)


def causal_conv1d_update(
    hidden_states: Tensor,
    conv_state: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    activation: str | None = None,
) -> Tensor:
    """Replaces transformers' ``causal_conv1d_update`` (same parameters): the decoding
    step of the convolution. ``conv_state`` (batch, channels, S) holds the last S inputs
    and advances in place by the new ones, ``hidden_states`` (batch, channels, steps);
    each new step's output is the filter times its last K inputs (plus ``bias``, then
    silu): a product and a sum over K instead of a grouped ``conv1d`` over S + steps
    inputs, which costs a model's decoding step a fifth of its time on a CPU."""
    check_in_place("causal_conv1d_update", "conv_state", conv_state)  # on every path
    if activation not in _CONV_ACTIVATIONS:
        return _transformers_own(
            "causal_conv1d_update", hidden_states, conv_state, weight, bias, activation
        )
    steps, width, kept = hidden_states.shape[-1], weight.shape[-1], conv_state.shape[-1]
    inputs = torch.cat([conv_state, hidden_states], dim=-1).to(weight.dtype)
    conv_state.copy_(inputs[:, :, -kept:])
    if inputs.shape[-1] < width:  # fewer inputs than taps: the missing ones are zeros
        inputs = torch.nn.functional.pad(inputs, (width - inputs.shape[-1], 0))
    windows = inputs.unfold(-1, width, 1)[:, :, -steps:]  # (batch, channels, steps, K)
    out = (windows * weight[:, None, :]).sum(-1)
    if bias is not None:
        out = out + bias[:, None]
    if activation is not None:
        out = torch.nn.functional.silu(out)
    return out.to(hidden_states.dtype)


def no_fused_inner(*args: Any, **kwargs: Any) -> None:
    """Replaces transformers' ``mamba_inner_fn``: returning None sends training through
    the mixer's unfused path (projections, convolution, then the patched scan), as it
    goes whenever mamba_ssm is not installed."""
    return None


# --- the gated delta rule (Qwen3-Next, Qwen3.5, OLMo-Hybrid, ...) ---------------------------


def _gated_delta(
    fn: str,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool,
    kwargs: dict[str, Any],
) -> tuple[Tensor, Tensor | None]:
    cu_seqlens = kwargs.get("cu_seqlens")
    if cu_seqlens is not None and (not isinstance(cu_seqlens, Tensor) or query.shape[0] != 1):
        raise ValueError(
            f"{fn}: parascan's replacement reads cu_seqlens as (num_seqs + 1,) offsets along L "
            f"of a batch of one, but got cu_seqlens {describe(cu_seqlens)} with a query of "
            f"shape {tuple(query.shape)}"
        )
    if cu_seqlens is not None and (output_final_state or initial_state is not None):
        # The layers read and write their cache's state through these two arguments.
        state = "output_final_state=True" if output_final_state else "an initial_state"
        _refuse_packed_cache(fn, cu_seqlens, f"{state}, which the layers pass with a cache")
    out, final = ps_delta_rule_scan(
        query, key, value, beta, g=g, qk_l2norm=bool(use_qk_l2norm_in_kernel),
        initial=None if initial_state is None else initial_state.float(),
        return_final=True, cu_seqlens=cu_seqlens,
    )  # fmt: skip
    return out.to(query.dtype), final.float() if output_final_state else None


def chunk_gated_delta_rule(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    chunk_size: int = 64,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """Replaces transformers' ``torch_chunk_gated_delta_rule`` (same parameters and
    results: the output (batch, L, Hv, V) in ``query``'s dtype, the final state
    (batch, Hv, K, V) in float32 or None): the gated delta rule by
    :func:`parascan.delta_rule_scan`, scale K ** -0.5. ``chunk_size`` changes nothing.
    ``cu_seqlens`` among the keywords (the layers pass ``cu_seq_lens_q`` under that
    name) packs sequences along L of a batch of one, each restarting from a zero state,
    which the torch fallback refuses; the other keywords (the model's attention
    keywords) are dropped.

    Packed sequences (more than one) with a state, ``initial_state`` or
    ``output_final_state=True`` (the layers pass them when the model runs with a cache:
    ``use_cache=True``, ``generate``), raise at once: the cache keeps one state per
    batch row, and this function's final state is (batch, Hv, K, V), so the next
    decoding step could not continue num_seqs sequences from it. Packed training and
    prefill run with ``use_cache=False``; :func:`parascan.delta_rule_scan` (or
    :func:`parascan.compat.fla.chunk_gated_delta_rule`) returns one state per packed
    sequence."""
    return _gated_delta(
        "torch_chunk_gated_delta_rule", query, key, value, g, beta, initial_state,
        output_final_state, use_qk_l2norm_in_kernel, kwargs,
    )  # fmt: skip


def recurrent_gated_delta_rule(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """Replaces transformers' ``torch_recurrent_gated_delta_rule`` (same parameters and
    results), the decoding step from a cached state: as :func:`chunk_gated_delta_rule`."""
    return _gated_delta(
        "torch_recurrent_gated_delta_rule", query, key, value, g, beta, initial_state,
        output_final_state, use_qk_l2norm_in_kernel, kwargs,
    )  # fmt: skip


def causal_conv1d_packed_q(
    hidden_states: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    activation: str | None = None,
    **kwargs: Any,
) -> Tensor:
    """Replaces transformers' ``causal_conv1d_fn`` in the gated-delta-rule, KDA and
    short-convolution modules: as :func:`causal_conv1d`, reading packed sequences from
    ``cu_seq_lens_q`` (the name under which these layers pass them to the convolution)
    when no ``cu_seqlens`` or ``seq_idx`` is given, so that no step reads an input of an
    earlier sequence (as the delta rule after it restarts at each boundary, and as the
    attention layers of the short-convolution models keep the sequences apart)."""
    if kwargs.get("seq_idx") is None and kwargs.get("cu_seqlens") is None:
        cu = kwargs.get("cu_seq_lens_q")
        return causal_conv1d(hidden_states, weight, bias, activation, cu_seqlens=cu)
    return causal_conv1d(
        hidden_states, weight, bias, activation,
        seq_idx=kwargs.get("seq_idx"), cu_seqlens=kwargs.get("cu_seqlens"),
    )  # fmt: skip


# --- Griffin's RG-LRU (RecurrentGemma) ----------------------------------------------------


def rg_lru_scan(
    self: Any,
    hidden_states: Tensor,
    recurrent_gate: Tensor,
    reset: Tensor,
    recurrent_states: Tensor | None,
    acc_dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """Replaces transformers' ``RecurrentGemmaRglru._rnn_scan`` (same parameters and
    results): ``x[t] = a[t] x[t-1] + b[t]`` along the tokens (dim 1) of ``hidden_states``
    (batch, L, width), ``a`` the ``recurrent_gate`` zeroed where ``reset`` (batch, L, 1)
    marks a document's first token, from ``recurrent_states`` (batch, width; zeros when
    None), accumulated in ``acc_dtype``: the outputs in the input's dtype and the last
    state in ``acc_dtype``, by :func:`parascan.linear_scan` instead of a Python loop over
    the tokens. The decoding step (one token) is the original's: a single step, which
    no scan makes faster (the scan's dispatch costs more than the step)."""
    if hidden_states.shape[1] == 1:
        step = _original("RecurrentGemmaRglru._rnn_scan", self)
        result: tuple[Tensor, Tensor] = step(
            self, hidden_states, recurrent_gate, reset, recurrent_states, acc_dtype
        )
        return result
    gates = (recurrent_gate * ~reset).to(acc_dtype)
    initial = None if recurrent_states is None else recurrent_states.to(gates.device, acc_dtype)
    out, final = ps_linear_scan(
        gates, hidden_states.to(acc_dtype), 1, initial=initial, return_final=True
    )
    return out.to(hidden_states.dtype), final


# --- RWKV-4's WKV -------------------------------------------------------------------------


def rwkv_linear_attention(
    time_decay: Tensor,
    time_first: Tensor,
    key: Tensor,
    value: Tensor,
    state: list[Tensor] | tuple[Tensor, ...] | None = None,
    return_state: bool = False,
) -> tuple[Tensor, list[Tensor] | None]:
    """Replaces transformers' ``rwkv_linear_attention_cpu`` (same parameters and
    results). With ``w = -exp(time_decay)`` and ``u = time_first`` (channels), RWKV-4's
    attention over ``key`` and ``value`` (batch, L, channels) is::

        A[t] = exp(w) A[t-1] + exp(k[t]) v[t],   B[t] = exp(w) B[t-1] + exp(k[t])
        out[t] = (A[t-1] + exp(u + k[t]) v[t]) / (B[t-1] + exp(u + k[t]))

    computed as two first-order scans, in float32 (the decay exponentiated in the
    parameter's dtype first, as the original; a float64 model's scans are float32 too,
    where the original mixes float64 values in): ``log B`` by
    :func:`parascan.log_linear_scan` (B is positive), then the weighted mean ``y = A / B``,
    ``y[t] = alpha[t] y[t-1] + exp(k[t] - log B[t]) v[t]`` with ``alpha[t] = exp(w +
    log B[t-1] - log B[t])`` in [0, 1], by :func:`parascan.linear_scan`; ``out[t]`` is
    the mean of ``y[t-1]`` and ``v[t]`` weighted ``B[t-1]`` and ``exp(u + k[t])``. No
    running maximum is needed: nothing is exponentiated that can overflow. ``state``,
    transformers' ``[num, den, max]`` (``A = num exp(max)``, ``B = den exp(max)``), is
    read and returned (when given, or ``return_state``) in that layout, as ``[y, 1, log
    B]``. The decoding step (one token) is the original's: a single step, which no
    scan makes faster (the scans' dispatch costs more than the step); it reads that
    state as it reads its own."""
    if key.shape[1] == 1:
        step = _original("rwkv_linear_attention_cpu")
        result: tuple[Tensor, list[Tensor] | None] = step(
            time_decay, time_first, key, value, state=state, return_state=return_state
        )
        return result
    w = -torch.exp(time_decay).float()
    k, v, u = key.float(), value.float(), time_first.float()
    batch, _, channels = k.shape
    if state is None:
        log_b0 = y0 = None
        before = torch.full((batch, 1, channels), -math.inf, device=k.device, dtype=k.dtype)
        y_before = torch.zeros(batch, 1, channels, device=k.device, dtype=k.dtype)
    else:
        num, den, top = (t.float() for t in state)
        seen = den > 0  # where den is 0 (nothing seen yet): log B = -inf, y = 0
        safe = torch.where(seen, den, torch.ones_like(den))  # no log(0) to differentiate
        log_b0 = torch.where(seen, torch.log(safe) + top, torch.full_like(den, -math.inf))
        y0 = torch.where(seen, num / safe, torch.zeros_like(num))
        before, y_before = log_b0[:, None], y0[:, None]
    log_b = ps_log_linear_scan(w, k, 1, initial=log_b0)
    log_prev = torch.cat([before, log_b[:, :-1]], dim=1)
    alpha = torch.exp(w + log_prev - log_b)
    y = ps_linear_scan(alpha, torch.exp(k - log_b) * v, 1, initial=y0)
    y_prev = torch.cat([y_before, y[:, :-1]], dim=1)
    out = torch.lerp(v, y_prev, torch.sigmoid(log_prev - u - k))
    if return_state or state is not None:
        return out.to(key.dtype), [y[:, -1], torch.ones_like(y[:, -1]), log_b[:, -1]]
    return out.to(key.dtype), None


# --- MiniMax's lightning attention ---------------------------------------------------------


def lightning_attention_forward(
    self: Any,
    hidden_states: Tensor,
    position_embeddings: tuple[Tensor, Tensor],
    attention_mask: Tensor | None,
    cache: Any = None,
    **kwargs: Any,
) -> tuple[Tensor, Tensor]:
    """Replaces transformers' ``MiniMaxLightningAttention.forward`` (same parameters and
    results): the layer's own projections, activation, padding mask, norm, output gate
    and cache, with its recurrence ``S[t] = exp(-slope) S[t-1] + k[t]^T v[t]``, ``o[t] =
    q[t] S[t]`` per head by :func:`parascan.ssd_scan` (the state transposed: transformers
    keeps ``K^T V``, the scan ``V^T K``). The original's blocks compute the same sums,
    within a block as a masked (block, block) product. Packed sequences
    (``cu_seq_lens_q`` among the keywords, batch 1, no cache) restart their state at
    each boundary; the returned state is then the last sequence's. With a cache, more
    than one packed sequence raises at once, as in :func:`chunk_gated_delta_rule` (the
    cache's one state per batch row cannot hold them; the original runs them as one
    sequence). A step of one token (not packed) is the original forward's (with a
    cached state, a single step, which no scan makes faster: the scan's dispatch costs
    more)."""
    if hidden_states.shape[1] == 1 and kwargs.get("cu_seq_lens_q") is None:
        forward = _original("MiniMaxLightningAttention.forward", self)
        given = () if cache is None else (cache,)  # past_key_values, if so, is in kwargs
        result: tuple[Tensor, Tensor] = forward(
            self, hidden_states, position_embeddings, attention_mask, *given, **kwargs
        )
        return result
    if cache is None:  # its name before transformers 5.24 (an alias until 5.40)
        cache = kwargs.get("past_key_values")
    batch, length, _ = hidden_states.shape
    packed = kwargs.get("cu_seq_lens_q")
    if cache is not None and packed is not None and batch == 1:
        _refuse_packed_cache("MiniMaxLightningAttention.forward", packed, "a cache")
    heads, dim = self.num_attention_heads, self.head_dim
    # the modeling module of the patched class (self may be of a subclass defined elsewhere)
    own = next(
        sys.modules[c.__module__]
        for c in type(self).__mro__
        if hasattr(sys.modules.get(c.__module__), "apply_mask_to_padding_states")
    )
    qkv = self.act_fn(self.qkv_proj(hidden_states))
    qkv = own.apply_mask_to_padding_states(qkv, attention_mask)
    q, k, v = torch.split(qkv.reshape(batch, length, heads, 3 * dim), dim, dim=3)
    state = None if cache is None else cache.get_linear_cache(self.layer_idx)
    cu = kwargs.get("cu_seq_lens_q") if state is None and batch == 1 else None
    step = torch.ones(batch, length, heads, device=v.device, dtype=v.dtype)
    out, final = ps_ssd_scan(
        v, step, -self.slope_rate.reshape(heads), k, q,
        initial=None if state is None else state.transpose(-1, -2),
        return_final=True, cu_seqlens=cu,
    )  # fmt: skip
    last = final if cu is None else final[-1:]  # packed: the last sequence's state
    inter = last.transpose(-1, -2).to(v.dtype).contiguous()  # the steps after read it
    out = self.norm(out.reshape(batch, length, heads * dim))
    out = self.out_proj(torch.sigmoid(self.output_gate(hidden_states)) * out)
    if cache is not None:
        cache.set_linear_cache(self.layer_idx, inter)
    return out, inter


# --- Kimi Delta Attention (Kimi Linear, GLM-5-Next, Bailing hybrid) -----------------------


def _kda_cu_seqlens(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The keywords :func:`_gated_delta` reads: ``cu_seqlens``, or else the layers'
    ``cu_seq_lens_q`` (the KDA layers pass their attention keywords down unchanged)."""
    cu_seqlens = kwargs.get("cu_seqlens")
    return {"cu_seqlens": kwargs.get("cu_seq_lens_q") if cu_seqlens is None else cu_seqlens}


def chunk_kimi_delta_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    chunk_size: int = 64,
    initial_state: Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """Replaces transformers' ``chunk_kimi_delta_attention`` (same parameters and
    results: the output (batch, L, H, V) in ``query``'s dtype, the final state
    (batch, H, K, V) in float32 or None): Kimi Delta Attention, the delta rule with
    ``g`` (batch, L, H, K) a log decay per key channel, by
    :func:`parascan.delta_rule_scan`, scale K ** -0.5. ``chunk_size`` changes nothing.
    ``cu_seq_lens_q`` (or ``cu_seqlens``) among the keywords packs sequences along L
    of a batch of one, each restarting from a zero state: the layers pass it down
    unchanged, and the torch fallback runs the packed sequences as one; the other
    keywords are dropped. Packed sequences (more than one) with a state (a cache)
    raise at once, as in :func:`chunk_gated_delta_rule` (:func:`parascan.compat.fla.chunk_kda`
    returns one state per packed sequence)."""
    return _gated_delta(
        "chunk_kimi_delta_attention", query, key, value, g, beta, initial_state,
        output_final_state, use_qk_l2norm_in_kernel, _kda_cu_seqlens(kwargs),
    )  # fmt: skip


def recurrent_kimi_delta_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    output_final_state: bool,
    use_qk_l2norm_in_kernel: bool = False,
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """Replaces transformers' ``recurrent_kimi_delta_attention`` (same parameters and
    results), the decoding step from a cached state: as
    :func:`chunk_kimi_delta_attention`."""
    return _gated_delta(
        "recurrent_kimi_delta_attention", query, key, value, g, beta, initial_state,
        output_final_state, use_qk_l2norm_in_kernel, _kda_cu_seqlens(kwargs),
    )  # fmt: skip


# --- what is patched where ----------------------------------------------------------------


# mamba_selective_scan's leading parameters: its replacement also takes (and ignores)
# use_mambapy and use_associative_scan, which the original need not have.
_SCAN_PARAMS = ("hidden_states", "dt", "A", "B", "C", "D", "z", "delta_bias", "delta_softplus",
                "return_last_state")  # fmt: skip
# Both families' modules carry the convolution's functions (patched where present); the
# Mamba-1 mixers' convolution refuses packed sequences, which their scan cannot restart at.
_CONV_UPDATE = Function("causal_conv1d_update", causal_conv1d_update, required=False)
_MAMBA1 = Family(
    marker="mamba_selective_scan",
    functions=(
        Function("mamba_selective_scan", selective_scan, _SCAN_PARAMS),
        Function("mamba_selective_state_update", selective_state_update),
        # Only where the mixer has a fused training path (not zamba's).
        Function("mamba_inner_fn", no_fused_inner, ("xz",), required=False),
        Function("causal_conv1d_fn", causal_conv1d_one_sequence, required=False),
        _CONV_UPDATE,
    ),
    expected=("mamba", "falcon_mamba"),
)
_MAMBA2 = Family(
    marker="mamba2_chunk_scan",
    functions=(
        Function("mamba2_chunk_scan", chunk_scan),
        Function("mamba2_selective_state_update", multihead_state_update),
        Function("mamba2_split_conv1d_scan_combined", split_conv_scan, required=False),
        # Where the fused path is there: it declines after a padded mask.
        Function("apply_mask_to_padding_states", mask_padding, required=False),
        Function("causal_conv1d_fn", causal_conv1d, required=False),
        _CONV_UPDATE,
    ),
)
_GATED_DELTA = Family(
    marker="torch_chunk_gated_delta_rule",
    functions=(
        Function("torch_chunk_gated_delta_rule", chunk_gated_delta_rule),
        Function("torch_recurrent_gated_delta_rule", recurrent_gated_delta_rule),
        Function("causal_conv1d_fn", causal_conv1d_packed_q, required=False),
        _CONV_UPDATE,
    ),
)
_KDA = Family(
    marker="chunk_kimi_delta_attention",
    functions=(
        Function("chunk_kimi_delta_attention", chunk_kimi_delta_attention),
        Function("recurrent_kimi_delta_attention", recurrent_kimi_delta_attention),
        Function("causal_conv1d_fn", causal_conv1d_packed_q, required=False),
        _CONV_UPDATE,
    ),
)
# The models whose only patched function is the convolution (a gated short convolution
# block in place of attention, or convolutions of the attention's projections).
_SHORT_CONV = Family(
    marker=_CONV_FN,
    functions=(Function(_CONV_FN, causal_conv1d_packed_q), _CONV_UPDATE),
    expected=("lfm2",),
    unless=tuple(family.marker for family in (_MAMBA1, _MAMBA2, _GATED_DELTA, _KDA)),
)
_RG_LRU = Family(
    marker="RecurrentGemmaRglru._rnn_scan",
    functions=(
        Function(
            "RecurrentGemmaRglru._rnn_scan",
            rg_lru_scan,
            ("self", "hidden_states", "recurrent_gate", "reset", "recurrent_states"),
        ),
    ),
    expected=("recurrent_gemma",),
)
_RWKV = Family(
    marker="rwkv_linear_attention_cpu",
    # called through rwkv_linear_attention (which the attention's forward calls): not
    # required to be looked up by a forward itself
    functions=(Function("rwkv_linear_attention_cpu", rwkv_linear_attention, required=False),),
    expected=("rwkv",),
)
_LIGHTNING = Family(
    marker="MiniMaxLightningAttention.forward",
    functions=(
        Function(
            "MiniMaxLightningAttention.forward",
            lightning_attention_forward,
            # the fifth, the cache, is `past_key_values` before 5.24 and `cache` after
            ("self", "hidden_states", "position_embeddings", "attention_mask"),
            required=False,  # the layer's forward itself: no other forward calls it
        ),
    ),
    expected=("minimax",),
)
_FAMILIES = (_MAMBA1, _MAMBA2, _GATED_DELTA, _KDA, _SHORT_CONV, _RG_LRU, _RWKV, _LIGHTNING)

# the functions patched now, with their originals
_PATCHES = Patches()
_ORIGINALS = _PATCHES.originals  # (module name, function name) -> the original


def _version_tuple(version: str) -> tuple[int, ...]:
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", version)
    if match is None:
        return (0,)
    return tuple(int(part or 0) for part in match.groups())


def _unsupported(version: str, what: str) -> UnsupportedVersionError:
    return UnsupportedVersionError(
        f"{_FN}: transformers {version} is installed, {what}. The patch supports "
        f"transformers>={MIN_VERSION} (tested with {TESTED_VERSIONS}), whose recurrent "
        "models' modeling modules compute their scans in functions the layers call "
        "(mamba_selective_scan and mamba_selective_state_update for Mamba-1, "
        "mamba2_chunk_scan for Mamba-2, torch_chunk_gated_delta_rule for the gated delta "
        "rule, ...); nothing was patched"
    )


def _candidate_modules(family: Family, models: tuple[str, ...] = ()) -> list[str]:
    """The modeling modules (of ``models`` only, when given) whose source defines
    ``family.marker`` and none of ``family.unless``, read as text, so that only those are
    imported (and, for ``models``, only their sources are read)."""
    spec = importlib.util.find_spec("transformers.models")
    if spec is None or not spec.submodule_search_locations:
        return []
    root = str(next(iter(spec.submodule_search_locations)))
    patterns = [f"{m}/modeling_{m}.py" for m in models] if models else ["*/modeling_*.py"]
    return [
        name
        for pattern in patterns
        for name in modules_defining(
            root, pattern, "transformers.models", family.marker, family.unless
        )
    ]


def _check(version: str, module: ModuleType, fn: Function) -> bool:
    """Whether ``fn`` is to be patched in ``module``; raises if the module does not
    have it as expected."""
    where = f"{module.__name__}.{fn.name}"
    original = _PATCHES.original(module, fn.name)
    if original is None or not callable(original):
        if fn.required:
            raise _unsupported(version, f"but {module.__name__} has no function {fn.name}")
        return False
    params = leading_params(original, fn)
    if params is not None:
        raise _unsupported(
            version,
            f"but {where} takes ({', '.join(params)}), not ({', '.join(fn.params)}, ...)",
        )
    _, attribute = owner_of(module, fn.name)
    if fn.required and not calls(module, attribute):
        raise _unsupported(version, f"but no mixer's forward in {module.__name__} calls {fn.name}")
    return True


def _model_of(module_name: str) -> str:
    """The model type of a modeling module: ``transformers.models.X.modeling_X`` -> X."""
    return module_name.split(".")[2]


def _targets(models: tuple[str, ...] = ()) -> list[tuple[ModuleType, Function]]:
    """Every (module, function) to patch, all checked before any is touched: of the
    modeling modules of ``models`` (model types, as transformers' folders name them),
    or of every family's modules when empty."""
    for model in models:
        if not isinstance(model, str) or not re.fullmatch(r"\w+", model, re.ASCII):
            raise TypeError(
                f"{_FN}: expected model types such as 'mamba2' or 'qwen3_5', but got "
                f"{type(model).__name__} {model!r}"
            )
    try:
        import transformers
    except ImportError as error:
        raise ImportError(
            f"{_FN}: transformers is not installed; install transformers>={MIN_VERSION} "
            "(pip install 'parascan[transformers]')"
        ) from error
    version = str(getattr(transformers, "__version__", "unknown"))
    if _version_tuple(version) < _version_tuple(MIN_VERSION):
        raise _unsupported(version, f"older than {MIN_VERSION}")
    modules = {family: _candidate_modules(family, models) for family in _FAMILIES}
    unknown = sorted(set(models) - {_model_of(n) for names in modules.values() for n in names})
    if unknown:
        every = {_model_of(n) for family in _FAMILIES for n in _candidate_modules(family)}
        raise ValueError(
            f"{_FN}: the patch leaves {', '.join(map(repr, unknown))} alone: no scan of "
            f"theirs is one parascan computes; it patches {', '.join(sorted(every))}"
        )
    targets = []
    for family, names in modules.items():
        for expected in () if models else family.expected:
            wanted = f"transformers.models.{expected}.modeling_{expected}"
            if wanted not in names:
                raise _unsupported(
                    version, f"but {wanted} does not define {family.marker} (or is missing)"
                )
        for name in names:
            try:
                module = importlib.import_module(name)
            except ImportError:
                if models:
                    raise  # asked for by name: its missing dependency is the answer
                continue  # a model whose own dependencies are missing cannot be built either
            targets += [(module, fn) for fn in family.functions if _check(version, module, fn)]
    return targets


# --- the public functions -----------------------------------------------------------------


def patch(*models: str) -> Patched:
    """Make the installed transformers' recurrent models compute their scans and
    decoding steps with parascan (see the module docstring): those of ``models``
    (model types, as transformers names its folders: ``patch("mamba2", "qwen3_5")``),
    or every family's when none is named. Only the modeling modules patched are
    imported.

    Idempotent: a second call changes nothing. Models created before the call are
    patched too (the layers look the functions up on every call). As a context manager,
    ``with patch("mamba2"):`` puts back on exit what that call replaced.

    Returns:
        The fully qualified names of the functions replaced now, by this call and
        earlier ones (the same list on every call until :func:`unpatch`), e.g.
        ``'transformers.models.mamba.modeling_mamba.mamba_selective_scan'``.

    Raises:
        ImportError: transformers is not installed (or a model named has a dependency
            that is not).
        UnsupportedVersionError: the installed transformers is older than
            :data:`MIN_VERSION` or its modules do not have the functions as expected
            (nothing is patched then).
        ValueError: a model named is one the patch leaves alone (the message lists
            those it patches); TypeError: a model named is not a string.
    """
    return _PATCHES.apply(_targets(models))


def unpatch() -> list[str]:
    """Restore every function :func:`patch` replaced; returns their names (empty when
    nothing was patched)."""
    return _PATCHES.restore()


def patched() -> list[str]:
    """The fully qualified names of the functions replaced now (to patch for a block,
    ``with patch(...):``)."""
    return _PATCHES.names()
