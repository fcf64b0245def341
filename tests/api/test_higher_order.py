"""Second (and some third) derivatives of every scan built on parascan's first-order,
matrix and generic Functions, against the float64 loops of oracles.py differentiated
by plain torch, on every CPU backend.

Every public function (ps.linear_scan and ps.log_linear_scan, also packed with
cu_seqlens; ps.matrix_linear_scan; ps.associative_scan and ps.associative_reduce; the
drop-ins parascan.compat.fla.fused_recurrent_hgrn / chunk_hgrn, accelerated_scan.scan,
heinsen_sequence, torch_parallel_scan) is differentiated in every order:

- forward over forward: ``jacfwd(jacfwd(f))``, ``jvp`` of ``jvp``. These were silently
  wrong (off by up to 12 against the loop): torch runs an autograd.Function's ``jvp``
  with forward grad off, so the outer transform saw none of the tangent's own
  computation. The Functions now run it in parascan._higher_order.tangent_mode;
- reverse over forward: ``jacrev(jacfwd(f))``; forward over reverse: ``hessian``
  (``jacfwd(jacrev(f))``); reverse over reverse: ``jacrev(jacrev(f))``, ``grad(grad)``,
  double backward (``create_graph=True``) and gradgradcheck;
- first order through vmap: ``grad``, ``jacrev``, ``jvp``, ``jacfwd`` of ``vmap(f)``, and
  ``vmap(f).sum().backward()``.

Each function maps one flat float64 parameter vector (split into the operands) to its
output, so that every order is one call; the functions differentiated are non-linear
in the scans' outputs (``sin``), so the second derivatives also go back through the
primal outputs. All of these are right, none is refused, except where a backward
exchanges gradients between ranks: parascan.distributed's scans raise parascan's
second-derivative error for a second derivative (before, torch.autograd.grad of one
through the saved inputs silently left the scan's part out).

Shapes are tiny (T <= 6): jacfwd of jacfwd vmaps over every parameter twice.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vmap

import parascan as ps
import parascan.distributed as psd
from parascan.compat import accelerated_scan, fla, heinsen_sequence
from parascan.compat import torch_parallel_scan as tps

from oracles import fold, fold_scan, heinsen_loop, linear_loop, log_loop, matrix_loop, packed_loop

F64 = torch.float64
BACKENDS = ["loop", "torch", "cpu"]
Fn = Callable[[torch.Tensor], torch.Tensor]


def _split(theta: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    parts, at = [], 0
    for shape in shapes:
        size = math.prod(shape)
        parts.append(theta[at : at + size].reshape(shape))
        at += size
    return parts


def _flat(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


class Case:
    """A public function and its loop as functions of one flat parameter vector."""

    def __init__(
        self, shapes: list[tuple[int, ...]], scan: Callable[..., torch.Tensor],
        loop: Callable[..., torch.Tensor], positive: bool = False,
    ) -> None:  # fmt: skip
        self.shapes, self.positive = shapes, positive
        self.scan: Fn = lambda theta: scan(*_split(theta, shapes))
        self.loop: Fn = lambda theta: loop(*_split(theta, shapes))

    def theta(self) -> torch.Tensor:
        gen = torch.Generator().manual_seed(0)
        n = sum(math.prod(s) for s in self.shapes)
        if self.positive:
            return 0.5 + torch.rand(n, generator=gen, dtype=F64)
        return 0.7 * torch.randn(n, generator=gen, dtype=F64)


def _pair(x: Any, y: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The first-order recurrence's (a, b) pairs."""
    return x[0] * y[0], y[0] * x[1] + y[1]


def _cases() -> dict[str, Case]:
    cases: dict[str, Case] = {}
    lin = [(2, 5), (2, 5), (2,)]
    cu = [0, 2, 2, 6]  # an empty sequence too
    packed = [(1, 6, 2), (1, 6, 2), (3, 2)]
    mat = [(4, 2, 2), (4, 2), (2,)]
    for bk in BACKENDS:
        cases[f"linear_scan-{bk}"] = Case(
            lin,
            lambda a, b, h, bk=bk: ps.linear_scan(a, b, -1, initial=h, backend=bk),
            lambda a, b, h: linear_loop(a, b, -1, h)[0],
        )
        cases[f"linear_scan-{bk}-reverse-final"] = Case(
            lin,
            lambda a, b, h, bk=bk: _flat(
                *ps.linear_scan(a, b, 1, initial=h, reverse=True, return_final=True, backend=bk)
            ),
            lambda a, b, h: _flat(*linear_loop(a, b, 1, h, True)),
        )
        cases[f"log_linear_scan-{bk}"] = Case(
            lin,
            lambda a, b, h, bk=bk: ps.log_linear_scan(a, b, -1, initial=h, backend=bk),
            lambda a, b, h: log_loop(a, b, -1, h)[0],
        )
        cases[f"log_linear_scan-{bk}-reverse-final"] = Case(
            lin,
            lambda a, b, h, bk=bk: _flat(
                *ps.log_linear_scan(a, b, 1, initial=h, reverse=True, return_final=True, backend=bk)
            ),
            lambda a, b, h: _flat(*log_loop(a, b, 1, h, True)),
        )
        cases[f"linear_scan-{bk}-packed"] = Case(
            packed,
            lambda a, b, h, bk=bk: _flat(
                *ps.linear_scan(
                    a, b, 1, initial=h, return_final=True, backend=bk, cu_seqlens=torch.tensor(cu)
                )
            ),
            lambda a, b, h: _flat(*packed_loop(linear_loop, a, b, 1, cu, list(h))),
        )
        cases[f"log_linear_scan-{bk}-packed-reverse"] = Case(
            packed,
            lambda a, b, h, bk=bk: _flat(
                *ps.log_linear_scan(
                    a,
                    b,
                    1,
                    initial=h,
                    reverse=True,
                    return_final=True,
                    backend=bk,
                    cu_seqlens=torch.tensor(cu),
                )
            ),
            lambda a, b, h: _flat(*packed_loop(log_loop, a, b, 1, cu, list(h), reverse=True)),
        )
        for reverse in (False, True):
            cases[f"matrix_linear_scan-{bk}" + ("-reverse" if reverse else "")] = Case(
                mat,
                lambda w, b, h, bk=bk, r=reverse: ps.matrix_linear_scan(
                    w, b, initial=h, reverse=r, backend=bk
                ),
                lambda w, b, h, r=reverse: matrix_loop(w, b, h, r)[0],
            )
    pair, mats = [(2, 5), (2, 5)], [(5, 2, 2)]
    cases["associative_scan-pair"] = Case(
        pair,
        lambda a, b: ps.associative_scan(_pair, (a, b), -1)[1],
        lambda a, b: fold_scan(_pair, (a, b), -1)[1],
    )
    cases["associative_scan-matmul-reverse"] = Case(
        mats,
        lambda m: ps.associative_scan(torch.matmul, m, 0, reverse=True),
        lambda m: fold_scan(torch.matmul, m, 0, reverse=True),
    )
    cases["associative_scan-chunked"] = Case(  # 288-byte elements: the chunked algorithm
        [(6, 6, 6)],
        lambda x: ps.associative_scan(torch.mul, x, 0),
        lambda x: fold_scan(torch.mul, x, 0),
        positive=True,
    )
    cases["associative_reduce-matmul"] = Case(  # the matrix-product kernel's call
        mats,
        lambda m: ps.associative_reduce(torch.matmul, m, 0),
        lambda m: fold(torch.matmul, m, 0),
    )
    cases["associative_reduce-pair"] = Case(
        pair,
        lambda a, b: ps.associative_reduce(_pair, (a, b), -1)[1],
        lambda a, b: fold(_pair, (a, b), -1)[1],
    )
    hgrn, hgrn_cu = [(1, 5, 2), (1, 5, 2), (1, 2)], [0, 3, 6]
    for name in ("fused_recurrent_hgrn", "chunk_hgrn"):
        fn = getattr(fla, name)
        cases[f"fla.{name}"] = Case(
            hgrn,
            lambda x, g, h, fn=fn: _flat(*fn(x, g, h, True)),
            lambda x, g, h: _flat(*linear_loop(g.exp(), x, 1, h)),
        )
        cases[f"fla.{name}-packed"] = Case(
            [(1, 6, 2), (1, 6, 2), (2, 2)],
            lambda x, g, h, fn=fn: _flat(*fn(x, g, h, True, cu_seqlens=torch.tensor(hgrn_cu))),
            lambda x, g, h: _flat(*packed_loop(linear_loop, g.exp(), x, 1, hgrn_cu, list(h))),
        )
    cases["accelerated_scan.scan"] = Case(
        [(1, 2, 5), (1, 2, 5)],
        accelerated_scan.scan,
        lambda a, b: linear_loop(a, b, -1)[0],
    )
    heinsen = [(2, 4), (2, 5)]
    cases["heinsen_sequence.compute_in_parallel"] = Case(
        heinsen,
        heinsen_sequence.compute_in_parallel,
        lambda c, v: heinsen_loop(c.exp(), v.exp()),
    )
    cases["heinsen_sequence.compute_in_parallel_special_case"] = Case(
        heinsen,
        heinsen_sequence.compute_in_parallel_special_case,
        lambda c, v: heinsen_loop(c.exp(), v.exp()),
    )
    cases["torch_parallel_scan.prefix_scan"] = Case(
        mats,
        lambda m: tps.prefix_scan(m, torch.matmul, 0),
        lambda m: fold_scan(torch.matmul, m, 0),
    )
    cases["torch_parallel_scan.reduce_scan"] = Case(
        mats,
        lambda m: tps.reduce_scan(m, torch.matmul, 0),
        lambda m: fold(torch.matmul, m, 0),
    )
    return cases


CASES = _cases()


def _directions(theta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return (
        torch.randn(theta.shape, generator=gen, dtype=F64),
        torch.randn(theta.shape, generator=gen, dtype=F64),
    )


def _scalar(f: Fn) -> Fn:
    """A scalar function non-linear in ``f``'s output (weights break symmetries)."""

    def s(theta: torch.Tensor) -> torch.Tensor:
        out = f(theta).reshape(-1)
        weights = torch.linspace(0.3, 1.7, out.numel(), dtype=F64)
        return (torch.sin(out) * weights).sum()

    return s


def _vector(f: Fn) -> Fn:
    return lambda theta: torch.sin(f(theta).reshape(-1))


def _batch(theta: torch.Tensor) -> torch.Tensor:
    return torch.stack([theta, 1.1 * theta, theta.flip(0)])


def _double_backward(f: Fn, theta: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    x = theta.detach().requires_grad_()
    (g,) = torch.autograd.grad(_scalar(f)(x), x, create_graph=True)
    (gg,) = torch.autograd.grad(g @ v, x)
    return gg


def _vmap_backward(f: Fn, theta: torch.Tensor) -> torch.Tensor:
    x = _batch(theta).requires_grad_()
    torch.sin(vmap(f)(x)).sum().backward()
    assert x.grad is not None
    return x.grad


Order = Callable[[Fn, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
ORDERS: dict[str, Order] = {
    # forward over forward
    "jacfwd(jacfwd)": lambda f, x, v, w: jacfwd(jacfwd(_vector(f)))(x),
    "jvp(jvp)": lambda f, x, v, w: jvp(lambda y: jvp(_vector(f), (y,), (v,))[1], (x,), (w,))[1],
    # reverse over forward, forward over reverse
    "jacrev(jacfwd)": lambda f, x, v, w: jacrev(jacfwd(_scalar(f)))(x),
    "hessian": lambda f, x, v, w: hessian(_scalar(f))(x),
    # reverse over reverse
    "jacrev(jacrev)": lambda f, x, v, w: jacrev(jacrev(_scalar(f)))(x),
    "grad(grad)": lambda f, x, v, w: grad(lambda y: grad(_scalar(f))(y) @ v)(x),
    "double backward": lambda f, x, v, w: _double_backward(f, x, v),
    # first order through vmap
    "grad(vmap)": lambda f, x, v, w: grad(lambda y: torch.sin(vmap(f)(y)).sum())(_batch(x)),
    "jacrev(vmap)": lambda f, x, v, w: jacrev(vmap(f))(_batch(x)),
    "jvp(vmap)": lambda f, x, v, w: jvp(vmap(f), (_batch(x),), (_batch(v),))[1],
    "jacfwd(vmap)": lambda f, x, v, w: jacfwd(vmap(f))(_batch(x)),
    "vmap.backward": lambda f, x, v, w: _vmap_backward(f, x),
}


@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("case", list(CASES))
def test_against_the_loop(case: str, order: str) -> None:
    c = CASES[case]
    theta = c.theta()
    v, w = _directions(theta)
    got = ORDERS[order](c.scan, theta, v, w)
    want = ORDERS[order](c.loop, theta, v, w)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("case", list(CASES))
def test_gradgradcheck(case: str) -> None:
    c = CASES[case]
    theta = c.theta().requires_grad_()
    assert torch.autograd.gradgradcheck(lambda x: torch.sin(c.scan(x)), (theta,))


# Third order and forward over forward under vmap: the inner jvp of a vmapped scan runs
# under a vmap of its own, and its saved tensors lose their tangent inside the batch.
NESTED: dict[str, Order] = {
    "jacfwd(jacfwd(jacfwd))": lambda f, x, v, w: jacfwd(jacfwd(jacfwd(_vector(f))))(x),
    "jacfwd(jacfwd(jacrev))": lambda f, x, v, w: jacfwd(jacfwd(jacrev(_scalar(f))))(x),
    "jvp(vmap(jvp))": lambda f, x, v, w: jvp(
        lambda y: vmap(lambda z: jvp(f, (z,), (v,))[1])(torch.stack([y, y.cos()])), (x,), (w,)
    )[1],
    "vmap(jacfwd(jacfwd))": lambda f, x, v, w: vmap(jacfwd(jacfwd(_vector(f))))(_batch(x)),
}
SMALL = {
    "linear_scan": Case(
        [(1, 3), (1, 3), (1,)],
        lambda a, b, h: ps.linear_scan(a, b, -1, initial=h, reverse=True, backend="cpu"),
        lambda a, b, h: linear_loop(a, b, -1, h, True)[0],
    ),
    "log_linear_scan-packed": Case(
        [(1, 3, 1), (1, 3, 1), (2, 1)],
        lambda a, b, h: ps.log_linear_scan(
            a, b, 1, initial=h, backend="cpu", cu_seqlens=torch.tensor([0, 1, 3])
        ),
        lambda a, b, h: packed_loop(log_loop, a, b, 1, [0, 1, 3], list(h))[0],
    ),
    "matrix_linear_scan": Case(
        [(2, 2, 2), (2, 2)],
        lambda w, b: ps.matrix_linear_scan(w, b, backend="cpu"),
        lambda w, b: matrix_loop(w, b)[0],
    ),
}


@pytest.mark.parametrize("order", list(NESTED))
@pytest.mark.parametrize("case", list(SMALL))
def test_nested_against_the_loop(case: str, order: str) -> None:
    c = SMALL[case]
    theta = c.theta()
    v, w = _directions(theta)
    got = NESTED[order](c.scan, theta, v, w)
    want = NESTED[order](c.loop, theta, v, w)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)


# parascan.distributed: the backward exchanges gradients between ranks and is not
# differentiable again. One process, a group of one (the multi-rank results are
# tests/distributed's).


@pytest.fixture
def group_of_one() -> Any:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
@pytest.mark.parametrize("name", ["linear_scan", "log_linear_scan"])
def test_distributed_refuses_second_derivatives(group_of_one: Any, name: str, packed: bool) -> None:
    scan, loop = getattr(psd, name), {"linear_scan": linear_loop, "log_linear_scan": log_loop}[name]
    cu = [0, 2, 5]
    gen = torch.Generator().manual_seed(0)
    x = (0.5 * torch.randn(1, 5, 2, generator=gen, dtype=F64)).requires_grad_()
    tokens = torch.randn(1, 5, 2, generator=gen, dtype=F64)

    def run(f: Any) -> torch.Tensor:
        if packed:
            return f(x, tokens, 1, cu_seqlens=torch.tensor(cu))
        return f(x, tokens, 1)

    out = run(scan)
    want = (
        run(lambda *a, **k: packed_loop(loop, *a[:3], cu)[0])
        if packed
        else run(lambda *a, **k: loop(*a)[0])
    )
    # the first derivatives under create_graph are the loop's
    (g,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    (g_want,) = torch.autograd.grad(want.sum(), x, create_graph=True)
    torch.testing.assert_close(g, g_want, rtol=1e-9, atol=1e-10)
    error = rf"parascan\.distributed\.{name}: second derivatives"
    # a second derivative through the saved inputs only (out.sum() is linear in out):
    # torch's once_differentiable left the scan's part out, silently
    with pytest.raises(RuntimeError, match=error):
        torch.autograd.grad((g * x).sum(), x)
    (g2,) = torch.autograd.grad(torch.sin(out).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match=error):
        g2.sum().backward()
