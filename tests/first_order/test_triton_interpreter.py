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


@pytest.mark.slow  # 20 s interpreted; the default suite's interpreter tests run one of each
@pytest.mark.parametrize("op", ["linear", "log"])
def test_both_tiles_and_both_chunk_plans_run_and_match_the_loop(op, monkeypatch) -> None:
    """The harness's interpreted cases reach every launch plan: the time-major and the
    time-contiguous tile (scanned with tl.associative_scan), one chunk (no carry pass)
    and several; here each plan is checked against the float64 loop with lengths on
    and next to the interpreter's tile and chunk sizes (read from the kernels)."""
    from parascan.first_order import triton_kernels as kernels

    from oracles import linear_loop, log_loop

    seen = set()
    plan = kernels.plan

    def recording(steps, channels, time_stride, chunk=None):
        tile, chunk = plan(steps, channels, time_stride, chunk)
        seen.add((tile, -(-steps // chunk) == 1))
        return tile, chunk

    monkeypatch.setattr(kernels, "plan", recording)
    major, contiguous = kernels.INTERPRETED_BLOCKS
    lengths = sorted({1, contiguous.steps + 1, contiguous.min_chunk, 2 * contiguous.min_chunk + 1})
    scan, loop = (ps.linear_scan, linear_loop) if op == "linear" else (ps.log_linear_scan, log_loop)
    gen = torch.Generator().manual_seed(5)
    for steps in lengths:
        for shape, dim in (
            ((2, steps, 2 * major.channels + 1), 1),
            ((2 * contiguous.channels + 1, steps), -1),
        ):
            gates = torch.rand(shape, generator=gen, dtype=torch.float64) * 0.5 + 0.5
            if op == "log":
                gates = gates.log()
            tokens = torch.randn(shape, generator=gen, dtype=torch.float64)
            state = tuple(n for i, n in enumerate(shape) if i != dim % len(shape))
            initial = torch.randn(state, generator=gen, dtype=torch.float64)
            for reverse in (False, True):
                got = scan(gates, tokens, dim, initial=initial, reverse=reverse, backend="triton")
                want, _ = loop(gates, tokens, dim, initial, reverse)
                torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert seen == {(t, one) for t in (major, contiguous) for one in (True, False)}


# 15 to 25 s each interpreted, all four (reverse, initial) pairs on each layout: with the
# slow tests; by default linear_scan's, two pairs a layout (each direction and each kind
# of start on each, every pair on some). log_linear_scan's is the same direct path
# (api.fast_path) with the log semiring, which
# test_the_direct_path_leaves_to_the_op_what_it_does_not_take checks it takes.
@pytest.mark.parametrize(
    ("op", "every_pair"),
    [
        ("linear", False),
        pytest.param("linear", True, marks=pytest.mark.slow),
        pytest.param("log", True, marks=pytest.mark.slow),
    ],
)
def test_calls_without_gradients_reach_the_kernels_directly(op, every_pair, monkeypatch) -> None:
    """A call that needs no gradient goes straight to the Triton kernels, past the op
    machinery (whose host time left an H200 waiting: 0.36 ms per call through the op,
    0.09 ms in the launch), with the general path's result bit for bit; the op's own
    forward never runs."""
    from dataclasses import replace

    from parascan.first_order.ops import ROWS

    scan = ps.linear_scan if op == "linear" else ps.log_linear_scan
    gen = torch.Generator().manual_seed(11)
    cases = []
    for i, (shape, dim) in enumerate([((2, 9, 5), 1), ((3, 13), -1), ((4, 3, 7), -3)]):
        gates = torch.rand(shape, generator=gen) * 0.5 + 0.5
        gates = gates.log() if op == "log" else gates
        tokens = torch.randn(shape, generator=gen)
        tokens = tokens.abs().log() if op == "log" else tokens
        d = dim % len(shape)
        initial = torch.randn(shape[:d] + shape[d + 1 :], generator=gen)
        for reverse in (False, True):
            for h in (None, initial):
                if not every_pair and (h is None) != (reverse == bool(i % 2)):
                    continue  # (False, None), (True, initial); then the other two
                # the general path: the op, with autograd recording
                a, b = gates.clone().requires_grad_(), tokens.clone()
                out, final = scan(a, b, dim, initial=h, reverse=reverse, return_final=True,
                                  backend="triton")  # fmt: skip
                cases.append((gates, tokens, dim, h, reverse, out.detach(), final.detach()))

    def fail(*args):  # type: ignore[no-untyped-def]
        raise AssertionError("the op ran")

    row = ROWS[op].backends
    monkeypatch.setitem(row, "triton", replace(row["triton"], forward=fail))
    for gates, tokens, dim, h, reverse, out, final in cases:
        got, got_final = scan(gates, tokens, dim, initial=h, reverse=reverse, return_final=True,
                              backend="triton")  # fmt: skip
        assert torch.equal(got, out) and torch.equal(got_final, final)
        assert got_final.untyped_storage().data_ptr() != got.untyped_storage().data_ptr()
        with torch.no_grad():  # gradients asked for, but autograd is off
            got = scan(gates.requires_grad_(), tokens, dim, initial=h, reverse=reverse,
                       backend="triton")  # fmt: skip
        gates.requires_grad_(False)
        assert torch.equal(got, out)


def test_the_direct_path_leaves_to_the_op_what_it_does_not_take(monkeypatch) -> None:
    """The direct path runs the Triton kernels only where the op would pick them: a
    dtype their row excludes, mixed dtypes, another backend, or CPU tensors outside the
    interpreter take the general path (which refuses the last)."""
    from parascan.first_order import api
    from parascan.first_order.semiring import LINEAR, LOG

    x = torch.rand(3, 8)
    assert api.fast_path(LINEAR, x, x, 1, None, False, False, "triton") is not None
    logs = x.to(torch.complex64).log()
    assert api.fast_path(LOG, logs, logs, 1, None, False, False, "triton") is None  # real only
    assert api.fast_path(LOG, x.log(), x.log(), 1, None, False, False, "triton") is not None
    assert api.fast_path(LINEAR, x, x.double(), 1, None, False, False, "triton") is None
    assert api.fast_path(LINEAR, x, x, 1, None, False, False, "torch") is None
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert api.fast_path(LINEAR, x, x, 1, None, False, False, "triton") is None
    with pytest.raises(RuntimeError, match="'triton' is not available: it runs on CUDA"):
        ps.linear_scan(x, x, 1, backend="triton")
