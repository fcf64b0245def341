"""parascan.integrations.transformers on the Kimi Delta Attention models: small randomly
initialized Kimi Linear and Bailing-Hybrid models compute the same logits, gradients and
greedy generations patched as unpatched (float32, to rounding), and a GLM-5-Next text
model the same hidden states and gradients; patch() names the new functions in all three
KDA families and unpatch() restores the very same ones; a packed batch (cu_seq_lens_q),
which the torch fallback runs as one sequence, equals its sequences run alone, and with a
cache raises at the prefill. The helpers (and the autouse fixture ``restored``) are
test_transformers_delta's."""

from __future__ import annotations

import importlib

import pytest
import torch

transformers = pytest.importorskip("transformers")

# restored: the autouse fixture that unpatches around every test
from test_transformers_delta import (  # noqa: E402, F401
    REFUSED,
    VOCAB,
    both,
    close,
    inputs,
    packed_keywords,
    restored,
)

import parascan.integrations.transformers as integration  # noqa: E402

KDA_MODULES = ("kimi_linear", "glm5_next", "bailing_hybrid")
KDA_FUNCTIONS = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention")


def kimi_linear(layer_types: tuple[str, ...]) -> torch.nn.Module:
    config = transformers.KimiLinearConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
        num_hidden_layers=len(layer_types), num_attention_heads=2, num_key_value_heads=2,
        kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16,
        v_head_dim=16, linear_num_heads=2, linear_head_dim=16,
        layer_types=list(layer_types), mlp_layer_types=["dense"] * len(layer_types),
        pad_token_id=0, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    return transformers.KimiLinearForCausalLM(config)


def bailing_hybrid(layer_types: tuple[str, ...]) -> torch.nn.Module:
    """Its safe gate (the default): log decays -5 * sigmoid(...), cast to the model's dtype;
    the convolution's weight float32."""
    config = transformers.BailingHybridConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
        num_hidden_layers=len(layer_types), num_attention_heads=2, num_key_value_heads=2,
        head_dim=16, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=16, v_head_dim=16, num_mtp_layers=0,
        layer_types=list(layer_types), mlp_layer_types=["dense"] * len(layer_types),
        pad_token_id=0, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    return transformers.BailingHybridForCausalLM(config)


MODELS = {"kimi_linear": kimi_linear, "bailing_hybrid": bailing_hybrid}


@pytest.fixture(params=sorted(MODELS))
def family(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def build(family: str, *layer_types: str) -> torch.nn.Module:
    """A tiny ``family`` model (dense MLPs, multi-head latent attention for the full
    layers), by default one KDA layer and one full attention layer."""
    torch.manual_seed(0)
    return MODELS[family](layer_types or ("linear_attention", "full_attention")).float()


def test_logits_equal(family: str) -> None:
    """Two chunks of the fallback (L > 64)."""
    model = build(family).eval()
    ids = inputs(length=75)

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
    assert got.keys() == want.keys() and got
    assert any("forget_gate.A_log" in name for name in got)  # the decay is differentiated
    for name in want:
        close(got[name], want[name], name)


def test_greedy_generation(family: str) -> None:
    model = build(family).eval()
    ids = inputs(length=11)

    def run():  # type: ignore[no-untyped-def]
        out = model.generate(
            ids, max_new_tokens=8, do_sample=False, pad_token_id=0,
            return_dict_in_generate=True, output_scores=True,
        )  # fmt: skip
        return out.sequences, torch.stack(out.scores)

    (got, got_scores), (want, want_scores) = both(run)
    assert torch.equal(got, want)
    close(got_scores, want_scores, "scores")


def test_patch_names_the_kda_functions_and_unpatch_restores_them() -> None:
    modules = {}
    for name in KDA_MODULES:
        modules[name] = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    fns = (*KDA_FUNCTIONS, "causal_conv1d_fn", "causal_conv1d_update")
    before = {(m, f): getattr(modules[m], f) for m in modules for f in fns}
    names = integration.patch()
    for m, f in before:
        assert f"transformers.models.{m}.modeling_{m}.{f}" in names
        assert getattr(modules[m], f) is not before[(m, f)]
    assert modules["kimi_linear"].causal_conv1d_fn is integration.causal_conv1d_packed_q
    assert integration.patch() == names  # idempotent
    assert integration.unpatch() == names
    for (m, f), original in before.items():
        assert getattr(modules[m], f) is original


def test_a_packed_batch_equals_its_sequences_alone(family: str) -> None:
    """KDA layers only: the sdpa attention of this CPU build does not read cu_seq_lens_q
    (only flash attention keeps packed sequences apart). Unpatched, the packed sequences
    run as one (the fallback drops cu_seq_lens_q): the second one's logits differ."""
    model = build(family, "linear_attention", "linear_attention").eval()
    lengths = [7, 12]
    seqs = [inputs(1, n)[0] for n in lengths]
    packed = torch.cat(seqs)[None]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32)

    def run():  # type: ignore[no-untyped-def]
        with torch.no_grad():
            alone = [model(s[None], use_cache=False).logits[0] for s in seqs]
            got = model(
                packed, position_ids=position_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                use_cache=False, max_length_q=max(lengths), max_length_k=max(lengths),
            ).logits[0]  # fmt: skip
        return got, torch.cat(alone)

    (got, alone), (unpatched, _) = both(run)
    close(got, alone, "packed logits")
    assert not torch.allclose(unpatched[lengths[0] :], alone[lengths[0] :], atol=1e-3)


def test_a_packed_call_as_the_layers_make_it() -> None:
    """Called as the layers call it, with cu_seq_lens_q among the keywords: the outputs
    equal each sequence's alone, with the log decays of kimi_linear's own gate (its
    softplus form); with a final state (what the layers ask for with a cache) it raises
    at once (issue 52): a cache keeps one state per batch row, not one per sequence."""
    layer = build("kimi_linear", "linear_attention").model.layers[0].self_attn
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 14, 2, 16, generator=gen) for _ in range(3))
    x = torch.randn(1, 14, 64, generator=gen)
    with torch.no_grad():
        g, beta = layer.forget_gate(x), torch.sigmoid(layer.b_proj(x))
    integration.patch()
    mod = importlib.import_module("transformers.models.kimi_linear.modeling_kimi_linear")
    cu = torch.tensor([0, 5, 14], dtype=torch.int32)
    out, final = mod.chunk_kimi_delta_attention(
        q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True, cu_seq_lens_q=cu,
        position_ids=None,
    )  # fmt: skip
    assert final is None
    for i, part in enumerate([slice(0, 5), slice(5, 14)]):
        want, _ = mod.chunk_kimi_delta_attention(
            q[:, part], k[:, part], v[:, part], g=g[:, part], beta=beta[:, part],
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        close(out[:, part], want, f"sequence {i}")
    for fn in KDA_FUNCTIONS:
        refused = REFUSED.format(fn=fn, what="output_final_state=True")
        with pytest.raises(ValueError, match=refused):
            getattr(mod, fn)(
                q, k, v, g=g, beta=beta, initial_state=None, output_final_state=True,
                use_qk_l2norm_in_kernel=True, cu_seq_lens_q=cu,
            )  # fmt: skip


def test_a_packed_prefill_with_a_cache_is_refused_at_once(family: str) -> None:
    """Issue 52, as for the gated delta rule: the prefill of a packed batch with a cache
    (use_cache=True, or the config's default) raises, where it stored one state per
    sequence in the cache's one row for the next decoding step to fail on; with
    use_cache=False it runs, equal to its sequences alone (KDA layers only there)."""
    lengths = [7, 12]
    seqs = [inputs(1, n)[0] for n in lengths]
    packed, keywords = torch.cat(seqs)[None], packed_keywords(lengths)
    integration.patch()
    refused = REFUSED.format(fn="chunk_kimi_delta_attention", what="output_final_state=True")
    hybrid = build(family).eval()  # a KDA layer first, then a full-attention one
    for cache in ({"use_cache": True}, {}):
        with torch.no_grad(), pytest.raises(ValueError, match=refused):
            hybrid(packed, **cache, **keywords)
    model = build(family, "linear_attention", "linear_attention").eval()
    with torch.no_grad():
        alone = torch.cat([model(s[None], use_cache=False).logits[0] for s in seqs])
        got = model(packed, use_cache=False, **keywords).logits[0]
    close(got, alone, "packed logits without a cache")


NAMES = ("out", "final", "step", "step final")


def _prefill_then_step(
    module: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
    beta: torch.Tensor, h0: torch.Tensor,
) -> list[torch.Tensor]:  # fmt: skip
    """``module``'s chunk function from ``h0``, then a decoding step from its final state."""
    mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    out, final = mod.chunk_kimi_delta_attention(
        q, k, v, g=g, beta=beta, initial_state=h0, output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    step, step_final = mod.recurrent_kimi_delta_attention(
        q[:, :1], k[:, :1], v[:, :1], g=g[:, :1], beta=beta[:, :1], initial_state=final,
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    return [out, final, step, step_final]


def _same_dtypes(
    got: object, want: object, names: tuple[str, ...]
) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``got`` and ``want`` (lists of tensors, named ``names``) paired, their dtypes equal."""
    pairs = list(zip(names, got, want, strict=True))  # type: ignore[call-overload]
    for what, a, b in pairs:
        assert a.dtype == b.dtype, what
    return pairs


@pytest.mark.parametrize("family", ["glm5_next", "bailing_hybrid"])
def test_the_other_families_compute_the_fallbacks_results(family: str) -> None:
    """glm5_next's and bailing_hybrid's functions (the same text as kimi_linear's) equal
    their own fallbacks, with their safe gates' log decays (lower bound -5)."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 70, 2, 16, generator=gen) for _ in range(3))
    g = -5.0 * torch.sigmoid(torch.randn(2, 70, 2, 16, generator=gen))
    beta = torch.rand(2, 70, 2, generator=gen)
    h0 = torch.randn(2, 2, 16, 16, generator=gen)
    got, want = both(lambda: _prefill_then_step(family, q, k, v, g, beta, h0))
    for what, a, b in _same_dtypes(got, want, NAMES):
        close(a, b, what)


def test_glm5_next_text_model_and_its_gradients() -> None:
    """GLM-5-Next has no text-only causal LM class: its text model's hidden states and
    gradients, with its safe gate (lower bound -5) and a sparse (DSA) attention layer."""
    layer_types = ["linear_attention", "full_attention"]
    config = transformers.Glm5NextTextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=16, kv_lora_rank=16,
        q_lora_rank=16, qk_rope_head_dim=0, qk_nope_head_dim=16, v_head_dim=16,
        linear_num_heads=2, linear_head_dim=16, index_n_heads=2, index_head_dim=16,
        index_topk=16, layer_types=layer_types, mlp_layer_types=["dense"] * 2,
        pad_token_id=0, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    module = importlib.import_module("transformers.models.glm5_next.modeling_glm5_next")
    model = module.Glm5NextTextModel(config).float().train()
    ids = inputs()

    def run():  # type: ignore[no-untyped-def]
        model.zero_grad()
        hidden = model(ids).last_hidden_state
        hidden.square().mean().backward()
        return hidden.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                 if p.grad is not None}  # fmt: skip

    (got_hidden, got), (want_hidden, want) = both(run)
    close(got_hidden, want_hidden, "hidden states")
    assert got.keys() == want.keys() and any("forget_gate.A_log" in name for name in got)
    for name in want:
        close(got[name], want[name], name)


@pytest.mark.parametrize("g_dtype", [torch.bfloat16, torch.float32])
def test_bfloat16_dtypes_as_the_fallbacks(g_dtype: torch.dtype) -> None:
    """In a bfloat16 model: the output in query's dtype, the final state float32 (from a
    float32 cached state), as the fallbacks; bailing_hybrid's log decays come in
    bfloat16, kimi_linear's in float32. The convolution of a bfloat16 input with
    glm5_next's and bailing_hybrid's float32 weight returns bfloat16, as the original."""
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 20, 2, 16, generator=gen).bfloat16() for _ in range(3))
    g = (-5.0 * torch.sigmoid(torch.randn(1, 20, 2, 16, generator=gen))).to(g_dtype)
    beta = torch.rand(1, 20, 2, generator=gen).bfloat16()
    h0 = torch.randn(1, 2, 16, 16, generator=gen)
    x = torch.randn(1, 96, 20, generator=gen).bfloat16()
    weight = torch.randn(96, 4, generator=gen)
    mod = importlib.import_module("transformers.models.bailing_hybrid.modeling_bailing_hybrid")

    def run() -> list[torch.Tensor]:
        conv = mod.causal_conv1d_fn(x, weight=weight, bias=None, activation="silu")
        return [*_prefill_then_step("bailing_hybrid", q, k, v, g, beta, h0), conv]

    got, want = both(run)
    for _, a, b in _same_dtypes(got, want, (*NAMES, "conv")):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
