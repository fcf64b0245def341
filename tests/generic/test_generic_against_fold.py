"""associative_scan and associative_reduce against sequential folds (the harness,
harness.py): every combine function of harness.COMBINES (add, max, logaddexp, matmul
over operand dims, affine pairs (W, b), quaternion products, the first-order pair, a
dict pytree), forward and reverse, the standard lengths, negative dims and transposed
operands, each dtype the combine takes, outputs and every gradient."""

from __future__ import annotations

import pytest

from harness import ASSOCIATIVE_REDUCES, ASSOCIATIVE_SCANS, check, grid


@pytest.mark.parametrize("case", [p for spec in ASSOCIATIVE_SCANS for p in grid(spec)])
def test_associative_scan_matches_the_fold(case, gen) -> None:
    check(case, gen)


@pytest.mark.parametrize("case", [p for spec in ASSOCIATIVE_REDUCES for p in grid(spec)])
def test_associative_reduce_matches_the_fold(case, gen) -> None:
    check(case, gen)
