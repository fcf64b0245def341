"""No work at import: ``import parascan`` costs little beyond ``import torch``, and
neither it nor ``parascan --help`` imports torch's compiler stack or an optional peer.

``import parascan`` once imported ``torch._dynamo`` (through
``torch.compiler.assume_constant_result``): about 1.8 s on top of torch's own import,
and ``parascan --help`` took 3.9 s. Each measurement runs in a fresh interpreter.
Times are the best of a few runs (the machine may be shared); parascan's bytecode is
cached (in a temporary folder) by a first run, as an installed package's is."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import parascan as ps
from parascan import _core

# Modules that `import parascan` must leave unimported: torch's compiler stack (seconds),
# and the optional peers and backends, imported only where used.
DEFERRED = ("torch._dynamo", "torch._inductor", "sympy", "triton", "transformers", "fla",
            "mamba_ssm", "matplotlib")  # fmt: skip
BUDGET_S = 0.2  # import parascan's time beyond import torch's

# One interpreter: import torch, then parascan, timed; which modules parascan added
# besides its own and the standard library's. Bytecode is written for the modules
# imported after torch (parascan's) under the given folder, whatever the environment
# says (PYTHONDONTWRITEBYTECODE would make every run compile parascan's sources).
_IMPORT = textwrap.dedent(
    """
    import json, sys, time
    import torch
    middle, cpu = time.perf_counter(), time.process_time()
    sys.dont_write_bytecode = False
    sys.pycache_prefix = {prefix!r}
    before = set(sys.modules)
    import parascan
    end, cpu = time.perf_counter(), time.process_time() - cpu
    added = sorted(
        m for m in set(sys.modules) - before
        if m.split(".")[0] not in sys.stdlib_module_names and m.split(".")[0] != "parascan"
    )
    deferred = [m for m in {deferred!r} if m in sys.modules]
    print(json.dumps({{"parascan": end - middle, "cpu": cpu, "added": added,
                      "deferred": deferred}}))
    """
)


def _run(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_import_parascan_costs_little_beyond_import_torch(tmp_path: Path) -> None:
    code = _IMPORT.format(prefix=str(tmp_path), deferred=DEFERRED)
    first = json.loads(_run(code))  # writes parascan's bytecode
    assert first["deferred"] == [], f"import parascan imported {first['deferred']}"
    assert first["added"] == [], f"import parascan imported {first['added']} besides torch"
    runs = [json.loads(_run(code)) for _ in range(3)]
    wall_s, cpu_s = min(r["parascan"] for r in runs), min(r["cpu"] for r in runs)
    # `import torch, parascan` less `import torch`, both timed inside one interpreter:
    # the difference of two interpreters' wall times (3 s each) varies by a second on a
    # shared machine, parascan's share by little; and in CPU time, which other work on
    # the machine does not lengthen as it does the wall clock's
    assert cpu_s < BUDGET_S, (
        f"import parascan took {cpu_s:.3f} s of CPU time ({wall_s:.3f} s) after import torch "
        f"(budget {BUDGET_S} s)"
    )


def test_parascan_help_imports_no_compiler() -> None:
    code = textwrap.dedent(
        f"""
        import runpy, sys
        sys.argv = ["parascan", "--help"]
        try:
            runpy.run_module("parascan", run_name="__main__")
        except SystemExit as exit:
            assert exit.code == 0, exit.code
        print([m for m in {DEFERRED!r} if m in sys.modules])
        """
    )
    out = _run(code)
    assert "usage: parascan" in out
    assert out.strip().splitlines()[-1] == "[]", out


def test_constant_results_are_marked_as_torch_marks_them() -> None:
    """``_core.assume_constant_result`` sets the attribute that
    ``torch.compiler.assume_constant_result`` sets (without importing torch._dynamo):
    were torch to mark them otherwise, torch.compile would trace into the file system
    (a graph break, an error under fullgraph=True)."""

    def probe() -> int:
        return 1

    marked = torch.compiler.assume_constant_result(probe)
    assert marked is probe
    assert vars(probe) == {"_dynamo_marked_constant": True}
    for fn in (_core._kernel_library_error, _core._triton_importable, _core._allow_in_graph):
        assert vars(fn).get("_dynamo_marked_constant") is True, fn


@pytest.mark.parametrize("backend", ["auto", "cpu"])
def test_the_constant_checks_compile_without_a_graph_break(backend: str) -> None:
    """A compiled call reads the backend table (the kernel library's and triton's
    availability) as constants: fullgraph=True compiles."""

    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return ps.linear_scan(a, b, 1, backend=backend)

    torch.compiler.reset()
    a, b = torch.rand(2, 7), torch.rand(2, 7)
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="eager")(a, b), f(a, b))
