"""Second derivatives of ps.selective_scan and ps.ssd_scan on every CPU backend.

Reverse mode over forward mode is right: ``jacrev(jacfwd(f))``, ``grad`` of a ``jvp``,
``vjp`` of a ``jvp``, ``torch.autograd.grad`` of a dual tensor's tangent and
``torch.func.grad`` over a forward_ad dual level all give the float64 loops' own second
derivatives (oracles.py, differentiated by plain torch). Every other order raises
parascan's error (``refuse_second_derivatives``), never torch's internal asserts nor
silently wrong numbers: forward over reverse (``torch.func.hessian``, ``jvp`` of
``grad``), reverse over reverse (``jacrev(jacrev)``, ``grad(grad)``, double backward,
``torch.autograd.functional.hessian``) and forward over forward (``jacfwd(jacfwd)``,
``jvp`` of ``jvp``: torch runs an autograd.Function's jvp with forward grad off, so the
outer transform saw none of the tangents' own computation and got zeros).

The functions differentiated are non-linear in the scans' outputs: the second
derivatives then go back through the primal outputs too, which jacfwd computes under
vmap (its duals are batched). That backward through a vmapped scan is what failed
with torch's "flat_bdims must not be None" (its generated vmap rule pairs the saved
tensors with the vmapped dims of the last save: save_for_forward saved fewer than
save_for_backward), and forward mode through a vmapped scan failed on the checkpoints'
None tangent; the first-order checks through vmap below pin both down.

Shapes stay tiny: jacrev of jacfwd vmaps over every element, and the scans' vmap rule
runs once per element. The reverse-over-forward cases run on the first CPU backend (the C
kernel's) by default, on the others with the slow tests (``SECOND_ORDER_BACKENDS``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.autograd import forward_ad
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

import parascan as ps
from parascan.selective import autograd as ops
from parascan.ssd import autograd as ssd_ops

from oracles import selective_loop, ssd_loop

F64 = torch.float64
BACKENDS = [b for b in ps.backends("cpu") if b in ops.ROW.backends and b in ssd_ops.ROW.backends]
# Reverse over forward: every backend's tangents are the torch backend's forward under
# forward-mode AD (parascan._core.jvp_through), differentiated again in torch ops; the
# backends differ in the primal only. The C kernel's cases by default, the others' with
# the slow tests.
SECOND_ORDER_BACKENDS = [
    pytest.param(b, marks=[] if i == 0 else [pytest.mark.slow]) for i, b in enumerate(BACKENDS)
]
Problem = dict[str, Any]
Run = Callable[[Problem], tuple[torch.Tensor, torch.Tensor]]


def _selective(gen: torch.Generator, complex_a: bool = False) -> Problem:
    """Every operand present (grouped B, shared C), softplus on, L = 5."""
    batch, dim, n, length = 1, 3, 2, 5

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=F64)

    a = -0.5 - torch.rand(dim, n, generator=gen, dtype=F64)
    if complex_a:
        a = torch.complex(a, rand(dim, n))
    return {
        "u": rand(batch, dim, length),
        "delta": torch.rand(batch, dim, length, generator=gen, dtype=F64) - 0.5,
        "A": a,
        "B": rand(batch, 3, n, length),
        "C": rand(batch, n, length),
        "D": rand(dim),
        "z": rand(batch, dim, length),
        "delta_bias": 0.5 * rand(dim),
        "initial": torch.complex(rand(batch, dim, n), rand(batch, dim, n))
        if complex_a
        else rand(batch, dim, n),
    }


def _ssd(gen: torch.Generator) -> Problem:
    """Every operand present (2 groups of 2 heads), softplus on, L = 5."""
    batch, length, heads, headdim, groups, n = 1, 5, 4, 2, 2, 3

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=F64)

    return {
        "x": rand(batch, length, heads, headdim),
        "dt": torch.rand(batch, length, heads, generator=gen, dtype=F64) - 0.3,
        "A": -0.2 - torch.rand(heads, generator=gen, dtype=F64),
        "B": rand(batch, length, groups, n),
        "C": rand(batch, length, groups, n),
        "D": rand(heads, headdim),
        "z": rand(batch, length, heads, headdim),
        "dt_bias": 0.5 * rand(heads),
        "initial": rand(batch, heads, headdim, n),
    }


def _selective_run(backend: str) -> Run:
    def run(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
        if backend == "oracle":
            return selective_loop(
                p["u"], p["delta"], p["A"], p["B"], p["C"], p["D"], p["z"], p["delta_bias"],
                True, p["initial"],
            )  # fmt: skip
        return ps.selective_scan(
            p["u"], p["delta"], p["A"], p["B"], p["C"], p["D"], p["z"], p["delta_bias"], True,
            initial=p["initial"], return_final=True, backend=backend,
        )  # fmt: skip

    return run


def _ssd_run(backend: str) -> Run:
    def run(p: Problem) -> tuple[torch.Tensor, torch.Tensor]:
        options = {"D": p["D"], "z": p["z"], "dt_bias": p["dt_bias"], "dt_softplus": True,
                   "initial": p["initial"]}  # fmt: skip
        if backend == "oracle":
            return ssd_loop(p["x"], p["dt"], p["A"], p["B"], p["C"], **options)
        return ps.ssd_scan(p["x"], p["dt"], p["A"], p["B"], p["C"], **options,
                           return_final=True, backend=backend)  # fmt: skip

    return run


SCANS = {
    "selective": (_selective, _selective_run, r"parascan\.selective_scan"),
    "ssd": (_ssd, _ssd_run, r"parascan\.ssd_scan"),
}
# the real operands each scan is differentiated in (all of them)
NAMES = {
    "selective": ["u", "delta", "A", "B", "C", "D", "z", "delta_bias", "initial"],
    "ssd": ["x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial"],
}
FIRST = {"selective": "u", "ssd": "x"}
CASES = [(scan, name) for scan in SCANS for name in NAMES[scan]]


def _loss(run: Run, p: Problem, names: tuple[str, ...]) -> Callable[..., torch.Tensor]:
    """A scalar non-linear in both outputs, as a function of the operands ``names``."""

    def loss(*values: torch.Tensor) -> torch.Tensor:
        out, final = run({**p, **dict(zip(names, values, strict=True))})
        return torch.sin(out).sum() + (final.abs() ** 2).sum()

    return loss


def _setup(scan: str, gen: torch.Generator, backend: str) -> tuple[Problem, Run, Run, str]:
    problem, runner, public = SCANS[scan]
    return problem(gen), runner(backend), runner("oracle"), public


def _close(got: Any, want: Any) -> None:
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


# --- right: reverse mode over forward mode ------------------------------------------


@pytest.mark.parametrize("backend", SECOND_ORDER_BACKENDS)
@pytest.mark.parametrize(("scan", "name"), CASES)
def test_jacrev_of_jacfwd(scan, name, backend, gen):
    """The Hessian of a non-linear function of both outputs in each operand, as
    jacrev(jacfwd(f)), against the float64 loop's (torch.func.hessian of plain ops)."""
    p, run, oracle, _ = _setup(scan, gen, backend)
    got = jacrev(jacfwd(_loss(run, p, (name,))))(p[name])
    want = hessian(_loss(oracle, p, (name,)))(p[name])
    assert want.abs().max() > 0
    _close(got, want)


@pytest.mark.parametrize("backend", SECOND_ORDER_BACKENDS)
@pytest.mark.parametrize("scan", SCANS)
def test_jacrev_of_jacfwd_mixed(scan, backend, gen):
    """Mixed second derivatives (argnums tuples, A with B) of a vector-valued function,
    and jacfwd with has_aux."""
    p, run, oracle, _ = _setup(scan, gen, backend)
    names = ("A", "B")

    def vector(r: Run) -> Callable[..., torch.Tensor]:
        def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            out, final = r({**p, "A": a, "B": b})
            return torch.stack([torch.sin(out).sum(), (final**2).sum(), (out * out).mean()])

        return f

    def both(f):  # type: ignore[no-untyped-def]
        return jacrev(jacfwd(f, argnums=(0, 1)), argnums=(0, 1))(*(p[k] for k in names))

    _close(both(vector(run)), both(vector(oracle)))

    def with_aux(r: Run):  # type: ignore[no-untyped-def]
        def f(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            value = _loss(r, p, ("A",))(a)
            return value, value.detach()

        return jacrev(jacfwd(f, has_aux=True), has_aux=True)(p["A"])

    (h, aux), (h_want, aux_want) = with_aux(run), with_aux(oracle)
    _close(h, h_want)
    _close(aux, aux_want)


@pytest.mark.parametrize("backend", SECOND_ORDER_BACKENDS)
@pytest.mark.parametrize("scan", SCANS)
def test_reverse_over_forward_all_operands(scan, backend, gen):
    """One Hessian-vector product in every operand at once, four ways: grad of a jvp,
    vjp of a jvp, torch.autograd.grad of a dual tensor's tangent, and torch.func.grad
    over a forward_ad dual level."""
    p, run, oracle, _ = _setup(scan, gen, backend)
    names = tuple(NAMES[scan])
    primals = tuple(p[k] for k in names)
    directions = tuple(torch.randn(t.shape, generator=gen, dtype=F64) for t in primals)

    def directional(r: Run) -> Callable[..., torch.Tensor]:
        return lambda *v: jvp(_loss(r, p, names), v, directions)[1]

    want = grad(directional(oracle), argnums=tuple(range(len(names))))(*primals)
    got = grad(directional(run), argnums=tuple(range(len(names))))(*primals)
    _close(got, want)

    _, pullback = vjp(directional(run), *primals)
    _close(pullback(torch.ones((), dtype=F64)), want)

    leaves = [t.clone().requires_grad_() for t in primals]
    with forward_ad.dual_level():
        duals = [forward_ad.make_dual(t, d) for t, d in zip(leaves, directions, strict=True)]
        tangent = forward_ad.unpack_dual(_loss(run, p, names)(*duals)).tangent
    _close(torch.autograd.grad(tangent, leaves), want)

    def through_dual_level(*v: torch.Tensor) -> torch.Tensor:
        with forward_ad.dual_level():
            duals = [forward_ad.make_dual(t, d) for t, d in zip(v, directions, strict=True)]
            return forward_ad.unpack_dual(_loss(run, p, names)(*duals)).tangent

    _close(grad(through_dual_level, argnums=tuple(range(len(names))))(*primals), want)


@pytest.mark.parametrize("backend", SECOND_ORDER_BACKENDS)
@pytest.mark.parametrize("scan", SCANS)
def test_reverse_over_forward_under_vmap(scan, backend, gen):
    """vmap over jacrev(jacfwd(f)), and jacrev of a vmapped jacfwd: a batch of two
    problems (their first operand stacked)."""
    p, run, oracle, _ = _setup(scan, gen, backend)
    name = FIRST[scan]
    stacked = torch.stack([p[name], torch.randn(p[name].shape, generator=gen, dtype=F64)])

    def per_problem(r: Run):  # type: ignore[no-untyped-def]
        return _loss(r, p, (name,))

    want = vmap(hessian(per_problem(oracle)))(stacked)
    _close(vmap(jacrev(jacfwd(per_problem(run))))(stacked), want)
    # jacrev of vmap(jacfwd): the rows of one problem's Hessian meet only that problem's
    size = p[name].numel()
    got = jacrev(vmap(jacfwd(per_problem(run))))(stacked).reshape(2, size, 2, size)
    _close(torch.stack([got[i, :, i] for i in range(2)]), want.reshape(2, size, size))


@pytest.mark.parametrize("backend", SECOND_ORDER_BACKENDS)
def test_complex_a_reverse_over_forward(backend, gen):
    """The selective scan with a complex A (and state): the Hessian in delta and in B."""
    p = _selective(gen, complex_a=True)
    run, oracle = _selective_run(backend), _selective_run("oracle")
    for name in ("delta", "B"):
        _close(jacrev(jacfwd(_loss(run, p, (name,))))(p[name]),
               hessian(_loss(oracle, p, (name,)))(p[name]))  # fmt: skip


# --- first order through vmap (the same two faults) ---------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scan", SCANS)
def test_first_order_through_vmap(scan, backend, gen):
    """grad, jacrev, jvp and jacfwd of a vmapped scan, and backward through one."""
    p, run, oracle, _ = _setup(scan, gen, backend)
    name = FIRST[scan]
    stacked = torch.stack([p[name], torch.randn(p[name].shape, generator=gen, dtype=F64)])
    direction = torch.randn(stacked.shape, generator=gen, dtype=F64)

    def batched(r: Run) -> Callable[[torch.Tensor], torch.Tensor]:
        return lambda v: vmap(_loss(r, p, (name,)))(v)

    _close(grad(lambda v: batched(run)(v).sum())(stacked),
           grad(lambda v: batched(oracle)(v).sum())(stacked))  # fmt: skip
    _close(jacrev(batched(run))(stacked), jacrev(batched(oracle))(stacked))
    _close(jvp(batched(run), (stacked,), (direction,))[1],
           jvp(batched(oracle), (stacked,), (direction,))[1])  # fmt: skip
    _close(jacfwd(batched(run))(stacked), jacrev(batched(oracle))(stacked))
    leaf = stacked.clone().requires_grad_()
    batched(run)(leaf).sum().backward()
    _close(leaf.grad, grad(lambda v: batched(oracle)(v).sum())(stacked))


# --- refused: forward over reverse, reverse over reverse, forward over forward -------


def _double_backward(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Any:
    leaf = x.clone().requires_grad_()
    (g,) = torch.autograd.grad(f(leaf), leaf, create_graph=True)
    return torch.autograd.grad(g.sum(), leaf)


def _jvp_of_jvp(f: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Any:
    d = torch.ones_like(x)
    return jvp(lambda v: jvp(f, (v,), (d,))[1], (x,), (d,))


REFUSED = {
    "hessian": lambda f, x: hessian(f)(x),
    "jacfwd_of_jacrev": lambda f, x: jacfwd(jacrev(f))(x),
    "jvp_of_grad": lambda f, x: jvp(grad(f), (x,), (torch.ones_like(x),)),
    "jacrev_of_jacrev": lambda f, x: jacrev(jacrev(f))(x),
    "grad_of_grad": lambda f, x: grad(lambda v: grad(f)(v).sum())(x),
    "double_backward": _double_backward,
    "autograd_functional_hessian": lambda f, x: torch.autograd.functional.hessian(f, x),
    "autograd_functional_hessian_forward": lambda f, x: torch.autograd.functional.hessian(
        f, x, vectorize=True, outer_jacobian_strategy="forward-mode"
    ),
    "jacfwd_of_jacfwd": lambda f, x: jacfwd(jacfwd(f))(x),
    "jvp_of_jvp": _jvp_of_jvp,
}


@pytest.mark.parametrize("how", REFUSED)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scan", SCANS)
def test_refused(scan, backend, how, gen):
    p, run, _, public = _setup(scan, gen, backend)
    name = FIRST[scan]
    # delta / dt too for forward over forward: the one that was silently wrong in u or x
    # is right by luck (the scan is linear in it alone)
    for arg in (name, "A"):
        with pytest.raises(RuntimeError, match=rf"{public}: second derivatives"):
            REFUSED[how](_loss(run, p, (arg,)), p[arg])
