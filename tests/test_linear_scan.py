"""linear_scan against the float64 loop: outputs, final states and every gradient,
for every backend, dtype and awkward length, on both memory layouts."""

from __future__ import annotations

import pytest
import torch

import parascan as ps

from conftest import (
    DTYPES,
    assert_matches,
    loop_oracle,
    oracle_dtype,
    random_gates,
    random_tokens,
)

BACKENDS = ps.backends("cpu")
# 33: one past the CPU kernel's time tile (32); 17 and 257: past the torch
# backend's chunk (16) and its square; 63/64/65/127: around powers of two.
LENGTHS = [0, 1, 2, 3, 17, 33, 63, 64, 65, 127, 257, 1031]
# (shape with T for the time axis, dim). 257 channels: one past the CPU kernel's
# channel block (256); 9 rows: one past its row group (8).
LAYOUTS = {
    "time-major": ((2, "T", 257), 1),
    "time-contiguous": ((9, "T"), -1),
    "time-contiguous-3d": ((2, 9, "T"), 2),
}


def _shape(template: tuple[object, ...], steps: int) -> tuple[int, ...]:
    return tuple(steps if s == "T" else s for s in template)  # type: ignore[misc]


def check_against_oracle(
    gates: torch.Tensor | float,
    tokens: torch.Tensor,
    dim: int,
    *,
    initial: torch.Tensor | None,
    reverse: bool,
    backend: str,
    dtype: torch.dtype,
    gen: torch.Generator,
) -> None:
    """Outputs, final state and the gradients of every tensor input, on a random
    linear loss of both out and final, against the float64 loop."""
    inputs = {"tokens": tokens}
    if isinstance(gates, torch.Tensor):
        inputs["gates"] = gates
    if initial is not None:
        inputs["initial"] = initial
    mine = {k: v.detach().clone().requires_grad_() for k, v in inputs.items()}
    high = {k: v.detach().to(oracle_dtype(v.dtype)).requires_grad_() for k, v in inputs.items()}

    out, final = ps.linear_scan(
        mine.get("gates", gates), mine["tokens"], dim,
        initial=mine.get("initial"), reverse=reverse, return_final=True, backend=backend,
    )  # fmt: skip
    ref_out, ref_final = loop_oracle(
        high.get("gates", gates), high["tokens"], dim, high.get("initial"), reverse
    )
    assert out.dtype == dtype
    assert out.is_contiguous()
    assert_matches(out, ref_out, dtype)
    assert_matches(final, ref_final, dtype)

    w_out = random_tokens(tuple(ref_out.shape), oracle_dtype(dtype), gen)
    w_final = random_tokens(tuple(ref_final.shape), oracle_dtype(dtype), gen)
    ref_loss = (ref_out * w_out).real.sum() + (ref_final * w_final).real.sum()
    ref_grads = torch.autograd.grad(ref_loss, list(high.values()))
    loss = (out * w_out.to(dtype)).real.sum() + (final * w_final.to(dtype)).real.sum()
    grads = torch.autograd.grad(loss, list(mine.values()))
    for name, g, rg in zip(mine, grads, ref_grads, strict=True):
        assert g.shape == inputs[name].shape, name
        assert_matches(g, rg, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("steps", LENGTHS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_matches_loop(backend: str, dtype: torch.dtype, steps: int, layout: str, gen) -> None:
    template, dim = LAYOUTS[layout]
    shape = _shape(template, steps)
    reverse = steps % 2 == 1  # both directions across the length grid
    state_shape = shape[: dim % len(shape)] + shape[dim % len(shape) + 1 :]
    check_against_oracle(
        random_gates(shape, dtype, gen),
        random_tokens(shape, dtype, gen),
        dim,
        initial=random_tokens(state_shape, dtype, gen) if steps % 3 else None,
        reverse=reverse,
        backend=backend,
        dtype=dtype,
        gen=gen,
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("with_initial", [False, True])
def test_both_directions_with_and_without_initial(backend, reverse, with_initial, gen) -> None:
    shape = (3, 65, 20)
    check_against_oracle(
        random_gates(shape, torch.float64, gen),
        random_tokens(shape, torch.float64, gen),
        -2,
        initial=random_tokens((3, 20), torch.float64, gen) if with_initial else None,
        reverse=reverse,
        backend=backend,
        dtype=torch.float64,
        gen=gen,
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("gate_shape", "token_shape", "initial_shape", "dim"),
    [
        ((), (4, 37, 5), None, 1),  # one gate for everything
        ((37, 1), (4, 37, 5), (5,), 1),  # gate per step, initial per channel
        ((5,), (4, 37, 5), (4, 1), -2),  # gate per channel, constant in time
        ((4, 37, 5), (37, 5), (), -2),  # tokens shared by the batch, scalar initial
        ((4, 1, 5), (1, 37, 1), (4, 5), 1),  # both broadcast
        ((6, 1), (6, 37), None, 1),
    ],
)
def test_broadcasting_and_reduced_gradients(
    backend, gate_shape, token_shape, initial_shape, dim, gen
) -> None:
    dtype = torch.float64
    check_against_oracle(
        random_gates(gate_shape, dtype, gen),
        random_tokens(token_shape, dtype, gen),
        dim,
        initial=None if initial_shape is None else random_tokens(initial_shape, dtype, gen),
        reverse=False,
        backend=backend,
        dtype=dtype,
        gen=gen,
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("gate", [0.9, 1, -0.5])
def test_python_number_gate(backend, gate, gen) -> None:
    tokens = random_tokens((3, 50), torch.float32, gen)
    check_against_oracle(
        gate, tokens, -1, initial=None, reverse=False, backend=backend, dtype=torch.float32, gen=gen
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_non_contiguous_inputs(backend, dtype, gen) -> None:
    """Transposed, strided and (for complex) lazily conjugated inputs."""
    base_a = random_gates((70, 6, 2), dtype, gen)
    base_b = random_tokens((12, 70), dtype, gen)
    gates = base_a[:, :, 0].t()  # (6, 70), time stride 12
    tokens = base_b[::2]  # (6, 70), row stride 140
    if dtype.is_complex:
        gates = gates.conj()
    assert not gates.is_contiguous() and not tokens.is_contiguous()
    initial = random_tokens((6, 3), dtype, gen)[:, 1]
    check_against_oracle(
        gates, tokens, -1, initial=initial, reverse=True, backend=backend, dtype=dtype, gen=gen
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_dtype_promotion(backend, gen) -> None:
    gates = random_gates((3, 40), torch.float32, gen)
    tokens = random_tokens((3, 40), torch.complex64, gen)
    assert ps.linear_scan(gates, tokens, 1, backend=backend).dtype == torch.complex64
    check_against_oracle(
        gates, tokens, 1, initial=None, reverse=False, backend=backend,
        dtype=torch.complex64, gen=gen,
    )  # fmt: skip
    half = ps.linear_scan(gates.bfloat16(), tokens.real, 1, backend=backend)
    assert half.dtype == torch.float32


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dim", [0, 1, 2, -1, -2, -3])
def test_every_dim_positive_and_negative(backend, dim, gen) -> None:
    shape = (5, 6, 7)
    gates, tokens = (
        random_gates(shape, torch.float64, gen),
        random_tokens(shape, torch.float64, gen),
    )
    out = ps.linear_scan(gates, tokens, dim, backend=backend)
    assert_matches(out, loop_oracle(gates, tokens, dim)[0], torch.float64)
    assert torch.equal(out, ps.linear_scan(gates, tokens, dim % 3, backend=backend))


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_dim_input_is_a_length_one_sequence(backend) -> None:
    out, final = ps.linear_scan(
        torch.tensor(0.5), torch.tensor(2.0), 0, initial=torch.tensor(4.0),
        return_final=True, backend=backend,
    )  # fmt: skip
    assert out.shape == () and final.shape == ()
    assert out.item() == final.item() == 4.0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_types_accumulate_in_float32(backend, dtype) -> None:
    """Summing 4096 steps of 1/1024 in the half type itself would stall at 4
    (float16) or 2 (bfloat16); float32 accumulation reaches 4.0 + 0.5 ... exactly."""
    steps = 4608
    tokens = torch.full((2, steps), 1 / 1024, dtype=dtype)
    out, final = ps.linear_scan(1.0, tokens, -1, return_final=True, backend=backend)
    assert final.dtype == dtype
    assert final.float().tolist() == [4.5, 4.5]
    assert out[:, 1023].float().tolist() == [1.0, 1.0]


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_dims_and_zero_length(backend) -> None:
    for shape, dim in [((0, 5), 1), ((3, 0, 4), 1), ((3, 0), 0), ((2, 3, 0), 1)]:
        gates, tokens = torch.rand(shape), torch.rand(shape)
        out, final = ps.linear_scan(gates, tokens, dim, return_final=True, backend=backend)
        assert out.shape == shape
        assert final.shape == shape[:dim] + shape[dim + 1 :]
    initial = torch.randn(4, 3, requires_grad=True)
    out, final = ps.linear_scan(
        torch.rand(4, 0, 3), torch.rand(4, 0, 3), 1, initial=initial,
        return_final=True, backend=backend,
    )  # fmt: skip
    assert torch.equal(final, initial)
    final.sum().backward()
    assert torch.equal(initial.grad, torch.ones(4, 3))


def test_results_do_not_depend_on_thread_count(gen) -> None:
    if "cpu" not in BACKENDS:
        pytest.skip("the cpu backend is not built")
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
    from conftest import DTYPES as ALL

    for x in ALL:
        for y in ALL:
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


@pytest.mark.skipif("cpu" not in BACKENDS, reason="the cpu backend is not built")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_eager_fast_path_is_taken_and_correct(dtype, gen, monkeypatch) -> None:
    """Plain CPU calls that need no gradient skip the op machinery; the result is
    the same kernel's, checked against the oracle."""
    from parascan.linear import ops

    def fail(*args):
        raise AssertionError("the general path ran")

    monkeypatch.setitem(ops._FORWARD, "cpu", fail)
    for shape, dim in [((2, 65, 257), 1), ((9, 63), -1), ((3, 4, 33), -3)]:
        gates, tokens = random_gates(shape, dtype, gen), random_tokens(shape, dtype, gen)
        d = dim % len(shape)
        initial = random_tokens(shape[:d] + shape[d + 1 :], dtype, gen)
        for reverse in (False, True):
            for h in (None, initial):
                out = ps.linear_scan(gates, tokens, dim, initial=h, reverse=reverse)
                high = oracle_dtype(dtype)
                want, _ = loop_oracle(
                    gates.to(high), tokens.to(high), dim, None if h is None else h.to(high), reverse
                )
                assert_matches(out, want, dtype)


def test_calls_needing_the_op_machinery_take_the_general_path(gen, monkeypatch) -> None:
    from parascan.linear import api, cpu, ops

    def fast(a, b, dim, initial, reverse, backend, return_final=False):
        return api.cpu_fast_path(cpu.forward, a, b, dim, initial, reverse, return_final, backend)

    calls = []
    real = ops._FORWARD["torch"]
    monkeypatch.setattr(api, "cpu_fast_path", lambda *a: calls.append("fast"))
    monkeypatch.setitem(ops._FORWARD, "torch", lambda *a: calls.append("op") or real(*a))
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
    assert fast(a, x, 1, None, False, "auto", return_final=True) is None  # a final state
    assert fast(a, x, 1, None, False, "auto", return_final=None) is None  # not a bool
    assert fast(a, x, 1, None, 0, "auto") is None  # not a bool
    assert fast(a, x.to_sparse(), 1, None, False, "auto") is None  # not strided
    seen = []
    torch.func.vmap(lambda t: seen.append(fast(t, t, 0, None, False, "auto")) or t)(x)
    assert seen == [None]  # under a torch.func transform
    assert fast(a, x, 1, None, False, "auto") is not None


@pytest.mark.skipif("cpu" not in BACKENDS, reason="the cpu backend is not built")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("rows", "steps"), [(1, 2**16 + 1031), (3, 2**16 + 8 * 1024)])
def test_long_sequences_chunked_over_time(dtype, rows, steps, gen) -> None:
    """Few rows and long T: the CPU kernel cuts time into chunks scanned in
    parallel (past 2**16 steps); outputs and final state against the loop."""
    reverse = rows == 3
    gates = random_gates((rows, steps), dtype, gen)
    tokens = random_tokens((rows, steps), dtype, gen)
    initial = random_tokens((rows,), dtype, gen)
    out, final = ps.linear_scan(
        gates, tokens, -1, initial=initial, reverse=reverse, return_final=True, backend="cpu"
    )
    high = oracle_dtype(dtype)
    want, want_final = loop_oracle(gates.to(high), tokens.to(high), -1, initial.to(high), reverse)
    assert_matches(out, want, dtype)
    assert_matches(final, want_final, dtype)


def _python_loop(a: list, b: list, h: complex, reverse: bool) -> list:
    """The recurrence in Python floats (float64) or complex numbers (complex128)."""
    out = [h] * len(a)
    for t in range(len(a) - 1, -1, -1) if reverse else range(len(a)):
        h = a[t] * h + b[t]
        out[t] = h
    return out


@pytest.mark.skipif("cpu" not in BACKENDS, reason="the cpu backend is not built")
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.complex64, torch.complex128], ids=str
)
def test_long_sequences_span_several_cache_blocks(dtype, gen) -> None:
    """The long-sequence kernel walks a row in blocks of 64 chunks of 8256 bytes of
    each input (scan_forward_impl.h): whole blocks; a shorter last block cut into
    shorter chunks plus a few serial steps; a last block too short to cut. Reverse
    and initial states too, against the recurrence in Python's float64."""
    block = 64 * ((8192 + 64) // dtype.itemsize)
    whole = -(-(2**16) // block)  # enough whole blocks to take the long path
    for rows, steps, reverse in [
        (1, (whole + 1) * block + 64 * 70 + 5, False),
        (2, whole * block + 1000, True),
    ]:
        gates = random_gates((rows, steps), dtype, gen)
        tokens = random_tokens((rows, steps), dtype, gen)
        initial = random_tokens((rows,), dtype, gen)
        out, final = ps.linear_scan(
            gates, tokens, -1, initial=initial, reverse=reverse, return_final=True,
            backend="cpu",
        )  # fmt: skip
        high = oracle_dtype(dtype)
        want = torch.tensor(
            [
                _python_loop(gates[r].tolist(), tokens[r].tolist(), initial[r].item(), reverse)
                for r in range(rows)
            ],
            dtype=high,
        )
        assert_matches(out, want, dtype)
        assert_matches(final, want[:, 0 if reverse else -1], dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_types_round_exactly_like_torch(backend, dtype, gen) -> None:
    """A half-precision scan is the float32 scan rounded once, as torch rounds, and
    a zero gate returns every token bit pattern unchanged (all 65536 of them)."""
    for shape, dim in [((3, 70, 40), 1), ((5, 300), -1)]:
        gates = random_gates(shape, dtype, gen)
        tokens = (random_tokens(shape, torch.float32, gen) * 300).to(dtype)
        out = ps.linear_scan(gates, tokens, dim, backend=backend)
        want = ps.linear_scan(gates.float(), tokens.float(), dim, backend=backend).to(dtype)
        assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    # x = -1 * 0 + b is b for every bit pattern, -0.0, infinities and NaN included.
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    for layout, dim in [(every.reshape(-1, 1), 1), (every.reshape(1, -1), 0)]:
        out = ps.linear_scan(-1.0, layout, dim, backend=backend)
        same = out.view(torch.int16) == layout.view(torch.int16)
        assert (same | (out.isnan() & layout.isnan())).all()
    big = torch.tensor([60000.0, 60000.0, -1e-7, 3e-8]).to(dtype)
    out = ps.linear_scan(1.0, big, 0, backend=backend)
    assert torch.equal(out, big.float().cumsum(0).to(dtype))


@pytest.mark.skipif("cpu" not in BACKENDS, reason="the cpu backend is not built")
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


@pytest.mark.skipif("cpu" not in BACKENDS, reason="the cpu backend is not built")
def test_long_sequences_do_not_depend_on_thread_count(gen) -> None:
    gates = random_gates((2, 2**17 + 5), torch.float32, gen)
    tokens = random_tokens((2, 2**17 + 5), torch.float32, gen)
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 3, 4):
            torch.set_num_threads(threads)
            results.append(ps.linear_scan(gates, tokens, -1, backend="cpu"))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_python_number_keeps_the_precision_of_the_result_dtype() -> None:
    """A Python float next to float64 tokens is float64's value, not float32's
    rounding of it (0.1 differs in the 9th digit)."""
    out = ps.linear_scan(0.1, torch.ones(2, dtype=torch.float64), 0, initial=0.1)
    assert out.tolist() == [0.1 * 0.1 + 1.0, 0.1 * (0.1 * 0.1 + 1.0) + 1.0]
