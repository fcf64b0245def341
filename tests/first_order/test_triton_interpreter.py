"""The ``triton`` backend on CPU tensors, in Triton's interpreter (TRITON_INTERPRET=1,
set by conftest.py). Its outputs, final states and gradients against the float64
loops run in the harness (test_first_order_against_loop.py: every dtype, short
lengths, the interpreter's target ``triton-interpreter``) and in the tests marked
``@pytest.mark.targets(interpreter=True)``; on a CUDA machine every test that takes a
``target`` runs the compiled kernels too. Skipped when triton is not installed
(``parascan[triton]``)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

import parascan as ps

from conftest import Target, targets
from harness import INTERPRETER_LENGTHS, LINEAR_SCAN, LOG_LINEAR_SCAN, grid


def test_the_harness_runs_the_interpreter() -> None:
    assert Target("triton", "cpu") in targets(interpreter=True)
    for spec in (LINEAR_SCAN, LOG_LINEAR_SCAN):
        cases = [p.values[0] for p in grid(spec)]
        longest = max(INTERPRETER_LENGTHS)
        interpreted = {c.dtype for c in cases if c.target.interpreted and c.steps == longest}
        assert interpreted == {
            d for d in spec.dtypes if spec.supports(Target("triton", "cpu"), d)
        }, spec.name


def test_triton_is_never_chosen_for_cpu_tensors_and_complex_logs_fall_back() -> None:
    assert "triton" not in ps.backends("cpu")
    x = torch.rand(2, 5)
    assert torch.equal(ps.linear_scan(x, x, -1), ps.linear_scan(x, x, -1, backend="cpu"))
    logs = torch.rand(2, 5, dtype=torch.complex64).log()
    with pytest.raises(RuntimeError, match="'triton' is not available for complex"):
        ps.log_linear_scan(logs, logs, -1, backend="triton")
