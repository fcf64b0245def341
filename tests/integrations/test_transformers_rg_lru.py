"""parascan.integrations.transformers on RecurrentGemma (Griffin's RG-LRU): a small
randomly initialized model computes the same logits, gradients and greedy generation
patched as unpatched (float32), its recurrence through parascan.linear_scan (counted),
also with position ids that restart at 0 inside a row (the model's resets, where the
gates are zeroed); unpatch() restores the very same method. The helpers (and the
autouse fixture ``restored``) are test_transformers_delta's."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

# restored: the autouse fixture that unpatches around every test
from test_transformers_delta import (  # noqa: E402, F401
    VOCAB,
    assert_left_padded_generation_equal,
    assert_same_results,
    both,
    close,
    inputs,
    restored,
    scan_lengths,
    train_and_generate,
)

import parascan.integrations.transformers as integration  # noqa: E402

modeling = pytest.importorskip("transformers.models.recurrent_gemma.modeling_recurrent_gemma")


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.RecurrentGemmaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, lru_width=64, attention_window_size=16,
        conv1d_width=4, logits_soft_cap=30.0, pad_token_id=0,
        block_types=["recurrent", "recurrent", "attention"],
    )  # fmt: skip
    return transformers.RecurrentGemmaForCausalLM(config).float()


def test_logits_gradients_and_generation_equal(monkeypatch: pytest.MonkeyPatch) -> None:
    scans = scan_lengths(monkeypatch, "ps_linear_scan", 0)
    model = build()
    ids = inputs(batch=3, length=37)
    got, want = both(lambda: train_and_generate(model, ids, prompt=9))
    assert_same_results(got, want)  # type: ignore[arg-type]
    # 2 recurrent layers: the training forward and the prompt by the scan; the steps
    # of one new token each are the original's single step
    assert scans == [37, 37, 9, 9]


def test_greedy_generation_from_a_left_padded_batch() -> None:
    """Batch 2, the first row left-padded by 6 (the attention layer masks the padding;
    the recurrence runs over it, patched as unpatched)."""
    assert_left_padded_generation_equal(build().eval(), length=15, pad=6, new_tokens=5)


def test_resets_inside_a_row_equal_unpatched() -> None:
    """Position ids that restart at 0 inside a row (documents packed in one row) reset
    the RG-LRU's state there, which the patched method does as the loop does; the
    resets change the result (so they are exercised). (The documents are not exactly
    independent either way: the block's convolution before the recurrence reads across
    the boundary, patched or not.)"""
    model = build().eval()
    ids = inputs(batch=2, length=31)
    positions = torch.cat([torch.arange(11), torch.arange(20)])[None].expand(2, -1)

    def run() -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            return model(ids, position_ids=positions).logits, model(ids).logits

    (packed, plain), (want_packed, want_plain) = both(run)
    close(packed, want_packed, "logits with resets")
    close(plain, want_plain, "logits without")
    assert not torch.allclose(packed[:, 11:], plain[:, 11:], atol=1e-3)


def test_unpatch_restores_the_method() -> None:
    original = modeling.RecurrentGemmaRglru._rnn_scan
    names = integration.patch()
    assert f"{modeling.__name__}.RecurrentGemmaRglru._rnn_scan" in names
    assert modeling.RecurrentGemmaRglru._rnn_scan is integration.rg_lru_scan
    integration.unpatch()
    assert modeling.RecurrentGemmaRglru._rnn_scan is original
