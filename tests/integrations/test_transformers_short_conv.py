"""parascan.integrations.transformers on the short-convolution models (the family whose
modules define ``causal_conv1d_fn`` and no scan: LFM2, LFM2-MoE, LFM3, Inkling,
Inkling-2, Inkling-2-Loop): small randomly initialized models of all six compute the
same logits and gradients, and the same greedy generations from a left-padded batch
(prefill by ``causal_conv1d_fn`` on inputs masked at the padding, cached decoding by
``causal_conv1d_update``), patched as unpatched (float32, to rounding); patch() names
both functions in all six modules and unpatch() restores the very same ones; the models
call the patched functions.

A padding-free packed batch (batch 1, ``position_ids`` restarting per sequence, from
which transformers builds a block-diagonal mask for the sdpa and eager attention, no
attention mask or cache given) run patched equals its sequences run alone unpatched:

- LFM2, LFM2-MoE and LFM3 pass their keywords on to the convolution: with the
  flash-attention keywords (``cu_seq_lens_q`` ...) the torch fallback silently runs the
  sequences as one (the second sequence's logits differ); with ``seq_idx`` it refuses.
- Inkling-2 and Inkling-2-Loop pass the convolution only ``seq_idx`` (as their dynamic
  convolutions read it), which the torch fallback refuses; a batch packed by
  ``cu_seq_lens_q`` alone does not reach their convolutions, patched or not.
- Inkling is left out of the packed case: its layers call the convolutions without
  keywords, so no packing reaches them, patched or not (the second sequence's logits
  differ either way); nothing the patch can fix.

Every family builds small on CPU (hidden size 32, two or three layers mixing
convolution and attention layers, tiny MoEs; initializer_range 0.1, so that a leak
across a sequence boundary shows in the logits). The helpers (and the autouse fixture
``restored``) are test_transformers_delta's."""

from __future__ import annotations

import importlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

# restored: the autouse fixture that unpatches around every test
from test_transformers_delta import (  # noqa: E402, F401
    VOCAB,
    assert_left_padded_generation_equal,
    both,
    close,
    inputs,
    restored,
)

import parascan.integrations.transformers as integration  # noqa: E402

SHORT_CONV_MODULES = ("lfm2", "lfm2_moe", "lfm3", "inkling", "inkling2", "inkling2_loop")
CONV_FUNCTIONS = ("causal_conv1d_fn", "causal_conv1d_update")
# Shared by every config: no special tokens among the inputs (which are 1..VOCAB-1).
COMMON = dict(vocab_size=VOCAB, hidden_size=32, initializer_range=0.1, pad_token_id=0,
              bos_token_id=None, eos_token_id=None)  # fmt: skip
# The attention sizes of the Inkling families (full and sliding-window layers).
INKLING = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8,
               swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8,
               sliding_window_size=8, d_rel=4, rel_extent=16)  # fmt: skip


def lfm2() -> torch.nn.Module:
    """Convolutions with a bias (the default has none; initialized to zeros, so set
    random here)."""
    config = transformers.Lfm2Config(
        **COMMON, intermediate_size=64, block_auto_adjust_ff_dim=False, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, conv_bias=True,
        layer_types=["conv", "full_attention", "conv"],
    )  # fmt: skip
    model = transformers.Lfm2ForCausalLM(config)
    with torch.no_grad():
        for layer in model.model.layers:
            if not layer.is_attention_layer:
                layer.conv.conv.bias.normal_(std=0.1)
    return model


def lfm2_moe() -> torch.nn.Module:
    config = transformers.Lfm2MoeConfig(
        **COMMON, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, num_dense_layers=1, num_experts=4,
        num_experts_per_tok=2, layer_types=["conv", "full_attention", "conv"],
    )  # fmt: skip
    return transformers.Lfm2MoeForCausalLM(config)


def lfm3() -> torch.nn.Module:
    """A convolution (kernel 7), a sliding-window (8) and a full attention layer."""
    config = transformers.Lfm3Config(
        **COMMON, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=8,
        layer_types=["conv", "sliding_attention", "full_attention"],
    )  # fmt: skip
    return transformers.Lfm3ForCausalLM(config)


def inkling() -> torch.nn.Module:
    """Four convolutions a layer (keys, values, after attention, after the MLP)."""
    config = transformers.InklingTextConfig(
        **COMMON, **INKLING, num_hidden_layers=2, intermediate_size=64,
        layer_types=["hybrid_sliding", "hybrid"], mlp_layer_types=["dense", "dense"],
        logits_mup_width_multiplier=1.0,
    )  # fmt: skip
    return transformers.InklingForCausalLM(config)


def inkling2() -> torch.nn.Module:
    """Static and dynamic (the full layer's keys and values) convolutions, tiny MoEs."""
    config = transformers.Inkling2TextConfig(
        **COMMON, **INKLING, unpadded_vocab_size=VOCAB, num_hidden_layers=2,
        layer_types=["hybrid_sliding", "hybrid"], moe_intermediate_size=16,
        n_routed_experts=4, num_experts_per_tok=2, n_layers_per_attn_res_block=1,
    )  # fmt: skip
    return transformers.Inkling2ForCausalLM(config)


def inkling2_loop() -> torch.nn.Module:
    """The second (full attention) layer looped twice (a convolution cache per pass)."""
    config = transformers.Inkling2LoopTextConfig(
        **COMMON, **INKLING, unpadded_vocab_size=VOCAB, num_hidden_layers=2,
        layer_types=["hybrid_sliding", "hybrid"], moe_intermediate_size=16,
        n_routed_experts=4, num_experts_per_tok=2, n_layers_per_attn_res_block=1,
        loop_layer_index_start=1, loop_layer_index_end=2, loop_num_passes=2, loop_gate_rank=4,
    )  # fmt: skip
    return transformers.Inkling2LoopForCausalLM(config)


MODELS = {
    "lfm2": lfm2, "lfm2_moe": lfm2_moe, "lfm3": lfm3, "inkling": inkling,
    "inkling2": inkling2, "inkling2_loop": inkling2_loop,
}  # fmt: skip


@pytest.fixture(params=list(MODELS))
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def build(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return MODELS[family]().float()


def modeling(family: str):  # type: ignore[no-untyped-def]
    return importlib.import_module(f"transformers.models.{family}.modeling_{family}")


def test_logits_equal(family: str) -> None:
    model = build(family).eval()
    ids = inputs()

    def run():  # type: ignore[no-untyped-def]
        with torch.no_grad():
            return model(ids).logits

    got, want = both(run)
    close(got, want, "logits")  # type: ignore[arg-type]


def test_gradients_of_every_parameter(family: str) -> None:
    model = build(family).train()
    ids = inputs()

    def run():  # type: ignore[no-untyped-def]
        model.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                               if p.grad is not None}  # fmt: skip

    (got_loss, got), (want_loss, want) = both(run)
    close(got_loss, want_loss, "loss")
    assert got.keys() == want.keys()
    assert any("conv" in name for name in got)  # the convolutions' weights are differentiated
    for name in want:
        close(got[name], want[name], name)


# 5 to 17 s each: by default the families whose convolutions differ most (LFM2's with a
# bias, LFM3's of kernel 7, which eight new tokens roll over, Inkling-2's dynamic ones);
# the others (LFM2's with an MoE, Inkling's, Inkling-2's looped) with the slow tests. Every
# family's prefill and cached decoding run the patched functions by default
# (test_the_models_call_the_patched_functions).
GENERATION_BY_DEFAULT = ("lfm2", "lfm3", "inkling2")


@pytest.mark.parametrize(
    "family",
    [
        pytest.param(f, marks=[] if f in GENERATION_BY_DEFAULT else [pytest.mark.slow])
        for f in MODELS
    ],
)
def test_greedy_generation_from_a_left_padded_batch(family: str) -> None:
    """Batch 2, the first row left-padded by 4 (the convolutions' inputs masked there):
    the logits of the real tokens, and a greedy generation with a cache (the prefill by
    causal_conv1d_fn, every further token by causal_conv1d_update)."""
    assert_left_padded_generation_equal(build(family).eval(), length=11, pad=4, new_tokens=8)


LENGTHS = (7, 12)
# The families whose layers hand packed sequences to the convolution, and by which keyword.
PACKED = [
    ("lfm2", "cu_seq_lens_q"), ("lfm2_moe", "cu_seq_lens_q"), ("lfm3", "cu_seq_lens_q"),
    ("lfm2", "seq_idx"), ("inkling2", "seq_idx"), ("inkling2_loop", "seq_idx"),
]  # fmt: skip


def packing(keyword: str) -> dict[str, torch.Tensor | int]:
    """The keywords of a padding-free batch of sequences of LENGTHS: position_ids that
    restart per sequence, and the flash-attention keywords or ``seq_idx``."""
    position_ids = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    if keyword == "seq_idx":
        seq_idx = torch.cat([torch.full((n,), i) for i, n in enumerate(LENGTHS)])
        return {"position_ids": position_ids, "seq_idx": seq_idx[None].int()}
    cu = torch.tensor([0, LENGTHS[0], sum(LENGTHS)], dtype=torch.int32)
    return {"position_ids": position_ids, "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
            "max_length_q": max(LENGTHS), "max_length_k": max(LENGTHS)}  # fmt: skip


@pytest.mark.parametrize(("family", "keyword"), PACKED)
def test_a_packed_batch_equals_its_sequences_alone(family: str, keyword: str) -> None:
    """Patched, the packed batch's logits equal those of its sequences run alone
    unpatched: the convolutions restart at the boundary. Unpatched, the fallback runs
    the packed sequences as one (given cu_seq_lens_q: the second one's logits differ)
    or refuses (given seq_idx)."""
    model = build(family).eval()
    seqs = [inputs(1, n)[0] for n in LENGTHS]
    keywords = packing(keyword)

    def packed() -> torch.Tensor:
        with torch.no_grad():
            return model(torch.cat(seqs)[None], use_cache=False, **keywords).logits[0]

    with torch.no_grad():
        alone = torch.cat([model(s[None], use_cache=False).logits[0] for s in seqs])
    if keyword == "seq_idx":
        with pytest.raises(ValueError, match="packed sequences"):
            packed()
    else:
        unpatched, n = packed(), LENGTHS[0]
        close(unpatched[:n], alone[:n], "unpatched first sequence")
        assert not torch.allclose(unpatched[n:], alone[n:], atol=1e-2)
    integration.patch()
    close(packed(), alone, "packed logits")


def test_patch_names_the_conv_functions_and_unpatch_restores_them() -> None:
    modules = {name: modeling(name) for name in SHORT_CONV_MODULES}
    before = {(m, f): getattr(modules[m], f) for m in modules for f in CONV_FUNCTIONS}
    names = integration.patch()
    for m, f in before:
        assert f"transformers.models.{m}.modeling_{m}.{f}" in names
        assert getattr(modules[m], f) is not before[(m, f)]
    assert integration.patch() == names  # idempotent
    assert integration.unpatch() == names
    for (m, f), original in before.items():
        assert getattr(modules[m], f) is original


def test_the_models_call_the_patched_functions(family: str) -> None:
    """After patch(), each module's functions are parascan's, and a forward (the prefill)
    and a cached decoding step of the model go through them: the layers look them up in
    the module on every call."""
    model = build(family).eval()
    module = modeling(family)
    integration.patch()
    assert module.causal_conv1d_fn is integration.causal_conv1d_packed_q
    assert module.causal_conv1d_update is integration.causal_conv1d_update
    calls = dict.fromkeys(CONV_FUNCTIONS, 0)

    def spy(name: str):  # type: ignore[no-untyped-def]
        patched = getattr(module, name)

        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            calls[name] += 1
            return patched(*args, **kwargs)

        return counted

    for name in CONV_FUNCTIONS:
        setattr(module, name, spy(name))
    try:
        model.generate(inputs(length=5), max_new_tokens=2, do_sample=False, pad_token_id=0)
    finally:  # the patched functions back, for unpatch()
        module.causal_conv1d_fn = integration.causal_conv1d_packed_q
        module.causal_conv1d_update = integration.causal_conv1d_update
    assert calls["causal_conv1d_fn"] > 0 and calls["causal_conv1d_update"] > 0
