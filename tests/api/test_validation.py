"""One validation for every op: the same bad argument raises the same error, naming
the function, whichever backend is asked for and whatever the grad mode (inputs
that need a gradient, none, or ``torch.no_grad``). The CPU fast paths skip the op
machinery for speed; these tests hold them to the general path's checks."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import pytest
import torch

import parascan as ps

GRAD_MODES = ["no grad needed", "inputs need grad", "torch.no_grad"]


def first_order_backends() -> list[str]:
    # every backend name, available here or not: a bad argument is reported before
    # the backend is looked at
    return ["auto", "cpu", "triton", "torch", "loop"]


def _tensors(grad: bool, *shapes: tuple[int, ...]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.rand(s, generator=g).requires_grad_(grad) for s in shapes]


def first_order_cases(fn: Callable[..., Any]) -> dict[str, Callable[[bool, str], Any]]:
    """name -> call(grad, backend) of ``fn`` (linear_scan or log_linear_scan) with one
    bad argument and everything else valid."""

    def call(grad: bool, backend: str, **change: Any) -> Any:
        a, b, h = _tensors(grad, (2, 5, 3), (2, 5, 3), (2, 3))
        kwargs: dict[str, Any] = {"dim": 1, "initial": h, "backend": backend}
        args = {"gates": a, "tokens": b}
        for key, value in change.items():
            target = args if key in args else kwargs
            target[key] = value(a, b, h) if callable(value) else value
        return fn(args["gates"], args["tokens"], **kwargs)

    return {
        "return_final None": lambda g, be: call(g, be, return_final=None),
        "return_final 0": lambda g, be: call(g, be, return_final=0),
        "reverse None": lambda g, be: call(g, be, reverse=None),
        "reverse 1": lambda g, be: call(g, be, reverse=1),
        "dim float": lambda g, be: call(g, be, dim=1.0),
        "dim out of range": lambda g, be: call(g, be, dim=3),
        "dim -4": lambda g, be: call(g, be, dim=-4),
        "integer tokens": lambda g, be: call(g, be, tokens=torch.ones(2, 5, 3, dtype=torch.int64)),
        "bool gates": lambda g, be: call(g, be, gates=torch.ones(2, 5, 3, dtype=torch.bool)),
        "tokens a list": lambda g, be: call(g, be, tokens=[[1.0]]),
        "shapes that do not broadcast": lambda g, be: call(g, be, gates=lambda a, b, h: a[:, :4]),
        "initial of the wrong shape": lambda g, be: call(g, be, initial=lambda a, b, h: h[:, :2]),
        "initial with dim kept": lambda g, be: call(g, be, initial=lambda a, b, h: a),
        "complex initial, real result": lambda g, be: call(
            g, be, initial=torch.zeros(2, 3, dtype=torch.complex64)
        ),
        "initial a string": lambda g, be: call(g, be, initial="zeros"),
        "sparse tokens": lambda g, be: call(g, be, tokens=lambda a, b, h: b.detach().to_sparse()),
        "sparse gates": lambda g, be: call(g, be, gates=lambda a, b, h: a.detach().to_sparse()),
        "sparse CSR tokens": lambda g, be: call(
            g, be, tokens=lambda a, b, h: b.detach()[0].to_sparse_csr(), dim=0, initial=None
        ),
        "sparse initial": lambda g, be: call(g, be, initial=lambda a, b, h: h.detach().to_sparse()),
        "nested tokens": lambda g, be: call(
            g, be, tokens=torch.nested.nested_tensor([torch.ones(5, 3), torch.ones(4, 3)])
        ),
        "tokens on another device": lambda g, be: call(
            g, be, tokens=torch.ones(2, 5, 3, device="meta")
        ),
        "unknown backend": lambda g, be: call(g, "nope"),
        "backend None": lambda g, be: call(g, None),
    }


def matrix_cases() -> dict[str, Callable[[bool, str], Any]]:
    def call(grad: bool, backend: str, **change: Any) -> Any:
        w, b, h = _tensors(grad, (2, 6, 3, 3), (2, 6, 3), (2, 3))
        kwargs: dict[str, Any] = {"initial": h, "backend": backend}
        args = {"weights": w, "biases": b}
        for key, value in change.items():
            target = args if key in args else kwargs
            target[key] = value(w, b, h) if callable(value) else value
        return ps.matrix_linear_scan(args["weights"], args["biases"], **kwargs)

    return {
        "return_final None": lambda g, be: call(g, be, return_final=None),
        "reverse 1": lambda g, be: call(g, be, reverse=1),
        "weights not square": lambda g, be: call(g, be, weights=lambda w, b, h: w[..., :2]),
        "biases of another length": lambda g, be: call(g, be, biases=lambda w, b, h: b[:, :5]),
        "initial of another d": lambda g, be: call(g, be, initial=lambda w, b, h: h[:, :2]),
        "integer biases": lambda g, be: call(g, be, biases=torch.ones(2, 6, 3, dtype=torch.int32)),
        "weights a list": lambda g, be: call(g, be, weights=[[1.0]]),
        "sparse weights": lambda g, be: call(g, be, weights=lambda w, b, h: w.detach().to_sparse()),
        "sparse initial": lambda g, be: call(g, be, initial=lambda w, b, h: h.detach().to_sparse()),
        "batches that do not broadcast": lambda g, be: call(
            g, be, initial=lambda w, b, h: torch.zeros(3, 3)
        ),
        "unknown backend": lambda g, be: call(g, "nope"),
    }


def generic_cases(reduce: bool) -> dict[str, Callable[[bool, str], Any]]:
    """``backend`` here is the combine function: torch.matmul (which the reduce's C
    kernel recognizes) or the same product as a lambda (always the generic tree)."""
    fn = ps.associative_reduce if reduce else ps.associative_scan
    combines = {"matmul": torch.matmul, "lambda": lambda a, b: a @ b}

    def call(grad: bool, combine: str, **change: Any) -> Any:
        (x,) = _tensors(grad, (7, 4, 4))
        kwargs: dict[str, Any] = {"combine_fn": combines[combine], "elems": x, "dim": 0}
        for key, value in change.items():
            kwargs[key] = value(x) if callable(value) else value
        return fn(kwargs["combine_fn"], kwargs["elems"], kwargs["dim"])

    return {
        "dim out of range": lambda g, c: call(g, c, dim=3),
        "dim float": lambda g, c: call(g, c, dim=0.0),
        "combine_fn not callable": lambda g, c: call(g, c, combine_fn=3),
        "elems a list of numbers": lambda g, c: call(g, c, elems=[1.0, 2.0]),
        "sparse elems": lambda g, c: call(g, c, elems=lambda x: x.detach().to_sparse()),
        "0-d elems": lambda g, c: call(g, c, elems=torch.tensor(1.0)),
        **(
            {"nothing to reduce": lambda g, c: call(g, c, elems=torch.ones(0, 4, 4))}
            if reduce
            else {}
        ),
    }


OPS: dict[str, tuple[str, dict[str, Callable[[bool, str], Any]], list[str]]] = {
    "linear_scan": (
        "parascan.linear_scan", first_order_cases(ps.linear_scan), first_order_backends()
    ),
    "log_linear_scan": (
        "parascan.log_linear_scan",
        first_order_cases(ps.log_linear_scan),
        first_order_backends(),
    ),
    "matrix_linear_scan": (
        "parascan.matrix_linear_scan", matrix_cases(), ["auto", "cpu", "torch", "loop"]
    ),
    "associative_scan": ("parascan.associative_scan", generic_cases(False), ["matmul", "lambda"]),
    "associative_reduce": (
        "parascan.associative_reduce", generic_cases(True), ["matmul", "lambda"]
    ),
}  # fmt: skip

CASES = [(op, case) for op, (_, cases, _) in OPS.items() for case in cases]


@pytest.mark.parametrize(("op", "case"), CASES, ids=[f"{o}: {c}" for o, c in CASES])
def test_same_error_for_every_backend_and_grad_mode(op: str, case: str) -> None:
    name, cases, backends = OPS[op]
    outcomes = {}
    for backend in backends:
        for mode in GRAD_MODES:
            ctx = torch.no_grad() if mode == "torch.no_grad" else contextlib.nullcontext()
            with ctx, pytest.raises(Exception) as info:
                cases[case](mode == "inputs need grad", backend)
            outcomes[(backend, mode)] = (type(info.value), str(info.value))
    kinds = {kind for kind, _ in outcomes.values()}
    assert len(kinds) == 1, outcomes
    (kind,) = kinds
    assert issubclass(kind, (TypeError, ValueError, IndexError, RuntimeError)), outcomes
    for message in {m for _, m in outcomes.values()}:
        assert message.startswith(f"{name}: "), message


@pytest.mark.parametrize("fn", [ps.linear_scan, ps.log_linear_scan])
def test_the_fast_path_and_the_general_path_accept_the_same_calls(fn) -> None:
    # The call the CPU fast path takes (plain tensors, no grad) gives the same result
    # through the general path (a gradient needed).
    a, b = torch.rand(3, 7, 4), torch.randn(3, 7, 4)
    if fn is ps.log_linear_scan:
        b = b.abs().log()
    fast = fn(a, b, 1, reverse=True)
    general = fn(a.requires_grad_(), b, 1, reverse=True)
    torch.testing.assert_close(general.detach(), fast, rtol=0, atol=0)


def test_matrix_linear_scan_has_no_triton_backend() -> None:
    w, b = torch.rand(2, 4, 3, 3), torch.rand(2, 4, 3)
    with pytest.raises(RuntimeError, match=r"^parascan.matrix_linear_scan: backend 'triton'"):
        ps.matrix_linear_scan(w, b, backend="triton")
