"""parascan.compat.heinsen_sequence against the paper's README semantics, checked
with the float64 loop of x_t = a_t x_{t-1} + b_t, x_0 included in the result
(oracles.heinsen_loop)."""

from __future__ import annotations

import pytest
import torch

from parascan.compat.heinsen_sequence import compute_in_parallel, compute_in_parallel_special_case

from conftest import assert_matches
from oracles import heinsen_loop as _loop


def test_general_case_with_negative_inputs(gen) -> None:
    coeffs = torch.randn(3, 500, generator=gen, dtype=torch.float64) * 0.7
    values = torch.randn(3, 501, generator=gen, dtype=torch.float64)
    x = compute_in_parallel(
        log_coeffs=coeffs.to(torch.complex64).log(), log_values=values.to(torch.complex64).log()
    )
    assert x.shape == (3, 501) and x.dtype == torch.float32
    assert_matches(x, _loop(coeffs, values), torch.complex64)


def test_special_case_long_sequence_is_accurate(gen) -> None:
    """10^5 steps with a in [0.9, 1]: the cumsum formulation drifts; this does not."""
    coeffs = 0.9 + 0.1 * torch.rand(100_000, generator=gen, dtype=torch.float64)
    values = torch.rand(100_001, generator=gen, dtype=torch.float64) * 3
    x = compute_in_parallel_special_case(coeffs.float().log(), values.float().log())
    want = _loop(coeffs.float().double(), values.float().double())
    assert (x.double().log() - want.log()).abs().max().item() <= 1e-5


def test_gradients_are_finite_with_zero_values(gen) -> None:
    coeffs = torch.rand(2, 30, generator=gen, dtype=torch.float64)
    values = torch.rand(2, 31, generator=gen, dtype=torch.float64)
    values[:, :5] = 0.0  # x0 = 0 and b = 0 for a while: log 0 = -inf
    lc = coeffs.log().requires_grad_()
    lv = values.log().requires_grad_()
    x = compute_in_parallel_special_case(lc, lv)
    assert_matches(x, _loop(coeffs, values), torch.float64)
    x.sum().backward()
    assert torch.isfinite(lc.grad).all() and torch.isfinite(lv.grad).all()


def test_wrong_lengths_raise() -> None:
    with pytest.raises(ValueError, match="one longer"):
        compute_in_parallel(torch.zeros(5), torch.zeros(5))
