"""Rows of 2**16 steps and more in the CPU kernels, which cut such rows into chunks
scanned in parallel: lengths and row counts on and around the kernels' own long-row
constants (``kernel_constants()``: LONG_STEPS, LONG_ROWS, LONG_CHUNKS, LONG_MIN_LEN,
LONG_CHUNK_BYTES), outputs and final states against the float64 loops."""

from __future__ import annotations

import pytest
import torch

import parascan as ps

from conftest import DTYPES, assert_matches, oracle_dtype, random_gates, random_tokens
from harness import constants
from oracles import python_linear_loop, python_log_loop

pytestmark = pytest.mark.skipif(
    "cpu" not in ps.backends("cpu"), reason="the cpu backend is not built"
)

# name -> (rows, steps) from the constants
LONG = {
    "one row, a prime past LONG_STEPS": lambda c: (1, c["LONG_STEPS"] + 1031),
    "three rows, two blocks of minimal chunks past LONG_STEPS": lambda c: (
        3, c["LONG_STEPS"] + 2 * c["LONG_CHUNKS"] * c["LONG_MIN_LEN"]
    ),
}  # fmt: skip
BOUNDARIES = {
    "one step short of LONG_STEPS": lambda c: (2, c["LONG_STEPS"] - 1),
    "LONG_ROWS rows": lambda c: (c["LONG_ROWS"], c["LONG_STEPS"]),
    "one row more than LONG_ROWS": lambda c: (c["LONG_ROWS"] + 1, c["LONG_STEPS"]),
}


def _loop(
    gates: torch.Tensor, tokens: torch.Tensor, initial: torch.Tensor, reverse: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """oracles.linear_loop along the last dim of (rows, steps) inputs, row by row in
    Python's float64 (complex128) numbers: the same products and sums, without a torch
    op per step (seconds at these lengths)."""
    high = oracle_dtype(gates.dtype)
    a, b, h = gates.to(high), tokens.to(high), initial.to(high)
    want = torch.tensor(
        [
            python_linear_loop(a[r].tolist(), b[r].tolist(), h[r].item(), reverse)
            for r in range(a.shape[0])
        ],
        dtype=high,
    )
    return want, want[:, 0 if reverse else -1]


def _check(rows: int, steps: int, dtype: torch.dtype, reverse: bool, gen) -> None:
    gates = random_gates((rows, steps), dtype, gen)
    tokens = random_tokens((rows, steps), dtype, gen)
    initial = random_tokens((rows,), dtype, gen)
    out, final = ps.linear_scan(
        gates, tokens, -1, initial=initial, reverse=reverse, return_final=True, backend="cpu"
    )
    want, want_final = _loop(gates, tokens, initial, reverse)
    assert_matches(out, want, dtype)
    assert_matches(final, want_final, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(LONG))
def test_long_rows_chunked_over_time(dtype, case, gen) -> None:
    rows, steps = LONG[case](constants())
    _check(rows, steps, dtype, reverse=rows > 1, gen=gen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex128], ids=str)
@pytest.mark.parametrize("case", list(BOUNDARIES))
def test_where_the_long_row_path_starts(dtype, case, gen) -> None:
    rows, steps = BOUNDARIES[case](constants())
    _check(rows, steps, dtype, reverse=dtype.is_complex, gen=gen)


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.complex64, torch.complex128], ids=str
)
def test_long_rows_span_several_cache_blocks(dtype, gen) -> None:
    """The long-row kernel walks a row in blocks of LONG_CHUNKS chunks of
    LONG_CHUNK_BYTES of each input: whole blocks; a shorter last block cut into
    shorter chunks plus a few serial steps; a last block one step too short to cut
    into chunks of LONG_MIN_LEN. Reverse and initial states too, against the
    recurrence in Python's float64."""
    c = constants()
    block = c["LONG_CHUNKS"] * (c["LONG_CHUNK_BYTES"] // dtype.itemsize)
    whole = -(-c["LONG_STEPS"] // block)  # enough whole blocks to take the long path
    cut = c["LONG_CHUNKS"] * (c["LONG_MIN_LEN"] + 6) + 5
    too_short = c["LONG_CHUNKS"] * c["LONG_MIN_LEN"] - 1
    for rows, steps, reverse in [
        (1, (whole + 1) * block + cut, False),
        (2, whole * block + too_short, True),
    ]:
        gates = random_gates((rows, steps), dtype, gen)
        tokens = random_tokens((rows, steps), dtype, gen)
        initial = random_tokens((rows,), dtype, gen)
        out, final = ps.linear_scan(
            gates, tokens, -1, initial=initial, reverse=reverse, return_final=True,
            backend="cpu",
        )  # fmt: skip
        want = torch.tensor(
            [
                python_linear_loop(
                    gates[r].tolist(), tokens[r].tolist(), initial[r].item(), reverse
                )
                for r in range(rows)
            ],
            dtype=oracle_dtype(dtype),
        )
        assert_matches(out, want, dtype)
        assert_matches(final, want[:, 0 if reverse else -1], dtype)


def test_long_rows_do_not_depend_on_thread_count(gen) -> None:
    steps = 2 * constants()["LONG_STEPS"] + 5
    gates = random_gates((2, steps), torch.float32, gen)
    tokens = random_tokens((2, steps), torch.float32, gen)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3, 4):
            torch.set_num_threads(threads)
            results.append(ps.linear_scan(gates, tokens, -1, backend="cpu"))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(results[0], r) for r in results[1:])


def _log_inputs(shape, dtype, gen):  # type: ignore[no-untyped-def]
    gates = random_gates(shape, oracle_dtype(dtype), gen)
    if dtype.is_complex:
        return gates.log().to(dtype), random_tokens(shape, torch.complex128, gen).log().to(dtype)
    return gates.log().to(dtype), random_tokens(shape, torch.float64, gen).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex64], ids=str)
def test_long_log_rows_chunked_over_time(dtype, gen) -> None:
    """log_linear_scan's kernel chains the log-space carries of its chunks; reverse
    with an initial state too."""
    c = constants()
    rows, steps = 3, c["LONG_STEPS"] + 2 * c["LONG_CHUNKS"] * c["LONG_MIN_LEN"]
    la, lb = _log_inputs((rows, steps), dtype, gen)
    h0 = _log_inputs((rows,), dtype, gen)[1]
    for reverse in (False, True):
        out, final = ps.log_linear_scan(
            la, lb, -1, initial=h0, reverse=reverse, return_final=True, backend="cpu"
        )
        want = torch.tensor(
            [
                python_log_loop(la[r].tolist(), lb[r].tolist(), complex(h0[r].item()), reverse)
                for r in range(rows)
            ],
            dtype=torch.complex128,
        )
        if dtype.is_complex:  # compare x = exp(h): the phase is defined modulo 2 pi
            out, final, want = out.exp(), final.exp(), want.exp()
        else:
            want = want.real
        assert_matches(out, want, dtype)
        assert_matches(final, want[:, 0 if reverse else -1], dtype)
