"""``parascan check``: every available backend against the float64 loop, and
gradcheck, on this machine. Exit status 1 when anything fails."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from parascan._core import FLOAT_DTYPES, backends
from parascan.cli.tolerance import TOLERANCE, relative_error
from parascan.first_order import linear_scan, log_linear_scan
from parascan.first_order.ops import ROWS as FIRST_ORDER_ROWS
from parascan.first_order.reference import linear_loop
from parascan.generic import associative_reduce, associative_scan
from parascan.generic import reference as generic_reference
from parascan.matrix import matrix_linear_scan
from parascan.matrix import reference as matrix_reference

__all__ = ["run_check"]

_CASES = [  # (shape, dim, reverse, with initial)
    ((3, 65, 257), 1, False, True),
    ((9, 1031), -1, True, False),
    ((2, 9, 33), 2, False, False),
    ((4, 0, 3), 1, True, True),
]


@dataclass
class CheckResult:
    what: str
    backend: str
    passed: bool
    detail: str
    ran: bool = True  # False: the backend does not take this case ("n/a", not a failure)


def _high(dtype: torch.dtype) -> torch.dtype:
    return torch.complex128 if dtype.is_complex else torch.float64


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int):  # type: ignore[no-untyped-def]
    gen = torch.Generator().manual_seed(seed)
    gates = (0.5 + 0.5 * torch.rand(shape, generator=gen, dtype=torch.float64)).to(dtype)
    tokens = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    return gates.to(device), tokens.to(device)


def _forward_checks(backend: str, device: str) -> Iterator[CheckResult]:
    for dtype in FLOAT_DTYPES:
        worst, ok = 0.0, True
        for i, (shape, dim, reverse, with_initial) in enumerate(_CASES):
            gates, tokens = _inputs(shape, dtype, device, seed=i)
            d = dim % len(shape)
            initial = tokens.select(d, 0).clone() if with_initial and shape[d] else None
            if with_initial and initial is None:
                initial = torch.ones(shape[:d] + shape[d + 1 :], dtype=dtype, device=device)
            out, final = linear_scan(
                gates, tokens, dim, initial=initial, reverse=reverse, return_final=True,
                backend=backend,
            )  # fmt: skip
            want = linear_loop(
                gates.to(_high(dtype)), tokens.to(_high(dtype)),
                None if initial is None else initial.to(_high(dtype)), dim, reverse,
            )  # fmt: skip
            if out.numel() == 0:
                continue
            end = 0 if reverse else -1
            err = max(relative_error(out, want), relative_error(final, want.select(d, end)))
            worst = max(worst, err)
            ok = ok and err <= TOLERANCE[dtype][1] and bool(torch.isfinite(out).all())
        yield CheckResult(
            f"forward {str(dtype).removeprefix('torch.')}", backend, ok, f"max rel err {worst:.1e}"
        )


def _gradchecks(backend: str, device: str) -> Iterator[CheckResult]:
    for dtype in (torch.float64, torch.complex128):
        for reverse in (False, True):
            gates, tokens = _inputs((3, 6, 2), dtype, device, seed=7)
            initial = tokens[:, 0].clone()
            args = tuple(t.requires_grad_() for t in (gates, tokens, initial))

            def fn(a, b, h, reverse=reverse):  # type: ignore[no-untyped-def]
                return linear_scan(a, b, 1, initial=h, reverse=reverse, backend=backend)

            ok, detail = _gradcheck(fn, args)
            name = f"gradients {str(dtype).removeprefix('torch.')}{' reverse' if reverse else ''}"
            yield CheckResult(name, backend, ok, detail)


def _log_checks(backend: str, device: str) -> Iterator[CheckResult]:
    """log_linear_scan: exp(h) against the float64 linear loop of exp(inputs), and
    gradcheck; tokens with log 0 (-inf) included."""
    taken = FIRST_ORDER_ROWS["log"].backends[backend].dtypes
    for dtype in (torch.float32, torch.float64, torch.complex64, torch.complex128):
        name = f"log forward {str(dtype).removeprefix('torch.')}"
        if dtype not in taken:  # the triton log-space kernel is real ("auto" takes torch)
            yield CheckResult(name, backend, True, f"{backend} takes real inputs", ran=False)
            continue
        gates, tokens = _inputs((3, 257, 5), dtype, device, seed=11)
        tokens = tokens if dtype.is_complex else tokens.abs()
        tokens[:, :3] = 0  # log 0 for the first steps
        h = log_linear_scan(gates.log(), tokens.log(), 1, backend=backend)
        want = linear_loop(gates.to(_high(dtype)), tokens.to(_high(dtype)), None, 1, False)
        err = relative_error(h.exp(), want)
        ok = err <= TOLERANCE[dtype][1] and not bool(h.isnan().any())
        yield CheckResult(name, backend, ok, f"max rel err {err:.1e}")
    gates, tokens = _inputs((2, 6, 3), torch.float64, device, seed=12)
    args = tuple(t.requires_grad_() for t in (gates.log(), tokens.abs().log()))
    ok, detail = _gradcheck(lambda a, b: log_linear_scan(a, b, 1, backend=backend), args)
    yield CheckResult("log gradients float64", backend, ok, detail)


def _gradcheck(fn, args) -> tuple[bool, str]:  # type: ignore[no-untyped-def]
    try:
        ok = torch.autograd.gradcheck(fn, args) and torch.autograd.gradgradcheck(fn, args)
        return ok, "gradcheck + gradgradcheck"
    except Exception as exc:  # gradcheck raises on mismatch: report it, do not crash
        return False, f"{type(exc).__name__}: {str(exc).splitlines()[0]}"


def _matrix_checks(backend: str, device: str) -> Iterator[CheckResult]:
    """matrix_linear_scan against the float64 loop, broadcast batch dims, both
    directions; and gradcheck."""
    if backend not in ("cpu", "torch", "loop"):
        return
    dtypes = [torch.float32, torch.float64] + ([] if backend == "cpu" else [torch.complex128])
    for dtype in dtypes:
        gen = torch.Generator().manual_seed(13)
        # complex dtypes get complex inputs and a complex128 reference (a real one
        # would hide a wrong imaginary part)
        wide = torch.complex128 if dtype.is_complex else torch.float64
        w = torch.randn(2, 1, 67, 6, 6, generator=gen, dtype=wide) / 3
        b = torch.randn(3, 67, 6, generator=gen, dtype=wide)
        h = torch.randn(6, generator=gen, dtype=wide)
        worst = 0.0
        for reverse in (False, True):
            want = matrix_reference.forward(w, b, h, reverse)
            wd, bd, hd = (t.to(dtype).to(device) for t in (w, b, h))
            got = matrix_linear_scan(wd, bd, initial=hd, reverse=reverse, backend=backend)
            worst = max(worst, relative_error(got.cpu(), want))
        ok = worst <= TOLERANCE[dtype][1]
        name = f"matrix forward {str(dtype).removeprefix('torch.')}"
        yield CheckResult(name, backend, ok, f"max rel err {worst:.1e}")
    gen = torch.Generator().manual_seed(14)
    operands = tuple(
        (torch.randn(shape, generator=gen, dtype=torch.float64) / 2).to(device).requires_grad_()
        for shape in ((5, 3, 3), (2, 5, 3), (3,))
    )
    ok, detail = _gradcheck(
        lambda w, b, h: matrix_linear_scan(w, b, initial=h, backend=backend), operands
    )
    yield CheckResult("matrix gradients float64", backend, ok, detail)


def _generic_checks(device: str) -> Iterator[CheckResult]:
    """associative_scan / associative_reduce of matrix products and of first-order
    pairs against the sequential folds, forward and reverse."""
    gen = torch.Generator().manual_seed(15)
    x = (torch.randn(300, 4, 4, generator=gen, dtype=torch.float64) / 2).to(device)
    pairs = tuple(
        torch.rand(3, 257, generator=gen, dtype=torch.float64).to(device) * 2 - 1 for _ in range(2)
    )

    def first_order(p, q):  # type: ignore[no-untyped-def]
        return p[0] * q[0], q[0] * p[1] + q[1]

    err = 0.0
    for reverse in (False, True):
        want = generic_reference.scan(torch.matmul, x, 0, reverse)
        err = max(err, relative_error(associative_scan(torch.matmul, x, 0, reverse=reverse), want))
        got_pairs = associative_scan(first_order, pairs, 1, reverse=reverse)
        want_pairs = generic_reference.scan(first_order, pairs, 1, reverse)
        for got, want_leaf in zip(got_pairs, want_pairs, strict=True):
            err = max(err, relative_error(got, want_leaf))
    want_product = generic_reference.fold(torch.matmul, x, 0)
    err = max(err, relative_error(associative_reduce(torch.matmul, x, 0), want_product))
    yield CheckResult("associative scan/reduce", "-", err <= 1e-10, f"max rel err {err:.1e}")
    args = ((x[:7] * 1.0).requires_grad_(),)
    ok, detail = _gradcheck(lambda m: associative_scan(torch.matmul, m, 0, reverse=True), args)
    yield CheckResult("associative gradients", "-", ok, detail)


def run_check(devices: list[str] | None = None, out=sys.stdout) -> int:  # type: ignore[no-untyped-def]
    devices = devices or ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    failures = 0
    print(f"{'check':<32}{'device':<8}{'backend':<9}{'result':<8}detail", file=out)
    for device in devices:
        results = itertools.chain(
            (
                r
                for backend in backends(device)
                for check in (_forward_checks, _gradchecks, _log_checks, _matrix_checks)
                for r in check(backend, device)
            ),
            _generic_checks(device),
        )
        for r in results:  # each row as it is found: a run cut off at a limit keeps them
            failures += not r.passed
            status = "n/a" if not r.ran else "ok" if r.passed else "FAILED"
            print(f"{r.what:<32}{device:<8}{r.backend:<9}{status:<8}{r.detail}", file=out)
    print(f"\n{'all checks passed' if failures == 0 else f'{failures} checks FAILED'}", file=out)
    return 1 if failures else 0
