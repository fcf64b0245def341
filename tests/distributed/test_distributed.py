"""parascan.distributed.linear_scan and log_linear_scan on real gloo process groups
(2 and 4 ranks, torch.multiprocessing): each rank's shard of the output, the global
final state and every gradient against the float64 loop of the whole sequence
(oracles.py), which every rank runs on its own."""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import parascan.distributed as psd

from conftest import assert_matches
from oracles import linear_loop, log_loop, packed_loop


def _spawn(worker, world: int) -> None:  # type: ignore[no-untyped-def]
    """``worker(rank, world, init_file)`` on ``world`` processes of one gloo group."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(worker, args=(world, os.path.join(tmp, "init")), nprocs=world, join=True)


# (shape of the whole sequence, dim, shard lengths per world size)
CASES = [
    ((2, 13, 3), 1, {2: [7, 6], 4: [5, 0, 7, 1]}),
    ((3, 9), -1, {2: [0, 9], 4: [2, 2, 2, 3]}),
    ((4, 2, 5), 0, {2: [4, 0], 4: [1, 1, 1, 1]}),
]


def _log_inputs(shape, dim, dtype, seed):
    """Logs of gates in (0.05, 1) and of tokens with some zeros (log 0 = -inf)."""
    gates, tokens, initial = _inputs(shape, dim, dtype, seed)
    if dtype.is_complex:
        gates = gates / gates.abs() * (0.05 + 0.95 * gates.abs())
        return gates.log(), tokens.log(), initial.log()
    tokens = torch.where(tokens.abs() < 0.3, 0.0, tokens.abs())
    return (0.05 + 0.95 * gates.abs()).log(), tokens.log(), initial.abs().log()


def _inputs(shape, dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    gates = torch.rand(shape, generator=g, dtype=torch.float64) * 1.6 - 0.8
    tokens = torch.randn(shape, generator=g, dtype=torch.float64)
    d = dim % len(shape)
    initial = torch.randn(shape[:d] + shape[d + 1 :], generator=g, dtype=torch.float64)
    if dtype.is_complex:
        gates = torch.polar(gates.abs(), torch.rand(shape, generator=g, dtype=torch.float64))
        tokens = torch.complex(tokens, torch.randn(shape, generator=g, dtype=torch.float64))
        initial = initial.to(dtype)
    return gates.to(dtype), tokens.to(dtype), initial


def _oracle(gates, tokens, dim, initial, reverse, log):  # type: ignore[no-untyped-def]
    """(x, final) of the whole sequence in linear space (the loop of the
    exponentials for log inputs, where log 0 = -inf is an ordinary 0), and the log
    values where the inputs are real logs."""
    if not log:
        out, final = linear_loop(gates, tokens, dim, initial, reverse)
        return out, final, None
    x, x_final = linear_loop(
        gates.exp(), tokens.exp(), dim, None if initial is None else initial.exp(), reverse
    )
    logs = None if gates.is_complex() else log_loop(gates, tokens, dim, initial, reverse)
    return x, x_final, logs


def _check_case(
    rank, world, shape, dim, lengths, dtype, reverse, with_initial, shared_gates, log=False
):
    d = dim % len(shape)
    make = _log_inputs if log else _inputs
    shard_scan = psd.log_linear_scan if log else psd.linear_scan
    gates, tokens, initial = make(shape, dim, dtype, seed=sum(lengths) + world)
    if shared_gates:  # one gate per channel, the same tensor on every rank
        gates = gates.narrow(d, 0, 1).clone()
    g = torch.Generator().manual_seed(99)
    weights = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    final_weights = torch.randn((world, *initial.shape), generator=g, dtype=torch.float64)
    final_weights = final_weights.to(dtype)

    # The whole sequence, one step at a time: the expected shard, final and gradients
    # of a loss of x (exp of the output for log inputs) and of the final states.
    leaves = [t.clone().requires_grad_() for t in (gates, tokens, initial)]
    x, x_final, logs = _oracle(
        leaves[0], leaves[1], dim, leaves[2] if with_initial else None, reverse, log
    )
    loss = (x * weights).real.sum() + (x_final * final_weights.sum(0)).real.sum()
    want_grads = torch.autograd.grad(loss, leaves, allow_unused=True)

    start = sum(lengths[:rank])
    n = lengths[rank]
    mine = [
        gates if shared_gates else gates.narrow(d, start, n),
        tokens.narrow(d, start, n),
        initial,
    ]
    mine = [t.clone().requires_grad_() for t in mine]
    got, got_final = shard_scan(
        mine[0], mine[1], dim, initial=mine[2] if with_initial else None,
        reverse=reverse, return_final=True,
    )  # fmt: skip
    if logs is not None:  # real logs: the log values themselves, -inf included
        assert_matches(got, logs[0].narrow(d, start, n), dtype)
        assert_matches(got_final, logs[1], dtype)
    if log:
        got, got_final = got.exp(), got_final.exp()
    assert_matches(got, x.narrow(d, start, n), dtype)
    assert_matches(got_final, x_final, dtype)
    local = (got * weights.narrow(d, start, n)).real.sum()
    local = local + (got_final * final_weights[rank]).real.sum()
    grads = torch.autograd.grad(local, mine, allow_unused=True)

    # gates: a shard's gradient is its own, unless shared: then the ranks' sum
    grad_gates = grads[0]
    if shared_gates:
        grad_gates = grad_gates.clone()
        dist.all_reduce(grad_gates)
        assert_matches(grad_gates, want_grads[0], dtype)
    else:
        assert_matches(grad_gates, want_grads[0].narrow(d, start, n), dtype)
    assert_matches(grads[1], want_grads[1].narrow(d, start, n), dtype)
    first = (world - 1) if reverse else 0
    if with_initial and rank == first:
        assert_matches(grads[2], want_grads[2], dtype)
    else:
        assert grads[2] is None or not grads[2].abs().any()


def _worker(rank, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for shape, dim, splits in CASES:
            for dtype in (torch.float64, torch.complex128):
                for reverse in (False, True):
                    for with_initial in (False, True):
                        for shared, log in ((False, False), (True, False), (False, True)):
                            _check_case(
                                rank, world, shape, dim, splits[world], dtype, reverse,
                                with_initial, shared, log,
                            )  # fmt: skip
        # a sub-group: ranks 0 and 1 only; the others do not call
        if world == 4:
            sub = dist.new_group([0, 1])
            if rank < 2:
                x = torch.arange(1.0, 5.0).reshape(1, 4)
                shard = x[:, 2 * rank : 2 * rank + 2]
                out = psd.linear_scan(0.5, shard, -1, group=sub)
                want = linear_loop(0.5, x.double(), -1)[0][:, 2 * rank : 2 * rank + 2]
                assert_matches(out, want, torch.float32)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_matches_one_process(world) -> None:
    _spawn(_worker, world)


def test_needs_a_process_group() -> None:
    with pytest.raises(RuntimeError, match=r"distributed\.linear_scan: expected an initialized"):
        psd.linear_scan(0.5, torch.ones(2, 3), -1)


def test_checks_inputs_first() -> None:
    with pytest.raises(TypeError, match=r"distributed\.linear_scan: expected tokens"):
        psd.linear_scan(0.5, [1.0, 2.0], 0)


@pytest.mark.parametrize(
    ("shape", "cu", "initial", "error", "match"),
    [
        ((1, 4), [0.0, 4.0], None, TypeError, "1-d int32 or int64"),
        ((1, 4), [[0, 4]], None, TypeError, "1-d int32 or int64"),
        ((1, 4), [0, 3, 2, 4], None, ValueError, "non-decreasing"),
        ((1, 4), [1, 4], None, ValueError, "non-decreasing"),
        ((1, 4), [0, 3], None, ValueError, "at least this rank's 4"),
        ((2, 4), [0, 4], None, ValueError, "leading dim to be 1"),
        ((1, 4), [0, 2, 4], torch.zeros(3), ValueError, r"\(num_seqs, state...\) = \(2,\)"),
    ],
)
def test_checks_packed_sequences_before_communicating(shape, cu, initial, error, match) -> None:
    """A rank's own bad cu_seqlens (or initial) raises before it needs a process group."""
    cu = torch.tensor(cu) if not isinstance(cu, torch.Tensor) else cu
    with pytest.raises(error, match=r"distributed\.log_linear_scan: .*" + match):
        psd.log_linear_scan(0.0, torch.zeros(shape), -1, initial=initial, cu_seqlens=cu)


# --- shards that disagree: every rank raises, no abort, no mixed result ---------------
# (rank 0's call, rank 1's call, what every rank's error names); each call is
# (function, gates, tokens, dim, keyword arguments)
_MISMATCHES = {
    "channels": (
        (psd.linear_scan, (2, 5, 3), 1, {}), (psd.linear_scan, (2, 4, 4), 1, {}), "(2, 3)"
    ),
    "dtype": (
        (psd.linear_scan, (2, 5, 3), 1, {}),
        (psd.linear_scan, (2, 5, 3), 1, {"dtype": torch.float64}),
        "torch.float64",
    ),
    "dim": ((psd.linear_scan, (3, 3, 3), 0, {}), (psd.linear_scan, (3, 3, 3), 2, {}), "dim 2"),
    "reverse": (
        (psd.linear_scan, (2, 5, 3), 1, {"reverse": True}),
        (psd.linear_scan, (2, 5, 3), 1, {}),
        "reverse=True",
    ),
    "initial given on one rank": (
        (psd.linear_scan, (2, 5, 3), 1, {"initial": True}),
        (psd.linear_scan, (2, 5, 3), 1, {}),
        "initial given",
    ),
    "linear on one rank, log on the other": (
        (psd.linear_scan, (2, 5, 3), 1, {}),
        (psd.log_linear_scan, (2, 5, 3), 1, {}),
        "rank 1: log_linear_scan along",
    ),
    "a backward on one rank only": (
        (psd.linear_scan, (2, 5, 3), 1, {"grad": True}),
        (psd.linear_scan, (2, 5, 3), 1, {}),
        "needs backward",
    ),
    "a rank whose own arguments are bad": (
        (psd.linear_scan, (2, 5, 3), 1, {}),
        (psd.linear_scan, (2, 5, 3), 7, {}),
        "rank(s) 1 failed before the exchange",
    ),
    "a rank whose return_final is not a bool": (
        (psd.linear_scan, (2, 5, 3), 1, {"return_final": None}),
        (psd.linear_scan, (2, 5, 3), 1, {}),
        "rank(s) 0 failed before the exchange",
    ),
    # packed sequences: the global offsets must be the same everywhere
    "different cu_seqlens": (
        (psd.linear_scan, (1, 5, 3), 1, {"cu": [0, 3, 10]}),
        (psd.linear_scan, (1, 5, 3), 1, {"cu": [0, 4, 10]}),
        "cu_seqlens of 2 sequences",
    ),
    "cu_seqlens on one rank only": (
        (psd.linear_scan, (1, 5, 3), 1, {}),
        (psd.linear_scan, (1, 5, 3), 1, {"cu": [0, 3, 10]}),
        "rank 0: linear_scan along dim 1 of 3, shape without it (1, 3), torch.float32, cpu, "
        "reverse=False, initial not given, no backward, no cu_seqlens",
    ),
    "return_final on one rank only, packed": (
        (psd.linear_scan, (1, 5, 3), 1, {"cu": [0, 3, 10], "return_final": True}),
        (psd.linear_scan, (1, 5, 3), 1, {"cu": [0, 3, 10]}),
        "return_final=True",
    ),
    "cu_seqlens that end before the global length": (
        (psd.linear_scan, (1, 5, 3), 1, {"cu": [0, 3, 9]}),
        (psd.linear_scan, (1, 5, 3), 1, {"cu": [0, 3, 9]}),
        "the sum of the ranks' shard lengths 5 + 5 = 10, but got [0, 3, 9]",
    ),
    "a rank whose cu_seqlens decrease": (
        (psd.linear_scan, (1, 5, 3), 1, {"cu": [0, 3, 10]}),
        (psd.linear_scan, (1, 5, 3), 1, {"cu": [0, 6, 3, 10]}),
        "rank(s) 1 failed before the exchange",
    ),
}  # fmt: skip


def _call(spec, rank):
    fn, shape, dim, options = spec
    options = dict(options)
    dtype = options.pop("dtype", torch.float32)
    g = torch.Generator().manual_seed(rank)
    tokens = torch.rand(shape, generator=g, dtype=dtype).requires_grad_(options.pop("grad", False))
    if "cu" in options:
        options["cu_seqlens"] = torch.tensor(options.pop("cu"))
    if options.pop("initial", False):
        d = dim % len(shape) if -len(shape) <= dim < len(shape) else 0
        options["initial"] = torch.zeros(shape[:d] + shape[d + 1 :], dtype=dtype)
    return fn(torch.rand(shape, generator=g, dtype=dtype), tokens, dim, **options)


def _mismatch_worker(rank, world, init_file):
    import datetime

    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )  # fmt: skip
    try:
        for what, (first, second, named) in _MISMATCHES.items():
            own_error = {
                "a rank whose own arguments are bad": (1, IndexError),
                "a rank whose return_final is not a bool": (0, TypeError),
                "a rank whose cu_seqlens decrease": (1, ValueError),
            }.get(what)
            if what == "cu_seqlens that end before the global length":  # seen by every rank
                own_error = (rank, ValueError)
            expected = own_error[1] if own_error and own_error[0] == rank else RuntimeError
            own_error = own_error is not None and own_error[0] == rank
            with pytest.raises(expected) as info:
                _call(first if rank == 0 else second, rank)
            if what == "cu_seqlens that end before the global length":
                assert named in str(info.value), (what, str(info.value))
            elif not own_error:
                message = str(info.value)
                assert message.startswith("parascan.distributed."), (what, message)
                assert named in message, (what, message)
        # a rank whose local packed scan fails: it raises its error, the other one names it
        from parascan.distributed import packed

        finals = packed._finals
        if rank == 1:

            def broken(*args):
                raise RuntimeError("broken on purpose")

            packed._finals = broken
        try:
            with pytest.raises(RuntimeError) as info:
                _call((psd.linear_scan, (1, 5, 3), 1, {"cu": [0, 3, 10]}), rank)
        finally:
            packed._finals = finals
        expected = "broken on purpose" if rank == 1 else "rank(s) 1 failed in their local scan"
        assert expected in str(info.value)
        # the group still works afterwards, packed or not
        x = torch.arange(1.0, 9.0).reshape(2, 4)
        out = psd.linear_scan(0.5, x[:, 2 * rank : 2 * rank + 2], -1)
        want = linear_loop(0.5, x.double(), -1)[0][:, 2 * rank : 2 * rank + 2]
        assert_matches(out, want, torch.float32)
        out = psd.linear_scan(
            0.5, x[:1, 2 * rank : 2 * rank + 2], -1, cu_seqlens=torch.tensor([0, 3, 4])
        )
        want = packed_loop(linear_loop, torch.tensor(0.5).double(), x[:1].double(), -1, [0, 3, 4])
        assert_matches(out, want[0][:, 2 * rank : 2 * rank + 2], torch.float32)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_shards_that_disagree_raise_on_every_rank() -> None:
    _spawn(_mismatch_worker, 2)


# --- packed sequences (cu_seqlens): global offsets, sequences across ranks ----------------
# (global shape with T in place of the time dim, dim, shard lengths of 3 ranks, cu_seqlens)
_PACKED = [
    # empty first, length 1, a boundary on rank 0's end (then empty), one next to it;
    # rank 1 empty
    (("T", 2), 0, [5, 0, 6], [0, 0, 1, 5, 5, 6, 11]),
    # one sequence over every rank
    ((1, "T", 3), 1, [4, 3, 5], [0, 12]),
    # next to a shard boundary (3, 8), on one (4), across ranks 1 and 2, trailing empty
    ((1, 2, "T"), -1, [4, 3, 5], [0, 3, 4, 8, 12, 12]),
    # rank 1 covered by one sequence that runs on into rank 2
    ((1, "T", 2), 1, [2, 6, 3], [0, 1, 9, 11]),
    # random boundaries (seeded) over shards of 3, 5, 4 steps
    (("T", 3), 0, [3, 5, 4], "random"),
    # no steps anywhere: two empty sequences
    ((1, "T", 2), 1, [0, 0, 0], [0, 0, 0]),
]


def _random_offsets(total: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    cuts = torch.randint(0, total + 1, (6,), generator=g).tolist()
    return [0, *sorted(cuts), total]


def _check_packed(
    rank, world, case, dtype, reverse, with_initial, return_final, log, backend="auto"
):
    template, dim, lengths, cu = case
    total = sum(lengths)
    if cu == "random":
        cu = _random_offsets(total, seed=len(template) + int(reverse) + 2 * int(log))
    shape = tuple(total if n == "T" else n for n in template)
    d = dim % len(shape)
    nseq = len(cu) - 1
    state = shape[:d] + shape[d + 1 :]
    public = (nseq, *state[1:]) if d else (nseq, *state)  # num_seqs in place of the batch
    make = _log_inputs if log else _inputs
    gates, tokens, _ = make(shape, dim, dtype, seed=total + nseq)
    g = torch.Generator().manual_seed(7 + nseq)
    initial = torch.randn(public, generator=g, dtype=torch.float64).to(dtype)
    if log:
        initial = initial.log() if dtype.is_complex else initial.abs().log()
    weights = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    final_weights = torch.randn((world, *public), generator=g, dtype=torch.float64).to(dtype)

    # each sequence alone, one step at a time, over the whole (concatenated) data
    leaves = [t.clone().requires_grad_() for t in (gates, tokens, initial)]
    rows = [h.reshape(state) for h in leaves[2].unbind(0)] if with_initial else None
    if log:
        loops = [(linear_loop, lambda t: t.exp())]
        if not dtype.is_complex:
            loops.append((log_loop, lambda t: t))
    else:
        loops = [(linear_loop, lambda t: t)]
    want = []
    for loop, f in loops:
        x, finals = packed_loop(
            loop, f(leaves[0]), f(leaves[1]), dim, cu,
            None if rows is None else [f(h) for h in rows], reverse,
        )  # fmt: skip
        want.append((x, finals.reshape(public)))
    x, x_final = want[0]
    loss = (x * weights).real.sum()
    if return_final:
        loss = loss + (x_final * final_weights.sum(0)).real.sum()
    want_grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    want_grads = [  # None: the loss does not read it (no steps, no final)
        torch.zeros_like(t) if w is None else w for t, w in zip(leaves, want_grads, strict=True)
    ]

    start, n = sum(lengths[:rank]), lengths[rank]
    mine = [gates.narrow(d, start, n), tokens.narrow(d, start, n), initial]
    mine = [t.clone().requires_grad_() for t in mine]
    shard_scan = psd.log_linear_scan if log else psd.linear_scan
    result = shard_scan(
        mine[0], mine[1], dim, initial=mine[2] if with_initial else None, reverse=reverse,
        return_final=return_final, cu_seqlens=torch.tensor(cu), backend=backend,
    )  # fmt: skip
    got, got_final = result if return_final else (result, None)
    if len(want) == 2:  # real logs: the log values themselves, -inf included
        assert_matches(got, want[1][0].narrow(d, start, n), dtype)
        if return_final:
            assert_matches(got_final, want[1][1], dtype)
    if log:
        got = got.exp()
        got_final = None if got_final is None else got_final.exp()
    assert_matches(got, x.narrow(d, start, n), dtype)
    local = (got * weights.narrow(d, start, n)).real.sum()
    if return_final:
        assert_matches(got_final, x_final, dtype)
        local = local + (got_final * final_weights[rank]).real.sum()
    grads = torch.autograd.grad(local, mine, allow_unused=True)
    assert_matches(grads[0], want_grads[0].narrow(d, start, n), dtype)
    assert_matches(grads[1], want_grads[1].narrow(d, start, n), dtype)
    if with_initial:  # split over the ranks: their sum is the gradient
        summed = grads[2].clone()
        dist.all_reduce(summed)
        assert_matches(summed, want_grads[2], dtype)
    else:
        assert grads[2] is None


def _packed_worker(rank, world, init_file):
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        for case in _PACKED:  # (the work takes about a second: starting 3 processes dominates)
            for reverse in (False, True):
                for log in (False, True):
                    for with_initial, return_final in ((False, True), (True, True), (True, False)):
                        _check_packed(
                            rank, world, case, torch.float64, reverse, with_initial,
                            return_final, log,
                        )  # fmt: skip
        _check_packed(rank, world, _PACKED[2], torch.complex128, True, True, True, False)
        _check_packed(rank, world, _PACKED[3], torch.complex128, False, True, True, True)
        for backend in ("torch", "loop"):  # the local packed work on other backends
            _check_packed(rank, world, _PACKED[2], torch.float64, True, True, True, False, backend)
        _check_packed(rank, world, _PACKED[0], torch.float32, False, True, True, True)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # 7 to 9 s of process groups; `pytest -m slow`
def test_packed_sequences_across_ranks() -> None:
    _spawn(_packed_worker, 3)


def _precision_worker(rank, world, init_file):
    """Three cases that went wrong, each against the float64 loop of the whole
    sequence: half types (the shards' gate products and log-gate sums, and the states
    crossing ranks, were kept in the half type: float16 finals 11% off, a bfloat16
    log final a factor e^1.5 off), and float32 gates whose product overflows where
    the scan does not (inf * 0 made NaN of every later rank's output)."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        steps = 700
        d = 1
        g = torch.Generator().manual_seed(5)
        # float16, linear: gates 0.999 (their product over a shard, 0.50, came out 0.53)
        gates = torch.full((1, world * steps, 3), 0.999, dtype=torch.float64)
        tokens = torch.rand(1, world * steps, 3, generator=g, dtype=torch.float64) * 1e-3
        gates, tokens = gates.half().double(), tokens.half().double()  # the inputs it sees
        x, x_final = linear_loop(gates, tokens, d, None, False)
        mine = [t.narrow(d, rank * steps, steps).half().requires_grad_() for t in (gates, tokens)]
        got, got_final = psd.linear_scan(*mine, d, return_final=True)
        assert got.dtype == got_final.dtype == torch.float16
        assert_matches(got, x.narrow(d, rank * steps, steps), torch.float16)
        assert_matches(got_final, x_final, torch.float16)
        # its gradients against autograd through the loop (a loss of the final state,
        # counted on rank 0: every rank's final-state gradient reaches every shard)
        leaves = [t.clone().requires_grad_() for t in (gates, tokens)]
        want = torch.autograd.grad(linear_loop(*leaves, d, None, False)[1].sum(), leaves)
        grads = torch.autograd.grad(got_final.sum() * (rank == 0), mine)
        for grad, w in zip(grads, want, strict=True):
            assert grad.dtype == torch.float16
            assert_matches(grad, w.narrow(d, rank * steps, steps), torch.float16)
        # bfloat16, log space: log gates summing to -705 per shard (-704 in bfloat16)
        log_gates = torch.full((1, world * steps, 2), -1.0078, dtype=torch.float64)
        log_tokens = torch.full((1, world * steps, 2), -20.0, dtype=torch.float64)
        log_tokens[:, 0] = 2120.0
        log_gates, log_tokens = log_gates.bfloat16().double(), log_tokens.bfloat16().double()
        logs, log_final = log_loop(log_gates, log_tokens, d, None, False)
        got, got_final = psd.log_linear_scan(
            log_gates.narrow(d, rank * steps, steps).bfloat16(),
            log_tokens.narrow(d, rank * steps, steps).bfloat16(), d, return_final=True,
        )  # fmt: skip
        assert_matches(got, logs.narrow(d, rank * steps, steps), torch.bfloat16)
        assert_matches(got_final, log_final, torch.bfloat16)
        # float32 gates 2 on rank 0 (product 2^700 = inf), zero tokens there
        gates = torch.where(torch.arange(world * steps) < steps, 2.0, 0.99).to(torch.float64)
        tokens = torch.zeros(world * steps, dtype=torch.float64)
        tokens[steps] = 1.0
        x, _ = linear_loop(gates, tokens, 0, None, False)
        got = psd.linear_scan(
            gates.narrow(0, rank * steps, steps).float(),
            tokens.narrow(0, rank * steps, steps).float(), 0,
        )  # fmt: skip
        assert not got.isnan().any()
        assert_matches(got, x.narrow(0, rank * steps, steps), torch.float32)
        # gates 1e20, 1e-20, ... on rank 1, entered with a state of about 2: torch.prod's
        # lanes overflow (NaN), the running product stays near 1
        gates = torch.full((world * steps,), 0.5, dtype=torch.float64)
        gates[steps : 2 * steps : 2], gates[steps + 1 : 2 * steps : 2] = 1e20, 1e-20
        gates = gates.float().double()  # the inputs it sees
        tokens = torch.ones(world * steps, dtype=torch.float64)
        x, x_final = linear_loop(gates, tokens, 0, None, False)
        got, got_final = psd.linear_scan(
            gates.narrow(0, rank * steps, steps).float(),
            tokens.narrow(0, rank * steps, steps).float(), 0, return_final=True,
        )  # fmt: skip
        assert_matches(got, x.narrow(0, rank * steps, steps), torch.float32)
        assert_matches(got_final, x_final, torch.float32)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.slow  # 7 to 9 s of process groups; `pytest -m slow`
def test_half_types_and_overflowing_products_across_ranks() -> None:
    _spawn(_precision_worker, 3)
