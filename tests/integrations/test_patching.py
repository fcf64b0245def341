"""The integrations' patching engine on a library made up here: finding the modules that
define a marker by their source, replacing functions and methods idempotently, and
putting back exactly what was there."""

from __future__ import annotations

import sys
import types

import pytest

from parascan.integrations._patching import Function, Patches, leading_params, modules_defining


def _module(name: str, source: str) -> types.ModuleType:
    module = types.ModuleType(name)
    exec(compile(source, name, "exec"), module.__dict__)
    return module


def test_modules_defining_reads_sources_and_names_them_by_their_path(tmp_path) -> None:
    scan = "x = 1\ndef scan(x):\n    return x\n"
    files = {
        "a/modeling_a.py": scan,
        "b/modeling_b.py": scan + "def other(y):\n    pass\n",
        "c/modeling_c.py": "x = 1\n# def scan(x): a comment, not a definition\n",
        "a/helpers.py": scan,  # not a modeling file
    }
    for relative, text in files.items():
        (tmp_path / relative).parent.mkdir(exist_ok=True)
        (tmp_path / relative).write_text(text)
    found = modules_defining(str(tmp_path), "*/modeling_*.py", "lib.models", "scan", ())
    assert found == ("lib.models.a.modeling_a", "lib.models.b.modeling_b")
    # a module that defines another family's marker is that family's
    assert modules_defining(str(tmp_path), "*/modeling_*.py", "lib.models", "scan", ("other",)) == (
        "lib.models.a.modeling_a",
    )


def test_patches_apply_once_and_restore_what_was_there(monkeypatch) -> None:
    source = (
        "def scan(x, y):\n    return 'scan'\n"
        "class Layer:\n    @staticmethod\n    def step(x):\n        return 'step'\n"
    )
    module = _module("_parascan_fake_modeling", source)
    monkeypatch.setitem(sys.modules, module.__name__, module)
    original_scan, original_step = module.scan, vars(module.Layer)["step"]

    def scan(x, y):  # type: ignore[no-untyped-def]
        return "ours"

    def step(x):  # type: ignore[no-untyped-def]
        return "our step"

    patches = Patches()
    targets = [(module, Function("scan", scan)), (module, Function("Layer.step", step, ("x",)))]
    names = patches.apply(targets)
    assert names == ["_parascan_fake_modeling.Layer.step", "_parascan_fake_modeling.scan"]
    assert module.scan(1, 2) == "ours" and module.Layer.step(1) == "our step"
    assert patches.apply(targets) == names  # idempotent: the originals are kept, not ours
    assert patches.original(module, "scan") is original_scan
    assert patches.restore() == names and patches.names() == []
    assert module.scan is original_scan and vars(module.Layer)["step"] is original_step
    assert patches.restore() == []


@pytest.mark.parametrize(
    ("params", "expected"), [(("x", "y"), None), (("x",), None), (("y",), ("x", "y", "z"))]
)
def test_leading_params(params, expected) -> None:
    def original(x, y, z=None):  # type: ignore[no-untyped-def]
        return x

    assert leading_params(original, Function("f", original, params)) == expected
