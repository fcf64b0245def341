"""Differential fuzzer of the C kernels against the float64 loops, time-boxed.

    python tests/native/fuzz_kernels.py --seconds 60          # a new random seed, printed
    python tests/native/fuzz_kernels.py --seed 123 --case 45  # one case again, alone

Every case goes through the public functions, so each C entry point is reached the
way users reach it (linear_scan and log_linear_scan forward and fused backward in
every dtype, matrix_linear_scan, the matrix-product kernel of associative_reduce),
with what torch can hand over: negative dims, lazy negative and conjugate views,
stride-0 (broadcast), sliced and transposed inputs, reverse, initial states, packed
sequences (cu_seqlens: the packed entries), 1 to 4 threads, and lengths on and around
every block and chunk constant the kernels were built with (read from the library,
parascan._native.kernel_constants). Outputs,
final states and gradients are compared with the float64 loops of tests/oracles.py.

Case ``i`` of seed ``s`` draws from ``random.Random(f"{s}-{i}")`` only, so a failure
reproduces alone with ``--seed s --case i``. The process exits 1 on any mismatch;
run under AddressSanitizer and UBSan (tools/sanitize.sh) any out-of-bounds access
or undefined behaviour aborts it.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/

import torch

import parascan as ps
from parascan._native import kernel_constants, kernel_library_path

from conftest import DTYPES, TOLERANCE, assert_matches
from oracles import (
    delta_rule_loop,
    dplr_delta_rule_loop,
    linear_attention_loop,
    linear_loop,
    log_loop,
    matmul_fold,
    matrix_loop,
    selective_loop,
    ssd_loop,
)

_T = TypeVar("_T")

FIRST_ORDER_DTYPES = DTYPES  # every dtype of the first-order scans
MAX_ELEMENTS = 400_000  # per operand: keeps a case (and its float64 loop) quick
GRAD_MAX_STEPS = 600  # gradients through the loop oracle's autograd graph


def _lengths(rng: random.Random, dtype_size: int) -> int:
    """A time length: small, or on/around one of the kernels' constants."""
    c = kernel_constants()
    long_block = c["LONG_CHUNKS"] * (c["LONG_CHUNK_BYTES"] // dtype_size)
    anchors = [
        c["ROWS"],
        c["TILE"],
        c["BLOCK"],
        c["LONG_STEPS"],
        long_block,
        c["LONG_CHUNKS"] * c["LONG_MIN_LEN"],
    ]
    if rng.random() < 0.55:
        return rng.choice([0, 1, 2, 3, *range(4, 70), 127, 128, 129, 257, 1031])
    return max(0, rng.choice(anchors) + rng.choice([-1, 0, 1, 7]))


def _channels(rng: random.Random) -> int:
    c = kernel_constants()
    sizes = [1, 1, 2, 3, 5, 7, 8, 9, 15, 16, 17, 31, 33, 63, 64, 65]
    return rng.choice([*sizes, c["BLOCK"] - 1, c["BLOCK"] + 1, c["LONG_ROWS"], c["LONG_ROWS"] + 1])


def _view(rng: random.Random, t: torch.Tensor, kind: str) -> torch.Tensor:
    """``t`` (the values) as a view of the given kind, equal to ``t``."""
    if kind == "transposed" and t.dim() >= 2:
        return t.transpose(0, -1).contiguous().transpose(0, -1)
    if kind == "sliced" and t.dim() >= 1 and t.numel():
        d = rng.randrange(t.dim())
        big = torch.repeat_interleave(t, 2, dim=d)
        return big.narrow(d, rng.randrange(2), 2 * t.shape[d] - 1)[
            (slice(None),) * d + (slice(None, None, 2),)
        ]
    if kind == "negative":
        return (-t)._neg_view()
    if kind == "conjugate" and t.is_complex():
        return t.conj_physical().conj()
    return t


_KINDS = ["contiguous", "contiguous", "transposed", "sliced", "negative", "conjugate"]


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator, low: float = -1.0):
    real = torch.rand(shape, generator=gen, dtype=torch.float64) * (1 - low) + low
    if dtype.is_complex:
        imag = torch.rand(shape, generator=gen, dtype=torch.float64) * 0.5
        real = torch.complex(real, imag)
    return real.to(dtype)


def _first_order_case(rng: random.Random, log: bool) -> tuple[str, Callable[[], None]]:
    dtype = rng.choice(FIRST_ORDER_DTYPES)
    size = torch.empty((), dtype=dtype).element_size()
    steps = _lengths(rng, size)
    ndim = rng.choice([1, 2, 2, 3])
    shape = [_channels(rng) for _ in range(ndim)]
    time_dim = rng.randrange(ndim)
    shape[time_dim] = steps
    if steps >= 4096:  # long rows: few of them, time contiguous (the long-row path)
        shape = [rng.choice([1, 2, 3, kernel_constants()["LONG_ROWS"]]) for _ in range(ndim)]
        time_dim = ndim - 1
        shape[time_dim] = steps
        if math.prod(shape) > MAX_ELEMENTS:
            shape = [1] * (ndim - 1) + [steps]
    while math.prod(shape) > MAX_ELEMENTS:
        biggest = max((i for i in range(ndim) if i != time_dim), key=lambda i: shape[i])
        shape[biggest] = max(1, shape[biggest] // 2)
    dim = time_dim - ndim if rng.random() < 0.5 else time_dim
    reverse = rng.random() < 0.5
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    if log:
        gates = _random(tuple(shape), dtype, gen, low=-2.0).real.clamp(max=0).to(dtype)
        if dtype.is_complex:
            gates = gates + 1j * _random(tuple(shape), dtype, gen).imag.to(dtype)
        tokens = _random(tuple(shape), dtype, gen, low=-3.0)
        if not dtype.is_complex and rng.random() < 0.3:  # log 0 tokens
            tokens = tokens.masked_fill(torch.rand(tuple(shape), generator=gen) < 0.2, -math.inf)
    else:
        mag = 0.5 + 0.5 * torch.rand(tuple(shape), generator=gen, dtype=torch.float64)
        gates = (
            (mag * torch.exp(1j * _random(tuple(shape), torch.float64, gen))).to(dtype)
            if dtype.is_complex
            else mag.to(dtype)
        )
        tokens = _random(tuple(shape), dtype, gen)
    if rng.random() < 0.25 and ndim > 1:  # broadcast gates: stride 0 along a dim
        keep = rng.choice([i for i in range(ndim) if i != time_dim])
        gates = gates.narrow(keep, 0, 1).expand(tuple(shape))
    state = [s for i, s in enumerate(shape) if i != time_dim]
    initial = None
    if rng.random() < 0.5:
        initial = _random(tuple(state), dtype, gen, low=-2.0 if log else -1.0)
        if log and not dtype.is_complex:
            initial = initial.real.to(dtype)
    cu = None
    if rng.random() < 0.3:  # packed sequences: a batch of one (or time first)
        if time_dim > 0:
            shape[0] = 1
            gates, tokens = gates.narrow(0, 0, 1), tokens.narrow(0, 0, 1)
        cu = _offsets(rng, steps)
        if initial is not None:  # one state per sequence, num_seqs in place of the batch
            rest = state[1:] if time_dim > 0 else state
            initial = _random((len(cu) - 1, *rest), dtype, gen, low=-2.0 if log else -1.0)
            if log and not dtype.is_complex:
                initial = initial.real.to(dtype)
    kinds = [rng.choice(_KINDS) for _ in range(3)]
    a, b = _view(rng, gates, kinds[0]), _view(rng, tokens, kinds[1])
    h = None if initial is None else _view(rng, initial, kinds[2])
    grads = steps <= GRAD_MAX_STEPS and math.prod(shape) <= 20_000 and rng.random() < 0.5
    threads = rng.choice([1, 2, 3, 4])
    what = (
        f"{'log_linear_scan' if log else 'linear_scan'} {dtype} shape {tuple(shape)} "
        f"dim {dim} reverse {reverse} initial {initial is not None} views {kinds} "
        f"threads {threads} grads {grads} cu_seqlens {cu}"
    )
    if cu is not None:
        return what, lambda: _with_threads(
            threads, lambda: _check_packed(log, a, b, h, dim, reverse, grads, dtype, cu)
        )
    return what, lambda: _with_threads(
        threads, lambda: _check_first_order(log, a, b, h, dim, reverse, grads, dtype)
    )


def _offsets(rng: random.Random, steps: int) -> list[int]:
    """Packed-sequence offsets: empty and length-1 sequences, and cuts on and next to
    the kernels' constants as well as random ones."""
    c = kernel_constants()
    near = [k + d for k in (c["ROWS"], c["TILE"], c["BLOCK"], c["LONG_STEPS"]) for d in (-1, 0, 1)]
    pool = [t for t in near if 0 <= t <= steps] + [rng.randint(0, steps) for _ in range(4)]
    cuts = [rng.choice(pool) for _ in range(rng.randint(0, 6))] if pool else []
    return [0, *sorted(cuts), steps]


def _with_threads(n: int, fn: Callable[[], _T]) -> _T:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


def _oracle(log: bool, a, b, h, dim, reverse):  # type: ignore[no-untyped-def]
    if not log:
        wide = torch.complex128 if a.is_complex() else torch.float64
        return linear_loop(a.to(wide), b.to(wide), dim, None if h is None else h.to(wide), reverse)
    if a.is_complex():  # compare exp(h): the complex log's branch is not unique
        x, final = linear_loop(
            a.cdouble().exp(),
            b.cdouble().exp(),
            dim,
            None if h is None else h.cdouble().exp(),
            reverse,
        )
        return x, final
    return log_loop(a.double(), b.double(), dim, None if h is None else h.double(), reverse)


def _check_first_order(log, a, b, h, dim, reverse, grads, dtype) -> None:  # type: ignore[no-untyped-def]
    fn = ps.log_linear_scan if log else ps.linear_scan
    want, want_final = _oracle(log, a, b, h, dim, reverse)
    leaves = []
    if grads:
        a, b = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
        leaves = [a, b]
        if h is not None:
            h = h.detach().clone().requires_grad_()
            leaves.append(h)
    got, final = fn(a, b, dim, initial=h, reverse=reverse, return_final=True)
    plain = fn(
        a.detach(), b.detach(), dim, initial=None if h is None else h.detach(), reverse=reverse
    )  # the eager fast path, no final state
    if log and dtype.is_complex:
        got, final, plain = got.exp(), final.exp(), plain.exp()
    for actual, expected in ((got, want), (final, want_final), (plain, want)):
        _assert_close(actual.detach(), expected, dtype, log)
    if not grads:
        return
    seeded = torch.Generator().manual_seed(int(want.numel()) + 7)  # reproducible weights
    # in the output's dtype for both losses: the kernel's incoming gradient is rounded
    # to it, and in bfloat16 that rounding alone, summed with cancellation into the
    # initial state's gradient, was 1.8 times that gradient (seed 2640312857 case 300)
    weights = torch.randn(want.shape, generator=seeded, dtype=torch.float64)
    weights = weights.to(got.dtype).to(want.dtype)
    if log:
        finite = torch.isfinite(want.real) & torch.isfinite(got.real.detach())
        weights = torch.where(finite, weights, 0)
    wide = [
        t.detach().to(torch.complex128 if t.is_complex() else torch.float64).requires_grad_()
        for t in leaves
    ]
    oracle_out, _ = _oracle(
        log, wide[0], wide[1], dim=dim, reverse=reverse, h=wide[2] if len(wide) > 2 else None
    )
    if log and dtype.is_complex:
        return  # the exp-space oracle has other gradients; values were checked
    loss = (torch.where(torch.isfinite(oracle_out), oracle_out, 0) * weights).real.sum()
    want_grads = torch.autograd.grad(loss, wide, allow_unused=True)
    got_out = torch.where(torch.isfinite(got.real), got, 0)
    got_loss = (got_out * weights.to(got.dtype)).real.sum()
    got_grads = torch.autograd.grad(got_loss, leaves, allow_unused=True)
    for g, w in zip(got_grads, want_grads, strict=True):
        if w is None:
            continue
        _assert_close(g, torch.nan_to_num(w, nan=0.0), dtype, log)


def _check_packed(log, a, b, h, dim, reverse, grads, dtype, cu) -> None:  # type: ignore[no-untyped-def]
    """Packed sequences against the float64 loop scanning each sequence alone."""
    fn = ps.log_linear_scan if log else ps.linear_scan
    d = dim % a.dim()
    leaves = []
    if grads:
        a, b = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
        leaves = [a, b] + ([] if h is None else [h := h.detach().clone().requires_grad_()])
    got, final = fn(a, b, dim, initial=h, reverse=reverse, return_final=True,
                    cu_seqlens=torch.tensor(cu))  # fmt: skip

    def oracle(a, b, h):  # type: ignore[no-untyped-def]
        pieces, finals = [], []
        for s in range(len(cu) - 1):
            lo, hi = cu[s], cu[s + 1]
            hs = None if h is None else (h[s] if d == 0 else h[s].unsqueeze(0))
            x, f = _oracle(log, a.narrow(d, lo, hi - lo), b.narrow(d, lo, hi - lo), hs, d, reverse)
            pieces.append(x)
            finals.append(f if d == 0 else f.squeeze(0))
        return torch.cat(pieces, d), torch.stack(finals)

    want, want_final = oracle(a.detach(), b.detach(), None if h is None else h.detach())
    if log and dtype.is_complex:
        got, final = got.exp(), final.exp()
    _assert_close(got.detach(), want, dtype, log)
    _assert_close(final.detach(), want_final, dtype, log)
    if not grads or (log and dtype.is_complex):
        return
    wide = [
        t.detach().to(torch.complex128 if t.is_complex() else torch.float64).requires_grad_()
        for t in leaves
    ]
    out, _ = oracle(wide[0], wide[1], wide[2] if len(wide) > 2 else None)
    seeded = torch.Generator().manual_seed(int(out.numel()) + 11)
    weights = torch.randn(out.shape, generator=seeded, dtype=torch.float64)
    weights = weights.to(got.dtype).to(out.dtype)  # rounded as the kernel's (above)
    if log:
        weights = torch.where(
            torch.isfinite(out.real) & torch.isfinite(got.real.detach()), weights, 0
        )
    loss = (torch.where(torch.isfinite(out), out, 0) * weights).real.sum()
    want_grads = torch.autograd.grad(loss, wide, allow_unused=True)
    got_loss = (torch.where(torch.isfinite(got.real), got, 0) * weights.to(got.dtype)).real.sum()
    got_grads = torch.autograd.grad(got_loss, leaves, allow_unused=True)
    for g, w in zip(got_grads, want_grads, strict=True):
        if w is not None:
            _assert_close(g, torch.nan_to_num(w, nan=0.0), dtype, log)


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype, log: bool) -> None:  # type: ignore[no-untyped-def]
    if log and not dtype.is_complex:  # -inf where the result is log 0
        inf = torch.isinf(expected)
        assert torch.equal(torch.isinf(actual) & inf, inf), "log 0 positions differ"
        actual, expected = actual.masked_fill(inf, 0), expected.masked_fill(inf, 0)
    assert_matches(actual, expected, dtype)


def _matrix_case(rng: random.Random) -> tuple[str, Callable[[], None]]:
    dtype = rng.choice([torch.float32, torch.float64])
    d = rng.choice([1, 2, 3, 4, 5, 8, 9, 17])
    steps = rng.choice([0, 1, 2, 3, 17, 64, 65, 300])
    batch = rng.choice([(), (1,), (3,), (2, 3)])
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    w = torch.randn((*batch, steps, d, d), generator=gen, dtype=torch.float64) / (2 * math.sqrt(d))
    b = torch.randn((*batch, steps, d), generator=gen, dtype=torch.float64)
    h = torch.randn((*batch, d), generator=gen, dtype=torch.float64) if rng.random() < 0.5 else None
    if batch and rng.random() < 0.3:  # weights shared by the batch: stride 0
        w = w[:1].expand(*w.shape) if len(batch) == 1 else w[:, :1].expand(*w.shape)
    reverse = rng.random() < 0.5
    kinds = [rng.choice(["contiguous", "transposed", "sliced", "negative"]) for _ in range(3)]
    wv = _view(rng, w.to(dtype), kinds[0])
    if kinds[0] == "transposed":
        wv = w.to(dtype).transpose(-1, -2).contiguous().transpose(-1, -2)  # column-major
    bv = _view(rng, b.to(dtype), kinds[1])
    hv = None if h is None else _view(rng, h.to(dtype), kinds[2])
    threads = rng.choice([1, 2, 3, 4])
    what = (
        f"matrix_linear_scan {dtype} weights {tuple(w.shape)} reverse {reverse} "
        f"initial {h is not None} views {kinds} threads {threads}"
    )

    def check() -> None:
        got, final = ps.matrix_linear_scan(wv, bv, initial=hv, reverse=reverse, return_final=True)
        w64, b64 = w.to(dtype).double(), b.to(dtype).double()
        h64 = None if h is None else h.to(dtype).double()
        out, x = matrix_loop(w64, b64, h64, reverse)
        assert_matches(got, out, dtype)
        assert_matches(final, x, dtype)

    return what, lambda: _with_threads(threads, check)


def _product_case(rng: random.Random) -> tuple[str, Callable[[], None]]:
    c = kernel_constants()
    dtype = rng.choice([torch.float32, torch.float64])
    d = rng.choice([1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 33])
    n = max(
        2,
        rng.choice(
            [
                2,
                3,
                c["PRODUCT_MIN_SEGMENT"],
                c["PRODUCT_MIN_SEGMENT"] + 1,
                2 * c["PRODUCT_MIN_SEGMENT"] - 1,
                100,
                257,
            ]
        ),
    )
    batch = rng.choice(
        [
            (),
            (1,),
            (c["PRODUCT_ITEMS"] - 1,),
            (c["PRODUCT_ITEMS"],),
            (c["PRODUCT_ITEMS"] + 1,),
            (2, 3),
        ]
    )
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    q = torch.linalg.qr(torch.randn((*batch, n, d, d), generator=gen, dtype=torch.float64))[0]
    x = q.to(dtype)
    time_dim = len(batch) if rng.random() < 0.7 else 0
    if time_dim != len(batch):
        x = x.movedim(len(batch), 0)
    kind = rng.choice(["contiguous", "transposed", "sliced", "negative"])
    xv = _view(rng, x, kind)
    if kind == "transposed":
        xv = x.transpose(-1, -2).contiguous().transpose(-1, -2)
    dim = time_dim - x.dim() if rng.random() < 0.5 else time_dim
    threads = rng.choice([1, 2, 3, 4])
    what = (
        f"associative_reduce(matmul) {dtype} {tuple(x.shape)} dim {dim} view {kind} "
        f"threads {threads}"
    )

    def check() -> None:
        got = ps.associative_reduce(torch.matmul, xv, dim)
        want = matmul_fold(x, time_dim)
        tol = 5e-5 if dtype == torch.float32 else 1e-12
        torch.testing.assert_close(got.double(), want, rtol=0, atol=tol * max(1.0, n / 50))

    return what, lambda: _with_threads(threads, check)


_NO_BAD_FLAG = object()


def _overlapping_like(t: torch.Tensor) -> torch.Tensor | None:
    """A tensor of ``t``'s shape and dtype whose last two dims share memory (element
    ``[..., i, j]`` at ``i + j``: no stride is 0), or None when they cannot."""
    if t.dim() < 2 or t.shape[-1] < 2 or t.shape[-2] < 2:
        return None
    strides = [1] * t.dim()
    for d in range(t.dim() - 3, -1, -1):
        strides[d] = strides[d + 1] * (t.shape[d + 1] + t.shape[-1])
    size = 1 + sum((s - 1) * st for s, st in zip(t.shape, strides, strict=True))
    return torch.zeros(size, dtype=t.dtype).as_strided(t.shape, strides)


def _draws(
    gen: torch.Generator,
) -> tuple[Callable[..., torch.Tensor], Callable[..., torch.Tensor]]:
    """Float64 normal and uniform draws of a shape from ``gen``."""

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float64)

    def u(*shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=gen, dtype=torch.float64)

    return r, u


def _bad_flag(rng: random.Random) -> object:
    """A value that is not a bool (one case in eight), to pass as a flag: every public
    function must raise its TypeError, on every path; else _NO_BAD_FLAG."""
    if rng.random() >= 0.125:
        return _NO_BAD_FLAG
    return rng.choice(["0", "", "False", 0, 1, 1.0, None, (), torch.tensor(True)])


def _expect_flag_error(name: str, call: Callable[[], object]) -> None:
    try:
        call()
    except TypeError as error:
        assert str(error).startswith(f"{name}: expected "), error
        assert "to be a bool" in str(error), error
    else:
        raise AssertionError(f"{name} took a flag that is not a bool")


def _selective_case(rng: random.Random) -> tuple[str, Callable[[], None]]:
    """The selective scan's C kernel (forward, fused backward) and the decoding step's,
    through ps.selective_scan(backend="cpu") and ps.selective_state_update: every B/C
    form, real or complex A, optional D, z, delta_bias, initial, strided views, lengths
    around the checkpoint interval, 1 to 4 threads."""
    cplx = rng.random() < 0.2
    dtype = rng.choice([torch.float32, torch.float64] if cplx else [*DTYPES[:4]])
    if dtype.is_complex:
        dtype = torch.float32
    batch, n = rng.choice([1, 2, 3]), rng.choice([1, 2, 3, 7, 8, 9, 16, 17, 33])
    groups = rng.choice([1, 2, 3])
    dim = groups * rng.choice([1, 2, 3, 5, 8, 9, 22])
    k = 64  # the cpu backend's checkpoint interval (CHECKPOINT_STEPS)
    length = rng.choice([0, 1, 2, 3, 17, k - 1, k, k + 1, 2 * k + 1, 3 * k - 1])
    forms = [rng.choice(["invariant", "shared", "grouped"]) for _ in range(2)]
    opts = {name: rng.random() < 0.6 for name in ("D", "z", "delta_bias", "initial")}
    softplus = rng.random() < 0.7
    kinds = [rng.choice(["contiguous", "transposed", "sliced"]) for _ in range(3)]
    # the decoding step's state, updated in place: a view of its own memory, or one whose
    # elements share memory (refused); and now and then a flag that is not a bool
    state_view = rng.choice(["contiguous", "transposed", "sliced", "overlapping"])
    bad_flag = _bad_flag(rng)
    threads = rng.choice([1, 2, 3, 4])
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    what = (
        f"selective scan {dtype} complex={cplx} batch {batch} dim {dim} N {n} L {length} "
        f"B/C {forms} groups {groups} {opts} softplus={softplus} views {kinds} "
        f"state {state_view} bad flag {bad_flag!r} threads {threads}"
    )

    def r(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float64) * scale

    def bc(form: str) -> torch.Tensor:
        shape = {"invariant": (dim, n), "shared": (batch, n, length),
                 "grouped": (batch, groups, n, length)}[form]  # fmt: skip
        m = r(*shape)
        return torch.complex(m, r(*shape)) if cplx and rng.random() < 0.5 else m

    A = -r(dim, n).abs() - 0.05
    if cplx:
        A = torch.complex(A, r(dim, n))
    wide = {
        "u": r(batch, dim, length), "delta": r(batch, dim, length, scale=0.5),
        "A": A, "B": bc(forms[0]), "C": bc(forms[1]),
        "D": r(dim) if opts["D"] else None, "z": r(batch, dim, length) if opts["z"] else None,
        "delta_bias": r(dim, scale=0.1) if opts["delta_bias"] else None,
        "initial": (torch.complex(r(batch, dim, n), r(batch, dim, n)) if cplx
                    else r(batch, dim, n)) if opts["initial"] else None,
    }  # fmt: skip
    if not softplus:
        wide["delta"] = wide["delta"].abs()

    def low(name: str, t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        t = t.to(dtype if not t.is_complex() else torch.complex64 if dtype == torch.float32
                 else torch.complex128)  # fmt: skip
        if name in ("A", "D", "delta_bias", "initial") and not t.is_complex():
            t = t.float() if dtype in (torch.float16, torch.bfloat16) else t
        viewed = {"u": 0, "delta": 1, "B": 2}
        return _view(rng, t, kinds[viewed[name]]) if name in viewed else t

    def check() -> None:
        args = {name: low(name, t) for name, t in wide.items()}
        if bad_flag is not _NO_BAD_FLAG:
            positional = [args[k2] for k2 in ("u", "delta", "A", "B", "C")]
            for flags in ({"delta_softplus": bad_flag}, {"return_final": bad_flag}):
                _expect_flag_error("parascan.selective_scan", lambda f=flags: ps.selective_scan(
                    *positional, backend="cpu", **f))  # fmt: skip
        leaves = {k2: v.detach().clone().requires_grad_() for k2, v in args.items()
                  if v is not None and k2 in ("u", "delta", "A", "B", "C")}  # fmt: skip
        call = {**args, **leaves}
        got, final = ps.selective_scan(
            call["u"], call["delta"], call["A"], call["B"], call["C"], call["D"], call["z"],
            call["delta_bias"], delta_softplus=softplus, initial=call["initial"],
            return_final=True, backend="cpu",
        )  # fmt: skip
        exact = {
            k2: (
                None
                if v is None
                else v.detach().to(torch.complex128 if v.is_complex() else torch.float64)
            )
            for k2, v in args.items()
        }
        grads_of = {k2: exact[k2].clone().requires_grad_() for k2 in leaves}  # type: ignore[union-attr]
        want, want_final = selective_loop(**{**exact, **grads_of}, delta_softplus=softplus)
        assert_matches(got, want, dtype)
        assert_matches(final, want_final, dtype if not cplx else torch.complex64)
        if length == 0:
            return
        # in the output's dtype, so that the kernel's backward (whose incoming gradient
        # autograd rounds to that dtype) and the loop start from the same gradient: in
        # float16 the rounding alone, summed with cancellation into an invariant C's
        # gradient, was 2% of it (seed 3842573934 case 449)
        weights = r(*want.shape).to(got.dtype).double()
        got_grads = torch.autograd.grad((got.double() * weights).sum(), list(leaves.values()))
        want_grads = torch.autograd.grad((want * weights).sum(), list(grads_of.values()))
        for g, w in zip(got_grads, want_grads, strict=True):
            assert_matches(g, w, dtype)
        # the decoding step from the same initial state equals the scan's first step
        wide_state = dtype == torch.float64
        sd = {
            (True, True): torch.complex128,
            (True, False): torch.float64,
            (False, True): torch.complex64,
            (False, False): torch.float32,
        }[(wide_state, cplx)]
        state = (args["initial"].clone() if args["initial"] is not None else
                 torch.zeros(batch, dim, n)).to(sd)  # fmt: skip
        step = lambda m: m if m.dim() == 2 else (m.unsqueeze(1) if m.dim() == 3 else m)[..., 0]  # noqa: E731
        Bs, Cs = (step(args[name]) for name in ("B", "C"))
        if "invariant" in forms:  # the step takes B and C of (batch, N) or (batch, G, N)
            return
        step_args = (
            args["u"][..., 0], args["delta"][..., 0], args["A"], Bs, Cs, args["D"],
            None if args["z"] is None else args["z"][..., 0], args["delta_bias"],
        )  # fmt: skip
        if bad_flag is not _NO_BAD_FLAG:
            _expect_flag_error("parascan.selective_state_update", lambda: ps.selective_state_update(
                state.clone(), *step_args, dt_softplus=bad_flag))  # fmt: skip
        if state_view == "overlapping":  # refused before anything is written
            shared = _overlapping_like(state)
            if shared is not None:
                before = shared.clone()
                try:
                    ps.selective_state_update(shared, *step_args, dt_softplus=softplus)
                except ValueError as error:
                    assert "parascan.selective_state_update: expected state" in str(error)
                else:
                    raise AssertionError("an overlapping state was updated in place")
                assert torch.equal(shared, before)
        else:
            state = _view(rng, state, state_view)
        with torch.no_grad():
            y = ps.selective_state_update(state, *step_args, dt_softplus=softplus)
        assert_matches(y, want[..., 0], dtype)
        # the state after the step, written in place through the view: the scan's first
        timed = ("u", "delta", "z", "B", "C")  # B, C variable here: (batch, [G,] N, L)
        first = {k2: v[..., :1] if v is not None and k2 in timed else v
                 for k2, v in exact.items()}  # fmt: skip
        _, want_state = selective_loop(**first, delta_softplus=softplus)
        assert_matches(state, want_state, dtype if not cplx else torch.complex64)

    return what, lambda: _with_threads(threads, check)


def _check_outputs(
    got: torch.Tensor, final: torch.Tensor, leaves: dict[str, torch.Tensor],
    loop: Callable[..., tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype,
    randn: Callable[..., torch.Tensor], grads: bool,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
    """A scan's output and final states against the float64 ``loop`` (called with
    float64 copies of the scan's ``leaves``); then, with ``grads``, each leaf's
    gradients, the scan's and the loop's, for the same weights of the output and the
    final states (drawn by ``randn``), for the caller to compare."""
    exact = {k2: v.detach().double().clone().requires_grad_() for k2, v in leaves.items()}
    want, want_final = loop(**exact)
    assert_matches(got, want, dtype)
    assert_matches(final, want_final, dtype)
    if not grads:
        return {}
    # in the outputs' dtypes: the kernel and the loop start from the same gradients
    w_out = randn(*want.shape).to(got.dtype).double()
    w_fin = randn(*want_final.shape).to(final.dtype).double()
    got_grads = torch.autograd.grad(
        (got.double() * w_out).sum() + (final.double() * w_fin).sum(), list(leaves.values())
    )
    want_grads = torch.autograd.grad(
        (want * w_out).sum() + (want_final * w_fin).sum(), list(exact.values())
    )
    return dict(zip(leaves, zip(got_grads, want_grads, strict=True), strict=True))


def _ssd_case(rng: random.Random) -> tuple[str, Callable[[], None]]:
    """The SSD scan's C kernel (forward, fused backward) through
    ps.ssd_scan(backend="cpu"): batch, heads in groups, headdim and N not multiples of
    any vector width, lengths around the checkpoint interval, packed sequences (empty
    ones included), optional D (per head or per channel), z, dt_bias with softplus,
    initial states, strided views, float32/float64, 1 to 4 threads; the output, final
    states and every gradient against the float64 loop."""
    dtype = rng.choice([torch.float32, torch.float64])
    groups = rng.choice([1, 1, 2, 3])
    heads = groups * rng.choice([1, 2, 3])
    headdim = rng.choice([1, 3, 8, 16, 17, 33, 64])
    n = rng.choice([1, 3, 16, 17, 64])
    k = 64  # the cpu backend's checkpoint interval (CHECKPOINT_STEPS)
    length = rng.choice([0, 1, 2, 3, 17, k - 1, k, k + 1, 2 * k + 1])
    packed = rng.random() < 0.3
    batch = 1 if packed else rng.choice([1, 2, 3])
    cu = None
    if packed:
        cuts = sorted(rng.choice([0, 1, k - 1, k, k + 1, rng.randint(0, length)])
                      for _ in range(rng.randint(0, 4)))  # fmt: skip
        cu = [0, *[c for c in cuts if c <= length], length]
    opts = {name: rng.random() < 0.5 for name in ("D", "z", "dt_bias", "initial")}
    per_head_d = rng.random() < 0.5
    kinds = [rng.choice(["contiguous", "transposed", "sliced"]) for _ in range(2)]
    bad_flag = _bad_flag(rng)
    threads = rng.choice([1, 2, 3, 4])
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    states = batch if cu is None else len(cu) - 1
    what = (
        f"ssd scan {dtype} batch {batch} heads {heads} groups {groups} headdim {headdim} "
        f"N {n} L {length} cu_seqlens {cu} {opts} D per head={per_head_d} views {kinds} "
        f"bad flag {bad_flag!r} threads {threads}"
    )

    def r(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float64) * scale

    wide = {
        "x": r(batch, length, heads, headdim),
        "dt": r(batch, length, heads, scale=0.5),
        "A": -r(heads).abs() - 0.05,
        "B": r(batch, length, groups, n),
        "C": r(batch, length, groups, n),
        "D": (r(heads) if per_head_d else r(heads, headdim)) if opts["D"] else None,
        "z": r(batch, length, heads, headdim) if opts["z"] else None,
        "dt_bias": r(heads, scale=0.1) if opts["dt_bias"] else None,
        "initial": r(states, heads, headdim, n) if opts["initial"] else None,
    }
    softplus = opts["dt_bias"] or rng.random() < 0.5
    if not softplus:
        wide["dt"] = wide["dt"].abs()

    def check() -> None:
        args = {k2: None if v is None else v.to(dtype) for k2, v in wide.items()}
        if bad_flag is not _NO_BAD_FLAG:
            positional = [args[k2] for k2 in ("x", "dt", "A", "B", "C")]
            for flags in ({"dt_softplus": bad_flag}, {"return_final": bad_flag}):
                _expect_flag_error("parascan.ssd_scan", lambda f=flags: ps.ssd_scan(
                    *positional, backend="cpu", **f))  # fmt: skip
        leaves = {k2: v.detach().clone().requires_grad_() for k2, v in args.items()
                  if v is not None}  # fmt: skip
        viewed = {"x": _view(rng, leaves["x"], kinds[0]), "B": _view(rng, leaves["B"], kinds[1])}
        call = {**leaves, **viewed}
        got, final = ps.ssd_scan(
            call["x"], call["dt"], call["A"], call["B"], call["C"], D=call.get("D"),
            z=call.get("z"), dt_bias=call.get("dt_bias"), dt_softplus=softplus,
            initial=call.get("initial"), return_final=True,
            cu_seqlens=None if cu is None else torch.tensor(cu), backend="cpu",
        )  # fmt: skip
        loop = partial(ssd_loop, dt_softplus=softplus, cu_seqlens=cu)
        grads = _check_outputs(got, final, leaves, loop, dtype, r, grads=length > 0)
        for name, (g, w) in grads.items():
            if name == "dt_bias":
                # a sum over every step of terms as large as dt's gradient, which may
                # cancel: float32 rounds each term, so the tolerance scales with them
                rtol, atol = TOLERANCE[dtype]
                scale = max(1.0, w.abs().max().item(), grads["dt"][1].abs().max().item())
                torch.testing.assert_close(g.double(), w, rtol=rtol, atol=atol * scale)
            else:
                assert_matches(g, w, dtype)

    return what, lambda: _with_threads(threads, check)


def _delta_case(rng: random.Random) -> tuple[str, Callable[[], None]]:
    """The delta rule's C kernel (forward, fused backward) through
    ps.delta_rule_scan(backend="cpu"): no gate, a gate per head or per key channel,
    grouped value heads, K and V not multiples of any vector width or of the 32-float
    column block, lengths around the checkpoint interval, packed sequences (empty ones
    included), initial states, qk_l2norm, strided views, float32/float64, 1 to 4
    threads; the output, final states and every gradient against the float64 loop."""
    dtype = rng.choice([torch.float32, torch.float64])
    hk = rng.choice([1, 1, 2])
    hv = hk * rng.choice([1, 2, 3])
    dk = rng.choice([1, 3, 16, 17, 33, 64, 128])
    dv = rng.choice([1, 5, 16, 31, 32, 33, 70])
    gate = rng.choice(["none", "head", "channel"])
    c = 64  # the cpu backend's checkpoint interval (CHECKPOINT_STEPS)
    length = rng.choice([0, 1, 2, 3, 17, c - 1, c, c + 1, 2 * c + 1])
    packed = rng.random() < 0.3
    batch = 1 if packed else rng.choice([1, 2, 3])
    cu = None
    if packed:
        cuts = sorted(rng.choice([0, 1, c - 1, c, c + 1, rng.randint(0, length)])
                      for _ in range(rng.randint(0, 4)))  # fmt: skip
        cu = [0, *[x for x in cuts if x <= length], length]
    initial = rng.random() < 0.5
    # not with K = 1: x / sqrt(x^2 + 1e-6) is then +-1, and its gradient in float32 (torch's,
    # before the kernel) a difference of two terms near 1 that cancel to 1e-6
    l2norm = dk > 1 and rng.random() < 0.5
    kinds = [rng.choice(["contiguous", "transposed", "sliced"]) for _ in range(2)]
    bad_flag = _bad_flag(rng)
    threads = rng.choice([1, 2, 3, 4])
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    states = batch if cu is None else len(cu) - 1
    what = (
        f"delta rule {dtype} batch {batch} heads {hk}/{hv} K {dk} V {dv} gate {gate} L {length} "
        f"cu_seqlens {cu} initial {initial} qk_l2norm {l2norm} views {kinds} "
        f"bad flag {bad_flag!r} threads {threads}"
    )
    r, u = _draws(gen)

    k = r(batch, length, hk, dk)
    wide = {
        "q": r(batch, length, hk, dk),
        # keys of unit length unless normalized in the call: the stable regime
        "k": k if l2norm else torch.nn.functional.normalize(k, dim=-1),
        "v": r(batch, length, hv, dv),
        "beta": 2 * u(batch, length, hv),
        "g": {"none": None, "head": -3 * u(batch, length, hv),
              "channel": -3 * u(batch, length, hv, dk)}[gate],
        "initial": r(states, hv, dk, dv) if initial else None,
    }  # fmt: skip

    def check() -> None:
        args = {k2: None if v is None else v.to(dtype) for k2, v in wide.items()}
        if bad_flag is not _NO_BAD_FLAG:
            positional = [args[k2] for k2 in ("q", "k", "v", "beta")]
            for flags in ({"qk_l2norm": bad_flag}, {"return_final": bad_flag}):
                _expect_flag_error("parascan.delta_rule_scan", lambda f=flags: ps.delta_rule_scan(
                    *positional, backend="cpu", **f))  # fmt: skip
        leaves = {k2: v.detach().clone().requires_grad_() for k2, v in args.items()
                  if v is not None}  # fmt: skip
        viewed = {"q": _view(rng, leaves["q"], kinds[0]), "v": _view(rng, leaves["v"], kinds[1])}
        call = {**leaves, **viewed}
        got, final = ps.delta_rule_scan(
            call["q"], call["k"], call["v"], call["beta"], g=call.get("g"),
            initial=call.get("initial"), qk_l2norm=l2norm, return_final=True,
            cu_seqlens=None if cu is None else torch.tensor(cu), backend="cpu",
        )  # fmt: skip
        loop = partial(delta_rule_loop, qk_l2norm=l2norm, cu_seqlens=cu)
        grads = _check_outputs(got, final, leaves, loop, dtype, r, grads=length > 0)
        for g, w in grads.values():
            assert_matches(g, w, dtype)

    return what, lambda: _with_threads(threads, check)


# (K, V)-state scans of linear attention and DPLR: the oracle's autograd graph holds a
# few (rows, Hv, K, V) tensors per step, so a case's states times its steps is bounded
# (its lengths, at most 129, are far below GRAD_MAX_STEPS)
KV_MAX_STATE_STEPS = 1_500_000
# key and value widths on and around the kernels' blocks: register blocks of 4 or 8 rows
# and column blocks of 8 to 32 lanes (linear attention), column blocks of 16 to 64 lanes
# and rows in pairs (DPLR), by instruction-set level and type
_KV_DK = [1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 32, 33, 63, 64, 65, 127, 129]
_KV_DV = [1, 3, 4, 5, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 130]
_KV_VIEWS = ["contiguous", "transposed", "sliced", "negative", "broadcast"]


def _kv_state_case(rng: random.Random, family: str) -> tuple[str, Callable[[], None]]:
    """Linear attention's C kernel (``family`` "linear") or the generalized delta rule's
    ("dplr"), forward and fused backward, through their public functions with
    backend="cpu": float32/float64 and float16/bfloat16 inputs (a float32 state), grouped
    value heads, K and V around the kernels' blocks, lengths around the 64-step chunk,
    no gate, a gate per head or per key channel (for linear attention now and then
    strong decays and -inf resets that leave the kernel's frames, or weak ones that keep
    one frame over a chunk), initial states, packed sequences (empty ones included),
    strided, transposed, negative and broadcast (stride-0) views, an explicit scale, 1
    to 4 threads, return_final on and off; the output, final states and every gradient
    against the float64 loop, and the same call without autograd (the plain inference
    path: the decoding step at L = 1) against it too."""
    dplr = family == "dplr"
    fn = ps.dplr_delta_rule_scan if dplr else ps.linear_attention_scan
    name = "parascan.dplr_delta_rule_scan" if dplr else "parascan.linear_attention_scan"
    dtype = rng.choice([torch.float32, torch.float32, torch.float64, torch.float16,
                        torch.bfloat16])  # fmt: skip
    state_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    hk = rng.choice([1, 1, 2])
    hv = hk * rng.choice([1, 2, 3])
    dk, dv = rng.choice(_KV_DK), rng.choice(_KV_DV)
    gate = rng.choice(["none", "head", "channel"])
    strength = "normal"
    if gate != "none":
        strength = rng.choice(
            ["normal", "normal", "weak", "strong", "reset"] if not dplr else
            ["normal", "normal", "normal", "strong"]
        )  # fmt: skip
    c = 64  # the cpu backend's checkpoint interval (CHECKPOINT_STEPS)
    length = rng.choice([0, 1, 1, 2, 3, 17, c - 1, c, c + 1, 2 * c - 1, 2 * c, 2 * c + 1])
    packed = rng.random() < 0.3
    batch = 1 if packed else rng.choice([1, 2, 3])
    cu = None
    if packed:
        cuts = sorted(rng.choice([0, 0, 1, c - 1, c, c + 1, rng.randint(0, length)])
                      for _ in range(rng.randint(0, 4)))  # fmt: skip
        cu = [0, *[x for x in cuts if x <= length], length]
    initial = rng.random() < 0.5
    return_final = rng.random() < 0.7
    quiet_final = rng.random() < 0.5  # of the call without autograd
    scale = rng.choice([None, None, None, 0.5, 1.7])
    # the oracle's time: fewer batch rows, value heads, then narrower states
    while (batch * hv * dk * dv * max(length, 1) > KV_MAX_STATE_STEPS
           or batch * length * hv * max(dk, dv) > MAX_ELEMENTS):  # fmt: skip
        if batch > 1:
            batch -= 1
        elif hv > hk:
            hv = hk
        elif hk > 1:
            hk = hv = 1
        elif dk >= dv:
            dk = (dk + 1) // 2
        else:
            dv = (dv + 1) // 2
    states = batch if cu is None else len(cu) - 1
    keyed = ["q", "k", "a", "b"] if dplr else ["q", "k"]
    names = [*keyed, "v", *(["g"] if gate != "none" else []), *(["initial"] if initial else [])]
    shapes: dict[str, tuple[int, ...]] = {n: (batch, length, hk, dk) for n in keyed}
    shapes["v"] = (batch, length, hv, dv)
    shapes["g"] = (batch, length, hv) if gate == "head" else (batch, length, hv, dk)
    shapes["initial"] = (states, hv, dk, dv)
    # one view kind per operand; all contiguous on a third of the cases, where a call
    # of float32 or float64 without autograd takes the plain inference path
    plain = rng.random() < 0.35
    views: dict[str, str | tuple[str, int]] = {}
    for n in names:
        kind: str | tuple[str, int] = "contiguous" if plain else rng.choice(_KV_VIEWS)
        if kind == "broadcast":  # stride 0 along a dim of size > 1 (the leaf has size 1)
            dims = [d for d, s in enumerate(shapes[n]) if s > 1]
            kind = ("broadcast", rng.choice(dims)) if dims else "contiguous"
        views[n] = kind
    grads = length > 0 or (initial and return_final)
    bad_flag = _bad_flag(rng)
    threads = rng.choice([1, 2, 3, 4])
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    what = (
        f"{'dplr delta rule' if dplr else 'linear attention'} {dtype} batch {batch} "
        f"heads {hk}/{hv} K {dk} V {dv} gate {gate} ({strength}) L {length} cu_seqlens {cu} "
        f"initial {initial} return_final {return_final}/{quiet_final} scale {scale} views {views} "
        f"bad flag {bad_flag!r} threads {threads}"
    )
    r, u = _draws(gen)

    wide: dict[str, torch.Tensor] = {
        "q": r(*shapes["q"]),
        "k": r(*shapes["k"]) * dk**-0.5,
        "v": r(*shapes["v"]),
    }
    if dplr:  # RWKV-7's form: a = -kk, b = kk * rate, kk unit rows, rate in (0, 1)
        kk = torch.nn.functional.normalize(r(*shapes["k"]), dim=-1)
        wide["a"], wide["b"] = -kk, kk * u(*shapes["k"])
    if gate != "none":
        g = -(1.0 if dplr else 2.0) * u(*shapes["g"])
        if strength == "weak":  # one frame over a whole chunk
            g = g * 0.01
        elif strength in ("strong", "reset") and length:
            lo = rng.randrange(length)
            hi = rng.randint(lo + 1, length)
            g[:, lo:hi] *= 3.0 if dplr else 15.0  # down to -30 a step (-3 for DPLR)
            if strength == "reset":  # -inf: the state restarts (in some channels or all)
                t = rng.randrange(length)
                mask = u(*g[:, t].shape) < (1.0 if rng.random() < 0.5 else 0.3)
                g[:, t] = g[:, t].masked_fill(mask, -math.inf)
        wide["g"] = g
    if initial:
        wide["initial"] = r(*shapes["initial"])
    for n in names:  # a broadcast operand: the values of its first slice along the dim
        kind = views[n]
        if isinstance(kind, tuple):
            wide[n] = wide[n].narrow(kind[1], 0, 1).contiguous()

    def low(n: str) -> torch.Tensor:
        return wide[n].to(state_dtype if n == "initial" else dtype)

    def viewed(n: str, t: torch.Tensor) -> torch.Tensor:
        kind = views[n]
        if isinstance(kind, tuple):
            return t.expand(shapes[n])
        return _view(rng, t, str(kind))

    def call(args: dict[str, torch.Tensor], final: Any) -> Any:
        ops = [args[n] for n in (*keyed[:2], "v", *keyed[2:])]
        return fn(*ops, g=args.get("g"), scale=scale, initial=args.get("initial"),
                  return_final=final, backend="cpu",
                  cu_seqlens=None if cu is None else torch.tensor(cu))  # fmt: skip

    # the broadcast operands, and the dim of each
    spread = {n: kind[1] for n, kind in views.items() if isinstance(kind, tuple)}

    def loop(**full: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # a broadcast operand's gradient is the sum of its expanded gradient, which
        # autograd rounds to the operand's dtype element by element first (the public
        # function casts the expanded operand to the state's dtype): rounded here too. In
        # float16 the rounding of 16 terms alone, cancelling to a sum of 0.3, was 2.6 times
        # the tolerance (seed 12 case 230, a's gradient)
        full = {n: _RoundedGrad.apply(t, low(n).dtype) if n in spread else t
                for n, t in full.items()}  # fmt: skip
        if dplr:
            return dplr_delta_rule_loop(
                full["q"], full["k"], full["v"], full["a"], full["b"], g=full.get("g"),
                scale=scale, initial=full.get("initial"), cu_seqlens=cu,
            )  # fmt: skip
        return linear_attention_loop(
            full["q"], full["k"], full["v"], g=full.get("g"), scale=scale,
            initial=full.get("initial"), cu_seqlens=cu,
        )  # fmt: skip

    def check() -> None:
        args = {n: low(n) for n in names}
        if bad_flag is not _NO_BAD_FLAG:
            _expect_flag_error(name, lambda: call({n: viewed(n, t) for n, t in args.items()},
                                                  bad_flag))  # fmt: skip
        leaves = {n: t.clone().requires_grad_() for n, t in args.items()}
        operands = {n: viewed(n, t) for n, t in leaves.items()}
        got = call(operands, return_final)
        got, final = got if return_final else (got, None)
        exact = {n: t.detach().double().requires_grad_() for n, t in leaves.items()}
        full = {n: t.expand(shapes[n]) for n, t in exact.items()}
        # the loop on one thread: its thousands of small ops would each wake the others
        want, want_final = _with_threads(1, lambda: loop(**full))
        assert got.dtype == dtype, got.dtype
        assert_matches(got, want, dtype)
        if final is not None:
            assert final.dtype == state_dtype, final.dtype
            assert_matches(final, want_final, state_dtype)
        # the same call that nothing differentiates: the plain inference path (float32,
        # float64, contiguous, not packed), else the kernel without the op
        with torch.no_grad():
            quiet = call({n: viewed(n, t) for n, t in args.items()}, quiet_final)
        assert_matches(quiet[0] if quiet_final else quiet, want, dtype)
        if quiet_final:
            assert_matches(quiet[1], want_final, state_dtype)
        if not grads:
            return
        # in the outputs' dtypes: the kernel and the loop start from the same gradients
        w_out = r(*want.shape).to(dtype).double()
        w_fin = r(*want_final.shape).to(state_dtype).double()
        got_loss = (got.double() * w_out).sum()
        want_loss = (want * w_out).sum()
        if final is not None:
            got_loss = got_loss + (final.double() * w_fin).sum()
            want_loss = want_loss + (want_final * w_fin).sum()
        # the leaves' gradients, then the broadcast operands' expanded ones: what the
        # kernel computed, element by element, before autograd sums them into the leaf's
        got_grads = _grads_or_zeros(
            got_loss, [*leaves.values(), *(operands[n] for n in spread)]
        )  # fmt: skip
        want_grads = _with_threads(1, lambda: _grads_or_zeros(
            want_loss, [*exact.values(), *(full[n] for n in spread)]))  # fmt: skip
        m = len(leaves)
        expanded = dict(zip(spread, zip(got_grads[m:], want_grads[m:], strict=True), strict=True))
        for n, g_, w in zip(leaves, got_grads[:m], want_grads[:m], strict=True):
            assert g_.dtype == leaves[n].dtype, (n, g_.dtype)
            try:
                if n not in spread:
                    assert_matches(g_, w, leaves[n].dtype)
                    continue
                g_full, w_full = expanded[n]
                assert_matches(g_full, w_full, leaves[n].dtype)
                # the leaf's: a sum of those terms, whose errors it adds up, so the
                # tolerance scales with the magnitudes it sums (as SSD's dt_bias's does).
                # Linear attention's fixed decay (g broadcast over time) in float32: the
                # kernel's grad_g per step within 0.09 of the tolerance, but correlated
                # (suffix sums within a chunk), summed over 63 steps that cancel to 1/45
                # of their magnitudes: 3.4 times the tolerance of the sum's own
                # magnitude (seed 21 case 7549; also 14/1499, 21/9386, 23/11374)
                rtol, atol = TOLERANCE[leaves[n].dtype]
                terms = w_full.abs().sum(spread[n]).max().item() if w_full.numel() else 0.0
                scale_n = max(1.0, terms, w.abs().max().item() if w.numel() else 0.0)
                torch.testing.assert_close(g_.double(), w, rtol=rtol, atol=atol * scale_n)
            except AssertionError as error:
                raise AssertionError(f"the gradient of {n}: {error}") from None

    return what, lambda: _with_threads(threads, check)


class _RoundedGrad(torch.autograd.Function):
    """The identity, whose backward rounds the incoming gradient to ``dtype`` (and
    back): what autograd does to a gradient that flows through a cast from ``dtype``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.dtype = dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(ctx.dtype).to(grad.dtype), None


def _grads_or_zeros(loss: torch.Tensor, leaves: list[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients of ``loss`` by ``leaves``, zeros for those it does not reach (the
    loop reaches no operand of an empty input)."""
    if not loss.requires_grad:
        return [torch.zeros_like(t) for t in leaves]
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves, strict=True)]


def _linear_attention_case(rng: random.Random) -> tuple[str, Callable[[], None]]:
    """ps.linear_attention_scan(backend="cpu") (linear_attention/cpu.c): _kv_state_case."""
    return _kv_state_case(rng, "linear")


def _dplr_case(rng: random.Random) -> tuple[str, Callable[[], None]]:
    """ps.dplr_delta_rule_scan(backend="cpu") (dplr/cpu.c): _kv_state_case."""
    return _kv_state_case(rng, "dplr")


def make_case(seed: int, case: int) -> tuple[str, Callable[[], None]]:
    """Case ``case`` of ``seed``: its description, and the check that runs it."""
    rng = random.Random(f"{seed}-{case}")
    # one case in eight is the delta rule's, decided by a stream of its own so that
    # every other case draws what it drew before the delta rule had a kernel (a seed
    # and case number replay the same inputs: test_fuzz_regressions.py)
    if random.Random(f"{seed}-{case}-delta").random() < 0.125:
        return _delta_case(rng)
    # the same for linear attention's and DPLR's kernels, each decided after the ones
    # before it: a case drawn before they had a kernel keeps its inputs
    if random.Random(f"{seed}-{case}-linear").random() < 0.125:
        return _linear_attention_case(rng)
    if random.Random(f"{seed}-{case}-dplr").random() < 0.125:
        return _dplr_case(rng)
    kind = rng.choice(["linear", "linear", "log", "log", "matrix", "product", "selective", "ssd"])
    if kind in ("linear", "log"):
        return _first_order_case(rng, log=kind == "log")
    if kind == "selective":
        return _selective_case(rng)
    if kind == "ssd":
        return _ssd_case(rng)
    return _matrix_case(rng) if kind == "matrix" else _product_case(rng)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python tests/native/fuzz_kernels.py")
    parser.add_argument("--seconds", type=float, default=60.0, help="time box (default 60)")
    parser.add_argument("--seed", type=int, help="default: a new random one, printed")
    parser.add_argument("--case", type=int, help="run this one case of --seed only")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    loaded, wanted = kernel_library_path(), os.environ.get("PARASCAN_KERNEL_LIBRARY")
    print(f"fuzz_kernels: kernels from {loaded}")
    if loaded is None or (wanted and Path(loaded) != Path(wanted)):
        print(f"fuzz_kernels: expected the kernels from {wanted or 'the package'}; stopping")
        return 2
    print(f"fuzz_kernels: seed {seed} (reproduce a case with --seed {seed} --case N)", flush=True)
    cases = [args.case] if args.case is not None else None
    start, done, failures = time.monotonic(), 0, 0
    case = 0
    while True:
        if cases is not None:
            if not cases:
                break
            case = cases.pop()
        elif time.monotonic() - start > args.seconds:
            break
        what = "(the case could not be built)"
        try:
            what, check = make_case(seed, case)
            check()
        except Exception:
            failures += 1
            print(f"MISMATCH seed {seed} case {case}: {what}", flush=True)
            traceback.print_exc()
        done += 1
        case += 1
    print(
        f"fuzz_kernels: seed {seed}: {done} cases in {time.monotonic() - start:.0f} s, "
        f"{failures} failed"
    )
    print(f"{done - failures} passed, {failures} failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
