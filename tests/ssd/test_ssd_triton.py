"""The SSD scan's ``triton`` backend (parascan/ssd/triton.py) against the float64
loop ``oracles.ssd_loop``: in Triton's interpreter (TRITON_INTERPRET=1, set by
conftest.py) on CPU tensors and tiny shapes, its forward (out, final, every
checkpoint) and backward (all eight gradients, against autograd through the loop),
over lengths on and next to the checkpoint interval (64), groups, with and without
D, z and an initial state, packed sequences (empty ones, boundaries at and next to a
checkpoint); then the same kernels compiled for NVIDIA sm_80 and sm_90
(tools/gpu/ssd_compile.py, in a process of its own), with no register spills. Skipped when
triton is not installed."""

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

import parascan as ps
from parascan.ssd import autograd as ssd_ops
from parascan.ssd import triton as backend
from parascan.ssd.canonical import CHECKPOINT_STEPS
from parascan.ssd.chunked import dual_form_steps

from conftest import assert_matches
from oracles import ssd_loop

NAMES = ("x", "dt", "A", "B", "C", "D", "z", "initial")
K = CHECKPOINT_STEPS["triton"]


@dataclass(frozen=True)
class Case:
    """One problem: shapes, packed offsets (batch 1) or None, the options."""

    batch: int = 2
    length: int = 9
    heads: int = 2
    headdim: int = 3
    groups: int = 1
    n: int = 3
    cu: tuple[int, ...] | None = None
    D: bool = True
    z: bool = True
    initial: bool = True
    dtype: torch.dtype = torch.float64

    def __str__(self) -> str:
        flags = "".join(k for k in ("D", "z", "initial") if getattr(self, k)) or "plain"
        packed = f"-cu{'_'.join(map(str, self.cu))}" if self.cu is not None else ""
        return (
            f"b{self.batch}L{self.length}H{self.heads}P{self.headdim}G{self.groups}N{self.n}"
            f"{packed}-{flags}-{str(self.dtype)[6:]}"
        )


def operands(case: Case, seed: int = 0) -> list[torch.Tensor | None]:
    """Canonical operands (final step sizes, some negative) in ``case.dtype``, then
    cu_seqlens."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    b, length, heads, p, n = case.batch, case.length, case.heads, case.headdim, case.n
    states = b if case.cu is None else len(case.cu) - 1
    found = [
        rand(b, length, heads, p),
        torch.rand(b, length, heads, generator=gen, dtype=torch.float64) * 0.6 - 0.05,
        -(0.2 + torch.rand(heads, generator=gen, dtype=torch.float64)),
        rand(b, length, case.groups, n),
        rand(b, length, case.groups, n),
        rand(heads, p) if case.D else None,
        rand(b, length, heads, p) if case.z else None,
        rand(states, heads, p, n) if case.initial else None,
    ]
    ops = [t.to(case.dtype) if t is not None else None for t in found]
    return [*ops, torch.tensor(case.cu) if case.cu is not None else None]


def check(case: Case, ops: list[torch.Tensor | None], seed: int = 1) -> None:
    """The backend's forward and backward on ``ops`` against the loop in float64."""
    out, final, checkpoints = backend.forward(*ops)
    *tensors, cu = ops
    leaves = [t.detach().double().requires_grad_() if t is not None else None for t in tensors]
    x, dt, A, B, C, D, z, initial = leaves
    bounds = None if cu is None else [int(v) for v in cu]
    want, want_final = ssd_loop(x, dt, A, B, C, D, z, initial=initial, cu_seqlens=bounds)
    assert out.dtype == final.dtype == case.dtype
    assert_matches(out, want, case.dtype)
    assert_matches(final, want_final, case.dtype)
    # every checkpoint: the state entering step c K, the prefix's final state
    n_chunks = -(-case.length // K)
    assert checkpoints.shape == (case.batch, n_chunks, case.heads, case.headdim, case.n)
    for c in range(n_chunks):
        at = c * K
        lo, rows = 0, initial
        if bounds is not None:  # the packed sequence holding step c K, from its start
            s = max(i for i in range(len(bounds) - 1) if bounds[i] <= at < bounds[i + 1])
            lo, rows = bounds[s], None if initial is None else initial[s : s + 1]
        prefix = [t[:, lo:at] for t in (x, dt, B, C)]
        _, state = ssd_loop(prefix[0], prefix[1], A, prefix[2], prefix[3], initial=rows)
        assert_matches(checkpoints[:, c], state, case.dtype)

    gen = torch.Generator().manual_seed(seed)
    grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    grad_final = torch.randn(final.shape, generator=gen, dtype=torch.float64)
    got = backend.backward(
        *ops, checkpoints,
        grad_out.to(case.dtype).transpose(1, 2).contiguous().transpose(1, 2),  # other layouts
        grad_final.to(case.dtype).transpose(0, 2).contiguous().transpose(0, 2),
    )  # fmt: skip
    present = [t for t in leaves if t is not None]
    loss = (want * grad_out).sum() + (want_final * grad_final).sum()
    expected = iter(torch.autograd.grad(loss, present, allow_unused=True))
    assert len(got) == 8
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
    Case(),  # every option, two row blocks (headdim 3 in blocks of 2)
    Case(length=5, D=False, z=False, initial=False),
    Case(batch=1, heads=4, groups=2, headdim=2, length=6, n=4),  # groups; N a power of 2
    Case(batch=1, heads=2, groups=2, length=4, headdim=2, z=False),  # a group per head
    Case(batch=1, length=7, dtype=torch.float32),
    # lengths: none, one step, next to and on the checkpoint interval, past two
    Case(length=0),
    Case(length=1, batch=1, n=1),
    pytest.param(Case(length=63, batch=1, heads=1, headdim=2, n=2), marks=pytest.mark.slow),
    Case(length=64, batch=1, heads=1, headdim=1, n=2, D=False),
    pytest.param(
        Case(length=65, batch=1, heads=1, headdim=2, n=2, z=False), marks=pytest.mark.slow
    ),
    pytest.param(  # past two checkpoints: the packed case's below runs by default
        Case(length=130, batch=1, heads=1, headdim=1, n=2, initial=False), marks=pytest.mark.slow
    ),
    # packed: empty sequences first, in the middle and last; one spanning everything
    Case(batch=1, length=9, groups=2, cu=(0, 0, 4, 4, 9, 9)),
    Case(batch=1, length=9, cu=(0, 9), initial=False),
    Case(batch=1, length=0, cu=(0, 0, 0)),
    # boundaries at and next to the checkpoint (64)
    Case(batch=1, length=130, heads=1, headdim=1, n=2, cu=(0, 63, 64, 65, 128, 128, 130)),
    pytest.param(
        Case(batch=1, length=66, heads=2, groups=2, headdim=1, n=1, cu=(0, 64, 66), D=False),
        marks=pytest.mark.slow,
    ),
    # nothing to scan: no batch rows, no heads' rows, no states
    Case(batch=0),
    Case(headdim=0),
    Case(n=0, length=3, batch=1),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: str(c))
def test_forward_and_backward_match_the_loop(case: Case) -> None:
    check(case, operands(case))


CHUNKED = [
    Case(batch=1, length=7, headdim=5, dtype=torch.float32),
    Case(batch=1, length=70, heads=1, headdim=1, n=2, D=False),  # blocks across a checkpoint
    pytest.param(Case(heads=4, groups=2, headdim=20, n=17, length=33), marks=pytest.mark.slow),
]


@pytest.mark.parametrize("algorithm", ["chunked", "sequential"])
@pytest.mark.parametrize("case", CHUNKED, ids=lambda c: str(c))
def test_each_forward_algorithm_matches_the_loop(
    case: Case, algorithm: str, monkeypatch: pytest.MonkeyPatch
) -> None:  # fmt: skip
    """The forward by the dual form (blocks of 16 steps in the interpreter; headdim and
    N padded to 16) and by the walk step by step: out, final, checkpoints, and the
    backward from its checkpoints."""
    monkeypatch.setenv("PARASCAN_SSD_TRITON_FORWARD", algorithm)
    launch, *_ = backend.forward_launch(*operands(case))
    assert ("BLOCK_T" in launch.constexprs) == (algorithm == "chunked")
    check(case, operands(case))


def _growing(rate: float, live: int, length: int) -> list[torch.Tensor | None]:
    """Canonical float64 operands (batch 2, heads 4 of 2 rows, N 3) whose first head's
    state grows by exp(rate dt) a step, the others' by half that, not at all, or
    decaying (dt in [0.75, 1.25)); x is 0 but for the last ``live`` steps, so that the
    state is 0 until then."""
    gen = torch.Generator().manual_seed(int(rate))

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x = rand(2, length, 4, 2)
    x[:, : length - live] = 0
    dt = 0.75 + 0.5 * torch.rand(2, length, 4, generator=gen, dtype=torch.float64)
    A = torch.tensor([rate, rate / 2, 0.0, -0.5], dtype=torch.float64)
    return [x, dt, A, rand(2, length, 2, 3), rand(2, length, 2, 3), rand(4, 2),
            rand(2, length, 4, 2), None, None]  # fmt: skip


def _issue() -> list[torch.Tensor | None]:
    """The ssd_scan issue's case: 12 steps of dt = 30, heads with A = 0 and A = 2, x = B
    = C = 1, no initial state: the state grows by exp(60) a step, to 1.29e288."""
    ones = torch.ones(1, 12, 1, 1, dtype=torch.float64)
    dt = torch.full((1, 12, 2), 30.0, dtype=torch.float64)
    A = torch.tensor([0.0, 2.0], dtype=torch.float64)
    return [torch.ones(1, 12, 2, 1, dtype=torch.float64), dt, A, ones, ones.clone(), None,
            None, None, None]  # fmt: skip


# blocks of 16 steps whose weights (up to exp(16 max(dt A))) overflow, where the state
# stays in range: the dual form's inf * 0 gave NaN outputs and final states
GROWING = {
    "issue": (torch.float64, _issue),
    "float64": (torch.float64, lambda: _growing(60.0, 6, 20)),  # blocks of exp(> 720)
    "float32": (torch.float32, lambda: _growing(8.0, 6, 20)),  # blocks of exp(> 90)
}


# 4 to 8 s each interpreted: the growth past the block weights' range in float64 and in
# float32 with the slow tests (the issue's case, float64's, by default)
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[] if n == "issue" else [pytest.mark.slow]) for n in GROWING]
)
def test_chunked_forward_with_a_growing_state(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:  # fmt: skip
    """A state growing past the range of the dual form's block weights (dt A > 0, which
    the contract allows) walks step by step: out and final finite and matching the
    float64 loop, head by head; and the gradients wherever the loop's are finite and
    fit the dtype (and the float32 loop's are finite, in float32). The normal regime
    (dt A <= 0) keeps the dual form."""
    monkeypatch.setenv("PARASCAN_SSD_TRITON_FORWARD", "chunked")
    dtype, make = GROWING[name]
    ops = [t.to(dtype) if t is not None else None for t in make()]
    tensors = ops[:-1]
    dt, A = tensors[1], tensors[2]
    assert dt is not None and A is not None
    out, final, checkpoints = backend.forward(*ops)
    gen = torch.Generator().manual_seed(1)
    grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    grad_final = torch.randn(final.shape, generator=gen, dtype=torch.float64)
    got = backend.backward(*ops, checkpoints, grad_out.to(dtype), grad_final.to(dtype))

    def loop(wide: bool) -> list[torch.Tensor | None]:
        """out, final and the gradients by the loop, in float64 or the operands' dtype."""
        leaves = [
            (t.double() if wide else t).detach().requires_grad_() if t is not None else None
            for t in tensors
        ]  # fmt: skip
        y, last = ssd_loop(*leaves[:7], initial=leaves[7])
        loss = (y * grad_out.to(y.dtype)).sum() + (last * grad_final.to(y.dtype)).sum()
        found = iter(torch.autograd.grad(loss, [t for t in leaves if t is not None]))
        return [y.detach(), last.detach(), *(None if t is None else next(found) for t in leaves)]

    want = loop(wide=True)
    # in float32 a gradient's computation can overflow where its value fits (a zero
    # state times an overflowed gradient of the state: the float32 loop's NaN too)
    low = want if dtype == torch.float64 else loop(wide=False)
    limit = torch.finfo(dtype).max / 16
    assert want[0] is not None and want[1] is not None
    assert want[0].abs().max() < limit and want[1].abs().max() < limit
    # each head at its own scale (a growing head's values dwarf a decaying one's)
    heads = {"out": 2, "final": 1, "x": 2, "dt": 2, "z": 2, "A": 0, "D": 0}
    names = ("out", "final", *NAMES)
    for what, g, w, lw in zip(names, [out, final, *got], want, low, strict=True):
        if w is None or lw is None:
            continue
        owed = w.isfinite() & (w.abs() < limit) & lw.isfinite()
        assert owed.any(), what
        dim = heads.get(what)
        parts = [(g, w, owed)] if dim is None else zip(
            g.unbind(dim), w.unbind(dim), owed.unbind(dim), strict=True
        )  # fmt: skip
        for a, e, m in parts:
            assert a[m].isfinite().all(), (what, int((~a[m].isfinite()).sum()), int(m.sum()))
            try:
                assert_matches(a[m], e[m], dtype)
            except AssertionError as exc:
                raise AssertionError(f"{what}: {exc}") from None
    # the case walked step by step; a decaying state, or a 16 times slower growth, would not
    fits = lambda a: dual_form_steps(dt, a, 16) == 16  # noqa: E731
    assert not fits(A)
    assert fits(-A.abs()) and fits(A / 16)


def test_chunked_forward_walks_packed_sequences_step_by_step() -> None:
    case = Case(batch=1, length=5, cu=(0, 2, 5))
    launch, *_ = backend.forward_launch(*operands(case), algorithm="chunked")
    assert "BLOCK_T" not in launch.constexprs
    with pytest.raises(ValueError, match=r"parascan\.ssd_scan: expected algorithm"):
        backend.forward(*operands(case), algorithm="dual")


def test_strided_and_broadcast_operands() -> None:
    """Operands in other layouts than contiguous: x stored head-major, dt expanded
    over the batch, B read through a stride-0 batch, initial transposed; the backend
    copies what its kernels need contiguous."""
    case = Case(heads=2, groups=2, headdim=2, length=4)
    x, dt, A, B, C, D, z, initial, cu = operands(case)
    assert x is not None and dt is not None and B is not None and initial is not None
    ops = [
        x.transpose(1, 2).contiguous().transpose(1, 2),
        dt[:1].expand(case.batch, -1, -1),
        A, B[:1].expand(case.batch, -1, -1, -1), C, D, z,
        initial.transpose(1, 3).contiguous().transpose(1, 3), cu,
    ]  # fmt: skip
    assert not ops[0].is_contiguous() and ops[3].stride(0) == 0
    check(case, ops)


def test_through_the_public_function() -> None:
    """ps.ssd_scan(backend="triton") on CPU tensors (the interpreter), with the step
    pipeline and D per head, against the loop; gradients through autograd."""
    gen = torch.Generator().manual_seed(3)
    x, z = torch.randn(1, 11, 2, 3, generator=gen), torch.randn(1, 11, 2, 3, generator=gen)
    dt, bias = torch.randn(1, 11, 2, generator=gen), torch.randn(2, generator=gen)
    A, D = -torch.rand(2, generator=gen) - 0.1, torch.randn(2, generator=gen)
    B, C = torch.randn(1, 11, 1, 4, generator=gen), torch.randn(1, 11, 1, 4, generator=gen)
    cu = torch.tensor([0, 5, 11])
    leaves = [t.clone().requires_grad_() for t in (x, dt, A, B, C, D, z, bias)]
    out, final = ps.ssd_scan(
        *leaves[:5], D=leaves[5], z=leaves[6], dt_bias=leaves[7], dt_softplus=True,
        return_final=True, cu_seqlens=cu, backend="triton",
    )  # fmt: skip
    wide = [t.detach().double().requires_grad_() for t in leaves]
    want, want_final = ssd_loop(
        *wide[:5], D=wide[5], z=wide[6], dt_bias=wide[7], dt_softplus=True, cu_seqlens=[0, 5, 11]
    )  # fmt: skip
    assert_matches(out, want, torch.float32)
    assert_matches(final, want_final, torch.float32)
    (out.sum() + final.square().sum()).backward()
    (want.sum() + want_final.square().sum()).backward()
    for got, ref in zip(leaves, wide, strict=True):
        assert got.grad is not None and ref.grad is not None
        assert_matches(got.grad, ref.grad, torch.float32)


def test_backend_row_and_auto() -> None:
    """The row has a triton entry; "auto" never picks the interpreter for CPU tensors."""
    assert "triton" in ssd_ops.ROW.backends and "triton" not in ssd_ops.ROW.missing
    assert ssd_ops.ROW.backends["triton"].dtypes == (torch.float32, torch.float64)
    assert "triton" not in ps.backends("cpu")


def test_checkpoints_of_another_interval_are_refused() -> None:
    case = Case(length=9)
    ops = operands(case)
    out, final, checkpoints = backend.forward(*ops)
    with pytest.raises(ValueError, match=r"parascan\.ssd_scan: expected checkpoints"):
        backend.backward(*ops, checkpoints[:, :0], out, final)


def test_no_atomics() -> None:
    """What the interpreter cannot show: deterministic gradients (the kernels write
    partial sums, never accumulate with atomics, whose order varies on a GPU)."""
    source = Path(backend.__file__).with_name("triton_kernels.py").read_text()
    code = "\n".join(line.split("#")[0] for line in source.splitlines())
    assert "tl.atomic_" not in code


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
    assert "parascan.ssd.triton_kernels" not in top


# --- compiled for GPUs ------------------------------------------------------------------

HELPER = Path(__file__).parents[2] / "tools" / "gpu" / "ssd_compile.py"


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
    assert len(rows) == 3 * 2  # (forward, chunked forward, backward) in float32 x 2 targets


@pytest.mark.slow
def test_every_variant_compiles_without_spills() -> None:
    rows = _compiled(full=True)
    assert len(rows) == (2 * 2 * 2 * 2 + 2 * 2) * 2
