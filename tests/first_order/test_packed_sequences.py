"""Packed variable-length sequences (``cu_seqlens=``) of linear_scan and log_linear_scan,
against the float64 loop scanning each sequence alone (oracles.packed_loop): outputs,
final states and every gradient, on every backend, for boundaries that are empty
sequences, length-1 sequences, one sequence spanning everything, and boundaries on
and next to the C kernels' block and chunk sizes."""

from __future__ import annotations

import math
import random

import pytest
import torch

import parascan as ps

from conftest import DTYPES, assert_matches, oracle_dtype, random_gates, random_tokens
from harness import constants
from oracles import linear_loop, packed_loop

# (shape builder, dim): the sequences packed along time in each layout the kernels
# treat differently: time-major (channels contiguous), time-contiguous, time first.
LAYOUTS = {
    "time-major": (lambda t, c: (1, t, c), 1),
    "time-contiguous": (lambda t, c: (1, c, t), -1),
    "time-first": (lambda t, c: (t, c), 0),
}


def boundaries(steps: int, rng: random.Random) -> list[list[int]]:
    """Offsets to test for a length: one sequence spanning everything, empty and
    length-1 sequences, random cuts, and cuts on and next to the kernels' block
    sizes (TILE, ROWS, BLOCK)."""
    c = constants()
    near = {
        k + d
        for k in (c.get("TILE", 5), c.get("ROWS", 2), 2 * c.get("TILE", 5), 16)
        for d in (-1, 0, 1)
    }
    cases = [[0, steps], [0, 0, steps, steps]]
    if steps >= 2:
        cases.append([0, 1, 1, 2, steps])
        cases.append(sorted([0, steps, *rng.sample(range(steps + 1), min(6, steps + 1))]))
        cases.append(sorted([0, steps, *(k for k in near if 0 < k < steps)]))
    return cases


def _split(public: torch.Tensor | None, dim: int) -> list[torch.Tensor] | None:
    """A public per-sequence state (num_seqs first, in place of the batch) as one
    state of the result's shape without ``dim`` per sequence."""
    if public is None:
        return None
    return [h if dim == 0 else h.unsqueeze(0) for h in public.unbind(0)]


def _public(finals: torch.Tensor, dim: int) -> torch.Tensor:
    return finals if dim == 0 else finals.select(1, 0)


def _case(op: str, layout: str, steps: int, channels: int, dtype: torch.dtype, gen):  # type: ignore[no-untyped-def]
    make, dim = LAYOUTS[layout]
    shape = make(steps, channels)
    gates = random_gates(shape, dtype, gen)
    tokens = random_tokens(shape, dtype, gen)
    if op == "log":
        gates, tokens = gates.log(), tokens.to(torch.complex128).log()
        tokens = tokens.real.to(dtype) if not dtype.is_complex else tokens.to(dtype)
        gates = gates.real.to(dtype) if not dtype.is_complex else gates.to(dtype)
    return gates, tokens, dim


def _run(  # type: ignore[no-untyped-def]
    op, gates, tokens, dim, cu, initial, reverse, backend, device=None
):
    """(out, final) of the packed scan on ``backend``, the operands moved to ``device``
    (None: where they are; the offsets stay on the CPU); the outputs must come back on
    that device, and are returned moved to the device of ``tokens`` (differentiably:
    gradients, tangents and gradcheck pass through)."""
    home = tokens.device
    if device is not None:
        gates, tokens = gates.to(device), tokens.to(device)
        initial = None if initial is None else initial.to(device)
    scan = ps.linear_scan if op == "linear" else ps.log_linear_scan
    out, final = scan(
        gates,
        tokens,
        dim,
        initial=initial,
        reverse=reverse,
        return_final=True,
        backend=backend,
        cu_seqlens=torch.tensor(cu),
    )
    there = tokens.device
    assert out.device == there and final.device == there, (out.device, final.device, there)
    return out.to(home), final.to(home)


def _oracle(op, gates, tokens, dim, cu, initial, reverse):  # type: ignore[no-untyped-def]
    """(out, final) of the float64 loop; for log_linear_scan the linear loop of the
    exponentials (finite gradients at log 0), its log for real inputs, and for complex
    ones the values themselves (compare exp(out): the log's branch is not unique)."""
    wide = oracle_dtype(gates.dtype)
    init = None if initial is None else initial.to(wide)
    if op == "linear":
        x, finals = packed_loop(
            linear_loop, gates.to(wide), tokens.to(wide), dim, cu, _split(init, dim), reverse
        )
        return x, _public(finals, dim)
    x, finals = packed_loop(
        linear_loop,
        gates.to(wide).exp(),
        tokens.to(wide).exp(),
        dim,
        cu,
        _split(None if init is None else init.exp(), dim),
        reverse,
    )
    if gates.dtype.is_complex:
        return x, _public(finals, dim)
    return x.log(), _public(finals, dim).log()


def _comparable(op, t):  # type: ignore[no-untyped-def]
    return t.exp() if op == "log" and t.dtype.is_complex else t


def _other_tile_and_mode(op: str, layout: str) -> bool:
    """The interpreter's cases with the slow tests (2 to 6 s each) but linear_scan's
    time-major and log_linear_scan's time-contiguous ones: each of the Triton kernels'
    two tiles and each of their two modes runs by default (time first, channels
    contiguous, takes the time-major tile)."""
    return (op, layout) not in (("linear", "time-major"), ("log", "time-contiguous"))


@pytest.mark.targets(interpreter=True, slow_interpreter=_other_tile_and_mode)
@pytest.mark.parametrize("op", ["linear", "log"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_each_sequence_is_scanned_alone(target, op, layout, gen) -> None:
    rng = random.Random(7)
    lengths = [0, 9] if target.interpreted else [0, 1, 65, 257]
    channels = 3 if target.interpreted else constants().get("ROWS", 2) + 3
    # every dtype on the C kernels; the per-sequence backends run the plain scans, whose
    # dtypes their own tests cover: a real and a complex one here
    dtypes = DTYPES if target.backend == "cpu" else [torch.float32, torch.complex64]
    if target.interpreted:
        dtypes = [torch.float32]
    turn = 0
    for dtype in dtypes:
        if op == "log" and dtype.is_complex and target.backend == "triton":
            continue  # the Triton log kernel is real (the backend table says so)
        for steps in lengths:
            gates, tokens, dim = _case(op, layout, steps, channels, dtype, gen)
            for cu in boundaries(steps, rng):
                nseq = len(cu) - 1
                state = (nseq, channels)
                initial = random_tokens(state, dtype, gen)
                if op == "log":
                    initial = initial.abs().log() if not dtype.is_complex else initial.log()
                # the four (reverse, initial) pairs taken in turn over the cases (each
                # meets every dtype and length); interpreted: each direction once, each
                # kind of start once
                runs = [(r, h) for r in (False, True) for h in (None, initial)]
                runs = [runs[turn % 4]] if not target.interpreted else [runs[0], runs[3]]
                turn += 1
                for reverse, h in runs:
                    # on the target's device; the outputs back on the CPU, the oracle's
                    out, final = _run(
                        op, gates, tokens, dim, cu, h, reverse, target.backend, target.device
                    )
                    want, want_final = _oracle(op, gates, tokens, dim, cu, h, reverse)
                    assert out.dtype == dtype and final.shape == state, (out.dtype, final.shape)
                    assert_matches(_comparable(op, out), want, dtype)
                    assert_matches(_comparable(op, final), want_final, dtype)


@pytest.mark.targets(interpreter=True, slow_interpreter=_other_tile_and_mode)
@pytest.mark.parametrize("op", ["linear", "log"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gradients_stay_inside_each_sequence(target, op, layout, gen) -> None:
    steps = 9 if target.interpreted else 70
    cu = [0, 0, 1, 4, 4, steps - 1, steps]
    dtypes = [torch.float64] + ([] if target.interpreted or op == "log" else [torch.complex128])
    for dtype in dtypes:
        gates, tokens, dim = _case(op, layout, steps, 3, dtype, gen)
        initial = random_tokens((len(cu) - 1, 3), dtype, gen)
        if op == "log":
            initial = initial.abs().log()
        upstream = random_tokens(gates.shape, dtype, gen)
        upstream_final = random_tokens(initial.shape, dtype, gen)
        for reverse in (False, True):
            leaves = [
                t.clone().to(target.device).requires_grad_() for t in (gates, tokens, initial)
            ]
            out, final = _run(op, *leaves[:2], dim, cu, leaves[2], reverse, target.backend)
            loss = (out * upstream.to(target.device).conj()).real.sum() + (
                final * upstream_final.to(target.device).conj()
            ).real.sum()
            got = torch.autograd.grad(loss, leaves)
            wide = [t.clone().requires_grad_() for t in (gates, tokens, initial)]
            want, want_final = _oracle(op, *wide[:2], dim, cu, wide[2], reverse)
            loss = (want * upstream.conj()).real.sum() + (
                want_final * upstream_final.conj()
            ).real.sum()
            expected = torch.autograd.grad(loss, wide)
            for g, e in zip(got, expected, strict=True):
                assert_matches(g, e, dtype)


@pytest.mark.targets(interpreter=True)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_non_finite_state_does_not_leak_into_the_next_sequence(target, layout, gen) -> None:
    """A sequence whose state overflows to inf (and NaN: inf - inf) leaves the next
    sequence's outputs and gradients finite and exact (no 0 * inf at the boundary);
    with several chunks and tiles on the Triton kernels (cuts inside them)."""
    steps = 9 if target.interpreted else 150
    cut = 6 if target.interpreted else 70
    make, dim = LAYOUTS[layout]
    shape = make(steps, 3)
    gates = random_gates(shape, torch.float32, gen)
    tokens = random_tokens(shape, torch.float32, gen)
    gates.narrow(dim, 1, 1).fill_(math.inf)
    tokens.narrow(dim, 2, 1).fill_(-math.inf)
    cu = [0, cut, steps]
    leaves = [t.clone().to(target.device).requires_grad_() for t in (gates, tokens)]
    out, _ = _run("linear", *leaves, dim, cu, None, False, target.backend)
    assert not out.narrow(dim, 0, cut).isfinite().all()
    rest = out.narrow(dim, cut, steps - cut)
    a, b = (t.narrow(dim, cut, steps - cut) for t in (gates, tokens))
    want, _ = _oracle("linear", a, b, dim, [0, steps - cut], None, False)
    assert_matches(rest, want, torch.float32)
    grads = torch.autograd.grad(rest.sum(), leaves)
    for g in grads:  # (the first sequence's: 0 times its infinite states, NaN)
        assert g.narrow(dim, cut, steps - cut).isfinite().all()


@pytest.mark.targets(backends=("cpu", "torch", "loop"))
@pytest.mark.parametrize("op", ["linear", "log"])
def test_gradcheck(target, op) -> None:
    """gradcheck and gradgradcheck, the inputs on the target's device."""
    gen = torch.Generator().manual_seed(3)
    cu = [0, 2, 2, 5, 6]
    on = target.device
    gates = (torch.rand(1, 6, 2, generator=gen, dtype=torch.float64) * 0.5 + 0.4).to(on)
    tokens = torch.rand(1, 6, 2, generator=gen, dtype=torch.float64).to(on)
    initial = torch.rand(4, 2, generator=gen, dtype=torch.float64).to(on)
    for t in (gates, tokens, initial):
        t.requires_grad_()

    def f(a, b, h):  # type: ignore[no-untyped-def]
        if op == "log":
            a, b, h = a.log(), b.log(), h.log()
        return _run(op, a, b, 1, cu, h, False, target.backend)

    assert torch.autograd.gradcheck(f, (gates, tokens, initial))
    assert torch.autograd.gradgradcheck(f, (gates, tokens, initial))


@pytest.mark.targets(backends=("cpu", "torch"))
@pytest.mark.parametrize("op", ["linear", "log"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_forward_mode_against_the_loop(target, op, layout, gen) -> None:
    """torch.func.jvp (every tangent at once) and jacfwd: the tangents of the outputs
    and final states equal those of the float64 loop scanning each sequence alone. The
    primals and tangents stay on the CPU (the loop's); _run moves them to the target's
    device and the outputs back."""
    steps = 70
    cu = [0, 0, 1, 4, 4, 17, steps - 1, steps]
    gates, tokens, dim = _case(op, layout, steps, 3, torch.float64, gen)
    initial = random_tokens((len(cu) - 1, 3), torch.float64, gen)
    if op == "log":
        initial = initial.abs().log()
    primals = (gates, tokens, initial)
    tangents = tuple(random_tokens(t.shape, torch.float64, gen) for t in primals)
    for reverse in (False, True):

        def mine(a, b, h, reverse=reverse):  # type: ignore[no-untyped-def]
            return _run(op, a, b, dim, cu, h, reverse, target.backend, target.device)

        def loop(a, b, h, reverse=reverse):  # type: ignore[no-untyped-def]
            return _oracle(op, a, b, dim, cu, h, reverse)

        got = torch.func.jvp(mine, primals, tangents)[1]
        want = torch.func.jvp(loop, primals, tangents)[1]
        for g, w in zip(got, want, strict=True):
            assert g.abs().max() > 0
            assert_matches(g, w, torch.float64)
    small = tuple(t.narrow(dim, 0, 6) for t in primals[:2])
    cu_small = [0, 2, 2, 6]

    def out_only(a, b):  # type: ignore[no-untyped-def]
        return _run(op, a, b, dim, cu_small, None, False, target.backend, target.device)[0]

    def loop_only(a, b):  # type: ignore[no-untyped-def]
        return _oracle(op, a, b, dim, cu_small, None, False)[0]

    for g, w in zip(
        torch.func.jacfwd(out_only, argnums=(0, 1))(*small),
        torch.func.jacfwd(loop_only, argnums=(0, 1))(*small),
        strict=True,
    ):
        assert_matches(g, w, torch.float64)


@pytest.mark.targets(backends=("cpu",))
@pytest.mark.parametrize("op", ["linear", "log"])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_cpu_kernel_equals_scanning_each_sequence_alone_bit_for_bit(
    target, op, threads, gen
) -> None:
    """The C kernel's packed entries (forward and backward) run each sequence with the
    plain kernel's arithmetic (each channel block walking every sequence, or with few
    channels the team sharing short ones and long ones running alone): the same bits
    as one plain call per sequence, outputs, final states and every gradient, with any
    thread count. Long rows (the chunked long-sequence path), many short sequences
    (the shared pool) and the walk in both layouts."""
    c = constants()
    long = c["LONG_STEPS"] + c["LONG_CHUNKS"] * 3 + 5
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for shape, dim, cu in [
            ((1, 2, long), -1, [0, 7, 7, long - 3, long]),  # long rows: the chunked path
            ((1, 4000, 40), 1, sorted({0, 4000, *range(0, 4000, 37)})),  # many short ones
            # channels enough for every thread: each block walks every sequence
            ((1, 1500, 200), 1, [0, 0, 1, 16, 17, c["TILE"] + 17, 700, 700, 1499, 1500]),
            ((1, 40, 4000), -1, [0, 1, 2, c["TILE"], 2 * c["TILE"] + 1, 4000]),
        ]:
            gates = random_gates(shape, torch.float32, gen)
            tokens = random_tokens(shape, torch.float32, gen)
            if op == "log":
                gates, tokens = gates.log(), tokens.abs().log()
            scan = ps.linear_scan if op == "linear" else ps.log_linear_scan
            nseq = len(cu) - 1
            state = (nseq, shape[1] if dim == -1 else shape[2])
            initial = random_tokens(state, torch.float32, gen)
            if op == "log":
                initial = initial.abs().log()
            upstream = random_tokens(shape, torch.float32, gen)
            for reverse in (False, True):
                leaves = [t.clone().requires_grad_() for t in (gates, tokens, initial)]
                out, final = scan(
                    *leaves[:2],
                    dim,
                    initial=leaves[2],
                    reverse=reverse,
                    return_final=True,
                    cu_seqlens=torch.tensor(cu),
                    backend="cpu",
                )
                grads = torch.autograd.grad(out, leaves, upstream)  # the packed backward
                for s in range(nseq):
                    lo, hi = cu[s], cu[s + 1]
                    alone = [
                        leaves[0].detach().narrow(dim, lo, hi - lo).requires_grad_(),
                        leaves[1].detach().narrow(dim, lo, hi - lo).requires_grad_(),
                        leaves[2].detach()[s].unsqueeze(0).requires_grad_(),
                    ]
                    part, last = scan(
                        *alone[:2],
                        dim,
                        initial=alone[2],
                        reverse=reverse,
                        return_final=True,
                        backend="cpu",
                    )
                    assert torch.equal(out.narrow(dim, lo, hi - lo), part), (shape, s)
                    assert torch.equal(final[s], last.squeeze(0)), (shape, s)
                    if hi == lo:
                        assert torch.equal(grads[2][s], torch.zeros_like(grads[2][s]))
                        continue
                    want = torch.autograd.grad(part, alone, upstream.narrow(dim, lo, hi - lo))
                    assert torch.equal(grads[0].narrow(dim, lo, hi - lo), want[0]), (shape, s)
                    assert torch.equal(grads[1].narrow(dim, lo, hi - lo), want[1]), (shape, s)
                    assert torch.equal(grads[2][s], want[2].squeeze(0)), (shape, s)
    finally:
        torch.set_num_threads(old)


def test_a_long_row_against_the_python_loop() -> None:
    from oracles import python_linear_loop

    c = constants()
    steps = c["LONG_STEPS"] + 1000
    gen = torch.Generator().manual_seed(11)
    gates = random_gates((1, 1, steps), torch.float64, gen)
    tokens = random_tokens((1, 1, steps), torch.float64, gen)
    cu = [0, 17, 17, steps - 5, steps]
    initial = torch.tensor([[1.0], [2.0], [-3.0], [0.5]], dtype=torch.float64)
    out = ps.linear_scan(gates, tokens, -1, initial=initial, cu_seqlens=torch.tensor(cu))
    a, b = gates.flatten().tolist(), tokens.flatten().tolist()
    want = []
    for s in range(4):
        lo, hi = cu[s], cu[s + 1]
        want += python_linear_loop(a[lo:hi], b[lo:hi], initial[s, 0].item(), False)
    assert_matches(out.flatten(), torch.tensor(want, dtype=torch.float64), torch.float64)


def test_vmap_and_per_sample_gradients() -> None:
    gen = torch.Generator().manual_seed(5)
    cu = torch.tensor([0, 3, 3, 8])
    gates = random_gates((4, 1, 8, 3), torch.float64, gen)
    tokens = random_tokens((4, 1, 8, 3), torch.float64, gen)
    initial = random_tokens((4, 3, 3), torch.float64, gen)

    def one(a, b, h):  # type: ignore[no-untyped-def]
        out, final = ps.linear_scan(a, b, 1, initial=h, return_final=True, cu_seqlens=cu)
        return out.square().sum() + final.sum()

    batched = torch.func.vmap(one)(gates, tokens, initial)
    each = torch.stack([one(gates[i], tokens[i], initial[i]) for i in range(4)])
    torch.testing.assert_close(batched, each)
    grads = torch.func.vmap(torch.func.grad(one, argnums=(0, 1, 2)))(gates, tokens, initial)
    for i in range(4):
        want = torch.func.grad(one, argnums=(0, 1, 2))(gates[i], tokens[i], initial[i])
        for g, w in zip(grads, want, strict=True):
            torch.testing.assert_close(g[i], w)


def test_compile_fullgraph() -> None:
    gen = torch.Generator().manual_seed(6)
    cu = torch.tensor([0, 2, 7, 9])
    gates = random_gates((1, 9, 4), torch.float32, gen).requires_grad_()
    tokens = random_tokens((1, 9, 4), torch.float32, gen).requires_grad_()
    initial = random_tokens((3, 4), torch.float32, gen).requires_grad_()

    def step(a, b, h):  # type: ignore[no-untyped-def]
        out, final = ps.log_linear_scan(
            a.log(), b.abs().log(), 1, initial=h, return_final=True, cu_seqlens=cu
        )
        return out.exp().sum() + final.sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got = compiled(gates, tokens, initial)
    got_grads = torch.autograd.grad(got, (gates, tokens, initial))
    want = step(gates, tokens, initial)
    want_grads = torch.autograd.grad(want, (gates, tokens, initial))
    torch.testing.assert_close(got, want)
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w)


def test_inputs_are_not_modified_and_the_result_is_contiguous(gen) -> None:
    gates = random_gates((1, 6, 50), torch.float32, gen).transpose(1, 2)
    tokens = random_tokens((1, 50, 6), torch.float32, gen)
    initial = random_tokens((2, 50), torch.float32, gen)
    copies = [t.clone() for t in (gates, tokens, initial)]
    out = ps.linear_scan(gates, tokens, -1, initial=initial, cu_seqlens=torch.tensor([0, 4, 6]))
    assert out.is_contiguous()
    for t, c in zip((gates, tokens, initial), copies, strict=True):
        assert torch.equal(t, c)


def test_broadcast_gates_and_initial() -> None:
    tokens = torch.randn(1, 7, 3, dtype=torch.float64)
    cu = [0, 3, 7]
    out, final = ps.linear_scan(
        0.5,
        tokens,
        1,
        initial=torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64),
        return_final=True,
        cu_seqlens=torch.tensor(cu, dtype=torch.int32),
    )
    h = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64).expand(2, 3)
    want, want_final = packed_loop(
        linear_loop, torch.full_like(tokens, 0.5), tokens, 1, cu, _split(h, 1)
    )
    assert_matches(out, want, torch.float64)
    assert_matches(final, _public(want_final, 1), torch.float64)


BAD = [
    (lambda t: [0, 4], TypeError, "cu_seqlens to be an integer tensor"),
    (lambda t: torch.tensor([0.0, 4.0]), TypeError, "int32 or int64"),
    (lambda t: torch.tensor([[0, 4]]), TypeError, "1-d"),
    # sparse and meta offsets were torch's errors, naming no function
    (lambda t: torch.tensor([0, 4]).to_sparse(), TypeError, "strided tensor with values"),
    (lambda t: torch.tensor([], dtype=torch.int64), ValueError, "at least one offset"),
    (lambda t: torch.tensor([1, 4]), ValueError, "non-decreasing offsets from 0"),
    (lambda t: torch.tensor([0, 3]), ValueError, "(4)"),
    (lambda t: torch.tensor([0, 3, 2, 4]), ValueError, "[0, 3, 2, 4]"),
]


@pytest.mark.parametrize("op", ["linear", "log"])
@pytest.mark.parametrize(("make", "error", "fragment"), BAD)
def test_bad_cu_seqlens_raise_naming_the_function(op, make, error, fragment) -> None:
    tokens = torch.rand(1, 4, 2)
    scan = ps.linear_scan if op == "linear" else ps.log_linear_scan
    with pytest.raises(
        error, match=f"parascan.{op}_scan" if op == "linear" else "parascan.log_linear_scan"
    ) as info:
        scan(tokens, tokens, 1, cu_seqlens=make(tokens))
    assert fragment in str(info.value)


def test_bad_shapes_raise_naming_the_function() -> None:
    with pytest.raises(ValueError, match=r"parascan.linear_scan: .*leading dim to be 1"):
        ps.linear_scan(torch.rand(2, 4, 3), torch.rand(2, 4, 3), 1, cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(
        ValueError, match=r"parascan.linear_scan: .*initial broadcastable to .*\(2, 3\)"
    ):
        ps.linear_scan(
            torch.rand(1, 4, 3),
            torch.rand(1, 4, 3),
            1,
            initial=torch.rand(3, 3),
            cu_seqlens=torch.tensor([0, 1, 4]),
        )
    with pytest.raises(TypeError, match=r"parascan.log_linear_scan: .*real initial"):
        ps.log_linear_scan(
            torch.rand(1, 4),
            torch.rand(1, 4),
            1,
            initial=torch.zeros(1, dtype=torch.complex64),
            cu_seqlens=torch.tensor([0, 4]),
        )


def test_empty_sequences_return_their_initial_state() -> None:
    h = torch.tensor([[1.0, 2.0], [3.0, 4.0]], requires_grad=True)
    out, final = ps.linear_scan(
        torch.rand(1, 0, 2),
        torch.rand(1, 0, 2),
        1,
        initial=h,
        return_final=True,
        cu_seqlens=torch.tensor([0, 0, 0]),
    )
    assert out.shape == (1, 0, 2) and torch.equal(final, h)
    final.sum().backward()
    assert torch.equal(h.grad, torch.ones(2, 2))
    _, final = ps.log_linear_scan(
        torch.rand(3, 2), torch.rand(3, 2), 0, return_final=True, cu_seqlens=torch.tensor([0, 3, 3])
    )
    assert torch.equal(final[1], torch.full((2,), -math.inf))


def test_the_c_entries_refuse_what_they_cannot_index() -> None:
    """The bindings' guard in front of the packed entries (the public functions
    validate first, so these fire only on a bug in parascan), and the kernel's own
    check of the offsets."""
    from parascan._native import bindings

    a = torch.rand(1, 6, 3)
    h = torch.rand(1, 2, 3)
    for cu in (
        torch.tensor([0, 2, 6], dtype=torch.int32),
        torch.tensor([0, 2, 6], device="meta"),
        torch.tensor([0, 9, 2, 9, 6])[::2],
        torch.tensor([], dtype=torch.int64),
    ):
        with pytest.raises(RuntimeError, match="internal error"):
            bindings.scan_forward("linear", a, a, h, 1, False, cu_seqlens=cu)
    with pytest.raises(RuntimeError, match="internal error"):  # initial for 3 sequences
        bindings.scan_forward(
            "linear", a, a, torch.rand(1, 3, 3), 1, False, cu_seqlens=torch.tensor([0, 2, 6])
        )
    for cu in ([0, 7, 6], [1, 2, 6], [0, 2, 5]):  # out of order, not from 0, not to T
        with pytest.raises(RuntimeError, match="CPU kernel rejected"):
            bindings.scan_forward("linear", a, a, h, 1, False, cu_seqlens=torch.tensor(cu))
        with pytest.raises(RuntimeError, match="CPU kernel rejected"):
            bindings.scan_backward("log", a, a, a, a, h, 1, False, cu_seqlens=torch.tensor(cu))


@pytest.mark.targets(backends=("cpu", "torch", "loop"))
def test_edge_shapes(target) -> None:
    on = {"device": target.device, "dtype": torch.float64}
    be = target.backend
    # no sequence at all (T == 0)
    out, final = ps.linear_scan(
        torch.rand(1, 0, 3, **on),
        torch.rand(1, 0, 3, **on),
        1,
        return_final=True,
        cu_seqlens=torch.tensor([0]),
        backend=be,
    )
    assert out.shape == (1, 0, 3) and final.shape == (0, 3)
    assert out.device.type == final.device.type == target.device, (out.device, final.device)
    # no channels, real cuts
    out, final = ps.linear_scan(
        torch.rand(1, 0, 5, **on),
        torch.rand(1, 0, 5, **on),
        -1,
        initial=torch.rand(2, 0, **on),
        return_final=True,
        cu_seqlens=torch.tensor([0, 2, 5]),
        backend=be,
    )
    assert out.shape == (1, 0, 5) and final.shape == (2, 0)
    assert out.device.type == final.device.type == target.device, (out.device, final.device)
    # a 4-d layout along a middle dim, a number as initial, reverse
    gen = torch.Generator().manual_seed(9)
    a = random_gates((1, 2, 9, 3), torch.float64, gen).to(target.device)
    b = random_tokens((1, 2, 9, 3), torch.float64, gen).to(target.device)
    cu = [0, 4, 4, 9]
    out, final = ps.linear_scan(
        a,
        b,
        2,
        initial=0.5,
        reverse=True,
        return_final=True,
        cu_seqlens=torch.tensor(cu),
        backend=be,
    )
    assert out.device.type == final.device.type == target.device, (out.device, final.device)
    h = torch.full((3, 2, 3), 0.5, dtype=torch.float64)  # the oracle's, on the CPU
    want, want_final = packed_loop(linear_loop, a.cpu(), b.cpu(), 2, cu, _split(h, 2), True)
    assert final.shape == (3, 2, 3)
    assert_matches(out, want, torch.float64)
    assert_matches(final, _public(want_final, 2), torch.float64)


def test_out_of_order_offsets_are_caught_by_the_ops_under_compile() -> None:
    """torch.compile skips the public check of the values (it would read them); the
    ops check them again before any kernel runs."""
    a = torch.rand(1, 6, 3)

    def f(a, cu):  # type: ignore[no-untyped-def]
        return ps.linear_scan(a, a, 1, cu_seqlens=cu)

    compiled = torch.compile(f, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(a, torch.tensor([0, 2, 6])), f(a, torch.tensor([0, 2, 6])))
    with pytest.raises(ValueError, match=r"parascan\.linear_scan: expected cu_seqlens"):
        compiled(a, torch.tensor([0, 4, 2, 6]))


def test_meta_cu_seqlens_with_meta_operands_is_refused() -> None:
    """Offsets on the meta device with meta operands have no values to check: a named
    error (it was torch's "Cannot copy out of meta tensor")."""
    a = torch.rand(1, 4, 2, device="meta")
    with pytest.raises(ValueError, match=r"parascan\.linear_scan: expected cu_seqlens with values"):
        ps.linear_scan(a, a, 1, cu_seqlens=torch.tensor([0, 4], device="meta"))


def test_cu_seqlens_on_another_device_is_refused() -> None:
    with pytest.raises(ValueError, match=r"parascan\.linear_scan: expected cu_seqlens on the CPU"):
        ps.linear_scan(
            torch.rand(1, 4, 2),
            torch.rand(1, 4, 2),
            1,
            cu_seqlens=torch.tensor([0, 4], device="meta"),
        )


def test_linear_reverse_under_compile_and_vmap() -> None:
    gen = torch.Generator().manual_seed(12)
    cu = torch.tensor([0, 1, 5, 5, 7])
    a = random_gates((3, 1, 7, 2), torch.float64, gen)
    b = random_tokens((3, 1, 7, 2), torch.float64, gen)
    h = random_tokens((3, 4, 2), torch.float64, gen)

    def f(a, b, h):  # type: ignore[no-untyped-def]
        out, final = ps.linear_scan(
            a, b, 1, initial=h, reverse=True, return_final=True, cu_seqlens=cu
        )
        return out.sum() + (final * final).sum()

    want = torch.stack([f(a[i], b[i], h[i]) for i in range(3)])
    torch.testing.assert_close(torch.func.vmap(f)(a, b, h), want)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(torch.stack([compiled(a[i], b[i], h[i]) for i in range(3)]), want)
