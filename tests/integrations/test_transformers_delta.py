"""parascan.integrations.transformers on the gated-delta-rule models: a small randomly
initialized Qwen3.5 text model computes the same logits, gradients and greedy generations
patched as unpatched (float32, to rounding); patch() names the new functions and
unpatch() restores the very same ones; a packed batch (cu_seq_lens_q), which the torch
fallback refuses, equals its sequences run alone, and with a cache raises at the prefill."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

import parascan.integrations.transformers as integration  # noqa: E402

VOCAB = 100
GDN_MODULES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen4_exp", "lara_mini", "olmo_hybrid")


def qwen3_5(
    layer_types: tuple[str, ...] = ("linear_attention", "full_attention"),
) -> torch.nn.Module:
    config = transformers.Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, layer_types=list(layer_types),
    )  # fmt: skip
    return transformers.Qwen3_5ForCausalLM(config)


@pytest.fixture(autouse=True)
def restored() -> Iterator[None]:
    """Every test starts and ends unpatched."""
    integration.unpatch()
    yield
    integration.unpatch()


def build(*layer_types: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return (qwen3_5(layer_types) if layer_types else qwen3_5()).float()


def inputs(batch: int = 2, length: int = 19) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(1, VOCAB, (batch, length), generator=gen)


def both(run: Callable[[], object]) -> tuple[object, object]:
    """``run()`` unpatched, then patched."""
    want = run()
    integration.patch()
    try:
        got = run()
    finally:
        integration.unpatch()
    return got, want


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    scale = max(1.0, want.abs().max().item()) if want.numel() else 1.0
    torch.testing.assert_close(
        got, want, rtol=1e-4, atol=2e-5 * scale, msg=lambda m: f"{what}: {m}"
    )


def scan_lengths(monkeypatch: pytest.MonkeyPatch, name: str, operand: int) -> list[int]:
    """The lengths (dim 1 of positional argument ``operand``) of the calls that
    parascan.integrations.transformers makes to its scan ``name`` (e.g.
    ``"ps_linear_scan"``) from now on in the test: proof that a replacement runs it."""
    lengths: list[int] = []
    # the family modules of the package that call it
    modules = [m for m in _family_modules() if hasattr(m, name)]
    assert modules, f"no module of {integration.__name__} calls {name}"
    inner = getattr(modules[0], name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        lengths.append(args[operand].shape[1])
        return inner(*args, **kwargs)

    for module in modules:
        monkeypatch.setattr(module, name, counted)
    return lengths


def _family_modules() -> list[Any]:
    import importlib
    import pkgutil

    return [
        importlib.import_module(f"{integration.__name__}.{info.name}")
        for info in pkgutil.iter_modules(integration.__path__)
    ]


def train_and_generate(
    model: torch.nn.Module, ids: torch.Tensor, prompt: int
) -> dict[str, torch.Tensor]:
    """A training forward and backward on ``ids`` and a greedy generation of 8 tokens
    from ``ids[:, :prompt]`` (with a cache): the logits, the loss, every parameter's
    gradient by name and the generated tokens."""
    model.zero_grad()
    out = model(ids, labels=ids)  # type: ignore[operator]
    out.loss.backward()
    result = {"logits": out.logits.detach(), "loss": out.loss.detach()}
    for name, p in model.named_parameters():
        if p.grad is not None:
            result[f"gradient of {name}"] = p.grad.clone()
    with torch.no_grad():
        start = ids[:, :prompt]
        result["generated"] = model.generate(  # type: ignore[operator]
            start, attention_mask=torch.ones_like(start), max_new_tokens=8, do_sample=False
        )
    return result


def assert_left_padded_generation_equal(
    model: torch.nn.Module, length: int, pad: int, new_tokens: int
) -> None:
    """Batch 2 of ``length`` tokens, the first row left-padded by ``pad``: the logits of
    the real tokens and a greedy generation of ``new_tokens`` with a cache (its tokens
    exactly, its scores to rounding), patched as unpatched."""
    ids = inputs(length=length)
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    ids = ids.masked_fill(mask == 0, 0)

    def run():  # type: ignore[no-untyped-def]
        with torch.no_grad():
            logits = model(ids, attention_mask=mask).logits  # type: ignore[operator]
        out = model.generate(  # type: ignore[operator]
            ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
            pad_token_id=0, return_dict_in_generate=True, output_scores=True,
        )  # fmt: skip
        return logits, out.sequences, torch.stack(out.scores)

    (got, got_seq, got_scores), (want, want_seq, want_scores) = both(run)  # type: ignore[misc]
    close(got[0, pad:], want[0, pad:], "padded row")
    close(got[1], want[1], "unpadded row")
    assert torch.equal(got_seq, want_seq)
    close(got_scores, want_scores, "scores")


def assert_same_results(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """:func:`train_and_generate`'s results patched against unpatched: the same tokens,
    the rest to rounding."""
    assert got.keys() == want.keys()
    assert sum(name.startswith("gradient") for name in got) > 1
    assert torch.equal(got["generated"], want["generated"])
    for name in want:
        close(got[name], want[name], name)


def test_logits_equal() -> None:
    model = build().eval()
    ids = inputs()

    def run():  # type: ignore[no-untyped-def]
        with torch.no_grad():
            return model(ids).logits

    got, want = both(run)
    close(got, want, "logits")  # type: ignore[arg-type]


def test_gradients_of_every_parameter() -> None:
    model = build().train()
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
    for name in want:
        close(got[name], want[name], name)


def test_greedy_generation() -> None:
    model = build().eval()
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


def test_patch_names_the_delta_rule_functions_and_unpatch_restores_them() -> None:
    modules = {}
    for name in GDN_MODULES:
        modules[name] = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    fns = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
    before = {(m, f): getattr(modules[m], f) for m in modules for f in fns}
    names = integration.patch()
    for m, f in before:
        assert f"transformers.models.{m}.modeling_{m}.{f}" in names
        assert getattr(modules[m], f) is not before[(m, f)]
    qwen = "transformers.models.qwen3_5.modeling_qwen3_5"
    assert f"{qwen}.causal_conv1d_fn" in names and f"{qwen}.causal_conv1d_update" in names
    assert integration.patch() == names  # idempotent
    assert integration.unpatch() == names
    for (m, f), original in before.items():
        assert getattr(modules[m], f) is original


def test_a_packed_batch_equals_its_sequences_alone() -> None:
    """Linear-attention layers only: the sdpa attention of this CPU build does not read
    cu_seq_lens_q (only flash attention keeps packed sequences apart)."""
    model = build("linear_attention", "linear_attention").eval()
    lengths = [7, 12]
    seqs = [inputs(1, n)[0] for n in lengths]
    packed = torch.cat(seqs)[None]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, lengths[0], sum(lengths)], dtype=torch.int32)
    integration.patch()
    with torch.no_grad():
        alone = [model(s[None], use_cache=False).logits[0] for s in seqs]
        got = model(
            packed, position_ids=position_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, use_cache=False,
            max_length_q=max(lengths), max_length_k=max(lengths),
        ).logits[0]  # fmt: skip
    close(got, torch.cat(alone), "packed logits")


def test_packed_sequences_are_refused_unpatched() -> None:
    model = build().eval()
    cu = torch.tensor([0, 7, 19], dtype=torch.int32)
    position_ids = torch.cat([torch.arange(7), torch.arange(12)])[None]
    with pytest.raises(ValueError), torch.no_grad():
        model(inputs(1, 19), position_ids=position_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
              max_length_q=12, max_length_k=12)  # fmt: skip


def packed_keywords(lengths: list[int]) -> dict[str, Any]:
    """The flash-attention keywords of a padding-free batch of sequences of ``lengths``
    (as transformers' DataCollatorWithFlattening passes them), with position_ids that
    restart per sequence."""
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return {
        "position_ids": torch.cat([torch.arange(n) for n in lengths])[None],
        "cu_seq_lens_q": cu, "cu_seq_lens_k": cu,
        "max_length_q": max(lengths), "max_length_k": max(lengths),
    }  # fmt: skip


REFUSED = (
    r"{fn}: parascan's replacement got 2 packed sequences \(the model's cu_seq_lens_q\) in "
    r"a batch of one together with {what}.*one state per batch row.*Pass use_cache=False "
    r"to train on or prefill packed sequences.*a batch row of its own"
)


def test_a_packed_prefill_with_a_cache_is_refused_at_once() -> None:
    """Issue 52: with a cache (use_cache=True, or the config's default), the layers
    stored one state per packed sequence in the cache's one batch row, and the next
    decoding step failed on the state's shape. The prefill itself raises now, naming the
    function, what it got and what to do; with use_cache=False the same call runs, equal
    to its sequences alone (a model of linear-attention layers only: the sdpa attention
    of this CPU build does not read cu_seq_lens_q, and transformers' cache needs an
    attention layer)."""
    lengths = [7, 12]
    seqs = [inputs(1, n)[0] for n in lengths]
    packed, keywords = torch.cat(seqs)[None], packed_keywords(lengths)
    integration.patch()
    refused = REFUSED.format(fn="torch_chunk_gated_delta_rule", what="output_final_state=True")
    hybrid = build().eval()  # a linear-attention layer first, then a full-attention one
    for cache in ({"use_cache": True}, {}):  # the config's use_cache is True
        with torch.no_grad(), pytest.raises(ValueError, match=refused):
            hybrid(packed, **cache, **keywords)
    model = build("linear_attention", "linear_attention").eval()
    with torch.no_grad():
        alone = torch.cat([model(s[None], use_cache=False).logits[0] for s in seqs])
        got = model(packed, use_cache=False, **keywords).logits[0]
    close(got, alone, "packed logits without a cache")


def test_packed_sequences_with_a_state_are_refused_but_one_sequence_is_a_row() -> None:
    """Called as the layers call them: a packed prefill with a final state or a decoding
    step from the cache's state (initial_state) raises, in both functions; a single
    sequence given as cu_seqlens is one batch row and keeps its state."""
    integration.patch()
    mod = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 9, 2, 8, generator=gen) for _ in range(3))
    g, beta = -torch.rand(1, 9, 2, generator=gen), torch.rand(1, 9, 2, generator=gen)
    h0 = torch.randn(1, 2, 8, 8, generator=gen)
    two, one = torch.tensor([0, 4, 9]), torch.tensor([0, 9])
    for fn in ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule"):
        f = getattr(mod, fn)
        with pytest.raises(ValueError, match=REFUSED.format(fn=fn, what="output_final_state=True")):
            f(q, k, v, g, beta, output_final_state=True, cu_seqlens=two)
        with pytest.raises(ValueError, match=REFUSED.format(fn=fn, what="an initial_state")):
            f(q, k, v, g, beta, initial_state=h0, cu_seqlens=two)
        out, final = f(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=one)
        want, want_final = f(q, k, v, g, beta, initial_state=h0, output_final_state=True)
        close(out, want, f"{fn}: one packed sequence")
        close(final, want_final, f"{fn}: its final state")
        assert f(q, k, v, g, beta, cu_seqlens=two)[1] is None  # no state: packed as before
