"""linear_scan beyond the harness (test_first_order_against_loop.py): Python-number
gates, dtype promotion and rounding, every dim, 0-d and empty inputs, the CPU kernel's
paths, fast path and thread counts, against the float64 loop (oracles.py)."""

from __future__ import annotations

import pytest
import torch

import parascan as ps

from conftest import (
    DTYPES,
    assert_matches,
    oracle_dtype,
    random_gates,
    random_tokens,
)
from oracles import linear_loop

CPU_KERNEL = "cpu" in ps.backends("cpu")


def _check_with_gradients(gates, tokens, dim, target, dtype, gen) -> None:
    """Output, final state and the gradients of the tensor inputs against the loop;
    ``gates`` may be a Python number."""
    given = {"gates": gates, "tokens": tokens}
    tensors = {k: v for k, v in given.items() if isinstance(v, torch.Tensor)}
    mine = {k: v.detach().to(target.device).requires_grad_() for k, v in tensors.items()}
    high = {k: v.detach().to(oracle_dtype(v.dtype)).requires_grad_() for k, v in tensors.items()}
    out, final = ps.linear_scan(
        mine.get("gates", gates), mine["tokens"], dim, return_final=True, backend=target.backend
    )
    want, want_final = linear_loop(high.get("gates", gates), high["tokens"], dim)
    assert out.dtype == dtype
    assert_matches(out, want, dtype)
    assert_matches(final, want_final, dtype)
    w = random_tokens(tuple(want.shape), dtype, gen)
    loss = (out * w.to(out.device)).real.sum() + final.real.sum()
    want_loss = (want * w.to(want.dtype)).real.sum() + want_final.real.sum()
    grads = torch.autograd.grad(loss, list(mine.values()))
    for g, ref in zip(grads, torch.autograd.grad(want_loss, list(high.values())), strict=True):
        assert_matches(g, ref, dtype)


@pytest.mark.parametrize("gate", [0.9, 1, -0.5])
def test_python_number_gate(target, gate, gen) -> None:
    tokens = random_tokens((3, 50), torch.float32, gen)
    _check_with_gradients(gate, tokens, -1, target, torch.float32, gen)


def test_dtype_promotion(target, gen) -> None:
    gates = random_gates((3, 40), torch.float32, gen)
    tokens = random_tokens((3, 40), torch.complex64, gen)
    _check_with_gradients(gates, tokens, 1, target, torch.complex64, gen)
    half = ps.linear_scan(
        gates.bfloat16().to(target.device), tokens.real.to(target.device), 1,
        backend=target.backend,
    )  # fmt: skip
    assert half.dtype == torch.float32


@pytest.mark.parametrize("dim", [0, 1, 2, -1, -2, -3])
def test_every_dim_positive_and_negative(target, dim, gen) -> None:
    shape = (5, 6, 7)
    gates, tokens = (
        random_gates(shape, torch.float64, gen),
        random_tokens(shape, torch.float64, gen),
    )
    on = {"device": target.device}
    out = ps.linear_scan(gates.to(**on), tokens.to(**on), dim, backend=target.backend)
    assert_matches(out, linear_loop(gates, tokens, dim)[0], torch.float64)
    same = ps.linear_scan(gates.to(**on), tokens.to(**on), dim % 3, backend=target.backend)
    assert torch.equal(out, same)


def test_zero_dim_input_is_a_length_one_sequence(target) -> None:
    def scalar(x: float) -> torch.Tensor:
        return torch.tensor(x, device=target.device)

    out, final = ps.linear_scan(
        scalar(0.5), scalar(2.0), 0, initial=scalar(4.0), return_final=True,
        backend=target.backend,
    )  # fmt: skip
    assert out.shape == () and final.shape == ()
    assert out.item() == final.item() == 4.0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_types_accumulate_in_float32(target, dtype) -> None:
    """Summing 4096 steps of 1/1024 in the half type itself would stall at 4
    (float16) or 2 (bfloat16); float32 accumulation reaches 4.0 + 0.5 ... exactly."""
    steps = 4608
    tokens = torch.full((2, steps), 1 / 1024, dtype=dtype, device=target.device)
    out, final = ps.linear_scan(1.0, tokens, -1, return_final=True, backend=target.backend)
    assert final.dtype == dtype
    assert final.float().tolist() == [4.5, 4.5]
    assert out[:, 1023].float().tolist() == [1.0, 1.0]


def test_empty_dims_and_zero_length(target) -> None:
    on = {"device": target.device}
    for shape, dim in [((0, 5), 1), ((3, 0, 4), 1), ((3, 0), 0), ((2, 3, 0), 1)]:
        gates, tokens = torch.rand(shape, **on), torch.rand(shape, **on)
        out, final = ps.linear_scan(gates, tokens, dim, return_final=True, backend=target.backend)
        assert out.shape == shape
        assert final.shape == shape[:dim] + shape[dim + 1 :]
    initial = torch.randn(4, 3, **on, requires_grad=True)
    out, final = ps.linear_scan(
        torch.rand(4, 0, 3, **on), torch.rand(4, 0, 3, **on), 1, initial=initial,
        return_final=True, backend=target.backend,
    )  # fmt: skip
    assert torch.equal(final, initial)
    final.sum().backward()
    assert torch.equal(initial.grad, torch.ones(4, 3, **on))


@pytest.mark.skipif(not CPU_KERNEL, reason="the cpu backend is not built")
def test_results_do_not_depend_on_thread_count(gen) -> None:
    for shape, dim in [((4, 300, 200), 1), ((64, 2000), 1)]:
        gates, tokens = (
            random_gates(shape, torch.float32, gen),
            random_tokens(shape, torch.float32, gen),
        )
        before = torch.get_num_threads()
        try:
            torch.set_num_threads(1)
            one = ps.linear_scan(gates, tokens, dim, backend="cpu")
            torch.set_num_threads(2)
            two = ps.linear_scan(gates, tokens, dim, backend="cpu")
        finally:
            torch.set_num_threads(before)
        assert torch.equal(one, two)


def test_result_dtype_follows_torch_result_type() -> None:
    for x in DTYPES:
        for y in DTYPES:
            for gate_shape, token_shape in [((), (3,)), ((3,), ()), ((3,), (3,)), ((), ())]:
                gates, tokens = torch.ones(gate_shape, dtype=x), torch.ones(token_shape, dtype=y)
                want = torch.result_type(gates, tokens)
                if want == torch.complex32:
                    with pytest.raises(TypeError, match=r"parascan\.linear_scan"):
                        ps.linear_scan(gates, tokens, 0)
                else:
                    assert ps.linear_scan(gates, tokens, 0).dtype == want
    assert ps.linear_scan(0.5j, torch.ones(3), 0).dtype == torch.complex64
    assert ps.linear_scan(2, torch.ones(3, dtype=torch.float64), 0).dtype == torch.float64


@pytest.mark.skipif(not CPU_KERNEL, reason="the cpu backend is not built")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_eager_fast_path_is_taken_and_correct(dtype, gen, monkeypatch) -> None:
    """Plain CPU calls that need no gradient skip the op machinery; the result is
    the same kernel's, checked against the oracle."""
    from dataclasses import replace

    from parascan.first_order.ops import ROWS

    def fail(*args):
        raise AssertionError("the general path ran")

    linear = ROWS["linear"].backends
    monkeypatch.setitem(linear, "cpu", replace(linear["cpu"], forward=fail))
    for shape, dim in [((2, 65, 257), 1), ((9, 63), -1), ((3, 4, 33), -3)]:
        gates, tokens = random_gates(shape, dtype, gen), random_tokens(shape, dtype, gen)
        d = dim % len(shape)
        initial = random_tokens(shape[:d] + shape[d + 1 :], dtype, gen)
        for reverse in (False, True):
            for h in (None, initial):
                out, final = ps.linear_scan(
                    gates, tokens, dim, initial=h, reverse=reverse, return_final=True
                )
                high = oracle_dtype(dtype)
                want, want_final = linear_loop(
                    gates.to(high), tokens.to(high), dim, None if h is None else h.to(high), reverse
                )
                assert_matches(out, want, dtype)
                assert_matches(final, want_final, dtype)
                # the final state is a tensor of its own, not a view of the output
                assert final.untyped_storage().data_ptr() != out.untyped_storage().data_ptr()
                assert torch.equal(ps.linear_scan(gates, tokens, dim, initial=h, reverse=reverse),
                                   out)  # fmt: skip


def test_calls_needing_the_op_machinery_take_the_general_path(gen, monkeypatch) -> None:
    from dataclasses import replace

    from parascan.first_order import api
    from parascan.first_order.ops import ROWS
    from parascan.first_order.semiring import LINEAR

    def fast(a, b, dim, initial, reverse, backend, return_final=False):
        return api.fast_path(LINEAR, a, b, dim, initial, reverse, return_final, backend)

    calls = []
    linear = ROWS["linear"].backends
    real = linear["torch"].forward
    spy = replace(linear["torch"], forward=lambda *a: calls.append("op") or real(*a))
    monkeypatch.setattr(api, "fast_path", lambda *a: calls.append("fast"))
    monkeypatch.setitem(linear, "torch", spy)
    x = random_tokens((3, 20), torch.float32, gen)
    ps.linear_scan(x, x, 1, backend="torch")
    assert calls == ["fast", "op"]
    monkeypatch.undo()
    a = random_gates((3, 20), torch.float32, gen)
    assert fast(a.requires_grad_(), x, 1, None, False, "auto") is None  # needs autograd
    a = a.detach()
    assert fast(a, x, 1, None, False, "torch") is None  # another backend
    assert fast(a, x.double(), 1, None, False, "auto") is None  # mixed dtypes
    assert fast(a, x[:, :1], 1, None, False, "auto") is None  # broadcasting
    assert fast(a.to(torch.complex64).conj(), x.to(torch.complex64), 1, None, False, "auto") is None
    assert fast(a, x, 2, None, False, "auto") is None  # bad dim: the general path raises
    assert fast(a, x, 1, torch.zeros(3, 1), False, "auto") is None  # broadcast initial
    # the final state of no steps (the initial one, or zeros) is the general path's
    assert fast(a[:, :0], x[:, :0], 1, None, False, "auto", return_final=True) is None
    assert fast(a, x, 1, None, False, "auto", return_final=None) is None  # not a bool
    assert fast(a, x, 1, None, 0, "auto") is None  # not a bool
    assert fast(a, x.to_sparse(), 1, None, False, "auto") is None  # not strided
    seen = []
    torch.func.vmap(lambda t: seen.append(fast(t, t, 0, None, False, "auto")) or t)(x)
    assert seen == [None]  # under a torch.func transform
    assert fast(a, x, 1, None, False, "auto") is not None


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_types_round_exactly_like_torch(target, dtype, gen) -> None:
    """A half-precision scan is the float32 scan rounded once, as torch rounds, and
    a zero gate returns every token bit pattern unchanged (all 65536 of them)."""
    backend, on = target.backend, {"device": target.device}
    for shape, dim in [((3, 70, 40), 1), ((5, 300), -1)]:
        gates = random_gates(shape, dtype, gen).to(**on)
        tokens = (random_tokens(shape, torch.float32, gen) * 300).to(dtype).to(**on)
        out = ps.linear_scan(gates, tokens, dim, backend=backend)
        want = ps.linear_scan(gates.float(), tokens.float(), dim, backend=backend).to(dtype)
        assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    # x = -1 * 0 + b is b for every bit pattern, -0.0, infinities and NaN included.
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    every = every.to(**on)
    for layout, dim in [(every.reshape(-1, 1), 1), (every.reshape(1, -1), 0)]:
        out = ps.linear_scan(-1.0, layout, dim, backend=backend)
        same = out.view(torch.int16) == layout.view(torch.int16)
        assert (same | (out.isnan() & layout.isnan())).all()
    big = torch.tensor([60000.0, 60000.0, -1e-7, 3e-8]).to(dtype)
    out = ps.linear_scan(1.0, big.to(**on), 0, backend=backend)
    assert torch.equal(out.cpu(), big.float().cumsum(0).to(dtype))


@pytest.mark.skipif(not CPU_KERNEL, reason="the cpu backend is not built")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_cpu_path_gives_the_same_bits(dtype, gen) -> None:
    """Time-major rows, transposed (AVX2 or tile) time-contiguous rows and strided
    reads all multiply, then add, in the same order: bit-identical results, forward
    and backward, on any CPU. Complex types are the exception: gcc's vectorizer
    fuses a complex multiply-add (vfmaddsub) on the time-major path whatever
    -ffp-contract says, so there they agree to rounding only."""
    shape = (3, 77, 21)  # (batch, T, channels)
    gates, tokens = random_gates(shape, dtype, gen), random_tokens(shape, dtype, gen)
    upstream = random_tokens(shape, dtype, gen)
    initial = random_tokens((3, 21), dtype, gen)

    def run(a, b, g, dim):
        a, b = a.detach().requires_grad_(), b.detach().requires_grad_()
        out = ps.linear_scan(a, b, dim, initial=initial, reverse=True, backend="cpu")
        return (out, *torch.autograd.grad(out, (a, b), g))

    major = run(gates, tokens, upstream, 1)
    contiguous = run(*(t.transpose(1, 2).contiguous() for t in (gates, tokens, upstream)), -1)
    strided = run(
        *(t.transpose(1, 2).contiguous().transpose(1, 2) for t in (gates, tokens, upstream)), 1
    )
    for m, c, s in zip(major, contiguous, strided, strict=True):
        if dtype.is_complex:
            high = oracle_dtype(dtype)
            assert_matches(m, c.transpose(1, 2).to(high), dtype)
            assert_matches(m, s.to(high), dtype)
        else:
            assert torch.equal(m, c.transpose(1, 2))
            assert torch.equal(m, s)


def test_python_number_keeps_the_precision_of_the_result_dtype() -> None:
    """A Python float next to float64 tokens is float64's value, not float32's
    rounding of it (0.1 differs in the 9th digit)."""
    out = ps.linear_scan(0.1, torch.ones(2, dtype=torch.float64), 0, initial=0.1)
    assert out.tolist() == [0.1 * 0.1 + 1.0, 0.1 * (0.1 * 0.1 + 1.0) + 1.0]


def test_a_jit_trace_records_the_scan(gen) -> None:
    """torch.jit.trace records ops, not kernels: a call that went straight to the C
    kernel (the eager fast path) was missing from the trace, which then returned the
    traced inputs' scan for any new inputs. Traced calls take the op; a
    torch-function mode sees it too."""
    import warnings

    from torch.overrides import TorchFunctionMode

    a, b = random_gates((2, 9), torch.float32, gen), random_tokens((2, 9), torch.float32, gen)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's warnings about Python values
        traced = torch.jit.trace(lambda x, y: ps.linear_scan(x, y, -1), (a, b), check_trace=False)
    a2, b2 = random_gates((2, 9), torch.float32, gen), random_tokens((2, 9), torch.float32, gen)
    want, _ = linear_loop(a2.double(), b2.double(), -1, None, False)
    assert_matches(traced(a2, b2), want, torch.float32)

    class Seen(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.funcs: list[str] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.funcs.append(str(func))
            return func(*args, **(kwargs or {}))

    with Seen() as mode:
        out = ps.linear_scan(a2, b2, -1)
    assert any("parascan.linear_scan" in f for f in mode.funcs), mode.funcs
    assert_matches(out, want, torch.float32)
