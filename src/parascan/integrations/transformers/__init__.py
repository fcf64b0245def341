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
import re
from types import ModuleType

from parascan.compat import mamba_ssm as mamba_ssm  # the drop-ins the replacements call
from parascan.integrations._patching import (
    Family,
    Function,
    Patched,
    calls,
    leading_params,
    modules_defining,
    owner_of,
)
from parascan.integrations.transformers._common import (
    _CONV_FN,
    _PATCHES,
    causal_conv1d,
    causal_conv1d_one_sequence,
    causal_conv1d_packed_q,
    causal_conv1d_update,
)
from parascan.integrations.transformers._common import (
    _ORIGINALS as _ORIGINALS,
)
from parascan.integrations.transformers.delta import (
    chunk_gated_delta_rule,
    chunk_kimi_delta_attention,
    recurrent_gated_delta_rule,
    recurrent_kimi_delta_attention,
)
from parascan.integrations.transformers.lightning import lightning_attention_forward
from parascan.integrations.transformers.mamba import (
    no_fused_inner,
    selective_scan,
    selective_state_update,
)
from parascan.integrations.transformers.mamba2 import (
    chunk_scan,
    mask_padding,
    multihead_state_update,
    split_conv_scan,
)
from parascan.integrations.transformers.rg_lru import rg_lru_scan
from parascan.integrations.transformers.rwkv import rwkv_linear_attention

__all__ = ["MIN_VERSION", "UnsupportedVersionError", "patch", "patched", "unpatch"]

MIN_VERSION = "5.15.0"
TESTED_VERSIONS = "5.15.0, 5.20.0, 5.23.0 and 5.24.0"
_FN = "parascan.integrations.transformers.patch"


class UnsupportedVersionError(RuntimeError):
    """The installed transformers does not have the functions ``patch()`` replaces."""


# --- what is patched where (the replacements: one module per family, _common.py for what
# several share) ------------------------------------------------------------------------------


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
