"""matrix_linear_scan against the float64 loop (the harness, harness.py): outputs,
final states and every gradient, on every target, dtype, standard length and layout
(broadcast batch dims, weights shared by the batch, column-major and stride-0
weights); the Triton backend and the C kernel's complex dtypes raise the contract's
RuntimeError."""

from __future__ import annotations

import pytest

from harness import MATRIX_LINEAR_SCAN, check, grid


@pytest.mark.parametrize("case", grid(MATRIX_LINEAR_SCAN))
def test_matrix_linear_scan_matches_the_loop(case, gen) -> None:
    check(case, gen)
