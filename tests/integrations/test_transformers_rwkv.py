"""parascan.integrations.transformers on RWKV-4: the replacement of its WKV loop
(``rwkv_linear_attention``: two first-order scans, one in log space) against a float64
loop written here, with and without a state, keys large enough that the naive sums would
overflow float32, and its state in transformers' [num, den, max] layout; a small randomly
initialized model computes the same logits, gradients and greedy generation patched as
unpatched. The helpers (and the autouse fixture ``restored``) are test_transformers_delta's."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

# restored: the autouse fixture that unpatches around every test
from test_transformers_delta import (  # noqa: E402, F401
    VOCAB,
    assert_same_results,
    both,
    inputs,
    restored,
    scan_lengths,
    train_and_generate,
)

import parascan.integrations.transformers as integration  # noqa: E402

modeling = pytest.importorskip("transformers.models.rwkv.modeling_rwkv")

F64 = torch.float64


def wkv_loop(
    time_decay: torch.Tensor,
    time_first: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    a0: torch.Tensor,
    b0: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """RWKV-4's attention in float64 by its definition (sums A, B from a0, b0, scaled by
    exp(-shift) so that float64 holds them): out, and the last A and B (scaled)."""
    w, u = -torch.exp(time_decay.double()), time_first.double()
    k, v = key.double(), value.double()
    shift = k.max()  # one common scale: every exp(k - shift) <= 1
    a, b = a0.double() * torch.exp(-shift), b0.double() * torch.exp(-shift)
    out = torch.empty_like(v)
    for t in range(k.shape[1]):
        e = torch.exp(u + k[:, t] - shift)
        out[:, t] = (a + e * v[:, t]) / (b + e)
        a = torch.exp(w) * a + torch.exp(k[:, t] - shift) * v[:, t]
        b = torch.exp(w) * b + torch.exp(k[:, t] - shift)
    return out, a * torch.exp(shift), b * torch.exp(shift)


def _case(seed: int, batch: int, length: int, channels: int, big: float) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    decay = torch.rand(channels, generator=gen) * 6 - 3
    first = torch.randn(channels, generator=gen)
    key = torch.randn(batch, length, channels, generator=gen) * 3
    key[:, length // 2] += big  # exp(big) overflows float32 when big > 88
    value = torch.randn(batch, length, channels, generator=gen)
    return [decay, first, key, value]


@pytest.mark.parametrize("big", [0.0, 120.0], ids=["plain", "overflowing"])
@pytest.mark.parametrize("with_state", [False, True], ids=["fresh", "state"])
def test_wkv_against_a_float64_loop(with_state: bool, big: float) -> None:
    decay, first, key, value = _case(3, 2, 29, 5, big)
    zeros = torch.zeros(2, 5)
    if with_state:  # a state as transformers keeps it: A = num e^max, B = den e^max
        num, den, top = torch.randn(2, 5), torch.rand(2, 5) + 0.1, torch.randn(2, 5) * 4
        state = [num, den, top]
        a0, b0 = num.double() * torch.exp(top.double()), den.double() * torch.exp(top.double())
    else:
        state, a0, b0 = None, zeros.double(), zeros.double()
    out, new = integration.rwkv_linear_attention(
        decay, first, key, value, state=state, return_state=True
    )
    want, a, b = wkv_loop(decay, first, key, value, a0, b0)
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-5)
    assert new is not None
    num, den, top = (t.double() for t in new)
    # A / B and log B, which hold without overflow where A and B themselves would not
    torch.testing.assert_close(num / den, a / b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(torch.log(den) + top, torch.log(b), rtol=1e-5, atol=1e-4)
    if big == 0.0:  # the original keeps a running maximum: same results, another way
        original, _ = modeling.rwkv_linear_attention_cpu(
            decay, first, key, value, state=state, return_state=True
        )
        torch.testing.assert_close(out, original, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("big", [0.0, 120.0], ids=["plain", "overflowing"])
def test_one_token_steps_after_a_scanned_prefill(
    big: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decoding: steps of one token run the original's single step (patch() active),
    reading the scans' [y, 1, log B] state as their own; the scans then read the
    steps' state: the whole equals the float64 loop over the sequence."""
    scans = scan_lengths(monkeypatch, "ps_log_linear_scan", 1)
    decay, first, key, value = _case(5, 2, 13, 4, big)
    integration.patch()
    out, state = integration.rwkv_linear_attention(
        decay, first, key[:, :5], value[:, :5], return_state=True
    )
    outs = [out]
    for t in range(5, 9):  # one token at a time (the 6th overflows with big: the middle)
        step, state = integration.rwkv_linear_attention(
            decay, first, key[:, t : t + 1], value[:, t : t + 1], state=state, return_state=True
        )
        outs.append(step)
    rest, _ = integration.rwkv_linear_attention(
        decay, first, key[:, 9:], value[:, 9:], state=state, return_state=True
    )
    want, _, _ = wkv_loop(decay, first, key, value, torch.zeros(2, 4), torch.zeros(2, 4))
    torch.testing.assert_close(torch.cat([*outs, rest], 1).double(), want, rtol=1e-4, atol=1e-5)
    assert scans == [5, 4]  # the one-token steps never reached the scans


def test_state_only_when_asked() -> None:
    decay, first, key, value = _case(4, 1, 6, 3, 0.0)
    assert integration.rwkv_linear_attention(decay, first, key, value)[1] is None
    assert integration.rwkv_linear_attention(decay, first, key, value, return_state=True)[1]


def build() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.RwkvConfig(
        vocab_size=VOCAB, context_length=64, hidden_size=32, num_hidden_layers=2,
        attention_hidden_size=32, intermediate_size=64,
    )  # fmt: skip
    model = transformers.RwkvForCausalLM(config).float()
    with torch.no_grad():  # the time parameters as trained models have them
        for name, p in model.named_parameters():
            if "time_decay" in name:
                p.uniform_(-2, 2)
            elif "time_first" in name:
                p.uniform_(-1, 1)
    return model


def test_logits_gradients_and_generation_equal(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = scan_lengths(monkeypatch, "ps_log_linear_scan", 1)
    model = build()
    ids = inputs(batch=2, length=30)
    got, want = both(lambda: train_and_generate(model, ids, prompt=10))
    assert_same_results(got, want)  # type: ignore[arg-type]
    # 2 layers: the training forward, the prompt, then the generation's steps (two
    # tokens each for this batch of 2, as transformers 5.24's RWKV feeds them, seen by
    # hand; batch 1 feeds one, which the original's step takes:
    # test_one_token_steps_after_a_scanned_prefill)
    assert calls[:4] == [30, 30, 10, 10] and len(calls) >= 4 + 2 * 7


def test_unpatch_restores_the_function() -> None:
    original = modeling.rwkv_linear_attention_cpu
    assert f"{modeling.__name__}.rwkv_linear_attention_cpu" in integration.patch()
    assert modeling.rwkv_linear_attention_cpu is integration.rwkv_linear_attention
    integration.unpatch()
    assert modeling.rwkv_linear_attention_cpu is original
