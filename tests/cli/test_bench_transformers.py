"""parascan.cli.bench_transformers: the end-to-end table runs on a small model, checks
that patched and unpatched agree, and leaves transformers unpatched."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("transformers")

from parascan.cli import bench_transformers
from parascan.integrations import transformers as integration


def test_quick_run_gives_a_checked_row_per_workload() -> None:
    lines: list[str] = []
    rows = bench_transformers.run(
        quick=True, tokens=16, new_tokens=3, repeat=1, progress=lines.append
    )
    assert [r.name for r in rows] == ["forward, 16 tokens", "train step, 16 tokens",
                                      "generate 3 tokens"]  # fmt: skip
    for r in rows:
        assert r.correct, r
        assert r.speedup == pytest.approx(r.unpatched_s / r.patched_s)
        assert r.unpatched_s > 0 and r.patched_s > 0
    assert len(lines) == 8  # each variant of each workload, and two linear timings
    # the linear layers alone, for the forward and the training step only
    assert [r.linear_s is not None and r.linear_s > 0 for r in rows] == [True, True, False]
    table = bench_transformers.format_rows(rows)
    assert "transformers" in table and "train step, 16 tokens" in table
    forward = next(line for line in table.splitlines() if line.startswith("forward, 16"))
    assert f"{rows[0].patched_s / rows[0].linear_s:.2f}" in forward
    assert integration.patched() == []


def test_quick_mamba2_run() -> None:
    rows = bench_transformers.run(quick=True, tokens=20, new_tokens=2, repeat=1,
                                  model_name="mamba2")  # fmt: skip
    assert len(rows) == 3 and all(r.correct for r in rows), rows
    assert bench_transformers.format_rows(rows, "mamba2").startswith("Mamba2ForCausalLM on")
    assert integration.patched() == []
    with pytest.raises(ValueError, match="expected model 'mamba', 'mamba2', 'qwen3_5', 'kimi"):
        bench_transformers.run(quick=True, model_name="mamba3")


OTHER_FAMILIES = [
    ("qwen3_5", "Qwen3_5ForCausalLM"), ("kimi_linear", "KimiLinearForCausalLM"),
    ("lfm2", "Lfm2ForCausalLM"), ("recurrent_gemma", "RecurrentGemmaForCausalLM"),
    ("rwkv", "RwkvForCausalLM"), ("minimax", "MiniMaxForCausalLM"),
]  # fmt: skip
# A run costs 5 to 15 s: Qwen3.5's by default, the others with the slow tests; every
# family's model is built by default (test_each_family_builds_its_model), and the run is
# the same code for each (test_quick_mamba2_run and the tests above run it too).
RUNS_BY_DEFAULT = ("qwen3_5",)


@pytest.mark.parametrize(("name", "cls"), OTHER_FAMILIES)
def test_each_family_builds_its_model(name: str, cls: str) -> None:
    assert type(bench_transformers._model(name, 64, 2, None, 64, quick=True)).__name__ == cls


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        pytest.param(name, cls, marks=[] if name in RUNS_BY_DEFAULT else [pytest.mark.slow])
        for name, cls in OTHER_FAMILIES
    ],
)
def test_quick_runs_of_the_other_families(name: str, cls: str) -> None:
    assert type(bench_transformers._model(name, 64, 2, None, 64, quick=True)).__name__ == cls
    rows = bench_transformers.run(quick=True, tokens=12, new_tokens=2, repeat=1,
                                  model_name=name)  # fmt: skip
    assert len(rows) == 3 and all(r.correct for r in rows), rows
    assert bench_transformers.format_rows(rows, name).startswith(f"{cls} on")
    assert integration.patched() == []


@pytest.mark.parametrize(
    ("name", "kinds"),
    [("qwen3_5", ["Qwen3_5GatedDeltaNet"] * 3 + ["Qwen3_5Attention"]),
     ("kimi_linear", ["KimiLinearDeltaAttention"] * 3 + ["KimiLinearAttention"])],
)  # fmt: skip
def test_full_size_hybrids_mix_linear_and_full_attention(name: str, kinds: list[str]) -> None:
    model = bench_transformers._model(name, 1024, 4, None, 1024, quick=False)
    mixers = [type(getattr(layer, "linear_attn", None) or layer.self_attn).__name__
              for layer in model.model.layers]  # fmt: skip
    assert mixers == kinds
    assert not any("MoE" in type(m).__name__ for m in model.modules())
    assert sum(p.numel() for p in model.parameters()) < 70e6
    assert bench_transformers._HIDDEN[name] == 1024


def test_bench_models_covers_every_patched_family_but_no_unpatched_one() -> None:
    families = {"mamba", "mamba2", "qwen3_5", "kimi_linear", "lfm2", "recurrent_gemma",
                "rwkv", "minimax"}  # fmt: skip
    assert set(bench_transformers.PATCHED_MODELS) == families
    # xLSTM is built for tools/matmul_floor.py only: the patch leaves it alone
    assert set(bench_transformers.MODEL_CLASSES) == families | {"xlstm"}
    with pytest.raises(ValueError, match="the patch leaves 'xlstm' alone"):
        bench_transformers.run(quick=True, model_name="xlstm")


def test_a_wrong_result_gets_no_speed(monkeypatch) -> None:
    real = integration.selective_scan

    def off_by_a_little(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = real(*args, **kwargs)
        if isinstance(out, tuple):
            return (out[0] * 1.01, *out[1:])
        return out * 1.01

    family = integration._MAMBA1
    functions = tuple(
        dataclasses.replace(f, replacement=off_by_a_little)
        if f.name == "mamba_selective_scan" else f
        for f in family.functions
    )  # fmt: skip
    monkeypatch.setattr(
        integration, "_FAMILIES", (dataclasses.replace(family, functions=functions),)
    )
    rows = bench_transformers.run(quick=True, tokens=8, new_tokens=2, repeat=1)
    forward = rows[0]
    assert not forward.correct and forward.speedup is None
    assert "WRONG" in bench_transformers.format_rows(rows)
