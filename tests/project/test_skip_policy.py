"""The suite's skip policy (skip_policy.py), run on small test files of its own."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

TESTS = Path(__file__).resolve().parent.parent  # where skip_policy.py is


@pytest.mark.parametrize(
    ("body", "code"),
    [
        ("def test_a():\n    pytest.importorskip('surely_not_installed_pkg')", 0),
        ("def test_a():\n    pytest.skip('the kernel library is not built')", 1),
        # installed (pytest itself), but the import fails: a skip that hid a broken extra
        ("def test_a():\n    pytest.importorskip('pytest.no_such_module')", 1),
        ("@pytest.mark.skipif(True, reason='no reason')\ndef test_a():\n    pass", 1),
        ("def test_a():\n    pass", 0),
    ],
)
def test_only_missing_optional_packages_may_skip(pytester, monkeypatch, body, code) -> None:
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    pytester.makepyfile(f"import pytest\n\n\n{body}\n")
    result = pytester.runpytest_subprocess("-p", "skip_policy", "-p", "no:cacheprovider")
    assert result.ret == code, result.stdout.str()


def test_the_policy_holds_across_processes(pytester, monkeypatch) -> None:
    """The README's command runs the suite in two processes (pytest-xdist): a worker's
    skip reaches the policy in the process that sets the exit status."""
    monkeypatch.setenv("PYTHONPATH", str(TESTS))
    pytester.makepyfile(
        "import pytest\n\n\ndef test_a():\n    pass\n\n\n"
        "def test_b():\n    pytest.skip('the kernel library is not built')\n"
    )
    result = pytester.runpytest_subprocess("-p", "skip_policy", "-p", "no:cacheprovider", "-n", "2")
    assert result.ret == 1, result.stdout.str()
    assert "skipped tests of installed code" in result.stdout.str()
