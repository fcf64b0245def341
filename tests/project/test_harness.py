"""The harness (harness.py) can fail: each of its checks, handed a deliberately wrong
result, fails the case. A wrong output or final state (by a factor of 1.001), a
wrong gradient, a modified input, a wrong dtype, a non-contiguous result, and an
unsupported combination that does not raise."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import Target
from harness import (
    ASSOCIATIVE_REDUCES,
    ASSOCIATIVE_SCANS,
    LINEAR_SCAN,
    LOG_LINEAR_SCAN,
    MATRIX_LINEAR_SCAN,
    OPS,
    Case,
    OpSpec,
    check,
    grid,
)

FAILED = (AssertionError, pytest.fail.Exception)
SPECS = [LINEAR_SCAN, LOG_LINEAR_SCAN, MATRIX_LINEAR_SCAN, ASSOCIATIVE_SCANS[5],
         ASSOCIATIVE_REDUCES[3]]  # fmt: skip


class _ScaleGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # type: ignore[no-untyped-def]
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def]
        return grad * 1.001


def _sabotaged(spec: OpSpec, how: str) -> OpSpec:
    def run(inputs, case):  # type: ignore[no-untyped-def]
        out = list(spec.run(inputs, case))
        if how == "output":
            out[0] = out[0] * 1.001
        elif how == "final":
            out[-1] = out[-1] * 1.001
        elif how == "gradient":
            out = [_ScaleGradient.apply(o) for o in out]
        elif how == "modifies an input":
            next(iter(inputs.values())).data.mul_(1.001)  # unseen by autograd
        elif how == "dtype":
            out[0] = out[0].to(torch.complex128)
        elif how == "not contiguous":
            out[0] = out[0].transpose(0, -1).contiguous().transpose(0, -1)
        return tuple(out)

    return dataclasses.replace(spec, run=run)


def _a_case(spec: OpSpec, dtype: torch.dtype = torch.float64) -> Case:
    """A case of ``spec`` on the CPU with 17 steps (initial state where it takes one)."""
    for p in grid(spec):
        case = p.values[0]
        on_cpu = case.target.device == "cpu" and not case.target.interpreted
        if on_cpu and case.dtype == dtype and case.steps == 17 and case.layout is spec.layouts[0]:
            return case
    raise AssertionError(f"no case of {spec.name} at 17 steps")


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.name}{s.label and '-' + s.label}")
@pytest.mark.parametrize(
    "how", ["output", "final", "gradient", "modifies an input", "dtype", "not contiguous"]
)
def test_every_check_fails_on_a_wrong_result(spec, how, gen) -> None:
    case = _a_case(spec)
    check(case, gen)  # passes as it is
    if how == "not contiguous" and not spec.contiguous:
        return  # associative_scan promises no layout
    if how == "final" and spec.name.startswith("associative"):
        how = "output"  # no final state
    with pytest.raises(FAILED):
        check(dataclasses.replace(case, spec=_sabotaged(spec, how)), gen)


def test_complex_logs_are_compared_through_exp(gen) -> None:
    case = _a_case(LOG_LINEAR_SCAN, torch.complex128)
    check(case, gen)
    with pytest.raises(FAILED):
        check(dataclasses.replace(case, spec=_sabotaged(LOG_LINEAR_SCAN, "output")), gen)


def test_an_unsupported_combination_must_raise(gen) -> None:
    case = _a_case(LINEAR_SCAN)
    says_unsupported = dataclasses.replace(LINEAR_SCAN, supports=lambda target, dtype: False)
    with pytest.raises(FAILED, match="DID NOT RAISE"):
        check(dataclasses.replace(case, spec=says_unsupported), gen)


def test_every_op_has_cases_on_every_cpu_backend() -> None:
    for spec in OPS:
        backends = {p.values[0].target.backend for p in grid(spec)}
        wanted = {"auto"} if spec.backends is None else {t.backend for t in spec.targets()}
        assert backends == wanted, spec.name
    assert Target("cpu", "cpu") in LINEAR_SCAN.targets()
