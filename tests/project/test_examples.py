"""The example in examples/ runs: a few steps of the language model on 2 processes
with torchrun, data parallel and sequence parallel, and its loss falls."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_lm.py"


@pytest.mark.parametrize(
    "mode", [[], pytest.param(["--seq-parallel"], marks=pytest.mark.slow)]
)  # the sequence-parallel run (15 s) with the slow tests; test_distributed covers it
def test_language_model_trains_on_two_processes(mode) -> None:
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(EXAMPLE), "--steps", "8", "--log-every", "4", "--batch", "4", "--length", "64",
        "--width", "32", *mode,
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", done.stdout)]
    assert len(losses) == 3, done.stdout  # steps 1, 4 and 8
    assert losses[-1] < losses[0] - 0.5, done.stdout
    assert "tokens/s" in done.stdout
