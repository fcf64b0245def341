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


@pytest.mark.slow  # 2.5 to 3.5 minutes on 2 busy cores: the suite's longest case
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


BAD_LINES = {
    "check --device meta": "device type 'meta'",
    "check --device foo": "'foo' is not a device name",
    "check --device cpu --device nonsense:3": "not a device name",
    "bench --repeat 0": "--repeat: expected at least 1",
    "bench --repeat -3": "--repeat: expected at least 1",
    "bench --repeat x": "--repeat: expected a whole number",
    "bench --backend nope": "backend 'nope' cannot run on cpu",
    "bench --device foo": "'foo' is not a device name",
    "bench --device meta": "device type 'meta'",
    "bench --device cpu:1": "the CPU is one device",
    "bench --plot /nonexistent-folder/sweep.png": "its folder does not exist",
    "info --bogus": "unrecognized arguments",
    "frobnicate": "invalid choice",
}
if not torch.cuda.is_available():
    BAD_LINES["check --device cuda"] = "no CUDA device"
    BAD_LINES["bench --device cuda"] = "no CUDA device"
    BAD_LINES["bench --backend triton"] = "backend 'triton' cannot run on cpu"
else:
    BAD_LINES[f"check --device cuda:{torch.cuda.device_count()}"] = "CUDA devices"


@pytest.mark.parametrize("line", list(BAD_LINES))
def test_bad_arguments_exit_2_with_one_line_and_no_traceback(line, capsys) -> None:
    # argparse's convention: the usage, then one line saying what is wrong; exit 2,
    # before any work starts (a bad --plot folder once failed after the whole run).
    with pytest.raises(SystemExit) as done:
        main(line.split())
    assert done.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    last = captured.err.strip().splitlines()[-1]
    assert last.startswith(f"parascan {line.split()[0]}: error: ") or last.startswith(
        "parascan: error: "
    ), captured.err
    assert BAD_LINES[line] in last
    assert "Traceback" not in captured.err


def test_bad_arguments_from_the_shell_print_no_traceback() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "parascan", "bench", "--repeat", "0"], capture_output=True, text=True
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "error: argument --repeat" in done.stderr


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
