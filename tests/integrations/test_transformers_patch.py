"""parascan.integrations.transformers: small randomly initialized Mamba-family models
(Mamba-1 and Mamba-2 mixers, and the hybrids that carry them) of the installed
transformers compute the same logits, caches, parameter gradients and greedy generations
patched as unpatched (float32, to rounding); patch() is idempotent and names what it
replaced, unpatch() restores the very same functions, and an unsupported transformers is
refused before anything is patched."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import parascan.integrations.transformers as integration  # noqa: E402
from parascan._native import kernel_library_error  # noqa: E402
from parascan.integrations.transformers import UnsupportedVersionError  # noqa: E402

VOCAB = 100


def mamba() -> torch.nn.Module:
    config = transformers.MambaConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, state_size=16
    )
    return transformers.MambaForCausalLM(config)


def falcon_mamba() -> torch.nn.Module:
    config = transformers.FalconMambaConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, state_size=16
    )
    return transformers.FalconMambaForCausalLM(config)


def zamba() -> torch.nn.Module:
    """A hybrid whose mixer splits the channels into heads (the state update works on a
    strided view of the cached state)."""
    config = transformers.ZambaConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, n_mamba_heads=2,
        mamba_d_state=16, num_attention_heads=4, num_key_value_heads=4,
        attention_hidden_size=128, intermediate_size=64,
        layers_block_type=["hybrid", "linear_attention", "hybrid"],
    )  # fmt: skip
    return transformers.ZambaForCausalLM(config)


def jamba() -> torch.nn.Module:
    config = transformers.JambaConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, mamba_d_state=16,
        num_attention_heads=4, num_key_value_heads=4, intermediate_size=64,
        attn_layer_period=2, attn_layer_offset=1, num_experts=2, expert_layer_period=2,
    )  # fmt: skip
    return transformers.JambaForCausalLM(config)


# Mamba-2 mixers: 8 heads of 16 in 2 groups, state 16, chunk 16 (so that 19 tokens pad a
# chunk unpatched); weights drawn wide enough (initializer_range 0.3) that the mixers
# move the logits and the gradients well above the tolerance's floor.
MAMBA2 = dict(chunk_size=16, initializer_range=0.3)
HYBRID = dict(
    num_attention_heads=4, num_key_value_heads=2, intermediate_size=64, mamba_n_heads=8,
    mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_chunk_size=16, mamba_expand=2,
    initializer_range=0.3,
)  # fmt: skip


def mamba2() -> torch.nn.Module:
    config = transformers.Mamba2Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, state_size=16, num_heads=8,
        head_dim=16, n_groups=2, expand=2, **MAMBA2,
    )  # fmt: skip
    return transformers.Mamba2ForCausalLM(config)


def bamba() -> torch.nn.Module:
    config = transformers.BambaConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, attn_layer_indices=[1], **HYBRID
    )
    return transformers.BambaForCausalLM(config)


def falcon_h1() -> torch.nn.Module:
    """Its mixer may gate the scan's output with z in the decoding step."""
    config = transformers.FalconH1Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, mamba_d_ssm=128, **HYBRID
    )
    return transformers.FalconH1ForCausalLM(config)


def granitemoehybrid() -> torch.nn.Module:
    config = transformers.GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, shared_intermediate_size=64,
        num_local_experts=2, num_experts_per_tok=1, layer_types=["mamba", "attention"],
        **HYBRID,
    )  # fmt: skip
    return transformers.GraniteMoeHybridForCausalLM(config)


def nemotron_h() -> torch.nn.Module:
    config = transformers.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=64, mamba_num_heads=8, mamba_head_dim=16,
        n_groups=2, ssm_state_size=16, expand=2, hybrid_override_pattern="M*-", **MAMBA2,
    )  # fmt: skip
    return transformers.NemotronHForCausalLM(config)


def zamba2() -> torch.nn.Module:
    config = transformers.Zamba2Config(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=64, mamba_headdim=16, n_mamba_heads=8,
        mamba_ngroups=2, mamba_d_state=16, mamba_expand=2, attention_head_dim=32,
        layers_block_type=["mamba", "hybrid"], **MAMBA2,
    )  # fmt: skip
    return transformers.Zamba2ForCausalLM(config)


MODELS: dict[str, Callable[[], torch.nn.Module]] = {
    "mamba": mamba,
    "falcon_mamba": falcon_mamba,
    "zamba": zamba,
    "jamba": jamba,
    "mamba2": mamba2,
    "bamba": bamba,
    "falcon_h1": falcon_h1,
    "granitemoehybrid": granitemoehybrid,
    "nemotron_h": nemotron_h,
    "zamba2": zamba2,
}
CACHE_PARAMS = ("mamba", "falcon_mamba", "mamba2")  # the others return past_key_values


@pytest.fixture(autouse=True)
def restored() -> Iterator[None]:
    """Every test starts and ends unpatched."""
    integration.unpatch()
    yield
    integration.unpatch()


def installed():  # type: ignore[no-untyped-def]
    """The transformers module as imported now (importing one of its submodules may put a
    new module object in sys.modules in place of the one importorskip returned)."""
    import importlib

    return importlib.import_module("transformers")


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return MODELS[name]()


def inputs(batch: int = 2, length: int = 19) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (batch, length), generator=gen)
    mask = torch.ones(batch, length, dtype=torch.long)
    if batch > 1:
        mask[1, :5] = 0  # left padding in the second row
    return ids, mask


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


def cache_tensors(cache: object) -> list[torch.Tensor]:
    """The conv_states and ssm (recurrent) states of every Mamba layer of a cache."""
    found = []
    for layer in cache.layers:  # type: ignore[attr-defined]
        for key in ("conv_states", "recurrent_states"):
            states = getattr(layer, key, {})  # {state index: tensor}
            found += [t for _, t in sorted(states.items()) if isinstance(t, torch.Tensor)]
    return found


@pytest.mark.parametrize("name", list(MODELS))
def test_logits_and_cache_contents(name) -> None:
    model = build(name).eval()
    ids, mask = inputs()

    def run():  # type: ignore[no-untyped-def]
        with torch.no_grad():
            out = model(ids, attention_mask=mask, use_cache=True)
        cache = out.cache_params if name in CACHE_PARAMS else out.past_key_values
        return out.logits, cache_tensors(cache)

    (got, got_cache), (want, want_cache) = both(run)
    close(got, want, "logits")
    assert len(got_cache) == len(want_cache) > 0
    for i, (g, w) in enumerate(zip(got_cache, want_cache, strict=True)):
        assert g.dtype == w.dtype and g.shape == w.shape, i
        close(g, w, f"cache tensor {i}")


def test_a_bfloat16_model() -> None:
    """In bfloat16 the two round differently (transformers rounds the step and each
    step's output to bfloat16 inside its loop; parascan keeps float32 until the output):
    patched, the logits are as close to the float32 model's as unpatched, and the cache
    keeps the same dtypes."""
    model = build("mamba").eval()
    ids, mask = inputs()
    with torch.no_grad():
        exact = model(ids, attention_mask=mask).logits.double()
    model = model.to(torch.bfloat16)

    def run():  # type: ignore[no-untyped-def]
        with torch.no_grad():
            out = model(ids, attention_mask=mask, use_cache=True)
        return out.logits.double(), cache_tensors(out.cache_params)

    (got, got_cache), (want, want_cache) = both(run)
    scale = exact.abs().max().item()
    patched_error = (got - exact).abs().max().item() / scale
    unpatched_error = (want - exact).abs().max().item() / scale
    assert unpatched_error < 0.02 and patched_error < 1.5 * unpatched_error, (
        patched_error,
        unpatched_error,
    )
    assert [t.dtype for t in got_cache] == [t.dtype for t in want_cache]
    assert torch.float32 in [t.dtype for t in got_cache]  # the ssm state


@pytest.mark.parametrize("name", list(MODELS))
def test_gradients_of_every_parameter(name) -> None:
    model = build(name).train()
    ids, mask = inputs()

    def run():  # type: ignore[no-untyped-def]
        model.zero_grad(set_to_none=True)
        loss = model(ids, attention_mask=mask, labels=ids).loss
        loss.backward()
        return loss.detach(), {
            k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None
        }

    (got_loss, got), (want_loss, want) = both(run)
    close(got_loss, want_loss, "loss")
    assert got.keys() == want.keys() and any("A_log" in k for k in want)
    for k in want:
        close(got[k], want[k], k)


# 4 to 6 s each: by default Mamba's and Mamba-2's own models (their cache_params) and a
# hybrid of each (Zamba, Bamba: past_key_values); the other models' with the slow tests
# (their patched forward and cache run by default: test_logits_and_cache_contents).
GENERATION_BY_DEFAULT = ("mamba", "zamba", "mamba2", "bamba")


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(n, marks=[] if n in GENERATION_BY_DEFAULT else [pytest.mark.slow])
        for n in MODELS
    ],
)
def test_greedy_generation(name) -> None:
    model = build(name).eval()
    ids, mask = inputs(length=11)

    def run():  # type: ignore[no-untyped-def]
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0,
            return_dict_in_generate=True, output_scores=True,
        )  # fmt: skip
        return out.sequences, torch.stack(out.scores)

    (got, got_scores), (want, want_scores) = both(run)
    assert torch.equal(got, want)
    close(got_scores, want_scores, "scores")


def test_the_patched_paths_run_parascan(monkeypatch) -> None:
    """The comparisons above are not vacuous: the patched model calls the replacements,
    for the full-sequence scan and for each decoding step."""
    calls: dict[str, int] = {"scan": 0, "step": 0}
    scan, step = (
        integration.mamba_ssm.selective_scan_fn,
        integration.mamba_ssm.selective_state_update,
    )

    def counted_scan(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["scan"] += 1
        return scan(*args, **kwargs)

    def counted_step(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["step"] += 1
        return step(*args, **kwargs)

    monkeypatch.setattr(integration.mamba_ssm, "selective_scan_fn", counted_scan)
    monkeypatch.setattr(integration.mamba_ssm, "selective_state_update", counted_step)
    model = build("mamba").eval()
    ids, _ = inputs(batch=1, length=5)
    integration.patch()
    model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert calls == {"scan": 2, "step": 2 * 2}  # 2 layers: one prefill, two decoding steps
    model.train()
    model(ids, labels=ids).loss.backward()
    assert calls["scan"] == 4


def test_patch_is_idempotent_and_names_what_it_replaced() -> None:
    from transformers.models.mamba import modeling_mamba

    original = modeling_mamba.mamba_selective_scan
    names = integration.patch()
    prefix = "transformers.models"
    for model in ("mamba", "falcon_mamba"):
        for fn in ("mamba_selective_scan", "mamba_selective_state_update", "mamba_inner_fn"):
            assert f"{prefix}.{model}.modeling_{model}.{fn}" in names
    assert "transformers.models.zamba.modeling_zamba.mamba_selective_scan" in names
    for model in ("mamba2", "bamba", "falcon_h1", "granitemoehybrid", "nemotron_h", "zamba2"):
        for fn in (
            "mamba2_chunk_scan",
            "mamba2_selective_state_update",
            "mamba2_split_conv1d_scan_combined",
        ):
            assert f"{prefix}.{model}.modeling_{model}.{fn}" in names
    assert modeling_mamba.mamba_selective_scan is integration.selective_scan
    assert integration.patch() == names == integration.patched()
    assert modeling_mamba.mamba_selective_scan is integration.selective_scan
    assert integration.unpatch() == names
    assert modeling_mamba.mamba_selective_scan is original
    assert integration.unpatch() == [] and integration.patched() == []


def _count_reads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The files read with Path.read_text from now on in the test."""
    reads: list[Path] = []
    read_text = Path.read_text

    def counted(self: Path, *args: object, **kwargs: object) -> str:
        reads.append(self)
        return read_text(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "read_text", counted)
    return reads


def test_a_second_patch_reads_no_modeling_source(monkeypatch) -> None:
    """Which modeling modules define a family's functions is read from their sources
    once per process: every patch() used to read all of them again (0.3 s a call)."""
    integration.patch()
    integration.unpatch()
    reads = _count_reads(monkeypatch)
    try:
        names = integration.patch()
    finally:
        integration.unpatch()
    assert len(names) > 10 and reads == []


def test_patch_takes_the_models_to_patch() -> None:
    from transformers.models.mamba import modeling_mamba
    from transformers.models.mamba2 import modeling_mamba2

    mamba1_scan, mamba2_scan = (
        modeling_mamba.mamba_selective_scan,
        modeling_mamba2.mamba2_chunk_scan,
    )
    try:
        names = integration.patch("mamba2")
        assert names and all(n.startswith("transformers.models.mamba2.") for n in names)
        assert modeling_mamba2.mamba2_chunk_scan is integration.chunk_scan
        assert modeling_mamba.mamba_selective_scan is mamba1_scan  # not asked for
        both = integration.patch("mamba", "mamba2")
        assert set(names) < set(both) and modeling_mamba.mamba_selective_scan is not mamba1_scan
    finally:
        integration.unpatch()
    assert modeling_mamba2.mamba2_chunk_scan is mamba2_scan
    with pytest.raises(ValueError, match=r"leaves 'not_a_model' alone.*it patches .*mamba2"):
        integration.patch("mamba2", "not_a_model")
    with pytest.raises(TypeError, match="expected model types"):
        integration.patch(["mamba2"])  # type: ignore[arg-type]
    assert integration.patched() == []  # a refused call patches nothing


def test_patch_as_a_context_manager_puts_back_what_it_replaced() -> None:
    from transformers.models.mamba import modeling_mamba
    from transformers.models.mamba2 import modeling_mamba2

    mamba1_scan, mamba2_scan = (
        modeling_mamba.mamba_selective_scan,
        modeling_mamba2.mamba2_chunk_scan,
    )
    try:
        integration.patch("mamba")  # patched before the block: stays patched after it
        with integration.patch("mamba", "mamba2") as names:
            assert any(n.startswith("transformers.models.mamba2.") for n in names)
            assert modeling_mamba2.mamba2_chunk_scan is integration.chunk_scan
            assert modeling_mamba.mamba_selective_scan is integration.selective_scan
        assert modeling_mamba2.mamba2_chunk_scan is mamba2_scan
        assert modeling_mamba.mamba_selective_scan is integration.selective_scan
        assert all(n.startswith("transformers.models.mamba.") for n in integration.patched())
    finally:
        integration.unpatch()
    assert modeling_mamba.mamba_selective_scan is mamba1_scan


def test_patching_one_model_reads_its_source_alone(monkeypatch) -> None:
    from parascan.integrations import _patching

    _patching.modules_defining.cache_clear()  # a first call in a process
    reads = _count_reads(monkeypatch)
    try:
        assert integration.patch("mamba2")
    finally:
        integration.unpatch()
    assert reads and {(p.parent.name, p.name) for p in reads} == {("mamba2", "modeling_mamba2.py")}


def test_patching_one_model_imports_no_other_modeling_module() -> None:
    """patch() imported every recurrent family's modeling module (and through
    qwen3_5's, flash-linear-attention where installed); patch("mamba2") imports
    mamba2's alone."""
    import subprocess
    import sys

    code = (
        "import sys, parascan.integrations.transformers as t\n"
        "t.patch('mamba2')\n"
        "print(sorted(m for m in sys.modules if m.startswith('transformers.models.')\n"
        "             and '.modeling_' in m and '.auto.' not in m))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    ).stdout
    assert out.strip().splitlines()[-1] == "['transformers.models.mamba2.modeling_mamba2']"


def _resolve(name: str) -> object:
    """A patched name's current object: ``transformers.models.<x>.modeling_<x>.`` then a
    function, or a ``Class.method``."""
    import importlib

    parts = name.split(".")
    value: object = importlib.import_module(".".join(parts[:4]))
    for attribute in parts[4:]:
        value = getattr(value, attribute)
    return value


def test_unpatch_restores_the_original_functions() -> None:
    names = integration.patch()
    modules = {".".join(n.split(".")[:4]) for n in names}
    integration.unpatch()
    before = {n: _resolve(n) for n in names}
    integration.patch()
    for n in names:
        assert _resolve(n) is not before[n]
    integration.unpatch()
    for n in names:
        assert _resolve(n) is before[n]
    assert len(modules) >= 2
    assert any(n.endswith("RecurrentGemmaRglru._rnn_scan") for n in names)  # a method too


def test_an_older_transformers_is_refused(monkeypatch) -> None:
    from transformers.models.mamba import modeling_mamba

    original = modeling_mamba.mamba_selective_scan
    monkeypatch.setattr(installed(), "__version__", "5.14.1")
    with pytest.raises(UnsupportedVersionError, match=r"transformers 5\.14\.1 is installed.*5\.15"):
        integration.patch()
    assert modeling_mamba.mamba_selective_scan is original and integration.patched() == []


@pytest.mark.parametrize("change", ["missing", "signature", "not-called"])
def test_a_changed_module_is_refused(monkeypatch, change) -> None:
    from transformers.models.falcon_mamba import modeling_falcon_mamba as module
    from transformers.models.mamba import modeling_mamba

    original = modeling_mamba.mamba_selective_scan
    if change == "missing":
        monkeypatch.delattr(module, "mamba_selective_state_update")
        match = "has no function mamba_selective_state_update"
    elif change == "signature":
        monkeypatch.setattr(module, "mamba_selective_scan", lambda x, dt: x)
        match = r"mamba_selective_scan takes \(x, dt\)"
    else:
        monkeypatch.setattr(module.FalconMambaMixer, "forward", lambda self, x: x)
        match = "no mixer's forward in .*falcon_mamba calls mamba_selective_scan"
    version = installed().__version__
    with pytest.raises(UnsupportedVersionError, match=rf"transformers {version} .*{match}"):
        integration.patch()
    # Nothing patched, not even the modules checked before the bad one.
    assert modeling_mamba.mamba_selective_scan is original and integration.patched() == []


def test_extra_arguments_are_refused() -> None:
    ids = torch.zeros(1, 4, 3)
    A = -torch.ones(4, 2)
    B = torch.ones(1, 2, 3)
    with pytest.raises(ValueError, match="mamba_selective_scan: parascan's replacement takes no"):
        integration.selective_scan(ids, ids, A, B, B, seq_idx=torch.zeros(1, 3))


def test_the_patched_mamba2_paths_run_parascan(monkeypatch) -> None:
    """A Mamba-2 model calls parascan.ssd_scan (backend "auto") for every full-sequence
    scan in evaluation, the multi-head decoding step for each generated token, and in
    training (float32 on the CPU) the fused layer of parascan.ssd.layer, whose scan
    is ssd_scan's C kernel."""
    import parascan
    from parascan.ssd import layer as ssd_layer

    calls: dict[str, int] = {"scan": 0, "step": 0}
    scan, step = parascan.ssd_scan, integration.mamba_ssm.selective_state_update
    layer = ssd_layer.split_conv_scan

    def counted_layer(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["layer"] = calls.get("layer", 0) + 1
        return layer(*args, **kwargs)

    def counted_scan(*args, **kwargs):  # type: ignore[no-untyped-def]
        assert kwargs.get("backend", "auto") == "auto"
        calls["scan"] += 1
        return scan(*args, **kwargs)

    def counted_step(state, *args, **kwargs):  # type: ignore[no-untyped-def]
        assert state.dim() == 4  # (batch, heads, headdim, N)
        calls["step"] += 1
        return step(state, *args, **kwargs)

    monkeypatch.setattr(parascan, "ssd_scan", counted_scan)
    monkeypatch.setattr(integration.mamba_ssm, "selective_state_update", counted_step)
    monkeypatch.setattr(ssd_layer, "split_conv_scan", counted_layer)
    model = build("mamba2").eval()
    ids, _ = inputs(batch=1, length=5)
    integration.patch()
    model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert calls == {"scan": 2, "step": 2 * 2}  # 2 layers: one prefill, two decoding steps
    model.train()
    model(ids, labels=ids).loss.backward()
    if kernel_library_error() is None:
        assert calls == {"scan": 2, "step": 4, "layer": 2}
    else:  # built without the C kernels: the fused layer's path is the scan's
        assert calls == {"scan": 4, "step": 4}


@pytest.mark.parametrize("name", ["mamba2", "falcon_h1", "zamba2"])
def test_mamba2_training_runs_the_fused_layer(monkeypatch, name) -> None:
    """Training (no cache) goes through parascan's fused layer (convolution, scan, norm,
    projection) instead of transformers' unfused path; gradients equal to unpatched are
    checked above."""
    calls = [0]
    fused = integration.mamba_ssm.mamba_split_conv1d_scan_combined

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls[0] += 1
        return fused(*args, **kwargs)

    monkeypatch.setattr(integration.mamba_ssm, "mamba_split_conv1d_scan_combined", counted)
    model = build(name).train()
    ids, mask = inputs()
    integration.patch()
    model(ids, attention_mask=torch.ones_like(mask), labels=ids, use_cache=False).loss.backward()
    assert calls[0] == 2  # 2 Mamba-2 layers
    model(ids, labels=ids, use_cache=False).loss.backward()
    assert calls[0] == 4
    # a padded batch declines the fused layer: the unfused path masks again after the
    # convolution (test_mamba2_training_with_left_padding)
    model(ids, attention_mask=mask, labels=ids, use_cache=False).loss.backward()
    assert calls[0] == 4


@pytest.mark.parametrize(("name", "batch"), [("mamba2", 2), ("bamba", 2), ("mamba2", 1)])
def test_mamba2_training_with_left_padding(name, batch) -> None:
    """Training on a left-padded batch with a convolution bias (zero at initialization,
    not after training): logits, loss and every gradient equal unpatched. Before, the
    fused layer (as mamba_ssm's kernel) let the bias at the padded steps into the state:
    the padded row's logits differed by 5e-3 and some gradients by 1%."""
    model = build(name).train()
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.Conv1d) and module.bias is not None:
                module.bias.copy_(torch.randn(module.bias.shape, generator=gen))
    ids, mask = inputs()
    ids, mask = ids[-batch:], mask[-batch:]  # the last row is left-padded

    def run():  # type: ignore[no-untyped-def]
        model.zero_grad(set_to_none=True)
        out = model(ids, attention_mask=mask, labels=ids, use_cache=False)
        out.loss.backward()
        grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        return out.logits.detach(), out.loss.detach(), grads

    (got_logits, got_loss, got), (want_logits, want_loss, want) = both(run)
    close(got_logits, want_logits, "logits")
    close(got_loss, want_loss, "loss")
    assert got.keys() == want.keys()
    for k in want:
        close(got[k], want[k], k)


def test_mamba2_packed_sequences_stay_apart() -> None:
    """seq_idx or cu_seqlens handed down to the patched chunk scan restart the state at
    each boundary (transformers refuses them unpatched without mamba_ssm); the model's
    other keywords are dropped."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 12, 4, 3, generator=gen)
    dt = torch.randn(1, 12, 4, generator=gen)
    A = -torch.rand(4, generator=gen)
    B, C = torch.randn(2, 1, 12, 2, 5, generator=gen)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    out, final = integration.chunk_scan(
        x, dt, A, B, C, 16, return_final_states=True, cu_seqlens=cu, position_ids=None
    )
    seq = torch.tensor([[0] * 5 + [1] * 7])
    same = integration.chunk_scan(x, dt, A, B, C, 16, return_final_states=True, seq_idx=seq)
    assert torch.equal(out, same[0]) and torch.equal(final, same[1])
    first = integration.chunk_scan(x[:, :5], dt[:, :5], A, B[:, :5], C[:, :5], 16)
    second, last = integration.chunk_scan(
        x[:, 5:], dt[:, 5:], A, B[:, 5:], C[:, 5:], 16, return_final_states=True
    )
    torch.testing.assert_close(out, torch.cat([first, second], 1))
    torch.testing.assert_close(final, last)
    assert final.dtype == torch.float32


MAMBA2_MODELS = ["mamba2", "bamba", "falcon_h1", "granitemoehybrid", "nemotron_h", "zamba2"]
MAMBA1_MODELS = ["mamba", "falcon_mamba", "zamba", "jamba"]


def first_mixer(model: torch.nn.Module) -> torch.nn.Module:
    return next(m for m in model.modules() if hasattr(m, "conv1d") and hasattr(m, "in_proj"))


@pytest.mark.parametrize("name", MAMBA2_MODELS)
@pytest.mark.parametrize("path", ["eval", "eval-cache", "train", "train-cache", "train-padded"])
@pytest.mark.parametrize("packing", ["seq_idx", "cu_seqlens"])
def test_a_patched_mamba2_mixer_keeps_packed_sequences_apart(name, path, packing) -> None:
    """Every Mamba-2 family's patched mixer, on each of its paths (the fused training
    layer; the unfused one in evaluation, with a cache, after a padding mask), given
    two packed sequences equals the two run alone: the convolution stops at the
    boundary where the scan restarts (it used to read across it on the unfused path)."""
    model = build(name)
    mixer = first_mixer(model)
    with torch.no_grad():  # a bias, so that a convolution crossing the boundary shows
        mixer.conv1d.bias.normal_(generator=torch.Generator().manual_seed(4))
    hs = torch.randn(1, 12, model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    packed = (
        {"seq_idx": torch.tensor([[0] * 5 + [1] * 7])}
        if packing == "seq_idx"
        else {"cu_seqlens": torch.tensor([0, 5, 12], dtype=torch.int32)}
    )
    mixer.train(path.startswith("train"))
    integration.patch()

    def run(x: torch.Tensor, starts: list[int], **kwargs: object) -> torch.Tensor:
        if path.endswith("cache"):
            kwargs["cache"] = transformers.DynamicCache(config=model.config)
        if path.endswith("padded"):  # each sequence's first step padded: the unfused path
            mask = torch.ones(1, x.shape[1], dtype=torch.long)
            mask[0, starts] = 0
            kwargs["attention_mask"] = mask
        out: torch.Tensor = mixer(x, **kwargs)
        return out

    with torch.set_grad_enabled(path.startswith("train")):
        want = torch.cat([run(hs[:, :5], [0]), run(hs[:, 5:], [0])], 1)
        got = run(hs, [0, 5], **packed)
    close(got, want, f"{name} {path} {packing}")


@pytest.mark.parametrize("name", MAMBA2_MODELS)
def test_a_packed_chunk_continues_a_cached_sequence(name) -> None:
    """With a cache, the convolution's input starts with the cached steps: they
    continue the first packed sequence (whose scan starts from the cached state), and
    the second sequence reads none of them."""
    model = build(name).eval()
    mixer = first_mixer(model)
    with torch.no_grad():
        mixer.conv1d.bias.normal_(generator=torch.Generator().manual_seed(4))
    hs = torch.randn(1, 15, model.config.hidden_size, generator=torch.Generator().manual_seed(6))
    integration.patch()
    with torch.no_grad():
        cache = transformers.DynamicCache(config=model.config)
        mixer(hs[:, :3], cache=cache)  # the first sequence's first 3 steps, cached
        got = mixer(hs[:, 3:], cache=cache, seq_idx=torch.tensor([[0] * 5 + [1] * 7]))
        first = mixer(hs[:, :8])[:, 3:]
        second = mixer(hs[:, 8:])
    close(got, torch.cat([first, second], 1), name)


@pytest.mark.parametrize(
    ("name", "packing"),
    # zamba's mixer hands its convolution seq_idx alone (cu_seqlens reaches neither the
    # convolution nor the scan, patched or not)
    [
        (n, p)
        for n in MAMBA1_MODELS
        for p in ("seq_idx", "cu_seqlens")
        if (n, p) != ("zamba", "cu_seqlens")
    ],
)
def test_a_patched_mamba1_mixer_refuses_packed_sequences(name, packing) -> None:
    """The Mamba-1 mixers pass no sequence ids to their scan, which would carry the state
    across the boundary: patched, their convolution refuses packed sequences, as
    unpatched transformers does without causal_conv1d."""
    model = build(name).eval()
    mixer = first_mixer(model)
    hs = torch.randn(1, 12, model.config.hidden_size)
    packed = (
        {"seq_idx": torch.tensor([[0] * 5 + [1] * 7])}
        if packing == "seq_idx"
        else {"cu_seqlens": torch.tensor([0, 5, 12])}
    )
    integration.patch()
    with torch.no_grad(), pytest.raises(ValueError, match=f"causal_conv1d_fn: .*{packing}"):
        mixer(hs, **packed)


def test_a_changed_mamba2_module_is_refused(monkeypatch) -> None:
    from transformers.models.mamba import modeling_mamba
    from transformers.models.mamba2 import modeling_mamba2

    original = modeling_mamba.mamba_selective_scan
    monkeypatch.setattr(modeling_mamba2, "mamba2_chunk_scan", lambda x, dt: x)
    version = installed().__version__
    match = r"mamba2_chunk_scan takes \(x, dt\)"
    with pytest.raises(UnsupportedVersionError, match=rf"transformers {version} .*{match}"):
        integration.patch()
    assert modeling_mamba.mamba_selective_scan is original and integration.patched() == []


def conv_loop(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
              history: torch.Tensor | None, silu: bool) -> torch.Tensor:  # fmt: skip
    """The depthwise causal convolution in float64, one output at a time: step t of x
    (batch, channels, L) sees ``history`` (batch, channels, S) before step 0, zeros
    before that."""
    x, weight = x.double(), weight.double()
    batch, channels, length = x.shape
    width = weight.shape[1]
    past = history.double() if history is not None else x.new_zeros(batch, channels, 0)
    seq = torch.cat([x.new_zeros(batch, channels, width), past, x], dim=-1)
    start = seq.shape[-1] - length
    out = x.new_zeros(batch, channels, length)
    for t in range(length):
        for k in range(width):
            out[:, :, t] += weight[:, k] * seq[:, :, start + t - (width - 1) + k]
    if bias is not None:
        out += bias.double()[:, None]
    return torch.nn.functional.silu(out) if silu else out


@pytest.mark.parametrize("length", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("activation", [None, "silu"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_convolution_matches_a_float64_loop(length, activation, with_bias) -> None:
    """causal_conv1d (the replacement of causal_conv1d_fn) on a strided slice of a
    transposed projection, as the mixers pass it, with widths 2 and 4: outputs in
    float32, gradients of the input, weight and bias in float64 (gradcheck)."""
    gen = torch.Generator().manual_seed(length)
    channels = 5
    for width in (2, 4):
        projected = torch.randn(2, length, 2 * channels + 1, generator=gen).transpose(1, 2)
        x = projected[:, 1 : channels + 1]  # (batch, channels, L), channel stride 1
        weight = torch.randn(channels, width, generator=gen)
        bias = torch.randn(channels, generator=gen) if with_bias else None
        got = integration.causal_conv1d(x, weight, bias, activation=activation)
        want = conv_loop(x, weight, bias, None, activation is not None)
        assert got.shape == x.shape and got.dtype == x.dtype
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)

        def f(x, w, *b):  # type: ignore[no-untyped-def]
            return integration.causal_conv1d(x, w, b[0] if b else None, activation=activation)

        operands = [projected.double()[:, 1 : channels + 1], weight.double()]
        operands += [bias.double()] if bias is not None else []
        for t in operands:
            t.requires_grad_(True)
        assert torch.autograd.gradcheck(f, tuple(operands))


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_the_convolution_step_matches_a_float64_loop(steps, activation) -> None:
    """causal_conv1d_update (the replacement of causal_conv1d_update): the cached inputs
    advance in place by the new ones, and each new output is the filter over its last
    inputs, as if the whole sequence were convolved at once."""
    gen = torch.Generator().manual_seed(steps)
    channels, width, kept = 6, 4, 4
    history = torch.randn(2, channels, kept, generator=gen)
    x = torch.randn(2, steps, channels, generator=gen).transpose(1, 2)  # strided
    weight = torch.randn(channels, width, generator=gen)
    bias = torch.randn(channels, generator=gen)
    state = history.clone()
    got = integration.causal_conv1d_update(x, state, weight, bias, activation=activation)
    want = conv_loop(x, weight, bias, history, activation is not None)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state, torch.cat([history, x], dim=-1)[:, :, -kept:])


def test_another_activation_uses_transformers_own_convolution() -> None:
    """An activation other than silu is left to transformers' functions (the mixers of
    5.23 pass silu, or None)."""
    module = pytest.importorskip("transformers.models.mamba.modeling_mamba")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 3, 6, generator=gen)
    weight, bias = torch.randn(3, 4, generator=gen), torch.randn(3, generator=gen)
    state = torch.randn(1, 3, 4, generator=gen)
    want = module.causal_conv1d_fn(x, weight, bias, activation="gelu")
    want_step = module.causal_conv1d_update(x[..., :1], state.clone(), weight, bias, "gelu")
    integration.patch()
    assert module.causal_conv1d_fn is integration.causal_conv1d_one_sequence  # Mamba-1's
    torch.testing.assert_close(module.causal_conv1d_fn(x, weight, bias, "gelu"), want)
    torch.testing.assert_close(integration.causal_conv1d(x, weight, bias, "gelu"), want)
    torch.testing.assert_close(
        integration.causal_conv1d_update(x[..., :1], state.clone(), weight, bias, "gelu"),
        want_step,
    )


def compiled_matches_eager(module: torch.nn.Module, x: torch.Tensor, train: bool) -> None:
    """``torch.compile(module, fullgraph=True)`` (no graph break) gives the eager patched
    output and, in training, the same parameter gradients."""
    torch._dynamo.reset()
    module.train(train)
    compiled = torch.compile(module, fullgraph=True)
    results = []
    for run in (compiled, module):
        module.zero_grad()
        with torch.set_grad_enabled(train):
            out = run(x)
            out = getattr(out, "logits", out)
            if train:
                out.square().mean().backward()
        grads = [p.grad.clone() for p in module.parameters() if p.grad is not None]
        results.append((out.detach(), grads))
    (got, got_grads), (want, want_grads) = results
    close(got, want, "compiled output")
    assert (
        len(got_grads)
        == len(want_grads)
        == (sum(p.requires_grad for p in module.parameters()) if train else 0)
    )
    for g, w in zip(got_grads, want_grads, strict=True):
        close(g, w, "compiled gradient")


# 3 to 8 s a compilation: training (forward and backward) by default, eval mode's
# forward with the slow tests
@pytest.mark.parametrize("name", ["mamba", "mamba2"])
@pytest.mark.parametrize(
    "train", [pytest.param(False, marks=pytest.mark.slow), True], ids=["eval", "train"]
)
def test_a_patched_mixer_compiles_with_fullgraph(name, train) -> None:
    """The patched paths trace without a graph break: one mixer of each family (the
    fused Mamba-2 layer's eligibility test called Tensor.is_neg, which dynamo cannot
    trace, and the selective scan's backward returned gradients in another layout than
    its fake kernel said, which the compiled graph asserts). Every family's whole
    model: the slow test below."""
    model = build(name)
    mixer = first_mixer(model)
    x = torch.randn(2, 7, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    integration.patch()
    compiled_matches_eager(mixer, x, train)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_every_patched_model_compiles_with_fullgraph(name, train) -> None:
    model = build(name)
    ids, _ = inputs(2, 19)
    integration.patch()
    compiled_matches_eager(model, ids, train)
