"""parascan.cli.bench_ssd: the minimal SSD written for the bench computes Mamba-2's scan
(against the float64 loop of tests/oracles.py), and the SSD rows check every
implementation before timing it, give a wrong one no speed, and compare with a FLOP
limit measured in the same run."""

from __future__ import annotations

import io

import pytest
import torch

import parascan
from parascan.cli import bench, bench_ssd
from parascan.cli.common import cu_seqlens

from conftest import assert_matches
from oracles import ssd_loop

TINY = bench_ssd.SsdCase("tiny ssd", 2, 21, 4, 8, 5, groups=2)


@pytest.mark.parametrize("length", [1, 17, 64, 65, 129])
@pytest.mark.parametrize("groups", [1, 2])
def test_minimal_ssd_matches_the_loop(length, groups) -> None:
    gen = torch.Generator().manual_seed(length + groups)
    x = torch.randn(2, length, 4, 3, generator=gen, dtype=torch.float64)
    dt = torch.randn(2, length, 4, generator=gen, dtype=torch.float64)
    A = -torch.rand(4, generator=gen, dtype=torch.float64) * 2
    B, C = torch.randn(2, 2, length, groups, 5, generator=gen, dtype=torch.float64)
    D, dt_bias = torch.randn(2, 4, generator=gen, dtype=torch.float64)
    got = bench_ssd.minimal_ssd(x, dt, A, B, C, D, dt_bias, chunk=16)
    want, _ = ssd_loop(x, dt, A, B, C, D=D, dt_bias=dt_bias, dt_softplus=True)
    assert_matches(got, want, torch.float64)


def test_rows_of_every_implementation_and_direction() -> None:
    lines: list[str] = []
    rows = bench_ssd.run_ssd([TINY], repeat=1, step=lines.append)
    impls = ["parascan", "minimal SSD", "transformers"]  # transformers is a test extra
    assert [(r.impl, r.direction) for r in rows] == [
        (i, d) for i in impls for d in ("forward", "forward+backward")
    ]
    assert lines == bench_ssd.ssd_step_names(TINY)
    for r in rows:
        assert r.correct and r.max_error is not None and r.max_error < 1e-4, r
        assert r.time_ms is not None and r.time_ms > 0 and r.limit_ms > 0
        assert r.vs_limit == pytest.approx(r.time_ms / r.limit_ms)
        assert r.shape == (2, 21, 4, 8, 5, 2)
    assert rows[0].parascan_speedup == 1.0 and rows[1].peak_extra_mib is not None
    table = bench_ssd.format_ssd(rows)
    assert "SSD scan" in table and "minimal SSD" in table and "WRONG" not in table


def test_a_wrong_result_gets_no_speed(monkeypatch) -> None:
    real = parascan.ssd_scan
    monkeypatch.setattr(parascan, "ssd_scan", lambda *a, **kw: real(*a, **kw) * 1.001)
    out = io.StringIO()
    status = bench.run_bench(cases=[], ssm_cases=[TINY], repeat=1, out=out)
    assert status == 1
    wrong = [line for line in out.getvalue().splitlines() if "WRONG" in line]
    assert len(wrong) == 2 and all("parascan" in line for line in wrong)


def test_the_packed_row_is_checked_against_each_sequence_alone(monkeypatch) -> None:
    """A case with packed sequences adds a row of the same tokens as that many sequences
    (batch 1; some may be empty), checked against the float64 loop over each sequence
    alone: a scan that let the state cross a boundary would be WRONG."""
    case = bench_ssd.SsdCase("tiny packed", 1, 37, 4, 8, 5, packed=5)
    cu = cu_seqlens(case.length, case.packed, case.seed + 2)
    assert cu[0] == 0 and cu[-1] == 37 and len(cu) == 6 and bool((cu[1:] >= cu[:-1]).all())
    rows = bench_ssd.run_ssd([case], repeat=1)
    packed = [r for r in rows if r.impl == "parascan packed"]
    assert [r.direction for r in packed] == ["forward", "forward+backward"]
    assert all(r.correct and r.parascan_speedup is not None for r in packed)
    assert "5 sequences" in packed[0].note

    real = parascan.ssd_scan

    def leaky(*args, cu_seqlens=None, **kwargs):  # type: ignore[no-untyped-def]
        return real(*args, **kwargs)  # the boundaries ignored: one sequence

    monkeypatch.setattr(parascan, "ssd_scan", leaky)
    rows = bench_ssd.run_ssd([case], repeat=1)
    assert [r.correct for r in rows if r.impl == "parascan packed"] == [False, False]
