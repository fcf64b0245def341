"""The Triton kernels compile for real GPUs (NVIDIA sm_80, sm_90; AMD gfx942) on this CPU-only
machine with no register spills and within the target's shared memory: every
specialization the ``triton`` backend launches (see tools/gpu/first_order_compile.py, which compiles
them in a process of its own, since these tests run with TRITON_INTERPRET=1). A
failure names the kernel and the figure."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

HELPER = Path(__file__).parents[2] / "tools" / "gpu" / "first_order_compile.py"
# shared memory (LDS) one block may use: A100, H100, MI300
SHARED_LIMIT = {"sm_80": 163 * 1024, "sm_90": 227 * 1024, "gfx942": 64 * 1024}


def _report(full: bool, packed: bool = False) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(HELPER), *(["--full"] if full else []),
         *(["--packed"] if packed else [])],
        capture_output=True, text=True, env=env, timeout=7200,  # the full set: 6720 compiles
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


def _check(rows: list[dict]) -> None:
    assert rows, "tools/gpu/first_order_compile.py compiled nothing"
    problems = []
    for row in rows:
        what = row["what"]
        if "error" in row:
            problems.append(f"{what}: {row['error']}")
        elif not row["binary"] or row["registers"] is None or row["spilled"] is None:
            problems.append(f"{what}: no binary, or no figures in the report: {row['report']}")
        elif row["spilled"]:
            problems.append(f"{what}: spills ({row['spilled']}), {row['registers']} registers")
        elif row["shared"] > SHARED_LIMIT[row["arch"]]:
            problems.append(f"{what}: {row['shared']} bytes of shared memory")
    assert not problems, "\n".join(problems)


def test_every_pass_compiles_for_the_gpus_without_spills() -> None:
    # every (mode, dtype, tile, kernel) with reverse, an initial state and several chunks
    rows = _report(full=False)
    assert len(rows) == 3 * 20 * 2 * 3  # 3 targets x 20 (mode, dtype) x 2 tiles x 3 kernels
    _check(rows)


@pytest.mark.slow
def test_every_packed_pass_compiles_for_the_gpus_without_spills() -> None:
    # the same with packed sequences (each step's sequence id, the restarts' flags)
    rows = _report(full=False, packed=True)
    assert len(rows) == 3 * 20 * 2 * 3
    assert all("'PACKED': True" in row["what"] for row in rows)
    _check(rows)


@pytest.mark.slow
def test_every_flag_combination_compiles_without_spills() -> None:
    rows = _report(full=True)
    assert len(rows) == 3 * 20 * 2 * 2 * (8 + 4 + 16)  # _summaries, _carries, _apply
    _check(rows)
