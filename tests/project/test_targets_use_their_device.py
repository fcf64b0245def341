"""Every test that takes a backend/device target (conftest's ``target`` fixture, named
``target`` or ``where``) runs on the target's device: its body reads ``<name>.device``
or hands the whole target to a helper (a lint: it cannot tell whether the helper uses
it, nor catch a test that reads the device and ignores it). The first run on a GPU found the SSD,
selective, delta-rule and packed-sequence modules building their problems on the CPU
and passing only ``where.backend``: their CUDA cases ran on the CPU (or failed, for the
Triton backend) without anyone knowing. This check fails such a test on any machine;
on a machine with CUDA, conftest's ``_cuda_cases_run_on_the_gpu`` fails a CUDA case
that allocates nothing on the GPU."""

from __future__ import annotations

import ast
import os
from pathlib import Path

pytest_plugins = ["pytester"]

TESTS = Path(__file__).resolve().parents[1]
NAMES = ("target", "where")


def _cpu_only(fn: ast.FunctionDef) -> bool:
    """``@pytest.mark.targets(backends=("cpu",))``: the cpu backend only, no device."""
    for deco in fn.decorator_list:
        if isinstance(deco, ast.Call) and ast.unparse(deco.func).endswith("mark.targets"):
            for kw in deco.keywords:
                if kw.arg == "backends":
                    try:
                        return list(ast.literal_eval(kw.value)) == ["cpu"]
                    except ValueError:  # a name, not a literal: not known to be cpu only
                        return False
    return False


def _uses_device(fn: ast.FunctionDef, name: str) -> bool:
    for node in ast.walk(fn):
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "device"
            and isinstance(node.value, ast.Name)
            and node.value.id == name
        ):
            return True
        if isinstance(node, ast.Call):
            passed = [*node.args, *(kw.value for kw in node.keywords)]
            if any(isinstance(a, ast.Name) and a.id == name for a in passed):
                return True
    return False


def offenders(source: str) -> list[str]:
    """The test functions of ``source`` that take a target and never use its device."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef) or not node.name.startswith("test"):
            continue
        for name in (a.arg for a in node.args.args if a.arg in NAMES):
            if not _cpu_only(node) and not _uses_device(node, name):
                found.append(f"{node.name} ({name})")
    return found


def test_the_check_finds_a_test_that_ignores_the_device() -> None:
    bad = "def test_a(where, gen):\n    run(p, where.backend)\n"
    good = "def test_b(where):\n    run(p.to(where.device), where.backend)\n"
    handed = "def test_c(target):\n    _check(p, target)\n"
    cpu = (
        "@pytest.mark.targets(backends=('cpu',))\n"
        "def test_d(target):\n    run(p, target.backend)\n"
    )  # fmt: skip
    named = "@pytest.mark.targets(backends=CPU)\ndef test_e(target):\n    run(target.backend)\n"
    assert offenders(bad + good + handed + cpu + named) == ["test_a (where)", "test_e (target)"]


def test_every_target_test_runs_on_its_device() -> None:
    found = {
        str(path.relative_to(TESTS)): bad
        for path in sorted(TESTS.rglob("test_*.py"))
        if (bad := offenders(path.read_text()))
    }
    assert not found, found


def test_a_cuda_case_that_allocates_nothing_on_the_gpu_fails(pytester, monkeypatch) -> None:
    """conftest's ``_cuda_cases_run_on_the_gpu``, on a machine without CUDA (where no
    case allocates on a GPU): a case of a CUDA target fails in its teardown, unless it
    was skipped (an optional peer missing); a CPU target's case is not checked."""
    # conftest first; parascan wherever this run found it (an install, or src on the path)
    found = str(Path(__import__("parascan").__file__).parents[1])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(TESTS), found]))
    pytester.makepyfile(
        "import pytest\n"
        "from conftest import Target\n\n\n"
        "@pytest.mark.parametrize('where', [Target('torch', 'cuda'), Target('torch', 'cpu')],\n"
        "                         ids=['cuda', 'cpu'])\n"
        "def test_a(where):\n"
        "    pass\n\n\n"
        "@pytest.mark.parametrize('where', [Target('torch', 'cuda')], ids=['cuda'])\n"
        "def test_b(where):\n"
        "    pytest.importorskip('surely_not_installed_pkg')\n"
    )  # fmt: skip
    result = pytester.runpytest_subprocess("-p", "conftest", "-p", "no:cacheprovider", "-rA")
    result.assert_outcomes(passed=2, errors=1, skipped=1)
    result.stdout.fnmatch_lines(["*test_a[[]cuda[]]*a CUDA case put no tensor on the GPU*"])
