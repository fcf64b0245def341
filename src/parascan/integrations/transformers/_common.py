"""What the replacements of several families share: the checks of their extra arguments and
packed sequences, transformers' own functions behind a patch, and the causal
convolutions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from parascan._core import check_in_place, describe
from parascan.compat._checks import is_integer_tensor
from parascan.integrations._patching import Patches
from parascan.mixer import conv

# the functions patched now, with their originals
_PATCHES = Patches()
_ORIGINALS = _PATCHES.originals  # (module name, function name) -> the original


def _reject_extras(fn: str, kwargs: dict[str, Any]) -> None:
    given = sorted(k for k, v in kwargs.items() if v is not None)
    if given:
        raise ValueError(
            f"{fn}: parascan's replacement takes no {', '.join(given)} (the Mamba-1 mixers pass "
            f"none); call unpatch() to use transformers' own function"
        )


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
