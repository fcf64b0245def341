"""The parascan command line: info, check and bench."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
import torch

import parascan as ps
from parascan import bench
from parascan.check import run_check
from parascan.cli import main


def test_info_reports_versions_and_backends(capsys) -> None:
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["parascan"] == ps.__version__
    assert info["backends"]["cpu"] == ps.backends("cpu")
    assert info["threads"] >= 1


def test_python_dash_m_is_the_same_program() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "parascan", "info"], capture_output=True, text=True, check=True
    )
    assert "backends" in done.stdout and ps.__version__ in done.stdout


def test_check_passes_on_this_machine() -> None:
    out = io.StringIO()
    assert run_check(["cpu"], out=out) == 0, out.getvalue()
    text = out.getvalue()
    assert "all checks passed" in text
    for backend in ps.backends("cpu"):
        assert f" {backend} " in text


def test_bench_quick_json_reports_ratios_and_errors() -> None:
    out = io.StringIO()
    status = bench.run_bench(
        cases=bench.QUICK_CASES,
        generic_cases=bench.QUICK_GENERIC_CASES,
        repeat=1,
        as_json=True,
        out=out,
    )
    assert status == 0
    result = json.loads(out.getvalue())
    generic = result["generic_rows"]
    assert {r["kind"] for r in generic} == {"cumprod", "reduce", "matrix", "first-order"}
    for r in generic:
        assert r["correct"], r
        assert r["ratio"] == pytest.approx(r["time_ms"] / r["limit_ms"])
    rows = result["rows"]
    ours = [r for r in rows if r["kind"] == "parascan"]
    assert {(r["case"], r["impl"], r["direction"]) for r in ours} == {
        (c.name, b, d)
        for c in bench.QUICK_CASES
        for b in ps.backends("cpu")
        for d in ("forward", "backward")
    }
    assert {r["impl"] for r in rows if r["kind"] == "peer"} >= {"heinsen", "torch assoc_scan"}
    for r in rows:
        if r["note"]:  # a peer that cannot run this case says why
            continue
        assert r["correct"]
        assert r["ratio"] == pytest.approx(r["time_ms"] / r["limit_ms"])
        assert r["stream_ratio"] == pytest.approx(r["time_ms"] / r["stream_ms"])
        assert r["tensors"] == (3 if r["direction"] == "forward" else 5)
    for r in ours:
        assert r["max_error"] < 2e-5


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the message of a machine without CUDA"
)
def test_bench_on_cuda_without_a_gpu_says_so(capsys) -> None:
    assert main(["bench", "--device", "cuda"]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_bench_never_reports_a_speed_for_a_wrong_result(monkeypatch) -> None:
    from parascan.linear import ops

    real = ops._FORWARD["torch"]
    monkeypatch.setitem(ops._FORWARD, "torch", lambda *a: real(*a) * 1.01)
    out = io.StringIO()
    status = bench.run_bench(
        cases=bench.QUICK_CASES[:1], backend_names=["torch"], repeat=1, out=out
    )
    assert status == 1
    assert "WRONG" in out.getvalue()


def test_bench_never_reports_a_speed_for_a_wrong_generic_result(monkeypatch) -> None:
    from parascan import bench_generic

    real = bench_generic.associative_reduce
    monkeypatch.setattr(bench_generic, "associative_reduce", lambda *a: real(*a) * 1.01)
    out = io.StringIO()
    status = bench.run_bench(
        cases=bench.QUICK_CASES[:1],
        generic_cases=bench.QUICK_GENERIC_CASES[1:2],
        backend_names=["cpu"],
        repeat=1,
        out=out,
    )
    assert status == 1
    wrong = [line for line in out.getvalue().splitlines() if "WRONG" in line]
    assert len(wrong) == 1 and "associative_reduce" in wrong[0]


@pytest.mark.slow
def test_default_bench_workload_is_correct_for_every_backend() -> None:
    """The full default workload (minutes): every parascan result matches the float64
    reference."""
    out = io.StringIO()
    status = bench.run_bench(generic_cases=bench.GENERIC_CASES, repeat=1, as_json=True, out=out)
    assert status == 0
    result = json.loads(out.getvalue())
    assert all(r["correct"] for r in result["rows"] if r["kind"] == "parascan")
    assert all(r["correct"] for r in result["generic_rows"] if r["source"] == "parascan")
