"""parascan.integrations.transformers on MiniMax's lightning attention: a small randomly
initialized MiniMax model computes the same logits, gradients and greedy generation
(cached: the token-by-token branch of the original) patched as unpatched, the recurrence
through parascan.ssd_scan (counted); the patched layer keeps packed sequences
(cu_seq_lens_q) apart, equal to each sequence alone, where the original runs them as
one, and refuses them with a cache; unpatch() restores the very same forward. The
helpers (and the autouse fixture ``restored``) are test_transformers_delta's."""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

# restored: the autouse fixture that unpatches around every test
from test_transformers_delta import (  # noqa: E402, F401
    REFUSED,
    VOCAB,
    assert_left_padded_generation_equal,
    assert_same_results,
    both,
    close,
    inputs,
    packed_keywords,
    restored,
    scan_lengths,
    train_and_generate,
)

import parascan.integrations.transformers as integration  # noqa: E402

modeling = pytest.importorskip("transformers.models.minimax.modeling_minimax")


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.MiniMaxConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=2,
        num_experts_per_tok=1, block_size=8, pad_token_id=0,
        layer_types=["linear_attention", "full_attention"],
    )  # fmt: skip
    return transformers.MiniMaxForCausalLM(config).float()


def test_logits_gradients_and_generation_equal(monkeypatch: pytest.MonkeyPatch) -> None:
    lengths = scan_lengths(monkeypatch, "ps_ssd_scan", 0)
    model = build()
    ids = inputs(batch=2, length=29)  # not a multiple of the block size, 8
    got, want = both(lambda: train_and_generate(model, ids, prompt=10))
    assert_same_results(got, want)  # type: ignore[arg-type]
    # one linear-attention layer: the training forward and the prompt by the scan; the
    # steps of one new token each are the original forward's, from the scan's state
    assert lengths == [29, 10]


def test_greedy_generation_from_a_left_padded_batch() -> None:
    """Batch 2, the first row left-padded by 5 (the layer's q, k, v zeroed there, as the
    original masks them): the logits of the real tokens, and a greedy generation with a
    cache (the prefill by the scan, each new token by the original's step)."""
    assert_left_padded_generation_equal(build().eval(), length=13, pad=5, new_tokens=6)


def test_packed_sequences_equal_each_alone() -> None:
    model = build().eval()
    layer = model.model.layers[0].self_attn
    assert isinstance(layer, modeling.MiniMaxLightningAttention)
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(1, 23, 64, generator=gen)
    cu = torch.tensor([0, 9, 9, 23], dtype=torch.int32)
    rope = (torch.ones(1, 23, 16), torch.zeros(1, 23, 16))  # the layer ignores them

    def run(x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        with torch.no_grad():
            return layer(x, rope, None, **kwargs)[0]

    original = run(hidden, cu_seq_lens_q=cu)
    integration.patch()
    packed = run(hidden, cu_seq_lens_q=cu)
    alone = torch.cat([run(hidden[:, :9]), run(hidden[:, 9:])], dim=1)
    close(packed, alone, "packed against alone")
    assert not torch.allclose(original[:, 9:], alone[:, 9:], atol=1e-4)  # what unpatched does


def test_unpatch_restores_the_forward() -> None:
    original = modeling.MiniMaxLightningAttention.forward
    names = integration.patch()
    assert f"{modeling.__name__}.MiniMaxLightningAttention.forward" in names
    assert modeling.MiniMaxLightningAttention.forward is integration.lightning_attention_forward
    integration.unpatch()
    assert modeling.MiniMaxLightningAttention.forward is original


class _Cache:
    """The two methods of transformers' cache the layer calls, recording the states set."""

    def __init__(self) -> None:
        self.states: list[torch.Tensor] = []

    def get_linear_cache(self, layer: int) -> torch.Tensor | None:
        return self.states[-1] if self.states else None

    def set_linear_cache(self, layer: int, state: torch.Tensor) -> None:
        self.states.append(state)


def test_the_signature_before_5_24_is_patched_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers 5.15 to 5.23 name the forward's cache ``past_key_values`` (5.24:
    ``cache``): patch() takes that forward too (it once refused it, and with it every
    family), and the replacement reads the cache under either name."""

    def forward(  # the 5.23 signature
        self: Any, hidden_states: Any, position_embeddings: Any, attention_mask: Any,
        past_key_values: Any = None, **kwargs: Any,
    ) -> Any:  # fmt: skip
        raise AssertionError("the original runs")

    monkeypatch.setattr(modeling.MiniMaxLightningAttention, "forward", forward)
    assert f"{modeling.__name__}.MiniMaxLightningAttention.forward" in integration.patch()
    layer = build().eval().model.layers[0].self_attn
    hidden = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(2))
    rope = (torch.ones(1, 5, 16), torch.zeros(1, 5, 16))
    old, new = _Cache(), _Cache()
    with torch.no_grad():
        got = layer(hidden, rope, None, past_key_values=old)[0]
        want = layer(hidden, rope, None, cache=new)[0]
    assert len(old.states) == len(new.states) == 1
    assert torch.equal(got, want) and torch.equal(old.states[0], new.states[0])
    integration.unpatch()
    assert modeling.MiniMaxLightningAttention.forward is forward


def test_a_one_token_step_is_the_original_forwards(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step of one token runs the layer's original forward, handed the cache under
    the name the caller used (the 5.23 signature here: ``cache=`` arrives as its fifth
    argument, ``past_key_values``)."""
    seen: list[Any] = []

    def forward(  # the 5.23 signature
        self: Any, hidden_states: Any, position_embeddings: Any, attention_mask: Any,
        past_key_values: Any = None, **kwargs: Any,
    ) -> Any:  # fmt: skip
        seen.append(past_key_values)
        return "the original"

    monkeypatch.setattr(modeling.MiniMaxLightningAttention, "forward", forward)
    integration.patch()
    try:
        layer = build().eval().model.layers[0].self_attn
        hidden, rope = torch.randn(1, 1, 64), (torch.ones(1, 1, 16), torch.zeros(1, 1, 16))
        old, new = _Cache(), _Cache()
        assert layer(hidden, rope, None, past_key_values=old) == "the original"
        assert layer(hidden, rope, None, cache=new) == "the original"
        assert layer(hidden, rope, None) == "the original"
        assert seen == [old, new, None]
    finally:  # before monkeypatch puts the real forward back: unpatch() restores the fake
        integration.unpatch()
    assert modeling.MiniMaxLightningAttention.forward is forward


def test_packed_sequences_with_a_cache_are_refused_at_once() -> None:
    """Issue 52, as for the delta-rule families: a packed prefill with a cache
    (use_cache=True, or the config's default) raises in the lightning layer, before it
    stores anything, where it stored the last sequence's state in the cache's one row
    for the decoding steps to continue, while the attention layers' cache holds every
    sequence; one sequence with a cache is a batch row and runs as without cu_seq_lens_q."""
    integration.patch()
    model = build().eval()  # a lightning layer first, then a full-attention one
    seqs = [inputs(1, n)[0] for n in (7, 12)]
    refused = REFUSED.format(fn=r"MiniMaxLightningAttention\.forward", what="a cache")
    for cache in ({"use_cache": True}, {}):
        with torch.no_grad(), pytest.raises(ValueError, match=refused):
            model(torch.cat(seqs)[None], **cache, **packed_keywords([7, 12]))
    layer = model.model.layers[0].self_attn
    hidden = torch.randn(1, 9, 64, generator=torch.Generator().manual_seed(6))
    rope = (torch.ones(1, 9, 16), torch.zeros(1, 9, 16))
    stored, one, plain = _Cache(), _Cache(), _Cache()
    with torch.no_grad(), pytest.raises(ValueError, match=refused):
        layer(hidden, rope, None, cache=stored, cu_seq_lens_q=torch.tensor([0, 4, 9]))
    assert not stored.states
    with torch.no_grad():
        got = layer(hidden, rope, None, cache=one, cu_seq_lens_q=torch.tensor([0, 9]))[0]
        want = layer(hidden, rope, None, cache=plain)[0]
    close(got, want, "one packed sequence with a cache")
    close(one.states[0], plain.states[0], "its cached state")
