"""Coverage of parascan.integrations.transformers.patch() over the installed transformers:
every modeling module's slow fallback is replaced, or is one of the gaps listed here with
its reason, so that a new transformers release's new family (or a new fallback in an old
one) fails this test, naming the module and the function, instead of running a slow path
silently.

The fallbacks are found in the modules' source text, without importing a module that
patch() does not import:

- the functions transformers routes to a kernel package when one is installed
  (``@use_kernel_func_from_hub_with_fallback("name", "package")``: mamba_ssm,
  causal_conv1d, flash-linear-attention) and otherwise runs in torch: after patch(),
  each must be a replacement from parascan.integrations.transformers;
- the recurrences transformers computes in torch with no kernel behind them (a loop over
  tokens or blocks, inside a function, a method or a layer's forward): patch() must
  replace something in each module with one, or the module is a listed gap.
"""

from __future__ import annotations

import importlib
import re
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

import parascan.integrations.transformers as integration  # noqa: E402

ROOT = Path(transformers.__file__).parent / "models"

HUB = re.compile(
    r'@use_kernel_func_from_hub_with_fallback\(\s*"(\w+)",\s*"([\w-]+)"\s*\)\s*\n'
    r"(?:@.*\n)*def (\w+)\("
)

# Recurrences computed in torch with no kernel package behind them, as they appear in a
# module's source: the definition that holds the loop.
SLOW = {
    "def _rnn_scan(": "Griffin's RG-LRU, a Python loop over the tokens",
    "def rwkv_linear_attention_cpu(": "RWKV-4's WKV, a Python loop over the tokens",
    "LightningAttention(nn.Module)": "lightning attention, a loop over blocks in forward",
    "def mlstm_chunkwise_native_autograd(": "the mLSTM's chunkwise torch cell",
}

# The families patch() does not cover yet (issue 38), each with why it is still open. An
# entry whose module no longer has a slow path (or that patch() now covers) fails the
# test too, so that this list stays true.
KNOWN_GAPS = {
    "xlstm": "the mLSTM cell's stabilized exponential gating, an op parascan lacks",
}


def _sources() -> dict[str, str]:
    return {
        f"{path.parent.name}.{path.stem}": path.read_text(encoding="utf-8", errors="replace")
        for path in sorted(ROOT.glob("*/modeling_*.py"))
    }


SOURCES = _sources()


def _hub_fallbacks() -> list[tuple[str, str, str]]:
    """(module, function, kernel package) for every hub-routed function."""
    return [
        (module, function, package)
        for module, text in SOURCES.items()
        for _, package, function in HUB.findall(text)
    ]


def test_the_source_scan_finds_what_it_should() -> None:
    """The patterns still match transformers' code: the known patched families' hub
    functions and every listed gap's slow path are found (a renamed decorator or
    function would otherwise make the tests below pass vacuously)."""
    found = {(m.split(".")[0], f) for m, f, _ in _hub_fallbacks()}
    for module, function in [
        ("mamba", "mamba_selective_scan"),
        ("mamba2", "mamba2_chunk_scan"),
        ("qwen3_5", "torch_chunk_gated_delta_rule"),
        ("kimi_linear", "chunk_kimi_delta_attention"),
        ("lfm2", "causal_conv1d_fn"),
    ]:
        assert (module, function) in found
    for family in (*KNOWN_GAPS, "recurrent_gemma", "rwkv", "minimax"):
        text = SOURCES.get(f"{family}.modeling_{family}", "")
        assert any(marker in text for marker in SLOW), f"{family}: no slow path found"


def test_every_kernel_hub_fallback_is_patched() -> None:
    integration.patch()
    try:
        missing = []
        for name, function, package in _hub_fallbacks():
            module = sys.modules.get(f"transformers.models.{name}")
            if module is None:  # patch() did not import it: nothing of it was patched
                try:
                    module = importlib.import_module(f"transformers.models.{name}")
                except ImportError:  # its own dependencies are missing: it cannot run
                    continue
            current = getattr(module, function, None)
            if not str(getattr(current, "__module__", "")).startswith(integration.__name__):
                missing.append(f"transformers.models.{name}.{function} ({package})")
        left = ", ".join(missing)
        assert not missing, f"patch() leaves these transformers fallbacks in place: {left}"
    finally:
        integration.unpatch()


def test_every_slow_recurrence_is_patched_or_a_listed_gap() -> None:
    slow = {
        module.split(".")[0]: reason
        for module, text in SOURCES.items()
        for marker, reason in SLOW.items()
        if marker in text
    }
    covered = {name.split(".")[2] for name in integration.patch()}
    integration.unpatch()
    unlisted = {
        family: reason
        for family, reason in slow.items()
        if family not in KNOWN_GAPS and family not in covered
    }
    assert not unlisted, (
        "transformers modules computing a recurrence in torch that patch() does not cover "
        f"and this test does not list: {unlisted}"
    )
    stale = sorted(family for family in KNOWN_GAPS if family not in slow or family in covered)
    assert not stale, f"listed as gaps but without a slow path, or patched, now: {stale}"
