"""The parascan command line: info, check and bench."""

from __future__ import annotations

import importlib.util
import io
import json
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import parascan as ps
from parascan._core import table
from parascan.cli import bench, bench_delta, bench_selective, check
from parascan.cli.bench_generic import implementation_names
from parascan.cli.check import run_check
from parascan.cli.main import main


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


# ---- parascan check ---------------------------------------------------------------------

# API.md, the public contract, lives beside the repository (../shared/API.md) in the
# project's workspace, or inside it (shared/API.md) in some checkouts.
_API_MD = [
    Path(__file__).resolve().parents[2] / "shared" / "API.md",
    Path(__file__).resolve().parents[3] / "shared" / "API.md",
]


def _contract_functions() -> set[str]:
    """The public functions the check must cover: the top-level functions API.md
    documents (its ``### `ps.NAME(`` headings, all scans and scan steps) and every
    public callable of parascan but ``backends``."""
    names = {n for n in ps.__all__ if callable(getattr(ps, n)) and n != "backends"}
    for path in _API_MD:
        if path.is_file():
            found = set(re.findall(r"^### `ps\.(\w+)\(", path.read_text(), re.MULTILINE))
            # a heading format API.md no longer uses would find nothing: fail, not pass
            assert {"linear_scan", "ssd_scan", "delta_rule_scan"} <= found, found
            names |= found
    return names


def test_check_covers_every_public_scan() -> None:
    """Every function of the contract that this parascan has is a family of the check
    (a family added to the package without a check entry fails here); one API.md
    documents but the package does not have yet is the only one allowed out."""
    covered = set(check.family_names())
    missing = {n for n in _contract_functions() - covered if hasattr(ps, n)}
    assert not missing, f"parascan check does not cover {sorted(missing)}"
    assert "causal_conv1d" in covered  # API.md's, checked before the package exports it
    assert len(covered) == len(check.FAMILIES)  # one entry per family
    for family in check.FAMILIES:  # each on the backend table row it names
        assert family.op is None or family.op in table(), family.op


def _wrong(fn):  # type: ignore[no-untyped-def]
    """``fn`` with its first output 10% off (a backend's forward returns a tensor or a
    tuple whose first element is the output)."""

    def wrong(*args, **kwargs):  # type: ignore[no-untyped-def]
        result = fn(*args, **kwargs)
        if isinstance(result, torch.Tensor):
            return result * 1.1
        return (result[0] * 1.1, *result[1:])

    return wrong


def _rows(text: str) -> list[list[str]]:
    """The table's rows, each [family, check, device, backend, result, detail...]."""
    return [line.split() for line in text.splitlines()[1:] if line.strip() and "checks" not in line]


FAMILIES_WITH_BACKENDS = [f.name for f in check.FAMILIES if f.op is not None]
# 5 to 10 s each: with the slow tests. The check's (K, V)-state families come from one
# builder (parascan.cli.check._matrix_state_family): linear_attention_scan's case runs it
# by default.
SLOW_CHECKS = ("delta_rule_scan", "dplr_delta_rule_scan")


@pytest.mark.parametrize(
    "family",
    [
        pytest.param(f, marks=[pytest.mark.slow] if f in SLOW_CHECKS else [])
        for f in FAMILIES_WITH_BACKENDS
    ],
)
def test_check_fails_when_a_backend_is_wrong(family, monkeypatch) -> None:
    """A backend whose forward is 10% off fails every row of its family that it runs
    (the dtypes it takes, and gradcheck: its backward no longer matches), and
    `parascan check` exits 1."""
    entry = next(f for f in check.FAMILIES if f.name == family)
    row = table()[entry.op]
    # not "cpu": an eager call that nothing differentiates reaches the C kernel
    # directly there (the first-order scans' fast path), not the table's forward
    backend = next(b for b in ps.backends("cpu") if b in row.backends and b != "cpu")
    monkeypatch.setitem(
        row.backends,
        backend,
        replace(row.backends[backend], forward=_wrong(row.backends[backend].forward)),
    )
    out = io.StringIO()
    assert run_check(["cpu"], out=out, families=[family], backend_names=[backend]) == 1
    rows = _rows(out.getvalue())
    ran = [r for r in rows if r[4] != "n/a"]
    assert ran and all(r[0] == family and r[3] == backend for r in rows), rows
    assert all(r[4] == "FAILED" for r in ran), out.getvalue()
    assert {r[1] for r in ran} >= {"float32", "gradcheck"}


@pytest.mark.parametrize(
    "family", ["associative_scan", "associative_reduce", "causal_conv1d", "selective_state_update"]
)
def test_check_fails_when_a_function_without_backends_is_wrong(family, monkeypatch) -> None:
    """A function without a backend argument, 10% off, fails each dtype's row (its
    gradients, through the same wrapper, still pass gradcheck)."""
    from parascan.mixer import conv

    owner = ps if hasattr(ps, family) else conv  # causal_conv1d, before ps exports it
    monkeypatch.setattr(owner, family, _wrong(getattr(owner, family)))
    out = io.StringIO()
    assert run_check(["cpu"], out=out, families=[family]) == 1
    rows = _rows(out.getvalue())
    assert rows and all(r[0] == family and r[3] == "-" for r in rows), rows
    dtypes = next(f for f in check.FAMILIES if f.name == family).dtypes
    failed = {r[1] for r in rows if r[4] == "FAILED"}
    assert failed == {str(d).removeprefix("torch.") for d in dtypes}, out.getvalue()


def test_check_fails_only_the_wrong_backend_and_dtype(monkeypatch) -> None:
    """The complex matrix check compares complex values (it once compared with a real
    reference, which dropped the imaginary part): a torch backend returning the
    conjugate fails its complex rows only, and the other backends pass."""
    row = table()["parascan.matrix_linear_scan"]
    real = row.backends["torch"].forward

    def conj(*args):  # type: ignore[no-untyped-def]
        result = real(*args)
        if isinstance(result, torch.Tensor):
            return result.conj_physical()
        return (result[0].conj_physical(), *result[1:])

    monkeypatch.setitem(row.backends, "torch", replace(row.backends["torch"], forward=conj))
    out = io.StringIO()
    assert run_check(["cpu"], out=out, families=["matrix_linear_scan"]) == 1
    failed = {(r[1], r[3]) for r in _rows(out.getvalue()) if r[4] == "FAILED"}
    # (gradcheck is float64: the conjugate of a real result is itself)
    assert failed == {("complex64", "torch"), ("complex128", "torch")}, out.getvalue()


def test_check_asks_each_backend_only_for_the_dtypes_it_takes(monkeypatch) -> None:
    """`parascan check --device cuda` once crashed: the log-space checks ran complex
    inputs on the triton backend, which takes real ones. Every backend of a family's
    row (triton too, not listed on a machine without CUDA) is asked only for its
    dtypes, and the others are reported as not applicable, not as passed or failed."""
    row = table()["parascan.log_linear_scan"]
    asked: list[tuple[str, torch.dtype]] = []
    real = ps.log_linear_scan

    def recording(a, b, dim, *, backend, **kwargs):  # type: ignore[no-untyped-def]
        asked.append((backend, a.dtype))
        return real(a, b, dim, backend="torch", **kwargs)  # the check's logic, not the kernel

    monkeypatch.setattr(ps, "log_linear_scan", recording)
    monkeypatch.setattr(check, "_family_backends", lambda family, device, only=None: [
        (name, entry.dtypes) for name, entry in row.backends.items()])  # fmt: skip
    results = list(check._forward_rows(check.LOG_LINEAR_SCAN, "cpu"))
    for backend, entry in row.backends.items():
        mine = [r for r in results if r.backend == backend]
        skipped = {r.what for r in mine if not r.ran}
        expected = {str(d).removeprefix("torch.") for d in check.LOG_LINEAR_SCAN.dtypes
                    if d not in entry.dtypes}  # fmt: skip
        assert skipped == expected, backend
        assert all(r.passed for r in mine if r.ran), (backend, mine)
    assert asked and all(d in row.backends[b].dtypes for b, d in asked)
    assert ("triton", torch.complex64) not in asked and ("torch", torch.complex64) in asked


def test_check_prints_each_row_as_it_is_found(monkeypatch) -> None:
    """On a GPU with a cold kernel cache the check outran its limit, which then had its
    header and nothing else: the rows came only once every check had run. Each row is
    now written as soon as it is known."""

    def interrupted(family, device, only=None):  # type: ignore[no-untyped-def]
        raise KeyboardInterrupt  # what `timeout -s INT` does to a check in progress
        yield  # a generator, as the rows of the check are

    monkeypatch.setattr(check, "_gradcheck_rows", interrupted)
    out = io.StringIO()
    with pytest.raises(KeyboardInterrupt):
        run_check(["cpu"], out=out, families=["causal_conv1d"])
    rows = _rows(out.getvalue())
    assert [r[:2] for r in rows] == [["causal_conv1d", "float32"], ["causal_conv1d", "float64"]]
    assert all(r[4] == "ok" for r in rows), rows


def test_check_command_runs_a_family(capsys) -> None:
    assert main(["check", "--family", "selective_state_update", "--family", "causal_conv1d"]) == 0
    rows = _rows(capsys.readouterr().out)
    assert {r[0] for r in rows} == {"selective_state_update", "causal_conv1d"}
    assert all(r[4] == "ok" for r in rows) and any(r[1] == "gradcheck" for r in rows)


@pytest.mark.slow  # about 25 s on 2 busy cores: every family on every backend
def test_check_passes_on_this_machine() -> None:
    out = io.StringIO()
    assert run_check(["cpu"], out=out) == 0, out.getvalue()
    assert "all checks passed" in out.getvalue()
    seen = {(r[0], r[3]) for r in _rows(out.getvalue()) if r[1] == "gradcheck"}
    for family in check.FAMILIES:
        names = ["-"] if family.op is None else [
            b for b in ps.backends("cpu") if b in table()[family.op].backends]  # fmt: skip
        assert {(family.name, b) for b in names} <= seen, family.name


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
    "check --family nope": "--family nope: expected one of linear_scan, log_linear_scan",
    "check --backend nope": "--backend nope: it cannot run on cpu",
    "bench --repeat 0": "--repeat: expected at least 1",
    "bench --repeat -3": "--repeat: expected at least 1",
    "bench --repeat x": "--repeat: expected a whole number",
    "bench --backend nope": "backend 'nope' cannot run on cpu",
    "bench --device foo": "'foo' is not a device name",
    "bench --device meta": "device type 'meta'",
    "bench --device cpu:1": "the CPU is one device",
    "bench --plot /nonexistent-folder/sweep.png": "its folder does not exist",
    "bench --quick --full": "not allowed with argument --quick",
    "bench --json --models": "--json covers the kernel tables only",
    "info --bogus": "unrecognized arguments",
    "frobnicate": "invalid choice",
}
if importlib.util.find_spec("matplotlib") is None:
    BAD_LINES["bench --plot sweep.png"] = "--plot needs matplotlib"
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


# `parascan bench` as on a fresh install (torch without numpy, which torch warns about when
# first imported), its default workload cut to one small case per kind: at least 2^17
# elements, so every implementation is called once per sample.
_NO_NUMPY_BENCH = """
import sys
sys.modules["numpy"] = None  # import numpy raises ImportError
from parascan.cli import bench, main
shape = (1, 64, 2048)
bench.DEFAULT_CASES[:] = [
    bench.Case("linear", shape, -1, peers=True), bench.Case("log", shape, 1, peers=True, op="log")
]
bench.DEFAULT_GENERIC_CASES[:] = bench.QUICK_GENERIC_CASES
bench.DEFAULT_PACKED_CASES[:] = bench.QUICK_PACKED_CASES
bench.DEFAULT_SSM_CASES[:] = bench.QUICK_SSM_CASES
sys.exit(main.main(["bench", "--repeat", "1"]))
"""


def test_bench_without_numpy_prints_no_warning() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _NO_NUMPY_BENCH], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr
    assert "numpy" not in done.stderr.lower(), done.stderr
    assert "warning" not in done.stderr.lower(), done.stderr
    assert "torch assoc_scan" in done.stdout and "heinsen (log)" in done.stdout


def test_bench_backend_times_only_that_backend() -> None:
    # a case restricted to other backends is left out (it once ran every backend)
    cases = [
        bench.Case("cpu only", (1, 8, 2048), -1, backward=False, backends=("cpu",)),
        bench.Case("any", (1, 8, 2048), -1, backward=False),
    ]
    out = io.StringIO()
    status = bench.run_bench(cases=cases, backend_names=["torch"], repeat=1, as_json=True, out=out)
    assert status == 0
    rows = json.loads(out.getvalue())["rows"]
    assert [(r["case"], r["impl"]) for r in rows] == [("any", "torch")]


@pytest.mark.parametrize(("only", "left_out"), [("loop", "cpu"), ("cpu", "loop")])
def test_bench_backend_filters_the_generic_table(only, left_out) -> None:
    """The generic table's implementations that run one parascan backend follow
    --backend too (it once timed matrix_linear_scan's cpu backend under --backend
    loop); those without a backend choice stay."""
    from parascan.cli.bench_generic import GenericCase

    out = io.StringIO()
    status = bench.run_bench(
        cases=[], generic_cases=[GenericCase("m", "matrix", (16, 4), peers=False)],
        backend_names=[only], repeat=1, as_json=True, out=out,
    )  # fmt: skip
    assert status == 0
    impls = [r["impl"] for r in json.loads(out.getvalue())["generic_rows"]]
    assert impls == [f"matrix_linear_scan {only}"], impls


def test_bench_never_reports_a_speed_for_a_wrong_result(monkeypatch) -> None:
    from dataclasses import replace

    from parascan.first_order.ops import ROWS

    linear = ROWS["linear"].backends
    real = linear["torch"].forward
    wrong = replace(linear["torch"], forward=lambda *a: real(*a) * 1.01)
    monkeypatch.setitem(linear, "torch", wrong)
    out = io.StringIO()
    status = bench.run_bench(
        cases=bench.QUICK_CASES[:1], backend_names=["torch"], repeat=1, out=out
    )
    assert status == 1
    assert "WRONG" in out.getvalue()


def test_bench_never_reports_a_speed_for_a_wrong_generic_result(monkeypatch) -> None:
    from parascan.cli import bench_generic

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


def test_default_bench_times_every_backend_and_peer_and_the_headline_shapes() -> None:
    cases = bench.DEFAULT_CASES
    names = {name for c in cases for name, *_ in bench._implementations(c)}
    peers = set(bench.peers.PEERS) - bench.peers.CUDA_ONLY | set(bench.peers.LOG_PEERS)
    assert names == set(ps.backends("cpu")) | peers
    for shape, dim in (((8, 4096, 1536), 1), ((8, 1536, 4096), -1)):
        assert any(c.shape == shape and c.dim == dim and c.backward for c in cases)
    generic = {name for c in bench.DEFAULT_GENERIC_CASES for name in implementation_names(c)}
    assert generic == {name for c in bench.FULL_GENERIC_CASES for name in implementation_names(c)}


@pytest.mark.parametrize(
    ("flags", "workload"),
    [
        ([], (bench.DEFAULT_CASES, bench.DEFAULT_GENERIC_CASES, bench.DEFAULT_PACKED_CASES,
              bench.DEFAULT_SSM_CASES)),
        (["--full"], (bench.FULL_CASES, bench.FULL_GENERIC_CASES, bench.FULL_PACKED_CASES,
                      bench.FULL_SSM_CASES)),
        (["--quick"], (bench.QUICK_CASES, bench.QUICK_GENERIC_CASES, bench.QUICK_PACKED_CASES,
                       bench.QUICK_SSM_CASES)),
    ],
)  # fmt: skip
def test_bench_runs_the_default_full_or_quick_workload(flags, workload, monkeypatch) -> None:
    from parascan.cli import main as cli

    seen, models = [], []
    monkeypatch.setattr(bench, "run_bench", lambda **kw: seen.append(kw) or 0)
    monkeypatch.setattr(cli, "_bench_models", lambda quick: models.append(quick) or 0)
    assert main(["bench", *flags]) == 0
    kw = seen[0]
    assert (kw["cases"], kw["generic_cases"], kw["packed_cases"], kw["ssm_cases"]) == workload
    name = "quick" if flags == ["--quick"] else "full" if flags == ["--full"] else "default"
    assert kw["sweep"] == bench.SWEEPS[name]  # the sweep of --plot follows the workload
    # the end-to-end models come with --full (and --models), not by default
    assert models == ([False] if flags == ["--full"] else [])
    assert main(["bench", "--models", *flags]) == 0
    assert models[-1] == (flags == ["--quick"])


def test_bench_quick_plot_sweeps_a_small_workload(monkeypatch, tmp_path) -> None:
    """`parascan bench --quick --plot` once swept the default T (up to 2^16 steps of
    4 x 256 channels for every implementation, the loop backend and the tree peers
    included: minutes). --quick now sweeps its own small shapes."""
    pytest.importorskip("matplotlib")  # --plot refuses to start without it
    seen = []
    monkeypatch.setattr(bench, "run_bench", lambda **kw: seen.append(kw) or 0)
    assert main(["bench", "--quick", "--plot", str(tmp_path / "sweep.png")]) == 0
    sweep = seen[0]["sweep"]
    assert seen[0]["plot_path"] == str(tmp_path / "sweep.png")
    assert sweep == bench.SWEEPS["quick"]
    elements = [c.shape[0] * c.shape[1] * c.shape[2] for c in sweep.cases()]
    assert len(elements) >= 2 and sum(elements) <= 2**20, sweep  # 0.5 M elements in all
    default = [c.shape[0] * c.shape[1] * c.shape[2] for c in bench.SWEEPS["default"].cases()]
    assert 100 * sum(elements) <= sum(default)


def _assert_words(label: str) -> None:
    """An axis label in words: no Python tuple or repr in it, such as the
    "T (shape (4, 256, 'T'), float32, forward, last dim)" it once was."""
    assert isinstance(label, str) and label.strip(), label
    assert not re.search(r"\([^()]*,[^()]*\)", label), label  # no "(a, b, ...)"
    assert not re.search(r"['\"]", label), label  # no quoted repr


def test_plot_labels_are_words(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    sweep = bench.Sweep(1, 8, (16, 32))  # every implementation, on tiny shapes
    out = io.StringIO()
    labels = []
    real = bench.plot
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(bench, "plot", lambda *a: labels.append(real(*a)) or labels[-1])
        status = bench.run_bench(
            cases=[], plot_path=str(tmp_path / "sweep.png"), sweep=sweep, repeat=1, out=out
        )
    assert status == 0
    assert (tmp_path / "sweep.png").stat().st_size > 0
    ((xlabel, ylabel),) = labels
    assert "sequence length" in xlabel and "time" in ylabel and "ms" in ylabel
    assert "(" not in xlabel  # no shape in it: the title says it, in words
    for label in (xlabel, ylabel, *bench.plot_labels(sweep)):
        _assert_words(label)
    sweep_rows = [line for line in out.getvalue().splitlines() if line.startswith("sweep")]
    assert len(sweep_rows) == 2 * len(bench._implementations(sweep.cases()[0]))


def test_bench_models_prints_both_tables_and_fails_on_a_wrong_result(monkeypatch, capsys) -> None:
    from parascan.cli import bench_transformers
    from parascan.cli import main as cli

    def fake_run(*, quick, model_name, progress):  # type: ignore[no-untyped-def]
        progress("timing")
        correct = model_name == "mamba"
        return [bench_transformers.Row("forward", 2.0, 1.0, 2.0 if correct else None,
                                       0.0 if correct else 1.0, correct)]  # fmt: skip

    monkeypatch.setattr(bench_transformers, "run", fake_run)
    assert cli._bench_models(quick=True) == 1  # mamba2's result differs
    out = capsys.readouterr().out
    assert "End to end: mamba," in out and "End to end: mamba2," in out and "WRONG" in out


def test_bench_packed_rows_compare_with_one_sequence_and_a_loop() -> None:
    out = io.StringIO()
    status = bench.run_bench(
        cases=[], packed_cases=bench.QUICK_PACKED_CASES,
        backend_names=["cpu"], repeat=1, as_json=True, out=out,
    )  # fmt: skip
    assert status == 0
    rows = json.loads(out.getvalue())["packed_rows"]
    assert [r["impl"] for r in rows] == ["cu_seqlens", "one sequence", "python loop over sequences"]
    packed = rows[0]
    assert packed["correct"] and packed["max_error"] < 1e-5
    assert packed["time_ms"] > 0 and packed["ratio"] > 0 and rows[1]["vs_one_sequence"] == 1.0


@pytest.mark.parametrize("packed_cost", [1.0, 1.5])
def test_bench_packed_ratio_is_fair_to_both_rows(monkeypatch, packed_cost) -> None:
    """A scan right after a large torch op (the limit, the loop) charged 2x, and right after
    a timed scan 1.3x: the packed row's ratio to the single-sequence row is still the
    packed call's own cost, whatever the number of repetitions."""
    from parascan.cli import bench_packed

    events: list[str] = []
    real = bench_packed.linear_scan

    def scan(*args, **kw):  # type: ignore[no-untyped-def]
        events.append("scan")
        return real(*args, **kw)

    def fake(fn, calls=1, device="cpu"):  # type: ignore[no-untyped-def]
        before = events[-1] if events else ""
        fn()
        if fn.__name__ != "<lambda>":  # the limit or the loop
            events.append("big")
            return 1.0
        events.append("timed")
        packed = "cu_t" in fn.__code__.co_freevars  # the packed call's lambda holds the offsets
        return (packed_cost if packed else 1.0) * {"big": 2.0, "timed": 1.3}.get(before, 1.0)

    monkeypatch.setattr(bench_packed, "linear_scan", scan)
    monkeypatch.setattr(bench_packed, "_elapsed", fake)
    for repeat in (1, 2, 5):
        rows = bench_packed.run_packed(bench.QUICK_PACKED_CASES, repeat)
        assert [r.impl for r in rows][:2] == ["cu_seqlens", "one sequence"]
        assert rows[0].vs_one_sequence == pytest.approx(packed_cost)
        assert rows[1].vs_one_sequence == 1.0


def test_bench_never_reports_a_speed_for_a_wrong_packed_result(monkeypatch) -> None:
    from parascan.cli import bench_packed

    real = bench_packed.linear_scan

    def off(*args, cu_seqlens=None, **kw):  # type: ignore[no-untyped-def]
        out = real(*args, cu_seqlens=cu_seqlens, **kw)
        return out * 1.01 if cu_seqlens is not None else out

    monkeypatch.setattr(bench_packed, "linear_scan", off)
    out = io.StringIO()
    status = bench.run_bench(
        cases=[], packed_cases=bench.QUICK_PACKED_CASES,
        backend_names=["cpu"], repeat=1, out=out,
    )  # fmt: skip
    assert status == 1
    wrong = [line for line in out.getvalue().splitlines() if "WRONG" in line]
    assert len(wrong) == 1 and "cu_seqlens" in wrong[0]


@pytest.mark.slow
@pytest.mark.parametrize("workload", ["default", "full"])
def test_bench_workload_is_correct_for_every_backend(workload) -> None:
    """The default workload (a minute or two) and --full (minutes): every parascan result
    matches the float64 reference."""
    cases, generic_cases, packed_cases = {
        "default": (bench.DEFAULT_CASES, bench.DEFAULT_GENERIC_CASES, bench.DEFAULT_PACKED_CASES),
        "full": (bench.FULL_CASES, bench.FULL_GENERIC_CASES, bench.FULL_PACKED_CASES),
    }[workload]
    out = io.StringIO()
    status = bench.run_bench(
        cases=cases, generic_cases=generic_cases, packed_cases=packed_cases, repeat=1,
        as_json=True, out=out,
    )  # fmt: skip
    assert status == 0
    result = json.loads(out.getvalue())
    assert all(r["correct"] for r in result["rows"] if r["kind"] == "parascan")
    assert all(r["correct"] for r in result["generic_rows"] if r["source"] == "parascan")
    assert all(r["correct"] for r in result["packed_rows"])


# the selective scan's quick rows (the SSD scan's are tested in test_bench_ssd.py)
SELECTIVE = [c for c in bench.QUICK_SSM_CASES if isinstance(c, bench_selective.SsmCase)]
DELTA = [c for c in bench.QUICK_SSM_CASES if isinstance(c, bench_delta.DeltaCase)]


def test_bench_delta_rows_are_checked_and_compared_with_their_limits() -> None:
    out = io.StringIO()
    status = bench.run_bench(cases=[], ssm_cases=DELTA, repeat=1, as_json=True, out=out)
    assert status == 0
    rows = json.loads(out.getvalue())["ssm_rows"]
    impls = [(r["impl"], r["direction"]) for r in rows]
    assert impls[:4] == [
        ("parascan", "forward"), ("parascan", "forward+backward"),
        ("parascan packed", "forward"), ("parascan packed", "forward+backward"),
    ]  # fmt: skip
    assert impls[-2:] == [("parascan", "decode step"), ("parascan", "decode step, from memory")]
    for r in rows:
        assert r["correct"] and r["limit_ms"] > 0 and r["vs_limit"] > 0
        assert r["max_error"] is None or r["max_error"] < 1e-4


def test_bench_never_reports_a_speed_for_a_wrong_delta_result(monkeypatch) -> None:
    real = bench_delta.ps.delta_rule_scan

    def off(*a, **kw):  # type: ignore[no-untyped-def]
        out = real(*a, **kw)
        return out * 1.01 if isinstance(out, torch.Tensor) else out

    monkeypatch.setattr(bench_delta.ps, "delta_rule_scan", off)
    out = io.StringIO()
    status = bench.run_bench(cases=[], ssm_cases=DELTA, repeat=1, out=out)
    assert status == 1
    wrong = [line for line in out.getvalue().splitlines() if "WRONG" in line]
    assert len(wrong) == 4 and all("parascan" in line for line in wrong)


def test_bench_ssm_rows_compare_with_the_loop_and_the_exp_limit() -> None:
    out = io.StringIO()
    status = bench.run_bench(cases=[], ssm_cases=SELECTIVE, repeat=1, as_json=True, out=out)
    assert status == 0
    rows = json.loads(out.getvalue())["ssm_rows"]
    assert [(r["impl"], r["direction"]) for r in rows] == [
        ("parascan", "forward"), ("parascan", "forward+backward"),
        ("reference loop", "forward"), ("reference loop", "forward+backward"),
        ("published loop", "forward"), ("published loop", "forward+backward"),
    ]  # fmt: skip
    ours = rows[1]
    assert ours["correct"] and ours["max_error"] < 1e-4 and ours["exp_limit_ms"] > 0
    assert ours["speedup_vs_loop"] > 0 and ours["peak_extra_mib"] is not None
    assert "faster than the published loop" in ours["note"]


def test_bench_never_reports_a_speed_for_a_wrong_ssm_result(monkeypatch) -> None:
    from parascan.cli import bench_selective

    real = bench_selective.selective_scan
    monkeypatch.setattr(bench_selective, "selective_scan", lambda *a, **kw: real(*a, **kw) * 1.01)
    out = io.StringIO()
    # the check does not depend on the size: a small case (the quick one's loops take
    # 10 to 20 s), 16 channels for the 8 checked against the float64 loop
    small = [bench_selective.SsmCase("mamba-1 scan", 1, 16, 33, 4)]
    status = bench.run_bench(cases=[], ssm_cases=small, repeat=1, out=out)
    assert status == 1
    wrong = [line for line in out.getvalue().splitlines() if "WRONG" in line]
    assert len(wrong) == 2 and all("parascan" in line for line in wrong)


def test_the_published_and_the_reference_loops_compute_the_same_scan() -> None:
    """The bench's two loop baselines (einsums, or products and sums) agree with each
    other and with the float64 oracle loop of the tests."""
    from parascan.cli import bench_selective

    from oracles import selective_loop

    case = bench_selective.SsmCase("t", 2, 5, 9, 3)
    x = {k: v.double() for k, v in bench_selective._inputs(case).items()}
    want, _ = selective_loop(x["u"], x["delta"], x["A"], x["B"], x["C"], x["D"], x["z"],
                             x["delta_bias"], delta_softplus=True)  # fmt: skip
    torch.testing.assert_close(bench_selective.reference_loop(**x), want)
    torch.testing.assert_close(bench_selective.published_loop(**x), want)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc and getrusage")
def test_peak_measurement_leaves_malloc_reusing_blocks_afterwards() -> None:
    """peak_extra_mib makes blocks of 64 KiB and more fresh mappings while it measures;
    left so, every later tensor of that size would fault its pages in and zero them at
    each allocation (the bench's DPLR naive loop ran 4x slower after the first peak
    row). After it, a 1 MiB tensor allocated again and again reuses malloc's block."""
    import resource

    from parascan.cli.common import peak_extra_mib

    if peak_extra_mib(lambda: torch.ones(1 << 20)) is None:
        pytest.skip("no glibc mallopt or /proc/self/clear_refs here")

    def faults() -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

    for _ in range(16):  # 1 MiB: malloc settles on a block within a few allocations
        torch.ones(1 << 18)
    before = faults()
    for _ in range(40):
        torch.ones(1 << 18)
    pages = (1 << 20) // resource.getpagesize()
    assert faults() - before < 4 * pages  # a fresh mapping each time: 40 * 256 faults
