"""The kernels' block constants come from the built library (kernel_constants()), and
the harness places its lengths and sizes around them."""

from __future__ import annotations

from parascan._native import kernel_constants

from harness import constants, one_past_a_tile, rows, standard_lengths, wide


def test_the_library_exports_its_constants() -> None:
    c = kernel_constants()
    assert set(c) >= {"BLOCK", "ROWS", "TILE", "LONG_STEPS", "LONG_ROWS", "LONG_CHUNKS",
                      "LONG_MIN_LEN", "LONG_CHUNK_BYTES", "PRODUCT_ITEMS",
                      "PRODUCT_MIN_SEGMENT"}  # fmt: skip
    assert all(v > 0 for v in c.values()), c


def test_the_harness_sizes_come_from_them() -> None:
    c = kernel_constants()
    assert constants() == c
    assert {c["TILE"] - 1, c["TILE"], c["TILE"] + 1, 2 * c["TILE"] + 1} <= set(standard_lengths())
    assert rows() == c["ROWS"] + 1
    assert wide() == c["BLOCK"] + 1
    assert one_past_a_tile() == c["TILE"] + 1
