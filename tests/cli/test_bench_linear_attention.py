"""parascan.cli.bench_linear_attention: linear attention's (GLA) and DPLR's (RWKV-7) rows
of ``parascan bench`` are in the default workload at the models' shapes, check every
implementation before timing it (a wrong one, the packed row and the decoding step
included, gets no speed), and the bench's naive step loops and float64 loops compute
the families' recurrences (against tests/oracles.py's loops). Shared parts
(bench_kv.py, common.rounds) are tested here too."""

from __future__ import annotations

import io
import json
import math
import sys
from dataclasses import replace

import pytest
import torch

from parascan.cli import bench, bench_kv, bench_selective, common
from parascan.cli import bench_linear_attention as bl

from conftest import assert_matches
from oracles import dplr_delta_rule_loop, linear_attention_loop

QUICK = bl.QUICK_LINEAR_CASES
GLA, RWKV7 = QUICK


def _patch_scan(monkeypatch, family: str, wrap) -> None:  # type: ignore[no-untyped-def]
    name = "linear_attention_scan" if family == bl.LINEAR else "dplr_delta_rule_scan"
    real = getattr(bl.ps, name)
    monkeypatch.setattr(bl.ps, name, lambda *a, **kw: wrap(real, *a, **kw))


def test_the_default_workload_has_both_families_rows_at_the_models_shapes() -> None:
    # the default workload's cases of these families (the others' names import transformers)
    mine = [c for c in bench_selective.DEFAULT_SSM_CASES if isinstance(c, bl.LinearCase)]
    names = {n for c in mine for n in bench_selective.ssm_step_names(c)}
    for case, packed in (("gla 1.3B", True), ("rwkv-7 2.9B", False)):
        want = {f"{case} parascan forward", f"{case} parascan forward+backward",
                f"{case} naive loop forward", f"{case} decode step",
                f"{case} decode step, from memory"}  # fmt: skip
        if packed:
            want |= {f"{case} parascan packed forward", f"{case} parascan packed forward+backward"}
        assert want <= names, want - names
    cases = {c.name: c for c in bench.DEFAULT_SSM_CASES if isinstance(c, bl.LinearCase)}
    gla, rwkv = cases["gla 1.3B"], cases["rwkv-7 2.9B"]
    assert (gla.family, gla.batch, gla.length, gla.k_heads, gla.v_heads, gla.dk, gla.dv) == (
        bl.LINEAR, 1, 1024, 4, 4, 256, 512,
    )  # fmt: skip
    assert (gla.gate, gla.packed, gla.backward, gla.decode) == ("channel", 8, True, True)
    assert (rwkv.family, rwkv.length, rwkv.k_heads, rwkv.v_heads, rwkv.dk, rwkv.dv) == (
        bl.DPLR, 1024, 40, 40, 64, 64,
    )  # fmt: skip
    assert rwkv.gate == "channel" and rwkv.backward and rwkv.decode
    assert {c.family for c in bench.QUICK_SSM_CASES if isinstance(c, bl.LinearCase)} == {
        bl.LINEAR, bl.DPLR,
    }  # fmt: skip
    assert {c.name for c in bench.FULL_SSM_CASES if isinstance(c, bl.LinearCase)} == set(cases)


def test_quick_rows_are_checked_and_compared_with_their_limits() -> None:
    out = io.StringIO()
    status = bench.run_bench(cases=[], ssm_cases=QUICK, repeat=1, as_json=True, out=out)
    assert status == 0
    rows = json.loads(out.getvalue())["ssm_rows"]
    for family, name in ((bl.LINEAR, GLA.name), (bl.DPLR, RWKV7.name)):
        mine = [r for r in rows if r["family"] == family]
        assert [(r["impl"], r["direction"]) for r in mine] == [
            ("parascan", "forward"), ("parascan", "forward+backward"),
            ("parascan packed", "forward"), ("parascan packed", "forward+backward"),
            ("naive loop", "forward"),
            ("parascan", "decode step"), ("parascan", "decode step, from memory"),
        ]  # fmt: skip
        assert {r["case"] for r in mine} == {name}
        for r in mine:
            assert r["correct"] and r["max_error"] < 1e-4, r
            assert r["time_ms"] > 0 and r["limit_ms"] > 0
            assert r["vs_limit"] == pytest.approx(r["time_ms"] / r["limit_ms"])
        naive = mine[4]
        assert naive["parascan_speedup"] > 0 and "timed on 32 of 64 steps, x2" in naive["note"]
        assert "one vectorized update per step" in naive["note"]
        assert mine[0]["peak_extra_mib"] is not None and mine[1]["peak_extra_mib"] is not None
    table = bench_selective.format_ssm(bl.run_linear([GLA], 1))
    assert "2*K*V multiply-adds per token and head" in table and "WRONG" not in table


@pytest.mark.parametrize("case", QUICK, ids=lambda c: c.family)
def test_a_wrong_result_gets_no_speed(case, monkeypatch) -> None:
    def off(real, *a, **kw):  # type: ignore[no-untyped-def]
        out = real(*a, **kw)
        return tuple(t * 1.01 for t in out) if isinstance(out, tuple) else out * 1.01

    _patch_scan(monkeypatch, case.family, off)
    out = io.StringIO()
    status = bench.run_bench(cases=[], ssm_cases=[case], repeat=1, out=out)
    assert status == 1
    wrong = [line for line in out.getvalue().splitlines() if "WRONG" in line]
    # forward, forward+backward, both packed, both decoding steps; the naive loop is right
    assert len(wrong) == 6 and all("parascan" in line for line in wrong), wrong
    assert any("naive loop" in line and "WRONG" not in line for line in out.getvalue().splitlines())


@pytest.mark.parametrize("case", QUICK, ids=lambda c: c.family)
def test_the_packed_row_is_checked_against_each_sequence_alone(case, monkeypatch) -> None:
    def leaky(real, *a, cu_seqlens=None, **kw):  # type: ignore[no-untyped-def]
        return real(*a, **kw)  # the boundaries ignored: one sequence

    _patch_scan(monkeypatch, case.family, leaky)
    rows = bl.run_linear([replace(case, decode=False)], 1)
    assert [(r.impl, r.correct) for r in rows if r.impl.startswith("parascan packed")] == [
        ("parascan packed", False), ("parascan packed", False),
    ]  # fmt: skip
    assert all(r.correct for r in rows if r.impl != "parascan packed")


@pytest.mark.parametrize("gate", ["channel", "head", "none"])
@pytest.mark.parametrize("family", [bl.LINEAR, bl.DPLR])
def test_the_naive_and_float64_loops_compute_the_family(family, gate) -> None:
    """Value heads 4 reading 2 key heads (the grouped convention); an initial state for
    the float64 loop (the decoding rows' check)."""
    case = bl.LinearCase("t", 2, 9, 2, 4, 3, 5, family, gate=gate)
    x = bl._inputs(case)
    assert ("g" in x) == (gate != "none") and ("a" in x) == (family == bl.DPLR)
    initial = torch.randn(2, 4, 3, 5, dtype=torch.float64)
    x64 = {key: t.double() for key, t in x.items()}
    oracle = linear_attention_loop if family == bl.LINEAR else dplr_delta_rule_loop
    want, want_final = oracle(**x64, initial=initial)
    got, final = bl.reference_loop(family, initial=initial, **x)
    assert_matches(got, want, torch.float64)
    assert_matches(final, want_final, torch.float64)
    zero, _ = oracle(**x64)
    assert_matches(bl.naive_loop(family, **x), zero, torch.float32)
    if family == bl.DPLR and gate == "channel":  # RWKV-7's: w in (-e^-0.5, 0), |kk| = 1
        assert bool(((x["g"] < 0) & (x["g"] > -math.exp(-0.5))).all())
        torch.testing.assert_close(x["a"].norm(dim=-1), torch.ones(2, 9, 2))


def test_fla_naive_functions_are_timed_when_fla_is_importable(tmp_path, monkeypatch) -> None:
    """With fla importable, its naive files are loaded alone (not fla's package, whose
    import pulls Triton; this fake one raises) and timed beside the bench's loop."""
    pkg = tmp_path / "fla"
    (pkg / "ops" / "gla").mkdir(parents=True)
    (pkg / "ops" / "generalized_delta_rule" / "dplr").mkdir(parents=True)
    (pkg / "__init__.py").write_text("raise ImportError('fla imported whole')\n")
    (pkg / "ops" / "gla" / "naive.py").write_text(
        "from parascan.cli.bench_linear_attention import naive_loop\n"
        "def naive_recurrent_gla(q, k, v, gk, initial_state=None, output_final_state=False):\n"
        "    return naive_loop('linear attention', q=q, k=k, v=v, g=gk), None\n"
    )
    (pkg / "ops" / "generalized_delta_rule" / "dplr" / "naive.py").write_text(
        "from parascan.cli.bench_linear_attention import naive_loop\n"
        "def dplr_recurrence(q, k, v, alpha, beta, gk, initial_state=None,\n"
        "                    output_final_state=True):\n"
        "    x = dict(q=q, k=k, v=v, a=alpha, b=beta, g=gk)\n"
        "    o = naive_loop('dplr', **{n: t.transpose(1, 2) for n, t in x.items()})\n"
        "    return o.transpose(1, 2), None\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    # an "fla" imported before (transformers imports an empty site-packages/fla an
    # uninstall may leave, as a namespace package) would hide this one
    monkeypatch.delitem(sys.modules, "fla", raising=False)
    for case in (replace(c, packed=0, backward=False, decode=False) for c in QUICK):
        assert "fla naive forward" in " ".join(bl.linear_step_names(case))
        rows = bl.run_linear([case], 1)
        (fla,) = [r for r in rows if r.impl == "fla naive"]
        assert fla.correct and fla.time_ms is not None and fla.direction == "forward"
        assert "fla's" in fla.note


def test_rounds_time_a_slow_call_once(monkeypatch) -> None:
    seconds = {"slow": 3.0, "fast": 0.1}
    monkeypatch.setattr(common, "elapsed", lambda fn, calls=1, device="cpu": fn())
    fns = {key: (lambda s=s: s) for key, s in seconds.items()}
    times = common.rounds(fns, 4, once_over=bench_kv.SLOW_S)
    assert times == {"slow": [3.0], "fast": [0.1] * 4}
    assert common.rounds(fns, 2) == {"slow": [3.0] * 2, "fast": [0.1] * 2}
