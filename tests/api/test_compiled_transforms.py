"""torch.func transforms under torch.compile, for every differentiable public scan:
per-sample gradients ``vmap(grad(f))``, per-sample jacobians ``vmap(jacrev(f))`` and
per-sample forward mode ``vmap`` of a ``jvp``, each compiled with
``torch.compile(fullgraph=True, backend="aot_eager")`` (no graph break allowed) and
compared with the same transform run eagerly, which is compared with a loop over the
samples.

``vmap(grad(f))`` and ``vmap(jacrev(f))`` of every scan built on parascan's
autograd.Functions raised "You tried to vmap over ApplyTemplate, but it does not have
vmap support" when compiled (issue 52, defect 7), and a compiled ``jvp`` gave wrong
tangents: dynamo rewrote each Function into its own higher-order op, which keeps
neither the Function's vmap rule nor its ``jvp``. The Functions are now one opaque call
in dynamo's graph (``parascan._core.opaque_to_dynamo``), traced by AOTAutograd with
the transforms around them.

``selective_state_update`` is not here: a decoding step that updates its state in
place, not a function to differentiate. The generic scans (``associative_scan``,
``associative_reduce``) are plain torch ops, traced by dynamo itself: here so that the
matrix covers every scan.

Shapes are tiny (T = 3, two samples, float64, outputs of a few elements: a jacobian
vmaps a backward op over them), as the time is torch.compile's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.func import grad, jacrev, jvp, vmap

import parascan as ps

F64 = torch.float64
SAMPLES = 2
Tensors = tuple[torch.Tensor, ...]


def _pair(x: Any, y: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The first-order recurrence's (a, b) pairs, for the generic scans."""
    return x[0] * y[0], y[0] * x[1] + y[1]


def _flat(*tensors: torch.Tensor) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


# Each op: the shapes of one sample's operands, and the scan as a function of them
# (raw operands mapped into each argument's domain by smooth functions).
OPS: dict[str, tuple[list[tuple[int, ...]], Callable[..., Any]]] = {
    "linear_scan": (
        [(1, 3), (1, 3), (1,)],
        lambda a, b, h: _flat(
            *ps.linear_scan(torch.sigmoid(a), b, -1, initial=h, return_final=True)
        ),
    ),
    "log_linear_scan": (
        [(2, 3), (2, 3)],
        lambda a, b: ps.log_linear_scan(F.logsigmoid(a), b, -1),
    ),
    "matrix_linear_scan": (
        [(3, 2, 2), (3, 2)],
        lambda w, b: ps.matrix_linear_scan(0.5 * w, b),
    ),
    "associative_scan-and-reduce": (  # one case for the two (compiling is the time)
        [(2, 3), (2, 3)],
        lambda a, b: _flat(
            ps.associative_scan(_pair, (a, b), -1)[1], ps.associative_reduce(_pair, (a, b), -1)[1]
        ),
    ),
    "selective_scan": (  # u, delta, A, B, C, D; B and C shared by the channels
        [(1, 1, 3), (1, 1, 3), (1, 2), (1, 2, 3), (1, 2, 3), (1,)],
        lambda u, dt, a, b, c, d: ps.selective_scan(
            u, dt, -torch.exp(a), b, c, d, delta_softplus=True
        ),
    ),
    "ssd_scan": (  # x, dt, A, B, C
        [(1, 3, 1, 1), (1, 3, 1), (1,), (1, 3, 1, 2), (1, 3, 1, 2)],
        lambda x, dt, a, b, c: ps.ssd_scan(x, dt, -torch.exp(a), b, c, dt_softplus=True),
    ),
    "delta_rule_scan": (  # q, k, v, beta (a decay g costs a third more compile time)
        [(1, 3, 1, 2), (1, 3, 1, 2), (1, 3, 1, 1), (1, 3, 1)],
        lambda q, k, v, b: ps.delta_rule_scan(q, k, v, torch.sigmoid(b), qk_l2norm=True),
    ),
}


def _loss(op: Callable[..., Any]) -> Callable[..., torch.Tensor]:
    """A scalar, non-linear in the scan's output (so that the gradients depend on it)."""
    return lambda *xs: op(*xs).sin().sum()


def _per_sample(op: Callable[..., Any], n: int, kind: str) -> Callable[..., Any]:
    """The transform ``kind`` of one sample's function of ``n`` operands: it maps the
    operands (then, for ``jvp``, their tangents) to a tensor or a tuple of tensors."""
    if kind == "grad":
        return grad(_loss(op), argnums=tuple(range(n)))
    if kind == "jacrev":  # the first operand's: grad covers the others
        return jacrev(lambda *xs: op(*xs).sin())

    def tangent(*xs: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = jvp(lambda *p: op(*p).sin(), xs[:n], xs[n:])[1]
        return out

    return tangent


def _inputs(shapes: list[tuple[int, ...]], kind: str) -> Tensors:
    gen = torch.Generator().manual_seed(0)
    operands = [torch.randn((SAMPLES, *s), generator=gen, dtype=F64) for s in shapes]
    if kind == "jvp":  # the tangents, after the operands
        operands += [torch.randn((SAMPLES, *s), generator=gen, dtype=F64) for s in shapes]
    return tuple(operands)


@pytest.fixture(autouse=True)
def _fresh_dynamo() -> Iterator[None]:
    """Each case compiles from nothing: no cached graph answers for another case, and
    the recompile limit is never reached (which would run a function eagerly)."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


# A compilation costs 1 to 4 s: by default each op under one transform, each transform
# over two or three ops (the Functions share one path through dynamo:
# parascan._core.opaque_to_dynamo); every op under every transform with the slow tests.
BY_DEFAULT = {
    "linear_scan": "grad",
    "log_linear_scan": "jacrev",
    "matrix_linear_scan": "jvp",
    "associative_scan-and-reduce": "grad",
    "selective_scan": "jvp",
    "ssd_scan": "jacrev",
    "delta_rule_scan": "grad",
}


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        pytest.param(name, kind, marks=[] if BY_DEFAULT[name] == kind else [pytest.mark.slow])
        for name in OPS
        for kind in ("grad", "jacrev", "jvp")
    ],
)
def test_compiled_vmap_of_transform(name: str, kind: str) -> None:
    shapes, op = OPS[name]
    inputs = _inputs(shapes, kind)
    per_sample = _per_sample(op, len(shapes), kind)
    batched = vmap(per_sample)

    eager = batched(*inputs)
    # eager vmap against the loop over the samples
    for i in range(SAMPLES):
        torch.testing.assert_close(per_sample(*(x[i] for x in inputs)), _select(eager, i))

    compiled = torch.compile(batched, fullgraph=True, backend="aot_eager")(*inputs)
    torch.testing.assert_close(compiled, eager)


def _select(result: Any, i: int) -> Any:
    if isinstance(result, torch.Tensor):
        return result[i]
    return type(result)(_select(r, i) for r in result)
