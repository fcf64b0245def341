"""The ``cpu`` backend of the selective scan (selective/cpu.py over selective/cpu.c)
against the float64 loop (oracles.selective_loop): outputs, final states, checkpoints
and the gradient of every operand (the loop's by torch autograd), on awkward lengths
(around the checkpoint interval) and state sizes, every form of B and C, with and
without each optional operand, real and complex states, strided inputs; the backward
bit for bit with any thread count; the guard in front of the C entries; the accuracy
of the kernel's own vector exp, softplus and sigmoid."""

from __future__ import annotations

import ctypes
import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from parascan._native import kernel_library
from parascan.selective import cpu
from parascan.selective.canonical import CHECKPOINT_STEPS

from conftest import assert_matches, oracle_dtype
from oracles import selective_loop

K = CHECKPOINT_STEPS["cpu"]
NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial")
Operands = tuple[
    Tensor, Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None,
    Tensor | None,
]  # fmt: skip


def loop(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None,
    z: Tensor | None, delta_bias: Tensor | None, initial: Tensor | None, softplus: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The oracle (oracles.selective_loop, in the operands' own precision) as the
    kernel's entry returns: out, the last state, and the state entering each chunk of K
    steps (the checkpoints)."""
    out, final, states = selective_loop(
        u, delta, A, B, C, D, z, delta_bias, softplus, initial, return_states=True
    )
    return out, final, states[:, :, 0 : u.shape[-1] : K]


@dataclass(frozen=True)
class Case:
    batch: int
    dim: int
    length: int
    n: int
    dtype: torch.dtype = torch.float32
    B_groups: int = 1
    C_groups: int = 0
    D: bool = True
    z: bool = True
    delta_bias: bool = True
    initial: bool = True
    softplus: bool = True
    complex_A: bool = False
    complex_B: bool = True
    complex_C: bool = True
    delta_scale: float = 0.5
    grow: bool = False  # every other column of A positive: dt A > 0, the general exp
    seed: int = 0

    def operands(self) -> Operands:
        g = torch.Generator().manual_seed(self.seed)
        cd = self.dtype
        sd = cd
        if self.complex_A:
            sd = torch.complex64 if cd == torch.float32 else torch.complex128

        def rand(*shape: int, dtype: torch.dtype = cd) -> Tensor:
            return torch.randn(*shape, generator=g, dtype=dtype)

        b, d, L, n = self.batch, self.dim, self.length, self.n
        A = -torch.exp(rand(d, n))
        if self.grow:  # at most 0.02: the state grows but stays finite in float32
            A[:, ::2] = 0.02 * torch.rand(d, (n + 1) // 2, generator=g, dtype=cd)
        if self.complex_A:
            A = torch.complex(A, 3 * rand(d, n))

        def bc(groups: int, is_complex: bool) -> Tensor:
            dtype = sd if self.complex_A and is_complex else cd
            return rand(d, n, dtype=dtype) if groups == 0 else rand(b, groups, n, L, dtype=dtype)

        return (
            rand(b, d, L),
            # without softplus, a positive dt (a negative one grows the state past float32)
            self.delta_scale * (rand(b, d, L) if self.softplus else rand(b, d, L).abs()),
            A,
            bc(self.B_groups, self.complex_B),
            bc(self.C_groups, self.complex_C),
            rand(d) if self.D else None,
            rand(b, d, L) if self.z else None,
            (0.3 * rand(d)).abs() if self.delta_bias else None,
            rand(b, d, n, dtype=sd) if self.initial else None,
        )


def _map(fn: Callable[[Tensor], Tensor], ops: Operands) -> Operands:
    """``fn`` applied to every operand given."""
    u, delta, A, B, C, *rest = ops
    D, z, bias, initial = (None if t is None else fn(t) for t in rest)
    return fn(u), fn(delta), fn(A), fn(B), fn(C), D, z, bias, initial


def _close(got: Tensor, ref: Tensor, like: Tensor, what: str) -> None:
    """``got`` has ``like``'s shape and dtype and matches the loop's ``ref`` within the
    tolerance of its dtype (the one table, conftest.assert_matches)."""
    assert got.shape == like.shape and got.dtype == like.dtype, (what, got.shape, got.dtype)
    try:
        assert_matches(got, ref.detach(), got.dtype)
    except AssertionError as e:
        raise AssertionError(f"{what}: {e}") from None


def check(case: Case) -> None:
    """Forward and backward of ``case`` against the loop."""
    ops = case.operands()
    out, final, checkpoints = cpu.forward(*ops, case.softplus)
    g = torch.Generator().manual_seed(case.seed + 1)
    grad_out = torch.randn(out.shape, generator=g, dtype=out.dtype)
    grad_final = torch.randn(final.shape, generator=g, dtype=final.dtype)
    grads = cpu.backward(*ops, case.softplus, checkpoints, grad_out, grad_final)

    wide = _map(lambda t: t.to(torch.complex128 if t.is_complex() else torch.float64), ops)
    for t in wide:
        if t is not None:
            t.requires_grad_()
    ref_out, ref_final, ref_checkpoints = loop(*wide, case.softplus)
    _close(out, ref_out.detach(), ops[0], "out")
    _close(final, ref_final.detach(), torch.empty(final.shape, dtype=final.dtype), "final")
    _close(checkpoints, ref_checkpoints.detach(), checkpoints, "checkpoints")
    assert checkpoints.shape[2] == -(-case.length // K)

    leaves = [(name, t) for name, t in zip(NAMES, wide, strict=True) if t is not None]
    pairs = [
        (y, gy.to(y.dtype)) for y, gy in ((ref_out, grad_out), (ref_final, grad_final))
        if y.requires_grad
    ]  # fmt: skip
    ref_grads = torch.autograd.grad(
        [y for y, _ in pairs], [t for _, t in leaves], [gy for _, gy in pairs],
        allow_unused=True,
    )  # fmt: skip
    by_name = dict(zip(NAMES, grads, strict=True))
    for (name, t), ref in zip(leaves, ref_grads, strict=True):
        operand = ops[NAMES.index(name)]
        assert operand is not None
        _close(by_name[name], torch.zeros_like(t) if ref is None else ref, operand, f"grad {name}")
    for name, operand in zip(NAMES, ops, strict=True):
        if operand is None:
            assert by_name[name].numel() == 0, name


# Lengths around the checkpoint interval, each with every N; the rest of each case
# cycles through the forms of B and C, the optional operands, dtypes and odd dims.
_LENGTHS = (0, 1, 2, 3, 17, 63, 64, 65, 129)
_FORMS: list[tuple[int | str, int | str]] = [
    (0, 0), (1, 0), (0, 1), (1, 1), ("all", 1), (1, "some"), ("some", "all"),
]  # fmt: skip
_DIMS = (5, 13, 6)


def _cases() -> list[Case]:
    cases = []
    for i, (length, n) in enumerate(itertools.product(_LENGTHS, (1, 3, 16))):
        dim = _DIMS[i % 3]
        bf, cf = _FORMS[i % len(_FORMS)]

        def groups(form: int | str, dim: int = dim) -> int:
            if form == "all":
                return dim
            if form == "some":  # 1 < G < dim where dim allows it
                return 2 if dim % 2 == 0 else dim
            return int(form)

        flags = [(i >> k) & 1 == 1 for k in range(5)]
        cases.append(
            Case(
                batch=1 + i % 2, dim=dim, length=length, n=n,
                dtype=torch.float64 if i % 4 == 3 else torch.float32,
                B_groups=groups(bf), C_groups=groups(cf), D=flags[0], z=flags[1],
                delta_bias=flags[2], initial=flags[3], softplus=not flags[4] or i % 3 == 0,
                delta_scale=8.0 if i % 5 == 0 else 0.5, grow=i % 3 == 1, seed=i,
            )
        )  # fmt: skip
    return cases


@pytest.mark.parametrize("case", _cases(), ids=lambda c: f"L{c.length}-N{c.n}-seed{c.seed}")
def test_real_state_against_the_loop(case: Case) -> None:
    check(case)


_COMPLEX = [
    Case(2, 5, 65, 3, complex_A=True, B_groups=1, C_groups=0),
    Case(1, 6, 129, 16, complex_A=True, B_groups=0, C_groups=3, complex_B=False),
    Case(2, 4, 17, 1, complex_A=True, B_groups=2, C_groups=1, complex_C=False, D=False),
    Case(1, 5, 64, 16, complex_A=True, B_groups=5, C_groups=0, complex_B=False,
         complex_C=False, initial=False, softplus=False),
    Case(2, 3, 70, 3, dtype=torch.float64, complex_A=True, B_groups=1, C_groups=1, z=False),
    Case(1, 4, 2, 16, dtype=torch.float64, complex_A=True, B_groups=0, C_groups=2,
         complex_B=False, delta_bias=False),
    Case(2, 3, 0, 3, complex_A=True),
]  # fmt: skip


@pytest.mark.parametrize("case", _COMPLEX, ids=lambda c: f"L{c.length}-N{c.n}-{c.dtype}")
def test_complex_state_against_the_loop(case: Case) -> None:
    check(case)


@pytest.mark.parametrize(
    "case",
    [
        Case(1, 5, 65, 40, B_groups=1, C_groups=0),
        Case(2, 3, 70, 20, dtype=torch.float64, B_groups=0, C_groups=3),
        Case(1, 3, 66, 20, complex_A=True, B_groups=3, C_groups=1),
    ],
    ids=["float32", "float64", "complex64"],
)
def test_large_states(case: Case) -> None:
    """N past the sizes whose state the kernel keeps in registers (4 vectors)."""
    check(case)


@pytest.mark.parametrize(
    "case",
    [
        Case(1, 3, 1100, 16, dtype=torch.float64, B_groups=1, C_groups=1),
        Case(1, 2, 1100, 16, dtype=torch.float64, complex_A=True, B_groups=2, C_groups=1),
    ],
    ids=["real", "complex"],
)
def test_spans(case: Case) -> None:
    """Long enough that the kernel packs B and C, and sums the backward's g_B and g_C,
    a span of chunks at a time (two spans of 1024 steps for a float64 state of 16;
    three of 512 for a complex one, whose B is one group per channel)."""
    check(case)


@pytest.mark.parametrize(
    "case",
    [Case(0, 5, 10, 3), Case(2, 0, 10, 3), Case(2, 5, 10, 0), Case(0, 4, 0, 16, B_groups=2)],
    ids=["no batch", "no channels", "no state", "nothing"],
)
def test_empty_shapes(case: Case) -> None:
    check(case)


def _strided(t: Tensor, how: int) -> Tensor:
    """The same values in another layout: a transposed copy seen back, every other
    element of a larger tensor, or a broadcast along the first dimension."""
    if how == 0 and t.dim() >= 2:
        return t.transpose(-1, -2).contiguous().transpose(-1, -2)
    if how == 1 or t.dim() < 2 or t.shape[0] != 1:
        wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1] + 1, dtype=t.dtype)
        wide[..., 1::2] = t
        return wide[..., 1::2]
    return t[:1].expand_as(t)


@pytest.mark.parametrize(
    "case",
    [
        Case(1, 6, 70, 3, B_groups=1, C_groups=2),
        Case(1, 5, 129, 16, dtype=torch.float64, B_groups=0, C_groups=5),
        Case(1, 4, 65, 3, complex_A=True, B_groups=2, C_groups=0),
    ],
)
def test_strided_inputs_give_the_same_bits(case: Case) -> None:
    ops = case.operands()
    out, final, cps = cpu.forward(*ops, case.softplus)
    gen = torch.Generator().manual_seed(7)
    go = torch.randn(out.shape, generator=gen, dtype=out.dtype)
    gf = torch.randn(final.shape, generator=gen, dtype=final.dtype)
    grads = cpu.backward(*ops, case.softplus, cps, go, gf)
    for how in range(3):
        views = _map(functools.partial(_strided, how=how), ops)
        out2, final2, cps2 = cpu.forward(*views, case.softplus)
        strided = (_strided(t, (how + 1) % 3) for t in (cps, go, gf))
        grads2 = cpu.backward(*views, case.softplus, *strided)
        for a, b in zip((out, final, cps, *grads), (out2, final2, cps2, *grads2), strict=True):
            assert torch.equal(a, b)
    check(case)


@pytest.mark.parametrize(
    "case",
    [
        Case(2, 37, 200, 16, B_groups=1, C_groups=0, grow=True, seed=3),
        Case(2, 24, 150, 16, B_groups=24, C_groups=1, seed=6),
        Case(3, 24, 150, 3, dtype=torch.float64, B_groups=0, C_groups=4, seed=4),
        Case(2, 10, 300, 4, complex_A=True, B_groups=1, C_groups=0, complex_C=False, seed=5),
    ],
)
def test_any_thread_count_gives_the_same_bits(case: Case) -> None:
    """Every sum over channels, batch and time runs in an order fixed by the shapes."""
    ops = case.operands()
    saved = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            out, final, cps = cpu.forward(*ops, case.softplus)
            gen = torch.Generator().manual_seed(1)
            go = torch.randn(out.shape, generator=gen, dtype=out.dtype)
            gf = torch.randn(final.shape, generator=gen, dtype=final.dtype)
            grads = cpu.backward(*ops, case.softplus, cps, go, gf)
            results.append((out, final, cps, *grads))
    finally:
        torch.set_num_threads(saved)
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert torch.equal(a, b)


def _guarded_calls() -> dict[str, Callable[[], object]]:
    """Calls of the backend that no public call can make: each must raise in the guard
    (check_operands) before the kernel reads anything."""
    ops = Case(2, 6, 10, 3, B_groups=2, C_groups=0).operands()
    u, delta, A, B, C, D, z, bias, initial = ops
    assert D is not None and z is not None and initial is not None
    out, final, cps = cpu.forward(*ops, True)
    fwd, bwd = cpu.forward, cpu.backward
    return {
        "delta shorter": lambda: fwd(u, delta[..., :9], A, B, C, D, z, bias, initial, True),
        "B of another length": lambda: fwd(u, delta, A, B[..., :9], C, D, z, bias, initial, True),
        "C of another N": lambda: fwd(u, delta, A, B, C[:, :2], D, z, bias, initial, True),
        "D of another dtype": lambda: fwd(u, delta, A, B, C, D.double(), z, bias, initial, True),
        "initial of another batch": lambda: fwd(u, delta, A, B, C, D, z, bias, initial[:1], True),
        "complex B, real A": lambda: fwd(u, delta, A, B + 0j, C, D, z, bias, initial, True),
        "meta z": lambda: fwd(u, delta, A, B, C, D, z.to("meta"), bias, initial, True),
        "checkpoints of another count": lambda: bwd(*ops, True, cps[:, :, :0], out, final),
        "grad_out shorter": lambda: bwd(*ops, True, cps, out[..., :9], final),
    }


@pytest.mark.parametrize("what", list(_guarded_calls()))
def test_the_guard_rejects_what_the_kernel_cannot_index(what: str) -> None:
    with pytest.raises(RuntimeError, match=r"^parascan: internal error: the selective_"):
        _guarded_calls()[what]()


def test_the_kernel_rejects_groups_that_do_not_divide_dim() -> None:
    """Their shape is the one the guard is given; the kernel itself says no."""
    u, delta, A, _, C, D, z, bias, initial = Case(2, 6, 10, 3, C_groups=0).operands()
    with pytest.raises(RuntimeError, match="rejected"):
        cpu.forward(u, delta, A, torch.randn(2, 4, 3, 10), C, D, z, bias, initial, True)


def _math(dtype: torch.dtype, which: int, x: Tensor) -> Tensor:
    sfx = "f32" if dtype == torch.float32 else "f64"
    fn: Any = getattr(kernel_library(), f"ps_selective_math_{sfx}")
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    x = x.to(dtype).contiguous()
    out = torch.empty_like(x)
    assert fn(which, x.data_ptr(), out.data_ptr(), x.numel()) == 0
    return out


def _ulps(got: Tensor, ref: Tensor) -> Tensor:
    """|got - ref| in units of the last place of ref rounded to got's dtype."""
    r = ref.to(got.dtype).abs()
    ulp = torch.nextafter(r, torch.full_like(r, float("inf"))) - r
    return ((got.double() - ref) / ulp.double()).abs()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_vector_math_is_within_a_few_ulp(dtype: torch.dtype) -> None:
    """exp (0 instead of results under 2^-125 in float32, 2^-1021 in float64) and its
    variant for x <= 0, softplus with mamba's threshold, sigmoid; special values."""
    lo, hi = (-86.9, 88.72) if dtype == torch.float32 else (-708.0, 709.78)
    x = torch.cat([torch.linspace(lo, hi, 400_001, dtype=torch.float64), torch.randn(100_000)])
    x = x.to(dtype).double()
    assert _ulps(_math(dtype, 0, x), torch.exp(x)).max() <= 2
    x = x[x <= 0]
    assert torch.equal(_math(dtype, 4, x), _math(dtype, 0, x))  # the same operations
    x = torch.linspace(-80, 40, 200_001, dtype=torch.float64).to(dtype).double()
    assert _ulps(_math(dtype, 1, x), F.softplus(x, threshold=20)).max() <= 4
    x = torch.linspace(-60, 60, 200_001, dtype=torch.float64).to(dtype).double()
    assert _ulps(_math(dtype, 3, x), torch.sigmoid(x)).max() <= 5
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -1e30, -0.0, lo - 1])
    e = _math(dtype, 0, special)
    assert e[0].isnan() and e[1] == float("inf") and e[3] == float("inf")
    assert e[2] == 0 and e[4] == 0 and e[5] == 1 and e[6] == 0
    s = _math(dtype, 1, special)
    assert s[0].isnan() and s[1] == float("inf") and s[2] == 0 and s[4] == 0
    assert s[3] == special.to(dtype)[3]
    e = _math(dtype, 4, special[2:])
    assert e[0] == 0 and e[2] == 0 and e[3] == 1 and e[4] == 0


# --- growing states: A > 0 (allowed: the contract does not require A <= 0) -------------
# The backward took the gradient of dt A as (g_h[t] exp(dt A)) h[t-1]: where the adjoint
# grows past the range on a step whose entering state is 0 (the state not started
# yet), inf * 0 made the gradients of delta, A and delta_bias NaN where the loop's are
# finite (the issue: 5.8e286 and 5.8e290). The complex state's sweep multiplied
# exp(dt A) h[t-1] first, as the fix does now for the real one.


def _issue() -> tuple[Operands, bool]:
    """The reported case: 12 steps of dt = 30 on channels with A = 0 and A = 2 (N 1),
    u = B = C = 1, no softplus: the state grows by exp(60) a step, to 1.29e288."""
    ones = torch.ones(1, 1, 12, dtype=torch.float64)
    u, delta = torch.ones(1, 2, 12, dtype=torch.float64), torch.full((1, 2, 12), 30.0).double()
    A = torch.tensor([[0.0], [2.0]], dtype=torch.float64)
    return (u, delta, A, ones[:, None], ones[:, None].clone(), None, None, None, None), False


def _growing(
    rate: float, live: int, length: int = 150, *, groups: tuple[int, int] = (2, 2),
    softplus: bool = False, initial: float | None = None, scale: float = 1.0,
    complex_A: bool = False,
) -> tuple[Operands, bool]:  # fmt: skip
    """A float64 (complex128) problem of 2 x 4 channels, N 3: channel 0's state grows by
    exp(rate dt) a step in its first lane (0.8 and 0.6 of that in the others), channel
    2's by half that, channel 1's decays and channel 3's neither (dt = delta + bias in
    [0.75, 1.25), before the softplus when ``softplus``); u is 0 but for the last
    ``live`` steps (the state stays 0 until then, as it starts from none, or from
    ``initial`` times a random state), scaled by ``scale``. B and C: ``groups`` (0:
    invariant (dim, N), else (batch, G, N, L))."""
    g = torch.Generator().manual_seed(int(rate * 100) + live)
    f64 = torch.float64

    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=g, dtype=f64)

    batch, dim, n = 2, 4, 3
    lanes = torch.tensor([1.0, 0.8, 0.6], dtype=f64)
    A = torch.stack([rate * lanes, -lanes / 2, rate / 2 * lanes, torch.zeros(n, dtype=f64)])
    if complex_A:
        A = torch.complex(A, 3 * rand(dim, n))

    def bc(groups: int) -> Tensor:
        shape = (dim, n) if groups == 0 else (batch, groups, n, length)
        return torch.complex(rand(*shape), rand(*shape)) if complex_A else rand(*shape)

    u = rand(batch, dim, length) * scale
    u[:, :, : length - live] = 0
    bias = 0.01 * rand(dim)
    delta = 0.75 + 0.5 * torch.rand(batch, dim, length, generator=g, dtype=f64) - bias[:, None]
    h0 = None
    if initial is not None:
        h0 = (torch.complex(rand(batch, dim, n), rand(batch, dim, n)) if complex_A
              else rand(batch, dim, n)) * initial  # fmt: skip
    return (u, delta, A, bc(groups[0]), bc(groups[1]), rand(dim), rand(batch, dim, length),
            bias, h0), softplus  # fmt: skip


# name -> (input dtype, the problem); in the real cases the C backward gave NaN where
# the loop's gradients are finite (complex: the same problems, which it did not)
GROWING: dict[str, tuple[torch.dtype, Callable[[], tuple[Operands, bool]]]] = {
    "issue": (torch.float64, _issue),
    # the adjoint passes float64's range (exp(709)) some 47 steps from the end, where
    # the state is still 0: NaN in delta's gradient there
    "float64": (torch.float64, lambda: _growing(15.0, 35)),
    "float64-softplus": (torch.float64, lambda: _growing(12.0, 30, softplus=True, groups=(0, 4))),
    # initial states and inputs of 1e-200 grown by exp(675) to exp(1125) (60 steps of
    # 15 dt), to 1e93 to 1e289
    "float64-tiny": (
        torch.float64,
        lambda: _growing(15.0, 60, 60, initial=1e-200, scale=1e-200, groups=(4, 0)),
    ),
    # growth past float32's range over L (exp(> 225)), the state within it (at most
    # exp(63) from the zeros)
    "float32": (torch.float32, lambda: _growing(2.0, 25)),
    # initial states and inputs of 1e-30 grown by up to exp(131) (the adjoint past
    # float32's range), dt = softplus(about 1)
    "float32-tiny-softplus": (
        torch.float32,
        lambda: _growing(1.0, 30, 100, softplus=True, groups=(0, 1), initial=1e-30, scale=1e-30),
    ),
    "complex128": (torch.float64, lambda: _growing(15.0, 35, complex_A=True, groups=(0, 2))),
    "complex64": (torch.float32, lambda: _growing(2.0, 25, complex_A=True, groups=(1, 0))),
}


def _scales(name: str, t: Tensor) -> list[Tensor]:
    """``t`` cut into the parts that share one scale, to be compared each at its own
    (a growing channel's values dwarf a decaying one's): a channel's steps, a
    channel's lane, a group's lane of B or C."""
    if name in ("u", "delta", "z", "out"):
        dims: tuple[int, ...] = (1,)
    elif name in ("final", "initial") or (name in ("B", "C") and t.dim() == 4):
        dims = (1, 2)
    else:  # A, invariant B and C, D, delta_bias: every element
        dims = tuple(range(t.dim()))
    return list(t.movedim(dims, tuple(range(len(dims)))).flatten(0, len(dims) - 1).unbind(0))


def _fits(expected: Tensor, dtype: torch.dtype) -> Tensor:
    """Where the float64 ``expected`` is finite and fits ``dtype`` with room to spare
    (below 1/16 of its largest value): there a kernel computing in ``dtype`` owes it."""
    return expected.isfinite() & (expected.abs() < torch.finfo(dtype).max / 16)


def _matches_where(name: str, got: Tensor, want: Tensor, where: Tensor, dtype: torch.dtype) -> None:
    """``got`` finite and matching ``want`` wherever ``where``, scale by scale."""
    got = got.detach()
    parts = zip(_scales(name, got), _scales(name, want), _scales(name, where), strict=True)
    for a, e, w in parts:
        assert a[w].isfinite().all(), (name, int((~a[w].isfinite()).sum()), int(w.sum()))
        try:
            assert_matches(a[w], e[w], dtype)
        except AssertionError as err:
            raise AssertionError(f"{name}: {err}") from None


def _loop_grads(
    ops: Operands, softplus: bool, go: Tensor, gf: Tensor
) -> tuple[Tensor, Tensor, list[Tensor | None]]:  # fmt: skip
    """out, final and the nine gradients (None for an absent operand) by autograd
    through ``loop``, in the operands' own precision."""
    leaves = _map(lambda t: t.detach().clone().requires_grad_(), ops)
    out, final, _ = loop(*leaves, softplus)
    given = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad([out, final], given, [go.to(out.dtype), gf.to(final.dtype)]))
    return out.detach(), final.detach(), [None if t is None else next(grads) for t in leaves]


@pytest.mark.parametrize("case", list(GROWING))
def test_growing_state_against_the_loop(case: str) -> None:
    """A growing state (A > 0, or a positive real part) against the float64 loop: the
    outputs and final states (all finite, and fitting float32 for float32 inputs),
    and every gradient wherever the loop's is finite and fits the dtype. In float32 a
    gradient's computation can overflow where its value fits (a zero state times an
    overflowed gradient of the state: the float32 loop's NaN, the semantics at that
    precision): those entries are compared wherever the float32 loop's is finite."""
    dtype, make = GROWING[case]
    problem, softplus = make()
    ops = problem if dtype == torch.float64 else _map(
        lambda t: t.to(torch.complex64 if t.is_complex() else torch.float32), problem
    )  # fmt: skip
    wide = _map(lambda t: t.to(oracle_dtype(t.dtype)), ops)
    out, final, cps = cpu.forward(*ops, softplus)
    state = final.dtype.to_real()
    g = torch.Generator().manual_seed(1)
    go = torch.randn(out.shape, generator=g, dtype=torch.float64)
    gf = torch.randn(final.shape, generator=g, dtype=oracle_dtype(final.dtype))
    want_out, want_final, want = _loop_grads(wide, softplus, go, gf)
    assert _fits(want_out, dtype).all() and _fits(want_final, state).all()
    _matches_where("out", out, want_out, _fits(want_out, dtype), dtype)
    _matches_where("final", final, want_final, _fits(want_final, state), state)
    got = cpu.backward(*ops, softplus, cps, go.to(out.dtype), gf.to(final.dtype))
    low = _loop_grads(ops, softplus, go, gf)[2] if dtype != torch.float64 else want
    compared, total = 0, 0
    for name, w, gt, lw in zip(NAMES, want, got, low, strict=True):
        if w is None or lw is None:
            continue
        owed = _fits(w, state) & lw.isfinite()
        assert owed.any(), name
        _matches_where(name, gt, w, owed, state)
        compared, total = compared + int(owed.sum()), total + owed.numel()
    assert compared > 0.5 * total  # most of the gradients' entries are compared
