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
