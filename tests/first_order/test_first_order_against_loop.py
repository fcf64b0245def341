"""linear_scan and log_linear_scan against the float64 loops (the harness, harness.py):
outputs, final states and every gradient, on every target, dtype, standard length
and layout; unsupported (target, dtype) pairs raise the contract's RuntimeError."""

from __future__ import annotations

import pytest

from harness import LINEAR_SCAN, LOG_LINEAR_SCAN, check, grid


@pytest.mark.parametrize("case", grid(LINEAR_SCAN))
def test_linear_scan_matches_the_loop(case, gen) -> None:
    check(case, gen)


@pytest.mark.parametrize("case", grid(LOG_LINEAR_SCAN))
def test_log_linear_scan_matches_the_loop(case, gen) -> None:
    check(case, gen)
