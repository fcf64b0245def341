"""The generic-scan part of ``parascan bench``: associative_scan, associative_reduce
and matrix_linear_scan against their peers and a compute limit.

Summary of method. The limit of a case is the time of the same work done in one
batched call, measured back to back with each implementation in every repetition
(medians reported):
  - ``cumprod``: n products of d x d matrices, one ``torch.bmm`` over n matrices;
  - ``reduce``: n/2 products in one ``torch.bmm`` (the first level of any tree);
  - ``matrix``: n matrix-vector products in one ``torch.bmm``;
  - ``first-order``: ``torch.add`` over the case's tensors, scaled to 3 tensors
    (read a and b, write x), as in the linear_scan rows.
Every result is checked against a float64 sequential loop first; a wrong result
gets no speed.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from parascan.cli.common import cell, median, ms, ratio, rounds, run_cases, table
from parascan.cli.timing import elapsed as _elapsed
from parascan.first_order.reference import linear_loop
from parascan.generic import associative_reduce, associative_scan
from parascan.matrix import matrix_linear_scan

__all__ = [
    "DEFAULT_GENERIC_CASES",
    "FULL_GENERIC_CASES",
    "QUICK_GENERIC_CASES",
    "GenericCase",
    "GenericRow",
    "run_generic",
]

_TOLERANCE = 1e-3  # relative to the largest magnitude, float32 against float64


@dataclass(frozen=True)
class GenericCase:
    name: str
    kind: str  # "cumprod", "reduce", "matrix" or "first-order"
    shape: tuple[int, ...]
    peers: bool = True
    # parascan's backends to time where an implementation names one (None: all)
    backends: tuple[str, ...] | None = None


@dataclass
class GenericRow:
    case: str
    kind: str
    shape: tuple[int, ...]
    threads: int
    impl: str
    source: str  # "parascan" or "peer"
    time_ms: float | None
    limit_ms: float
    ratio: float | None
    max_error: float | None
    correct: bool
    note: str = ""


# `parascan bench --full`.
FULL_GENERIC_CASES = [
    GenericCase("cumulative matmul", "cumprod", (8192, 64, 64)),
    GenericCase("product of matrices", "reduce", (1000, 32, 32)),
    GenericCase("product of matrices", "reduce", (1000, 64, 64)),
    GenericCase("product of matrices", "reduce", (1000, 128, 128)),
    GenericCase("matrix recurrence", "matrix", (8192, 64)),
    GenericCase("first-order combine", "first-order", (8, 1536, 4096)),
]
# `parascan bench`: one case per kind, smaller than --full's (the doubling scans and Python
# loops are slow): the same peers, a few seconds each.
DEFAULT_GENERIC_CASES = [
    GenericCase("cumulative matmul", "cumprod", (1024, 64, 64)),
    GenericCase("product of matrices", "reduce", (1000, 32, 32)),
    GenericCase("matrix recurrence", "matrix", (1024, 64)),
    GenericCase("first-order combine", "first-order", (1, 768, 4096)),
]
QUICK_GENERIC_CASES = [
    GenericCase("cumulative matmul", "cumprod", (100, 8, 8)),
    GenericCase("product of matrices", "reduce", (100, 8, 8)),
    GenericCase("matrix recurrence", "matrix", (100, 8)),
    GenericCase("first-order combine", "first-order", (2, 16, 300)),
]


# --- peers, written here from their published methods ------------------------------


def doubling_scan(x: torch.Tensor, f: Callable[[Any, Any], Any]) -> torch.Tensor:
    """The doubling (Hillis-Steele) scan of torch_parallel_scan's prefix_scan, along
    dim 0: padded to a power of two, log2 n levels, each combining the last element
    of every left block into all of its right block: n log n / 2 combines."""
    n = x.shape[0]
    levels = max(1, (n - 1).bit_length())
    pad = torch.eye(x.shape[-1], dtype=x.dtype).expand(2**levels - n, *x.shape[1:])
    y = torch.cat([x, pad])
    for k in range(levels):
        width = 2**k
        blocks = y.view(-1, 2 * width, *y.shape[1:])
        right = f(blocks[:, width - 1 : width], blocks[:, width:])
        y = torch.cat([blocks[:, :width], right], 1).view(y.shape)
    return y[:n]


def _python_loop_cumprod(x: torch.Tensor) -> torch.Tensor:
    out = [x[0]]
    for m in x[1:]:
        out.append(out[-1] @ m)
    return torch.stack(out)


def _augmented_matrix_scan(w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch_parallel_scan's recipe for x[t] = W[t] x[t-1] + b[t]: (d+1) x (d+1)
    matrices multiplied on the right, scanned with the doubling scan."""
    mod_w = torch.cat([F.pad(w.mT, (0, 1), value=0), F.pad(b, (0, 1), value=1).unsqueeze(-2)], -2)
    start = F.pad(torch.zeros(w.shape[-1], dtype=w.dtype), (0, 1), value=1)
    return (start @ doubling_scan(mod_w, torch.matmul))[:, :-1]


def _first_order(
    x: tuple[torch.Tensor, torch.Tensor], y: tuple[torch.Tensor, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    return x[0] * y[0], torch.addcmul(y[1], y[0], x[1])


# --- cases ------------------------------------------------------------------------

Impl = tuple[str, str, Callable[[], torch.Tensor]]

# The implementations of each case kind, in table order: parascan's, then the peers.
_IMPLS = {
    "cumprod": ("associative_scan", "doubling scan (tps)", "python loop"),
    "reduce": ("associative_reduce", "linalg.multi_dot", "python loop"),
    "matrix": ("matrix_linear_scan cpu", "matrix_linear_scan loop", "augmented matrices (tps)"),
    "first-order": ("associative_scan", "torch assoc_scan"),
}
# parascan's implementations, and the backend of those that run one (None: no choice).
_PARASCAN = {
    "associative_scan": None,
    "associative_reduce": None,
    "matrix_linear_scan cpu": "cpu",
    "matrix_linear_scan loop": "loop",
}


def implementation_names(case: GenericCase) -> list[str]:
    return [
        name
        for name in _IMPLS[case.kind]
        if (case.peers or name in _PARASCAN)
        and (case.backends is None or _PARASCAN.get(name) in (None, *case.backends))
    ]


def _setup(case: GenericCase) -> tuple[list[Impl], Callable[[], object], torch.Tensor]:
    """(implementations, the limit's call, the float64 reference result)."""
    gen = torch.Generator().manual_seed(0)
    calls: dict[str, Callable[[], torch.Tensor]]
    if case.kind == "cumprod":
        x = torch.randn(case.shape, generator=gen) / case.shape[-1] ** 0.5
        calls = {
            "associative_scan": lambda: associative_scan(torch.matmul, x, 0),
            "doubling scan (tps)": lambda: doubling_scan(x, torch.matmul),
            "python loop": lambda: _python_loop_cumprod(x),
        }
        limit: Callable[[], object] = lambda: torch.bmm(x, x)  # noqa: E731
        want = _python_loop_cumprod(x.double())
    elif case.kind == "reduce":
        x = torch.randn(case.shape, generator=gen) / case.shape[-1] ** 0.5
        half = case.shape[0] // 2
        calls = {
            "associative_reduce": lambda: associative_reduce(torch.matmul, x, 0),
            "linalg.multi_dot": lambda: torch.linalg.multi_dot(list(x)),
            "python loop": lambda: functools.reduce(torch.matmul, x),
        }
        limit = lambda: torch.bmm(x[:half], x[half : 2 * half])  # noqa: E731
        want = functools.reduce(torch.matmul, x.double())
    elif case.kind == "matrix":
        n, d = case.shape
        w = torch.randn(n, d, d, generator=gen) / (1.1 * d**0.5)
        b = torch.randn(n, d, generator=gen)
        calls = {
            "matrix_linear_scan cpu": lambda: matrix_linear_scan(w, b, backend="cpu"),
            "matrix_linear_scan loop": lambda: matrix_linear_scan(w, b, backend="loop"),
            "augmented matrices (tps)": lambda: _augmented_matrix_scan(w, b),
        }
        limit = lambda: torch.bmm(w, b.unsqueeze(-1))  # noqa: E731
        want = matrix_linear_scan(w.double(), b.double(), backend="loop")
    elif case.kind == "first-order":
        from parascan.cli.peers import torch_associative_scan

        a = 0.9 + 0.1 * torch.rand(case.shape, generator=gen)
        x = torch.rand(case.shape, generator=gen)
        calls = {
            "associative_scan": lambda: associative_scan(_first_order, (a, x), -1)[1],
            "torch assoc_scan": lambda: torch_associative_scan(a, x, -1),
        }
        limit = lambda: torch.add(a, x)  # noqa: E731
        want = linear_loop(a.double(), x.double(), None, -1, False)
    else:
        raise ValueError(f"unknown generic case kind {case.kind!r}")
    impls = [
        (name, "parascan" if name in _PARASCAN else "peer", calls[name])
        for name in implementation_names(case)
    ]
    return impls, limit, want


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|: relative to the result's own scale, which for a
    product of many matrices may be far from 1."""
    scale = want.abs().max().item()
    return (got.to(want.dtype) - want).abs().max().item() / (scale if scale > 0 else 1.0)


def _run_case(case: GenericCase, repeat: int, step: Callable[[str], None]) -> list[GenericRow]:
    impls, limit_fn, want = _setup(case)
    rows = []
    for name, source, fn in impls:
        with torch.no_grad():
            error = _relative_error(fn(), want)
            ok = error <= _TOLERANCE
            runs = repeat if source == "parascan" else 1
            times = rounds({"limit": limit_fn, "impl": fn}, runs if ok else 0)
        limit = statistics.median(times["limit"]) if times["limit"] else _elapsed(limit_fn)
        t = median(times["impl"])
        rows.append(GenericRow(case.name, case.kind, case.shape, torch.get_num_threads(), name,
                               source, ms(t), limit * 1e3, ratio(t, limit), error, ok))  # fmt: skip
        step(f"{case.name} {name}")
    return rows


# run_generic(cases, repeat, step): every case's rows (see the module docstring)
run_generic = functools.partial(run_cases, _run_case)


_LIMITS = {
    "cumprod": "n products in one bmm",
    "reduce": "n/2 products in one bmm",
    "matrix": "n matrix-vector products in one bmm",
    "first-order": "torch.add, 3 tensors",
}


_GENERIC_LINE = "{:<22}{!s:<19}{:<26}{:>10}{:>9}{:>12}"


def format_generic(rows: list[GenericRow]) -> str:
    head = [
        "Generic scans: x limit = time / the same work batched in one call (same run):",
        "  " + "; ".join(f"{k}: {v}" for k, v in _LIMITS.items()),
        "",
    ]
    names = ("case", "shape", "impl", "time ms", "x limit", "max rel err")
    cells = (
        (r.case, r.shape, r.impl, cell(r.time_ms, ".2f", "WRONG"), cell(r.ratio, ".2f"),
         cell(r.max_error, ".1e", ""))
        for r in rows
    )  # fmt: skip
    return table(head, _GENERIC_LINE, names, cells)
