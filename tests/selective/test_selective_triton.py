"""The selective scan's ``triton`` backend (parascan/selective/triton.py) against the
float64 loop (oracles.selective_loop): in Triton's interpreter (TRITON_INTERPRET=1,
set by conftest.py) on CPU tensors and tiny shapes, its forward (out, final, every
checkpoint) and backward (all nine gradients, against autograd through the loop) over
lengths on and next to the interpreter's tile (4 steps) and the checkpoint interval
(64, and smaller intervals given to the backend), invariant, shared and grouped B and
C, with and without D, z, delta_bias, softplus and an initial state; then the same
kernels compiled for NVIDIA sm_80 and sm_90 (tools/gpu/selective_compile.py, in a
process of its own), with no register spills. Skipped when triton is not installed."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

from parascan.selective import triton as backend
from parascan.selective.canonical import CHECKPOINT_STEPS

from conftest import assert_matches
from oracles import selective_loop

NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial")


def loop(
    u: torch.Tensor, delta: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
    D: torch.Tensor | None, z: torch.Tensor | None, delta_bias: torch.Tensor | None,
    initial: torch.Tensor | None, softplus: bool,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:  # fmt: skip
    """The oracle (oracles.selective_loop, in the operands' own precision): out and the
    states [h[-1], h[0], ..., h[L-1]]. Differentiable by autograd."""
    out, _, states = selective_loop(
        u, delta, A, B, C, D, z, delta_bias, softplus, initial, return_states=True
    )
    return out, states.unbind(2)


@dataclass(frozen=True)
class Case:
    """One problem: shapes, B and C as "invariant" or a number of groups, the options."""

    batch: int = 2
    dim: int = 3
    length: int = 9
    n: int = 3
    b: str | int = 1
    c: str | int = 1
    D: bool = True
    z: bool = True
    bias: bool = True
    initial: bool = True
    softplus: bool = True
    chunk: int | None = None
    dtype: torch.dtype = torch.float64

    def __str__(self) -> str:
        flags = (
            "".join(k for k in ("D", "z", "bias", "initial", "softplus") if getattr(self, k))
            or "plain"
        )
        return (
            f"b{self.batch}d{self.dim}L{self.length}N{self.n}-B{self.b}-C{self.c}-{flags}"
            f"-K{self.chunk or CHECKPOINT_STEPS['triton']}-{str(self.dtype)[6:]}"
        )


def operands(case: Case, seed: int = 0) -> list[torch.Tensor | None]:
    """Canonical operands in ``case.dtype``; with softplus, some of delta + delta_bias
    beyond softplus's threshold (20) and some far below 0."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    batch, dim, length, n = case.batch, case.dim, case.length, case.n
    u = rand(batch, dim, length)
    delta = rand(batch, dim, length) * 0.5
    if case.softplus:
        pick = torch.rand(batch, dim, length, generator=gen, dtype=torch.float64)
        delta = torch.where(pick < 0.1, 20.5 + pick, torch.where(pick > 0.9, -25 - pick, delta))
    else:
        delta = delta.abs() + 0.05
    A = -(0.2 + torch.rand(dim, n, generator=gen, dtype=torch.float64))

    def bc(form: str | int) -> torch.Tensor:
        return rand(dim, n) if form == "invariant" else rand(batch, int(form), n, length)

    found = [
        u, delta, A, bc(case.b), bc(case.c),
        rand(dim) if case.D else None,
        rand(batch, dim, length) if case.z else None,
        rand(dim) * 0.1 if case.bias else None,
        rand(batch, dim, n) if case.initial else None,
    ]  # fmt: skip
    return [x.to(case.dtype) if x is not None else None for x in found]


def check(case: Case, ops: list[torch.Tensor | None], seed: int = 1) -> None:
    """The backend's forward and backward on ``ops`` against the loop in float64."""
    chunk = case.chunk or CHECKPOINT_STEPS["triton"]
    out, final, checkpoints = backend.forward(*ops, case.softplus, chunk=case.chunk)
    leaves = [x.detach().double().requires_grad_() if x is not None else None for x in ops]
    want, states = loop(*leaves, case.softplus)
    assert_matches(out, want, case.dtype)
    assert_matches(final, states[-1], case.dtype)
    n_chunks = -(-case.length // chunk)
    assert checkpoints.shape == (case.batch, case.dim, n_chunks, case.n)
    for c in range(n_chunks):
        assert_matches(checkpoints[:, :, c], states[c * chunk], case.dtype)

    gen = torch.Generator().manual_seed(seed)
    grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    grad_final = torch.randn(final.shape, generator=gen, dtype=torch.float64)
    # the incoming gradients in other layouts: stored time-major, and transposed
    got = backend.backward(
        *ops, case.softplus, checkpoints,
        grad_out.to(case.dtype).transpose(1, 2).contiguous().transpose(1, 2),
        grad_final.to(case.dtype).transpose(0, 2).contiguous().transpose(0, 2),
        chunk=case.chunk,
    )  # fmt: skip
    present = [x for x in leaves if x is not None]
    loss = (want * grad_out).sum() + (states[-1] * grad_final).sum()
    expected = iter(torch.autograd.grad(loss, present, allow_unused=True))
    assert len(got) == 9
    for name, leaf, grad in zip(NAMES, leaves, got, strict=True):
        if leaf is None:
            assert grad.numel() == 0, name
            continue
        reference = next(expected)
        if reference is None:  # no path from this operand (no steps)
            reference = torch.zeros_like(leaf)
        assert grad.dtype == case.dtype, name
        try:
            assert_matches(grad, reference, case.dtype)
        except AssertionError as exc:
            raise AssertionError(f"gradient of {name}: {exc}") from None


CASES = [
    # every option; B and C shared by all channels
    Case(),
    Case(batch=1, dim=5, length=17, chunk=8),  # several chunks of 2 tiles, a partial last one
    Case(batch=1, length=17, chunk=6),  # a chunk that is not a power of 2: tiles of 2 steps
    # no option at all
    Case(length=5, D=False, z=False, bias=False, initial=False, softplus=False),
    # invariant B and C; one invariant, one grouped; groups of different sizes
    Case(b="invariant", c="invariant", length=6),
    Case(dim=4, b=2, c="invariant", length=5, z=False, softplus=False),
    Case(dim=4, b="invariant", c=4, length=5, D=False, bias=False),
    Case(dim=4, b=2, c=4, length=7, initial=False),
    # lengths: none, one step, two, three (within one tile)
    Case(length=0),
    Case(length=1, batch=1, dim=2, n=1),
    Case(length=2, n=4, initial=False),
    Case(length=3, dim=1, b="invariant", z=False),
    # on and next to the default checkpoint interval (64 steps; 63 with the slow tests)
    pytest.param(Case(batch=1, dim=2, n=2, length=63), marks=pytest.mark.slow),
    Case(batch=1, dim=2, n=2, length=64, b="invariant", D=False),
    Case(batch=1, dim=1, n=2, length=65, z=False, softplus=False),
    # a realistic number of states, padded (16), and an odd one (3) in float32
    Case(batch=1, dim=2, n=16, length=3),
    Case(length=7, chunk=4, dtype=torch.float32),
    # nothing to scan: no batch rows, no channels, no states
    Case(batch=0),
    Case(dim=0),
    Case(n=0, length=3, batch=1),
]


@pytest.mark.parametrize("case", CASES, ids=str)
def test_forward_and_backward_match_the_loop(case: Case) -> None:
    check(case, operands(case))


def test_strided_and_broadcast_operands() -> None:
    """Operands in other layouts than contiguous: u stored time-major, delta expanded
    over the batch, B read through a stride-0 batch, A and initial transposed views;
    the backend copies what its kernels need contiguous."""
    case = Case(dim=4, length=6, b=2, c=1)
    u, delta, A, B, C, D, z, bias, initial = operands(case)
    assert u is not None and delta is not None and A is not None and B is not None
    assert initial is not None
    ops = [
        u.transpose(1, 2).contiguous().transpose(1, 2),
        delta[:1].expand(case.batch, -1, -1),
        A.t().contiguous().t(),
        B[:1].expand(case.batch, -1, -1, -1),
        C, D, z, bias,
        initial.transpose(0, 2).contiguous().transpose(0, 2),
    ]  # fmt: skip
    assert not ops[0].is_contiguous() and ops[3].stride(0) == 0
    check(case, ops)


def test_int64_offsets(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernels' WIDE variant (int64 offsets within a program's rows, which the
    backend launches when a row's offsets pass 2**31) on a small case."""
    plain = backend._constexprs

    def wide(*args, **kwargs):  # type: ignore[no-untyped-def]
        return {**plain(*args, **kwargs), "WIDE": True}

    monkeypatch.setattr(backend, "_constexprs", wide)
    case = Case(dim=3, length=6, chunk=4)
    check(case, operands(case))


def test_no_atomics_and_no_reduction_of_maps() -> None:
    """What the interpreter cannot show: deterministic gradients (the kernels write
    partial sums, never accumulate with atomics, whose order varies from run to run on
    a GPU), and no tl.reduce (compiled, it takes its combine to be commutative; the
    composition of affine maps is not, and only tl.associative_scan keeps the order)."""
    source = Path(backend.__file__).with_name("triton_kernels.py").read_text()
    code = "\n".join(line.split("#")[0] for line in source.splitlines())
    assert "tl.atomic_" not in code
    assert "tl.reduce(" not in code


def test_complex_operands_are_refused() -> None:
    assert backend.SUPPORTS_COMPLEX is False
    case = Case(length=2)
    ops = operands(case)
    assert ops[2] is not None
    ops[2] = torch.complex(ops[2], ops[2])
    with pytest.raises(NotImplementedError, match=r"parascan\.selective_scan"):
        backend.forward(*ops, True)


def test_checkpoints_of_another_interval_are_refused() -> None:
    case = Case(length=9)
    ops = operands(case)
    out, final, checkpoints = backend.forward(*ops, True, chunk=4)
    with pytest.raises(ValueError, match=r"parascan\.selective_scan: expected checkpoints"):
        backend.backward(*ops, True, checkpoints, out, final)  # default interval: 64


def test_channel_blocks_never_straddle_a_group() -> None:
    for dim, group_b, group_c in ((12, 12, 12), (12, 4, 6), (12, 3, 12), (7, 7, 1), (0, 0, 0)):
        for backward in (False, True):
            p = backend.plan(dim, 16, group_b, group_c, torch.float32, backward, interpreted=False)
            assert 1 <= p.cell <= max(dim, 1)
            assert group_b % p.cell == 0 and group_c % p.cell == 0
            assert p.blocks * p.channels >= p.cell
            assert p.chunk % p.steps == 0 and p.states == 16


def test_triton_is_imported_only_when_a_kernel_runs() -> None:
    """triton is an optional dependency: the backend's module imports neither triton nor
    its kernels' module at its top level (only inside the functions that launch)."""
    tree = ast.parse(Path(backend.__file__).read_text())
    top = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            top |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            top |= {f"{node.module}.{alias.name}" for alias in node.names} | {str(node.module)}
    assert not {name for name in top if name.split(".")[0] == "triton"}, top
    assert "parascan.selective.triton_kernels" not in top
    launches = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and node.module == "parascan.selective"
        and any(alias.name == "triton_kernels" for alias in node.names)
    ]
    assert len(launches) == 2  # in forward and backward


# --- growing states: A > 0 (allowed: the contract does not require A <= 0) -------------
# The backward took the gradient of a[t] = exp(dt A) as (g_h[t] a[t]) h[t-1]: where the
# adjoint grows past the range on a step whose entering state is 0 (the state not
# started yet), inf * 0 made the gradients of delta, A and delta_bias NaN where the
# loop's are finite. (The interpreter runs tl.associative_scan step by step, so what
# a GPU's tree of compositions does with products of several steps' decays is not
# seen here.)


def _growing(
    rate: float, live: int, length: int, chunk: int | None = None
) -> tuple[list[torch.Tensor | None], int | None]:  # fmt: skip
    """A float64 problem of 2 x 3 channels, N 2: channel 0's state grows by exp(rate dt)
    a step (0.8 of that in its second lane), channel 1's by half that, channel 2's
    decays (dt = softplus(delta + bias), 1.15 to 1.45); u is 0 but for the last
    ``live`` steps, so that the state is 0 until then; every option."""
    gen = torch.Generator().manual_seed(int(rate) + live)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    lanes = torch.tensor([1.0, 0.8], dtype=torch.float64)
    A = torch.stack([rate * lanes, rate / 2 * lanes, -lanes])
    u = rand(2, 3, length)
    u[:, :, : length - live] = 0
    delta = 0.75 + 0.5 * torch.rand(2, 3, length, generator=gen, dtype=torch.float64)
    bias = 0.01 * rand(3)
    ops = [u, delta, A, rand(2, 1, 2, length), rand(3, 2), rand(3), rand(2, 3, length), bias,
           None]  # fmt: skip
    return ops, chunk


def _issue() -> tuple[list[torch.Tensor | None], int | None]:
    """The reported case: 12 steps of dt = 30 on channels with A = 0 and A = 2 (N 1),
    u = B = C = 1, no softplus: the state grows by exp(60) a step, to 1.29e288."""
    ones = torch.ones(1, 1, 1, 12, dtype=torch.float64)
    u, delta = torch.ones(1, 2, 12, dtype=torch.float64), torch.full((1, 2, 12), 30.0).double()
    A = torch.tensor([[0.0], [2.0]], dtype=torch.float64)
    return [u, delta, A, ones, ones.clone(), None, None, None, None], None


def _issue_late() -> tuple[list[torch.Tensor | None], int | None]:
    """The issue's case with u = 0 but for the last 2 steps: in float32 the state fits
    (3.4e27), and the adjoint passes the range 2 steps from the end, where the state
    is 0."""
    ops, chunk = _issue()
    assert ops[0] is not None
    ops[0][:, :, :10] = 0
    return ops, chunk


GROWING = {
    "issue": (torch.float64, _issue),
    "issue-late-float32": (torch.float32, _issue_late),
    # the adjoint passes float64's range some 13 steps from the end, float32's some 11
    # (and 22 in channel 1), where the state is still 0 (inputs in the last 8)
    "float64": (torch.float64, lambda: _growing(40.0, 8, 24, chunk=8)),
    "float32": (torch.float32, lambda: _growing(6.0, 8, 24, chunk=8)),
}


def _fits(expected: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Where the float64 ``expected`` is finite and fits ``dtype`` with room to spare."""
    return expected.isfinite() & (expected.abs() < torch.finfo(dtype).max / 16)


def _grads(
    ops: list[torch.Tensor | None], softplus: bool, go: torch.Tensor, gf: torch.Tensor
) -> list[torch.Tensor | None]:  # fmt: skip
    """out, final and the nine gradients (None for an absent operand) through the loop,
    in the operands' own precision."""
    leaves = [x.detach().clone().requires_grad_() if x is not None else None for x in ops]
    out, states = loop(*leaves, softplus)
    present = [x for x in leaves if x is not None]
    loss = (out * go.to(out.dtype)).sum() + (states[-1] * gf.to(out.dtype)).sum()
    found = iter(torch.autograd.grad(loss, present))
    grads = [None if x is None else next(found) for x in leaves]
    return [out.detach(), states[-1].detach(), *grads]


def _scales(what: str, t: torch.Tensor) -> list[torch.Tensor]:
    """``t`` cut into the parts that share one scale, to be compared each at its own
    (a growing channel's values dwarf a decaying one's): a channel's steps, a channel's
    lane, a group's lane of a variable B or C, or single elements."""
    if what in ("out", "u", "delta", "z"):
        dims: tuple[int, ...] = (1,)
    elif what == "final" or (what in ("B", "C") and t.dim() == 4):
        dims = (1, 2)
    else:  # A, invariant B and C, D, delta_bias
        dims = tuple(range(t.dim()))
    return list(t.movedim(dims, tuple(range(len(dims)))).flatten(0, len(dims) - 1).unbind(0))


# 2 to 4 s each interpreted: the growth past the range in float64 and float32 with the
# slow tests (the issues' cases, float64's and float32's, by default)
@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=[] if n.startswith("issue") else [pytest.mark.slow]) for n in GROWING],
)
def test_growing_state_against_the_loop(name: str) -> None:
    """A growing state (A > 0) against the float64 loop: out and final (all finite and
    fitting the dtype), and every gradient wherever the loop's is finite and fits the
    dtype (in float32, and wherever the float32 loop's is finite: a zero state times
    an overflowed gradient of the state is that loop's NaN, the semantics at that
    precision), each channel's (and lane's) at its own scale."""
    dtype, make = GROWING[name]
    problem, chunk = make()
    softplus = problem[7] is not None
    ops = [x.to(dtype) if x is not None else None for x in problem]
    wide = [x.double() if x is not None else None for x in ops]
    out, final, checkpoints = backend.forward(*ops, softplus, chunk=chunk)
    gen = torch.Generator().manual_seed(1)
    go = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    gf = torch.randn(final.shape, generator=gen, dtype=torch.float64)
    want = _grads(wide, softplus, go, gf)
    got = [out, final, *backend.backward(*ops, softplus, checkpoints, go.to(dtype), gf.to(dtype),
                                         chunk=chunk)]  # fmt: skip
    low = _grads(ops, softplus, go, gf) if dtype != torch.float64 else want
    assert _fits(want[0], dtype).all() and _fits(want[1], dtype).all()
    compared = total = 0
    for what, w, g, lw in zip(("out", "final", *NAMES), want, got, low, strict=True):
        if w is None:
            continue
        owed = _fits(w, dtype) & lw.isfinite()
        assert owed.any(), what
        for a, e, m in zip(*(_scales(what, x) for x in (g, w, owed)), strict=True):
            assert a[m].isfinite().all(), (what, int((~a[m].isfinite()).sum()), int(m.sum()))
            try:
                assert_matches(a[m], e[m], dtype)
            except AssertionError as exc:
                raise AssertionError(f"{what}: {exc}") from None
        if what not in ("out", "final"):
            compared, total = compared + int(owed.sum()), total + owed.numel()
    assert compared > 0.5 * total  # most of the gradients' entries are compared


# --- compiled for GPUs ------------------------------------------------------------------

HELPER = Path(__file__).parents[2] / "tools" / "gpu" / "selective_compile.py"


def _compiled(full: bool) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, str(HELPER), *(["--full"] if full else [])],
        capture_output=True, text=True, env=env, timeout=1800,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    problems = []
    for row in rows:
        if "error" in row:
            problems.append(f"{row['what']}: {row['error']}")
        elif not row["binary"] or row["registers"] is None or row["spilled"] is None:
            problems.append(f"{row['what']}: no binary or no figures: {row['report']}")
        elif row["spilled"]:
            problems.append(f"{row['what']}: spills {row['spilled']} bytes")
        elif row["shared"] > 100 * 1024:
            problems.append(f"{row['what']}: {row['shared']} bytes of shared memory")
    assert not problems, "\n".join(problems)
    for row in rows:  # shown with pytest -rP
        print(f"{row['what']}: {row['registers']} registers, {row['shared']} B shared")
    return rows


def test_kernels_compile_for_sm80_and_sm90_without_spills() -> None:
    rows = _compiled(full=False)
    assert len(rows) == 2 * 2  # (forward, backward) in float32 x 2 targets


@pytest.mark.slow
def test_every_variant_compiles_without_spills() -> None:
    rows = _compiled(full=True)
    assert len(rows) == 2 * 2 * 4 * 2
