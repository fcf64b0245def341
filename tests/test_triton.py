"""The ``triton`` backend, run by Triton's interpreter on CPU tensors (TRITON_INTERPRET=1),
on tiny shapes, against the float64 loop: linear_scan (real and complex) and
log_linear_scan, forward and fused backward, every dtype, both layouts, reverse,
initial and final states. Skipped when triton is not installed (``parascan[triton]``).

The interpreter runs a kernel step by step in Python, so lengths stay under 50; T = 40
still spans three chunks of 16, so the carry pass between chunks is exercised. On a
CUDA machine the whole suite also runs the ``triton`` backend (``ps.backends("cuda")``).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
    pytest.skip("needs TRITON_INTERPRET=1 (conftest sets it) or CUDA", allow_module_level=True)

import parascan as ps

from conftest import (
    DTYPES,
    assert_matches,
    log_loop_oracle,
    loop_oracle,
    oracle_dtype,
    random_gates,
    random_tokens,
)

LAYOUTS = [((2, 40, 3), 1), ((3, 40), -1)]
# CPU tensors go through the interpreter; on a CUDA machine the kernels run compiled too.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _state(shape, dim):
    d = dim % len(shape)
    return shape[:d] + shape[d + 1 :]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_matches_the_loop(dtype, device, gen) -> None:
    for shape, dim in LAYOUTS:
        for reverse in (False, True):
            gates = random_gates(shape, dtype, gen).to(device)
            tokens = random_tokens(shape, dtype, gen).to(device)
            initial = random_tokens(_state(shape, dim), dtype, gen).to(device)
            out, final = ps.linear_scan(
                gates, tokens, dim, initial=initial, reverse=reverse, return_final=True,
                backend="triton",
            )  # fmt: skip
            o = oracle_dtype(dtype)
            want, want_final = loop_oracle(gates.to(o), tokens.to(o), dim, initial.to(o), reverse)
            assert out.dtype == dtype
            assert_matches(out, want, dtype)
            assert_matches(final, want_final, dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128])
@pytest.mark.parametrize("reverse", [False, True])
def test_gradients_match_the_loop(dtype, reverse, device, gen) -> None:
    shape, dim = (2, 37, 3), 1
    inputs = [
        random_gates(shape, dtype, gen).to(device).requires_grad_(),
        random_tokens(shape, dtype, gen).to(device).requires_grad_(),
        random_tokens(_state(shape, dim), dtype, gen).to(device).requires_grad_(),
    ]
    weights = random_tokens(shape, dtype, gen).to(device)
    out = ps.linear_scan(*inputs[:2], dim, initial=inputs[2], reverse=reverse, backend="triton")
    got = torch.autograd.grad((out * weights).real.sum(), inputs)
    want_out, _ = loop_oracle(*inputs[:2], dim, inputs[2], reverse)
    want = torch.autograd.grad((want_out * weights).real.sum(), inputs)
    for a, e in zip(got, want, strict=True):
        assert_matches(a, e, dtype)


@pytest.mark.parametrize("steps", [0, 1, 2])
def test_short_and_empty_sequences(steps, gen) -> None:
    gates = random_gates((3, steps), torch.float32, gen).requires_grad_()
    tokens = random_tokens((3, steps), torch.float32, gen).requires_grad_()
    out, final = ps.linear_scan(gates, tokens, -1, return_final=True, backend="triton")
    want, want_final = loop_oracle(gates.double(), tokens.double(), -1)
    assert_matches(out, want, torch.float32)
    assert_matches(final, want_final, torch.float32)
    if steps:
        got = torch.autograd.grad(out.sum(), (gates, tokens))
        expected = torch.autograd.grad(loop_oracle(gates, tokens, -1)[0].sum(), (gates, tokens))
        for a, e in zip(got, expected, strict=True):
            assert_matches(a, e, torch.float32)


def _log_inputs(shape, dtype, gen):
    log_gates = (torch.rand(shape, generator=gen, dtype=torch.float64) * 0.9 + 0.05).log()
    tokens = torch.rand(shape, generator=gen, dtype=torch.float64)
    tokens[..., :3] = 0.0  # log 0 at the start of every sequence
    return log_gates.to(dtype), tokens.log().to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_log_forward_matches_the_loop(dtype, gen) -> None:
    for reverse in (False, True):
        log_gates, log_tokens = _log_inputs((2, 40), dtype, gen)
        initial = torch.randn(2, generator=gen, dtype=torch.float64).to(dtype)
        out, final = ps.log_linear_scan(
            log_gates, log_tokens, -1, initial=initial, reverse=reverse, return_final=True,
            backend="triton",
        )  # fmt: skip
        want, want_final = log_loop_oracle(
            log_gates.double(), log_tokens.double(), -1, initial.double(), reverse
        )
        assert_matches(out, want, dtype)
        assert_matches(final, want_final, dtype)


@pytest.mark.parametrize("reverse", [False, True])
def test_log_gradients_are_exact_and_finite(reverse, gen) -> None:
    log_gates, log_tokens = _log_inputs((2, 37), torch.float64, gen)
    # a whole log-0 row without an initial state, and one with an initial state
    log_tokens[0] = float("-inf")
    inputs = [log_gates.requires_grad_(), log_tokens.requires_grad_()]
    weights = torch.randn(2, 37, generator=gen, dtype=torch.float64)
    for initial in (None, torch.randn(2, generator=gen, dtype=torch.float64).requires_grad_()):
        leaves = inputs + ([initial] if initial is not None else [])
        out = ps.log_linear_scan(*inputs, -1, initial=initial, reverse=reverse, backend="triton")
        finite = torch.isfinite(out)
        got = torch.autograd.grad((out.where(finite, 0) * weights).sum(), leaves)
        reference = ps.log_linear_scan(
            *inputs, -1, initial=initial, reverse=reverse, backend="loop"
        )
        want = torch.autograd.grad((reference.where(finite, 0) * weights).sum(), leaves)
        for a, e in zip(got, want, strict=True):
            assert torch.isfinite(a).all()
            torch.testing.assert_close(a, e)


def test_triton_is_never_chosen_for_cpu_tensors_and_complex_logs_fall_back() -> None:
    assert "triton" not in ps.backends("cpu")
    x = torch.rand(2, 5)
    assert torch.equal(ps.linear_scan(x, x, -1), ps.linear_scan(x, x, -1, backend="cpu"))
    logs = torch.rand(2, 5, dtype=torch.complex64).log()
    with pytest.raises(RuntimeError, match="'triton' is not available for complex"):
        ps.log_linear_scan(logs, logs, -1, backend="triton")
