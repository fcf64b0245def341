"""``parascan check``: every family of scans, on every backend the device has, against
a float64 loop written here, and gradcheck. Exit status 1 when anything fails.

Summary of method. A family is one entry of ``FAMILIES``: the public function, its row
of the backend table (which backends to run, and the dtypes each takes; ``None`` for a
function without a ``backend`` argument), its dtypes, its cases and its gradchecks.
For each dtype, each case draws its inputs from a fixed seed, in that dtype, and runs
the loop of this module on the same (already rounded) values widened to float64 (or
complex128); then each backend runs the case, and the row (family, dtype, backend)
reports the largest error over its cases' outputs and final states, relative to the
largest magnitude of the reference (``tolerance.relative_error``), against the dtype's
tolerance. In float64 and complex128 every input's gradient, for a random upstream
gradient, is compared with the loop's own autograd gradient too: the cases are long
enough to cross the backends' blocks and checkpoints, which a tiny gradcheck does not.
Last, ``torch.autograd.gradcheck`` (and ``gradgradcheck`` where the family has second
derivatives) on a tiny float64 case of each family and backend.

The loops are API.md's equations, one step at a time, in plain torch; they share no
code with the package, whose own ``loop`` backends are checked against them like the
other backends. (The generic scans' sequential folds, parascan.generic.reference, are
the exception: one combine call per element, written for this purpose, sharing nothing
with the batched algorithms.)

A new family is one more ``Family`` in ``FAMILIES``: its cases (``make`` the inputs,
``run`` the public function on a backend, ``loop`` the float64 reference, each
returning outputs in the same order) and a tiny gradcheck.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any, TextIO

import torch
import torch.nn.functional as F
from torch import Tensor

import parascan
from parascan._core import FLOAT_DTYPES, backends, table
from parascan.cli.tolerance import TOLERANCE, relative_error
from parascan.generic import reference as generic_reference
from parascan.mixer import conv

__all__ = [
    "FAMILIES",
    "Case",
    "CheckResult",
    "Family",
    "Gradcheck",
    "default_devices",
    "family_names",
    "run_check",
]

Inputs = dict[str, Tensor]
Outputs = tuple[Tensor, ...]
_WIDE = (torch.float64, torch.complex128)


@dataclass(frozen=True)
class Case:
    """One comparison with the loop: ``make(generator, dtype)`` draws the inputs (CPU
    tensors; ``dtype`` is the row's, the case chooses each input's own); ``run(inputs,
    backend)`` calls the public function; ``loop(inputs)`` is the reference, called on
    the inputs widened to float64/complex128. Both return their outputs in one order."""

    label: str
    make: Callable[[torch.Generator, torch.dtype], Inputs]
    run: Callable[[Inputs, str], Outputs]
    loop: Callable[[Inputs], Outputs]


@dataclass(frozen=True)
class Gradcheck:
    """A tiny float64 case for ``torch.autograd.gradcheck``: every floating input is
    differentiated; ``run`` as in ``Case``."""

    label: str
    make: Callable[[torch.Generator], Inputs]
    run: Callable[[Inputs, str], Outputs]


@dataclass(frozen=True)
class Family:
    """One public function: ``op`` its row of the backend table (parascan._core.table(),
    e.g. "parascan.ssd_scan"; None: it takes no backend, checked once as backend "-")."""

    name: str
    op: str | None
    dtypes: tuple[torch.dtype, ...]
    cases: tuple[Case, ...]
    gradchecks: tuple[Gradcheck, ...]
    second_order: bool = False  # gradgradcheck too


@dataclass
class CheckResult:
    family: str
    what: str  # the dtype, or "gradcheck"
    backend: str
    passed: bool
    detail: str
    ran: bool = True  # False: the backend does not take this dtype ("n/a", not a failure)


# ---- drawing inputs ---------------------------------------------------------------------


def _real(dtype: torch.dtype) -> torch.dtype:
    return {torch.complex64: torch.float32, torch.complex128: torch.float64}.get(dtype, dtype)


def _wide(dtype: torch.dtype) -> torch.dtype:
    return torch.complex128 if dtype.is_complex else torch.float64


def _normal(gen: torch.Generator, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    """Standard normal values (complex: real and imaginary parts each of variance 1/2)."""
    if dtype.is_complex:
        re, im = (torch.randn(tuple(shape), generator=gen, dtype=torch.float64) for _ in "ri")
        return (torch.complex(re, im) / math.sqrt(2)).to(dtype)
    return torch.randn(tuple(shape), generator=gen, dtype=torch.float64).to(dtype)


def _uniform(
    gen: torch.Generator, shape: Sequence[int], low: float, high: float, dtype: torch.dtype
) -> Tensor:
    u = torch.rand(tuple(shape), generator=gen, dtype=torch.float64)
    return (low + (high - low) * u).to(dtype)


def _gates(gen: torch.Generator, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
    """Magnitudes in (0.5, 1) (with a phase when complex): a long but fading memory."""
    mag = _uniform(gen, shape, 0.5, 1.0, torch.float64)
    if dtype.is_complex:
        mag = torch.polar(mag, _uniform(gen, shape, -0.5, 0.5, torch.float64))
    return mag.to(dtype)


def _offsets(*cuts: int) -> Tensor:
    return torch.tensor(cuts, dtype=torch.int32)


# ---- the float64 loops (API.md's equations, one step at a time) --------------------------


def _first_order_loop(
    gates: Tensor, tokens: Tensor, initial: Tensor | None, dim: int, reverse: bool
) -> Outputs:
    """x[t] = gates[t] * x[t-1] + tokens[t] along ``dim``: (x, final)."""
    a, b = (t.movedim(dim, 0) for t in torch.broadcast_tensors(gates, tokens))
    steps = b.shape[0]
    h = torch.zeros(b.shape[1:], dtype=b.dtype) if initial is None else initial.expand(b.shape[1:])
    out: dict[int, Tensor] = {}
    for t in range(steps - 1, -1, -1) if reverse else range(steps):
        h = a[t] * h + b[t]
        out[t] = h
    x = torch.stack([out[t] for t in range(steps)]) if steps else b.new_zeros(b.shape)
    return x.movedim(0, dim), h


def _matrix_loop(w: Tensor, b: Tensor, initial: Tensor, reverse: bool) -> Outputs:
    """x[t] = w[t] @ x[t-1] + b[t], batch dims broadcast: (x, final)."""
    steps, d = b.shape[-2], b.shape[-1]
    batch = torch.broadcast_shapes(w.shape[:-3], b.shape[:-2], initial.shape[:-1])
    h = initial.expand(*batch, d)
    out: dict[int, Tensor] = {}
    for t in range(steps - 1, -1, -1) if reverse else range(steps):
        h = (w[..., t, :, :] @ h.unsqueeze(-1)).squeeze(-1) + b[..., t, :]
        out[t] = h
    return torch.stack([out[t] for t in range(steps)], -2), h


def _selective_loop(x: Inputs, softplus: bool) -> Outputs:
    """Mamba-1's selective scan: (out, final)."""
    u, A, B, C = x["u"], x["A"], x["B"], x["C"]
    batch, dim, length = u.shape
    dt = x["delta"] + x["delta_bias"][:, None] if "delta_bias" in x else x["delta"]
    dt = F.softplus(dt) if softplus else dt
    h = x.get("initial", torch.zeros(batch, dim, A.shape[-1], dtype=A.dtype))

    def at(m: Tensor, t: int) -> Tensor:  # the (batch or 1, dim, N) row of B or C at t
        if m.dim() == 2:  # time-invariant (dim, N)
            return m[None]
        if m.dim() == 3:  # shared by the channels (batch, N, L)
            return m[:, None, :, t]
        return m[..., t].repeat_interleave(dim // m.shape[1], 1)  # grouped (batch, G, N, L)

    ys = []
    for t in range(length):
        h = torch.exp(dt[:, :, t, None] * A) * h + (dt[:, :, t] * u[:, :, t])[..., None] * at(B, t)
        y = (h * at(C, t)).sum(-1)
        ys.append(2 * y.real if y.is_complex() else y)
    out = torch.stack(ys, -1)
    if "D" in x:
        out = out + x["D"][:, None] * u
    if "z" in x:
        out = out * F.silu(x["z"])
    return out, h


def _segments(x: Inputs, length: int) -> list[tuple[int, int]]:
    if "cu_seqlens" not in x:
        return [(0, length)]
    cu = x["cu_seqlens"].tolist()
    return list(pairwise(cu))


def _ssd_loop(x: Inputs, softplus: bool, limit: tuple[float, float]) -> Outputs:
    """Mamba-2's SSD scan, packed sequences each from its own state: (out, final)."""
    X, A = x["x"], x["A"]
    batch, length, heads, headdim = X.shape
    dt = x["dt"] + x["dt_bias"] if "dt_bias" in x else x["dt"]
    dt = (F.softplus(dt) if softplus else dt).clamp(*limit)
    Bh = x["B"].repeat_interleave(heads // x["B"].shape[2], 2)
    Ch = x["C"].repeat_interleave(heads // x["C"].shape[2], 2)
    ys: dict[int, Tensor] = {}
    finals = []
    for i, (start, end) in enumerate(_segments(x, length)):
        zero = torch.zeros(batch, heads, headdim, Bh.shape[-1], dtype=X.dtype)
        packed = "cu_seqlens" in x
        h = x["initial"][i : i + 1] if packed and "initial" in x else x.get("initial", zero)
        for t in range(start, end):
            decay = torch.exp(dt[:, t, :, None, None] * A[:, None, None])
            h = decay * h + (dt[:, t, :, None] * X[:, t])[..., None] * Bh[:, t, :, None, :]
            ys[t] = (h * Ch[:, t, :, None, :]).sum(-1)
        finals.append(h)
    out = torch.stack([ys[t] for t in range(length)], 1)
    if "D" in x:
        D = x["D"]
        out = out + (D[:, None] if D.dim() == 1 else D) * X
    if "z" in x:
        out = out * F.silu(x["z"])
    return out, torch.cat(finals)


def _l2norm(t: Tensor) -> Tensor:
    return t * torch.rsqrt((t * t).sum(-1, keepdim=True) + 1e-6)


def _matrix_state_loop(x: Inputs, scale: float | None, qk_l2norm: bool) -> Outputs:
    """The (K, V)-state scans, g None, per head or per key channel, packed sequences each
    from its own state: (out, final). Linear attention, S[t] = Diag(exp(g[t])) S[t-1] +
    k[t] v[t]^T; the delta rule with ``beta`` in ``x`` (v[t] replaced by beta[t] (v[t] -
    S^T k[t]), S after the decay); DPLR with ``a`` and ``b`` in ``x`` (b[t] a[t]^T S[t-1]
    added to the decayed state)."""
    q, k, v, g = x["q"], x["k"], x["v"], x.get("g")
    batch, length, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    if qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    q, k = q.repeat_interleave(hv // hk, 2), k.repeat_interleave(hv // hk, 2)
    if "a" in x:
        a, b = x["a"].repeat_interleave(hv // hk, 2), x["b"].repeat_interleave(hv // hk, 2)
    scale = dk**-0.5 if scale is None else scale
    outs: dict[int, Tensor] = {}
    finals = []
    for i, (start, end) in enumerate(_segments(x, length)):
        zero = torch.zeros(batch, hv, dk, dv, dtype=v.dtype)
        packed = "cu_seqlens" in x
        S = x["initial"][i : i + 1] if packed and "initial" in x else x.get("initial", zero)
        for t in range(start, end):
            if "a" in x:  # DPLR: the rank-one part of the transition reads S[t-1]
                low_rank = (
                    b[:, t, :, :, None] * torch.einsum("bhkv,bhk->bhv", S, a[:, t])[..., None, :]
                )
            if g is not None:
                decay = torch.exp(g[:, t])  # (batch, Hv) or (batch, Hv, K)
                S = S * (decay[..., None, None] if decay.dim() == 2 else decay[..., None])
            if "a" in x:
                S = S + low_rank
            kt, u = k[:, t], v[:, t]
            if "beta" in x:  # the delta rule: only what S does not yet predict
                u = x["beta"][:, t, :, None] * (u - torch.einsum("bhkv,bhk->bhv", S, kt))
            S = S + kt[..., :, None] * u[..., None, :]
            outs[t] = scale * torch.einsum("bhkv,bhk->bhv", S, q[:, t])
        finals.append(S)
    return torch.stack([outs[t] for t in range(length)], 1), torch.cat(finals)


def _conv_loop(x: Inputs, silu: bool) -> Outputs:
    """out[t] = act(bias + sum_j weight[:, j] x[t - W + 1 + j]), zeros before each
    sequence's first step: (out,)."""
    X, w = x["x"], x["weight"]
    length, width = X.shape[1], w.shape[1]
    first = [0] * length  # the first step of the sequence each step is in
    for start, end in _segments(x, length):
        first[start:end] = [start] * (end - start)
    outs = []
    for t in range(length):
        acc = torch.zeros(X.shape[0], X.shape[2], dtype=X.dtype)
        for j in range(width):
            s = t - width + 1 + j
            if s >= first[t]:
                acc = acc + w[:, j] * X[:, s]
        outs.append(acc + x["bias"] if "bias" in x else acc)
    out = torch.stack(outs, 1)
    return (F.silu(out) if silu else out,)


def _step_loop(x: Inputs, softplus: bool) -> Outputs:
    """One decoding step, Mamba-1's (batch, dim, N) or the multi-head (batch, heads,
    headdim, N) state: (out, new state)."""
    state, X = x["state"], x["x"]
    heads = state.dim() == 4
    units = state.shape[1]
    dt = x["dt"] + x["dt_bias"] if "dt_bias" in x else x["dt"]
    dt = F.softplus(dt) if softplus else dt

    def per_unit(m: Tensor) -> Tensor:  # (batch, N) or (batch, G, N) -> a row per unit
        m = m[:, None] if m.dim() == 2 else m
        m = m.repeat_interleave(units // m.shape[1], 1)
        return m[:, :, None] if heads else m

    new = torch.exp(dt[..., None] * x["A"]) * state + (dt * X)[..., None] * per_unit(x["B"])
    y = (new * per_unit(x["C"])).sum(-1)
    if "D" in x:
        y = y + x["D"] * X
    if "z" in x:
        y = y * F.silu(x["z"])
    return y, new


# ---- the families ------------------------------------------------------------------------


def _pair(result: Any) -> Outputs:
    out, final = result
    return out, final


def _first_order_case(
    label: str,
    tokens_shape: tuple[int, ...],
    gates_shape: tuple[int, ...],
    dim: int,
    reverse: bool,
    initial: bool,
    strided: bool = False,
) -> Case:
    """A linear_scan case; ``strided``: tokens a transposed view."""

    def make(gen: torch.Generator, dtype: torch.dtype) -> Inputs:
        x = {"gates": _gates(gen, gates_shape, dtype)}
        if strided:
            x["tokens"] = _normal(gen, tokens_shape[::-1], dtype).permute(
                *range(len(tokens_shape) - 1, -1, -1)
            )
        else:
            x["tokens"] = _normal(gen, tokens_shape, dtype)
        if initial:
            d = dim % len(tokens_shape)
            x["initial"] = _normal(gen, tokens_shape[:d] + tokens_shape[d + 1 :], dtype)
        return x

    def run(x: Inputs, backend: str) -> Outputs:
        return _pair(
            parascan.linear_scan(
                x["gates"], x["tokens"], dim, initial=x.get("initial"), reverse=reverse,
                return_final=True, backend=backend,
            )
        )  # fmt: skip

    def loop(x: Inputs) -> Outputs:
        return _first_order_loop(x["gates"], x["tokens"], x.get("initial"), dim, reverse)

    return Case(label, make, run, loop)


def _linear_gradcheck(dtype: torch.dtype, reverse: bool) -> Gradcheck:
    def make(gen: torch.Generator) -> Inputs:
        return {
            "gates": _gates(gen, (3, 6, 2), dtype),
            "tokens": _normal(gen, (3, 6, 2), dtype),
            "initial": _normal(gen, (3, 2), dtype),
        }

    def run(x: Inputs, backend: str) -> Outputs:
        return (
            parascan.linear_scan(
                x["gates"], x["tokens"], 1, initial=x["initial"], reverse=reverse, backend=backend
            ),
        )

    label = f"{str(dtype).removeprefix('torch.')}{' reverse' if reverse else ''}"
    return Gradcheck(label, make, run)


LINEAR_SCAN = Family(
    "linear_scan",
    "parascan.linear_scan",
    FLOAT_DTYPES,
    (
        _first_order_case("T=65, dim 1, initial", (3, 65, 131), (3, 65, 131), 1, False, True),
        _first_order_case("T=1031 reversed, strided", (9, 1031), (9, 1031), -1, True, False, True),
        _first_order_case("T=33, broadcast gates", (2, 9, 33), (2, 1, 33), 2, False, False),
        _first_order_case("T=0, reversed, initial", (4, 0, 3), (4, 0, 3), 1, True, True),
    ),
    (_linear_gradcheck(torch.float64, False), _linear_gradcheck(torch.complex128, True)),
    second_order=True,
)


def _inputs(
    shape: tuple[int, ...], dtype: torch.dtype, device: str, seed: int
) -> tuple[Tensor, Tensor]:
    """Real gates in (0.5, 1) and standard normal real tokens from ``seed``, in
    ``dtype`` (complex ones with zero imaginary parts: log of a negative token is
    log|b| + i pi, so complex sums cancel). The first case of log_linear_scan, which
    tests/first_order/test_log_linear_scan.py reproduces."""
    gen = torch.Generator().manual_seed(seed)
    gates = (0.5 + 0.5 * torch.rand(shape, generator=gen, dtype=torch.float64)).to(dtype)
    tokens = torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
    return gates.to(device), tokens.to(device)


def _log_case(
    label: str,
    shape: tuple[int, ...],
    dim: int,
    reverse: bool,
    initial: bool,
    seed: int | None = None,
) -> Case:
    """log_linear_scan of log a and log b (log 0 = -inf for the first tokens), compared
    as exp(h) with the linear loop of a and b: finite where h is -inf, gradients
    included. ``seed``: ``_inputs``'s real gates and tokens; else gates with a phase
    when complex, and complex tokens."""

    def make(gen: torch.Generator, dtype: torch.dtype) -> Inputs:
        if seed is not None:
            gates, tokens = _inputs(shape, dtype, "cpu", seed)
        else:
            gates, tokens = _gates(gen, shape, dtype), _normal(gen, shape, dtype)
        tokens = tokens if dtype.is_complex else tokens.abs()
        tokens.narrow(dim, 0, 3).zero_()  # log 0 = -inf for the first steps
        x = {"log_gates": gates.log(), "log_tokens": tokens.log()}
        if initial:
            d = dim % len(shape)
            state = _gates(gen, shape[:d] + shape[d + 1 :], dtype)
            x["initial"] = state.log()
        return x

    def run(x: Inputs, backend: str) -> Outputs:
        h, final = parascan.log_linear_scan(
            x["log_gates"], x["log_tokens"], dim, initial=x.get("initial"), reverse=reverse,
            return_final=True, backend=backend,
        )  # fmt: skip
        return h.exp(), final.exp()

    def loop(x: Inputs) -> Outputs:
        initial = x["initial"].exp() if "initial" in x else None
        return _first_order_loop(x["log_gates"].exp(), x["log_tokens"].exp(), initial, dim, reverse)

    return Case(label, make, run, loop)


def _log_gradcheck_inputs(gen: torch.Generator) -> Inputs:
    return {
        "log_gates": _gates(gen, (2, 6, 3), torch.float64).log(),
        "log_tokens": _uniform(gen, (2, 6, 3), 0.1, 2.0, torch.float64).log(),
    }


LOG_LINEAR_SCAN = Family(
    "log_linear_scan",
    "parascan.log_linear_scan",
    (torch.float32, torch.float64, torch.complex64, torch.complex128),
    (
        _log_case("T=257, log 0 tokens", (3, 257, 5), 1, False, False, seed=11),
        _log_case("T=70 reversed, initial", (4, 70), -1, True, True),
    ),
    (
        Gradcheck(
            "float64",
            _log_gradcheck_inputs,
            lambda x, b: (parascan.log_linear_scan(x["log_gates"], x["log_tokens"], 1, backend=b),),
        ),
    ),
    second_order=True,
)


def _matrix_case(reverse: bool) -> Case:
    def make(gen: torch.Generator, dtype: torch.dtype) -> Inputs:
        return {
            "weights": _normal(gen, (2, 1, 67, 6, 6), dtype) / 3,  # batch dims broadcast
            "biases": _normal(gen, (3, 67, 6), dtype),
            "initial": _normal(gen, (6,), dtype),
        }

    def run(x: Inputs, backend: str) -> Outputs:
        return _pair(
            parascan.matrix_linear_scan(
                x["weights"], x["biases"], initial=x["initial"], reverse=reverse,
                return_final=True, backend=backend,
            )
        )  # fmt: skip

    def loop(x: Inputs) -> Outputs:
        return _matrix_loop(x["weights"], x["biases"], x["initial"], reverse)

    return Case(f"T=67, broadcast batch{', reversed' if reverse else ''}", make, run, loop)


def _matrix_gradcheck_inputs(gen: torch.Generator) -> Inputs:
    shapes = {"weights": (5, 3, 3), "biases": (2, 5, 3), "initial": (3,)}
    return {name: _normal(gen, shape, torch.float64) / 2 for name, shape in shapes.items()}


MATRIX_LINEAR_SCAN = Family(
    "matrix_linear_scan",
    "parascan.matrix_linear_scan",
    (torch.float32, torch.float64, torch.complex64, torch.complex128),
    (_matrix_case(False), _matrix_case(True)),
    (
        Gradcheck(
            "float64",
            _matrix_gradcheck_inputs,
            lambda x, b: (
                parascan.matrix_linear_scan(
                    x["weights"], x["biases"], initial=x["initial"], backend=b
                ),
            ),
        ),
    ),
    second_order=True,
)


def _first_order_pair(p: Any, q: Any) -> Any:
    return p[0] * q[0], q[0] * p[1] + q[1]


def _generic_inputs(gen: torch.Generator, dtype: torch.dtype) -> Inputs:
    """Orthogonal 4x4 matrices (every product has norm 1: no prefix vanishes or blows
    up) and first-order pairs with gates of magnitude in (0.99, 1), either sign."""
    sign = torch.randint(0, 2, (3, 257), generator=gen).to(dtype) * 2 - 1
    return {
        "m": torch.linalg.qr(_normal(gen, (300, 4, 4), dtype)).Q,
        "a": sign * _uniform(gen, (3, 257), 0.99, 1.0, dtype),
        "b": _normal(gen, (3, 257), dtype),
    }


def _generic_case(reduce: bool, reverse: bool) -> Case:
    """Products of 4x4 matrices (dim 0, operand dims after it) and first-order pairs (a
    tuple, dim 1), against the sequential folds."""

    def run(x: Inputs, backend: str) -> Outputs:
        if reduce:
            return (
                parascan.associative_reduce(torch.matmul, x["m"], 0),
                *parascan.associative_reduce(_first_order_pair, (x["a"], x["b"]), 1),
            )
        return (
            parascan.associative_scan(torch.matmul, x["m"], 0, reverse=reverse),
            *parascan.associative_scan(_first_order_pair, (x["a"], x["b"]), 1, reverse=reverse),
        )

    def loop(x: Inputs) -> Outputs:
        if reduce:
            return (
                generic_reference.fold(torch.matmul, x["m"], 0),
                *generic_reference.fold(_first_order_pair, (x["a"], x["b"]), 1),
            )
        return (
            generic_reference.scan(torch.matmul, x["m"], 0, reverse),
            *generic_reference.scan(_first_order_pair, (x["a"], x["b"]), 1, reverse),
        )

    label = "matrix products, first-order pairs" + (", reversed" if reverse else "")
    return Case(label, _generic_inputs, run, loop)


def _generic_gradcheck(reduce: bool) -> Gradcheck:
    def make(gen: torch.Generator) -> Inputs:
        return {"m": _normal(gen, (7, 3, 3), torch.float64) / 2}

    def run(x: Inputs, backend: str) -> Outputs:
        if reduce:
            return (parascan.associative_reduce(torch.matmul, x["m"], 0),)
        return (parascan.associative_scan(torch.matmul, x["m"], 0, reverse=True),)

    return Gradcheck("matrix products", make, run)


ASSOCIATIVE_SCAN = Family(
    "associative_scan",
    None,
    (torch.float64,),
    (_generic_case(False, False), _generic_case(False, True)),
    (_generic_gradcheck(False),),
    second_order=True,
)
ASSOCIATIVE_REDUCE = Family(
    "associative_reduce",
    None,
    (torch.float64,),
    (_generic_case(True, False),),
    (_generic_gradcheck(True),),
    second_order=True,
)


def _selective_case(
    label: str,
    b_form: str,
    extras: bool,
    batch: int = 2,
    dim: int = 4,
    n: int = 3,
    length: int = 130,
) -> Case:
    """``b_form``: "shared" (batch, N, L), "grouped" (batch, 2, N, L) or "invariant"
    (dim, N); ``extras``: D, z, delta_bias, softplus and an initial state. A complex
    row's A (and B, C when shared) is complex; u and the rest are real."""

    def make(gen: torch.Generator, dtype: torch.dtype) -> Inputs:
        real = _real(dtype)
        A = -_uniform(gen, (dim, n), 0.5, 1.5, torch.float64)
        if dtype.is_complex:
            A = torch.complex(A, _normal(gen, (dim, n), torch.float64))
        mat = dtype if b_form == "shared" else real
        shape = {"shared": (batch, n, length), "grouped": (batch, 2, n, length)}.get(
            b_form, (dim, n)
        )
        x = {
            "u": _normal(gen, (batch, dim, length), real),
            "delta": _uniform(gen, (batch, dim, length), 0.0, 0.5, real),
            "A": A.to(dtype),
            "B": _normal(gen, shape, mat),
            "C": _normal(gen, shape, mat),
        }
        if extras:
            x["D"] = _normal(gen, (dim,), real)
            x["z"] = _normal(gen, (batch, dim, length), real)
            x["delta_bias"] = _normal(gen, (dim,), real) / 2
            x["initial"] = _normal(gen, (batch, dim, n), dtype)
        return x

    def run(x: Inputs, backend: str) -> Outputs:
        return _pair(
            parascan.selective_scan(
                x["u"], x["delta"], x["A"], x["B"], x["C"], x.get("D"), x.get("z"),
                x.get("delta_bias"), extras, initial=x.get("initial"), return_final=True,
                backend=backend,
            )
        )  # fmt: skip

    return Case(label, make, run, lambda x: _selective_loop(x, extras))


SELECTIVE_SCAN = Family(
    "selective_scan",
    "parascan.selective_scan",
    (torch.float32, torch.float64, torch.complex64, torch.complex128),
    (
        _selective_case("L=130, B/C (batch, N, L), D, z, delta_bias, initial", "shared", True),
        _selective_case("L=130, B/C grouped", "grouped", False),
        _selective_case("L=70, B/C time-invariant, D, z", "invariant", True, length=70),
    ),
    (
        Gradcheck(
            "D, z, delta_bias, initial",
            lambda gen: _selective_case("", "shared", True, 1, 2, 2, 5).make(gen, torch.float64),
            _selective_case("", "shared", True).run,
        ),
    ),
)


def _ssd_case(
    label: str,
    extras: bool,
    packed: bool = False,
    length: int = 100,
    heads: int = 4,
    headdim: int = 3,
    n: int = 5,
) -> Case:
    """``extras``: D (heads,), z, dt_bias, softplus, dt_limit and an initial state;
    ``packed``: three sequences (one empty) by cu_seqlens, D (heads, headdim)."""
    batch, groups = (1, 2) if packed else (2, 2)
    cu = _offsets(0, 37, 37, length)
    limit = (0.05, 0.8) if extras else (0.0, math.inf)
    softplus = extras

    def make(gen: torch.Generator, dtype: torch.dtype) -> Inputs:
        x = {
            "x": _normal(gen, (batch, length, heads, headdim), dtype),
            "dt": _uniform(gen, (batch, length, heads), 0.01, 0.5, dtype),
            "A": -_uniform(gen, (heads,), 0.5, 2.0, dtype),
            "B": _normal(gen, (batch, length, groups, n), dtype),
            "C": _normal(gen, (batch, length, groups, n), dtype),
        }
        if extras:
            x["D"] = _normal(gen, (heads,), dtype)
            x["z"] = _normal(gen, (batch, length, heads, headdim), dtype)
            x["dt_bias"] = _normal(gen, (heads,), dtype) / 2
            x["initial"] = _normal(gen, (batch, heads, headdim, n), dtype)
        if packed:
            x["D"] = _normal(gen, (heads, headdim), dtype)
            x["initial"] = _normal(gen, (len(cu) - 1, heads, headdim, n), dtype)
            x["cu_seqlens"] = cu
        return x

    def run(x: Inputs, backend: str) -> Outputs:
        return _pair(
            parascan.ssd_scan(
                x["x"], x["dt"], x["A"], x["B"], x["C"], D=x.get("D"), z=x.get("z"),
                dt_bias=x.get("dt_bias"), dt_softplus=softplus, dt_limit=limit,
                initial=x.get("initial"), return_final=True, cu_seqlens=x.get("cu_seqlens"),
                backend=backend,
            )
        )  # fmt: skip

    return Case(label, make, run, lambda x: _ssd_loop(x, softplus, limit))


SSD_SCAN = Family(
    "ssd_scan",
    "parascan.ssd_scan",
    (torch.float32, torch.float64),
    (
        _ssd_case("L=300", False, length=300),
        _ssd_case("L=100, D, z, dt_bias, dt_limit, initial", True),
        _ssd_case("L=100, packed, D (heads, headdim), initial", False, packed=True),
    ),
    (
        Gradcheck(
            "D, z, dt_bias, initial",
            lambda gen: _ssd_case("", True, length=5, heads=2, headdim=2, n=2).make(
                gen, torch.float64
            ),
            _ssd_case("", True).run,
        ),
    ),
)


def _matrix_state_case(
    label: str,
    kind: str,
    gate: str,
    *,
    initial: bool = False,
    packed: bool = False,
    length: int = 140,
    heads: tuple[int, int] = (1, 2),
    dk: int = 4,
    dv: int = 3,
) -> Case:
    """A case of a (K, V)-state scan, ``kind`` "delta" (delta_rule_scan),
    "linear_attention" or "dplr" (dplr_delta_rule_scan). ``gate``: "none", "head"
    (batch, L, Hv) or "channel" (batch, L, Hv, K); q/k heads ``heads[0]`` serve
    ``heads[1]`` value heads. The delta rule's q and k are l2-normalized by the call,
    except with a per-head gate, which passes k already of norm 0.9; that gate comes
    with a scale of 0.3 (the default K ** -0.5 otherwise). DPLR's transition is
    RWKV-7's: a = -kk, b = kk * rate, kk of norm 1 and rate in (0, 1)."""
    batch = 1 if packed else 2
    hk, hv = heads
    cu = _offsets(0, length // 3, length // 3, length)  # one of the three sequences empty
    l2norm = kind == "delta" and gate != "head"
    scale = 0.3 if gate == "head" else None

    def make(gen: torch.Generator, dtype: torch.dtype) -> Inputs:
        qk = (batch, length, hk, dk)
        k = _normal(gen, qk, dtype)
        x = {
            "q": _normal(gen, qk, dtype),
            "k": 0.9 * k / k.norm(dim=-1, keepdim=True) if kind == "delta" and not l2norm else k,
            "v": _normal(gen, (batch, length, hv, dv), dtype),
        }
        if kind == "delta":
            x["beta"] = _uniform(gen, (batch, length, hv), 0.1, 1.0, dtype)
        if kind == "dplr":
            kk = _normal(gen, qk, dtype)
            kk = kk / kk.norm(dim=-1, keepdim=True)
            x["a"], x["b"] = -kk, kk * _uniform(gen, qk, 0.0, 1.0, dtype)
        if gate != "none":
            shape = (batch, length, hv) if gate == "head" else (batch, length, hv, dk)
            x["g"] = _uniform(gen, shape, -0.3, 0.0, dtype)
        if initial:
            x["initial"] = _normal(gen, (len(cu) - 1 if packed else batch, hv, dk, dv), dtype)
        if packed:
            x["cu_seqlens"] = cu
        return x

    def run(x: Inputs, backend: str) -> Outputs:
        common: dict[str, Any] = {
            "g": x.get("g"), "scale": scale, "initial": x.get("initial"), "return_final": True,
            "cu_seqlens": x.get("cu_seqlens"), "backend": backend,
        }  # fmt: skip
        q, k, v = x["q"], x["k"], x["v"]
        if kind == "delta":
            return _pair(parascan.delta_rule_scan(q, k, v, x["beta"], qk_l2norm=l2norm, **common))
        if kind == "dplr":
            return _pair(parascan.dplr_delta_rule_scan(q, k, v, x["a"], x["b"], **common))
        return _pair(parascan.linear_attention_scan(q, k, v, **common))

    return Case(label, make, run, lambda x: _matrix_state_loop(x, scale, l2norm))


def _matrix_state_family(
    name: str, kind: str, models: tuple[str, str, str], length: int = 140
) -> Family:
    """A (K, V)-state scan: without, with one and with a decay per key channel (the
    models each form is, in ``models``), the decoding step (L = 1 from a state) and
    packed sequences; ``length`` past the longest checkpoint interval of its backends
    (canonical.py's CHECKPOINT_STEPS)."""

    def case(label: str, gate: str, **kw: Any) -> Case:
        return _matrix_state_case(label, kind, gate, **kw)

    def tiny(gen: torch.Generator) -> Inputs:
        small = case("", "channel", initial=True, length=4, heads=(1, 2), dk=2, dv=2)
        return small.make(gen, torch.float64)

    n = length
    return Family(
        name,
        f"parascan.{name}",
        (torch.float32, torch.float64),
        (
            case(f"L={n}, g None{models[0]}", "none", length=n),
            case(f"L={n}, g per head{models[1]}, initial", "head", initial=True, length=n),
            case(
                f"L={n}, g per key channel{models[2]}, initial", "channel", initial=True, length=n
            ),
            case("decoding step: L=1, g per head, initial", "head", initial=True, length=1),
            case(
                f"L={n} packed, g per key channel, initial",
                "channel",
                initial=True,
                packed=True,
                length=n,
            ),
        ),
        (Gradcheck("g per key channel, initial", tiny, case("", "channel").run),),
    )


DELTA_RULE_SCAN = _matrix_state_family(
    "delta_rule_scan", "delta", (" (DeltaNet)", " (Gated DeltaNet)", " (KDA)")
)
LINEAR_ATTENTION_SCAN = _matrix_state_family(
    "linear_attention_scan", "linear_attention", ("", " (simple GLA, RetNet)", " (GLA)")
)
DPLR_DELTA_RULE_SCAN = _matrix_state_family(
    "dplr_delta_rule_scan", "dplr", ("", "", " (RWKV-7)"), length=80
)


def _causal_conv1d(
    x: Tensor, weight: Tensor, bias: Tensor | None, silu: bool, cu_seqlens: Tensor | None
) -> Tensor:
    """``parascan.causal_conv1d`` (API.md) where the package exports it, else the
    mixers' convolution it wraps (parascan.mixer.conv), packed sequences as ids."""
    public = getattr(parascan, "causal_conv1d", None)
    activation = "silu" if silu else None
    if public is not None:
        out: Tensor = public(x, weight, bias, activation=activation, cu_seqlens=cu_seqlens)
        return out
    seq_idx = None
    if cu_seqlens is not None:
        lengths = cu_seqlens.diff().to(torch.int64)
        ids = torch.arange(len(lengths), device=x.device)
        seq_idx = ids.repeat_interleave(lengths.to(x.device))[None].to(torch.int32)
    return conv.causal_conv1d(x, weight, bias, seq_idx, silu)


def _conv_case(
    label: str,
    silu: bool,
    bias: bool,
    *,
    strided: bool = False,
    packed: bool = False,
    length: int = 37,
    channels: int = 6,
    width: int = 4,
) -> Case:
    """``strided``: x a transposed (batch, channels, L) view (the torch version; the C
    kernel takes channels of stride 1); ``packed``: three sequences by cu_seqlens."""
    batch = 1 if packed else 2
    cu = _offsets(0, length // 3, 2 * (length // 3), length)  # 1, 1 and 3 steps at L=5

    def make(gen: torch.Generator, dtype: torch.dtype) -> Inputs:
        if strided:
            xs = _normal(gen, (batch, channels, length), dtype).transpose(1, 2)
        else:
            xs = _normal(gen, (batch, length, channels), dtype)
        x = {"x": xs, "weight": _normal(gen, (channels, width), dtype)}
        if bias:
            x["bias"] = _normal(gen, (channels,), dtype)
        if packed:
            x["cu_seqlens"] = cu
        return x

    def run(x: Inputs, backend: str) -> Outputs:
        return (_causal_conv1d(x["x"], x["weight"], x.get("bias"), silu, x.get("cu_seqlens")),)

    return Case(label, make, run, lambda x: _conv_loop(x, silu))


CAUSAL_CONV1D = Family(
    "causal_conv1d",
    None,
    (torch.float32, torch.float64),
    (
        _conv_case("silu, bias", True, True),
        _conv_case("no activation, strided x", False, False, strided=True),
        _conv_case("packed, silu, bias", True, True, packed=True),
    ),
    (
        Gradcheck(
            "silu, bias",
            lambda gen: _conv_case("", True, True, length=5, channels=2, width=3).make(
                gen, torch.float64
            ),
            _conv_case("", True, True).run,
        ),
        Gradcheck(
            "packed",
            lambda gen: _conv_case("", True, True, packed=True, length=5, channels=2).make(
                gen, torch.float64
            ),
            _conv_case("", True, True, packed=True, length=5).run,
        ),
    ),
)


def _step_case(label: str, heads: bool, batch: int = 2, units: int = 4, n: int = 3) -> Case:
    """One decoding step: Mamba-1's layout (state (batch, dim, N), B (batch, N), C
    (batch, 2, N)) or the multi-head one of Mamba-2 (state (batch, heads, headdim, N),
    A, dt and dt_bias one per head, broadcast over headdim as Mamba-2 passes them; B, C
    (batch, 2, N)); D, z, dt_bias, softplus. The state is updated in place: ``run``
    updates a copy and returns it after the output."""
    headdim = 3

    def make(gen: torch.Generator, dtype: torch.dtype) -> Inputs:
        lead = (units, headdim) if heads else (units,)
        x = {"state": _normal(gen, (batch, *lead, n), dtype)}
        x["x"] = _normal(gen, (batch, *lead), dtype)
        if heads:
            x["dt"] = _uniform(gen, (batch, units, 1), 0.0, 0.5, dtype).expand(batch, *lead)
            A = -_uniform(gen, (units, 1, 1), 0.5, 1.5, dtype)
            x["A"] = A.expand(*lead, n)
            x["dt_bias"] = (_normal(gen, (units, 1), dtype) / 2).expand(lead)
        else:
            x["dt"] = _uniform(gen, (batch, *lead), 0.0, 0.5, dtype)
            x["A"] = -_uniform(gen, (*lead, n), 0.5, 1.5, dtype)
            x["dt_bias"] = _normal(gen, lead, dtype) / 2
        x["B"] = _normal(gen, (batch, 2, n) if heads else (batch, n), dtype)
        x["C"] = _normal(gen, (batch, 2, n), dtype)
        x["D"] = _normal(gen, lead, dtype)
        x["z"] = _normal(gen, (batch, *lead), dtype)
        return x

    def run(x: Inputs, backend: str) -> Outputs:
        state = x["state"].clone()
        y = parascan.selective_state_update(
            state, x["x"], x["dt"], x["A"], x["B"], x["C"], x["D"], x["z"], x["dt_bias"], True
        )
        return y, state

    return Case(label, make, run, lambda x: _step_loop(x, True))


SELECTIVE_STATE_UPDATE = Family(
    "selective_state_update",
    None,
    (torch.float32, torch.float64),
    (
        _step_case("Mamba-1 layout, D, z, dt_bias, softplus", False),
        _step_case("multi-head layout (SSD step), D, z, dt_bias, softplus", True),
    ),
    (
        Gradcheck(
            "Mamba-1 layout",
            lambda gen: _step_case("", False, 1, 2, 2).make(gen, torch.float64),
            _step_case("", False).run,
        ),
        Gradcheck(
            "multi-head layout",
            lambda gen: _step_case("", True, 1, 2, 2).make(gen, torch.float64),
            _step_case("", True).run,
        ),
    ),
)

# Every family `parascan check` covers, in the order it prints them: one entry each.
FAMILIES: tuple[Family, ...] = (
    LINEAR_SCAN,
    LOG_LINEAR_SCAN,
    MATRIX_LINEAR_SCAN,
    ASSOCIATIVE_SCAN,
    ASSOCIATIVE_REDUCE,
    SELECTIVE_SCAN,
    SSD_SCAN,
    DELTA_RULE_SCAN,
    LINEAR_ATTENTION_SCAN,
    DPLR_DELTA_RULE_SCAN,
    CAUSAL_CONV1D,
    SELECTIVE_STATE_UPDATE,
)


# ---- the driver --------------------------------------------------------------------------


def _differentiable(t: Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _error(got: Tensor, want: Tensor) -> float:
    """relative_error, infinite for a shape that differs or a NaN anywhere."""
    if got.shape != want.shape:
        return math.inf
    err = relative_error(got.detach().cpu(), want.detach())
    return math.inf if math.isnan(err) else err


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


def _grads(outputs: Outputs, upstream: Outputs, inputs: list[Tensor]) -> list[Tensor | None]:
    """The gradients of ``inputs`` for the upstream gradients of ``outputs`` (None for
    an input no output depends on; outputs that depend on no input are left out)."""
    pairs = [(o, u) for o, u in zip(outputs, upstream, strict=True) if o.requires_grad]
    if not pairs:
        return [None] * len(inputs)
    found = torch.autograd.grad(
        [o for o, _ in pairs], inputs, [u for _, u in pairs], allow_unused=True
    )
    return list(found)


@dataclass
class _Reference:
    inputs: Inputs
    outputs: Outputs
    upstream: Outputs | None  # the upstream gradients of the outputs (wide dtypes only)
    grads: dict[str, Tensor]  # the loop's gradient of each differentiable input


def _reference(case: Case, seed: int, dtype: torch.dtype) -> _Reference:
    inputs = case.make(torch.Generator().manual_seed(seed), dtype)
    with_grads = dtype in _WIDE
    leaves = {
        k: v.detach().to(_wide(v.dtype)).requires_grad_(with_grads) if _differentiable(v) else v
        for k, v in inputs.items()
    }
    with torch.set_grad_enabled(with_grads):
        outputs = case.loop(leaves)
    if not with_grads:
        return _Reference(inputs, outputs, None, {})
    gen = torch.Generator().manual_seed(seed + 1000)
    upstream = tuple(_normal(gen, o.shape, o.dtype) for o in outputs)
    names = [k for k, v in leaves.items() if _differentiable(v)]
    found = _grads(outputs, upstream, [leaves[k] for k in names])
    grads = {
        k: torch.zeros_like(leaves[k]) if g is None else g
        for k, g in zip(names, found, strict=True)
    }
    return _Reference(inputs, tuple(o.detach() for o in outputs), upstream, grads)


def _compare(case: Case, ref: _Reference, backend: str, device: str) -> float:
    """The case's largest relative error on ``backend``: its outputs under no_grad (the
    kernels' inference paths), and, when the reference has gradients, the outputs and
    every input's gradient of a differentiated call."""
    inputs = {k: v.to(device) for k, v in ref.inputs.items()}
    with torch.no_grad():
        got = case.run(inputs, backend)
    err = max((_error(g, w) for g, w in zip(got, ref.outputs, strict=True)), default=0.0)
    if ref.upstream is None:
        return err
    leaves = {k: v.detach().requires_grad_() if k in ref.grads else v for k, v in inputs.items()}
    got = case.run(leaves, backend)
    err = max([err, *(_error(g, w) for g, w in zip(got, ref.outputs, strict=True))])
    names = list(ref.grads)
    upstream = tuple(u.to(device) for u in ref.upstream)
    found = _grads(got, upstream, [leaves[k] for k in names])
    for name, g in zip(names, found, strict=True):
        got_grad = torch.zeros_like(leaves[name]) if g is None else g
        err = max(err, _error(got_grad, ref.grads[name]))
    return err


def _family_backends(
    family: Family, device: str, only: Sequence[str] | None = None
) -> list[tuple[str, tuple[torch.dtype, ...]]]:
    """(backend, the dtypes it takes) of every backend of the family on ``device`` (of
    those in ``only``, when given); ("-", the family's dtypes) for a function without
    backends."""
    if family.op is None:
        return [("-", family.dtypes)]
    row = table()[family.op]
    names = [b for b in backends(device) if b in row.backends and (only is None or b in only)]
    return [(b, row.backends[b].dtypes) for b in names]


def _forward_rows(
    family: Family, device: str, only: Sequence[str] | None = None
) -> Iterator[CheckResult]:
    names = _family_backends(family, device, only)
    if not names:
        return
    for dtype in family.dtypes:
        what = str(dtype).removeprefix("torch.")
        refs = [_reference(case, seed, dtype) for seed, case in enumerate(family.cases)]
        tol = TOLERANCE[dtype][1]
        for backend, taken in names:
            if dtype not in taken:
                yield CheckResult(family.name, what, backend, True, "dtype not taken", ran=False)
                continue
            worst, where, failed = 0.0, "", []
            for case, ref in zip(family.cases, refs, strict=True):
                try:
                    err = _compare(case, ref, backend, device)
                except Exception as exc:  # a crash is a failure of this row, not of the check
                    failed.append(f"{case.label}: {_first_line(exc)}")
                    continue
                if err > tol:
                    failed.append(f"{case.label}: {err:.1e} > {tol:.0e}")
                if err >= worst:
                    worst, where = err, case.label
            compared = "outputs and gradients" if dtype in _WIDE else "outputs"
            detail = (
                f"max rel err {worst:.1e} (tol {tol:.0e}), {compared}; worst of "
                f"{len(family.cases)}: {where}"
            )
            if failed:
                detail = "; ".join(failed)
            yield CheckResult(family.name, what, backend, not failed, detail)


def _gradcheck(
    fn: Callable[..., Outputs], args: tuple[Tensor, ...], second: bool
) -> tuple[bool, str]:
    try:
        ok = torch.autograd.gradcheck(fn, args, fast_mode=True)
        if second:
            ok = ok and torch.autograd.gradgradcheck(fn, args, fast_mode=True)
        return ok, "gradcheck + gradgradcheck" if second else "gradcheck"
    except Exception as exc:  # gradcheck raises on a mismatch: report it, do not crash
        return False, _first_line(exc)


def _gradcheck_rows(
    family: Family, device: str, only: Sequence[str] | None = None
) -> Iterator[CheckResult]:
    for backend, _ in _family_backends(family, device, only):
        problems, done = [], ""
        for check in family.gradchecks:
            inputs = check.make(torch.Generator().manual_seed(99))
            names = [k for k, v in inputs.items() if _differentiable(v)]
            fixed = {k: v.to(device) for k, v in inputs.items() if k not in names}

            def fn(*args: Tensor, check: Gradcheck = check, names: list[str] = names,
                   fixed: Inputs = fixed, backend: str = backend) -> Outputs:  # fmt: skip
                return check.run({**fixed, **dict(zip(names, args, strict=True))}, backend)

            # gradcheck perturbs its inputs in place: no broadcast (stride 0) views
            args = tuple(inputs[k].contiguous().to(device).requires_grad_() for k in names)
            ok, done = _gradcheck(fn, args, family.second_order)
            if not ok:
                problems.append(f"{check.label}: {done}")
        labels = ", ".join(c.label for c in family.gradchecks)
        detail = "; ".join(problems) if problems else f"{done} ({labels})"
        yield CheckResult(family.name, "gradcheck", backend, not problems, detail)


def family_names() -> list[str]:
    return [f.name for f in FAMILIES]


def default_devices() -> list[str]:
    """The devices ``parascan check`` checks unless told: cpu, and cuda when present."""
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def run_check(
    devices: list[str] | None = None,
    out: TextIO | None = None,
    families: Sequence[str] | None = None,
    backend_names: Sequence[str] | None = None,
) -> int:
    """Check ``families`` (default: all of FAMILIES) on ``devices`` (default: cpu, and
    cuda when there is one) and ``backend_names`` (default: every backend the device
    has; a function without a backend argument runs regardless), printing a row per
    family, dtype and backend and one per family and backend for gradcheck, each as
    soon as it is known. Returns 1 when any check failed, else 0."""
    out = sys.stdout if out is None else out  # at call time: pytest's capsys swaps it
    devices = devices or default_devices()
    chosen = [f for f in FAMILIES if families is None or f.name in families]
    only = None if not backend_names else (*backend_names, "-")
    failures = 0
    line = "{:<24}{:<12}{:<8}{:<9}{:<8}{}"
    print(line.format("family", "check", "device", "backend", "result", "detail"), file=out)
    for device in devices:
        for family in chosen:
            if family.op is not None and family.op not in table():
                why = f"{family.op} is not in this build's backend table"
                print(line.format(family.name, "-", device, "-", "n/a", why), file=out)
                continue
            for rows in (
                _forward_rows(family, device, only),
                _gradcheck_rows(family, device, only),
            ):
                for r in rows:
                    failures += not r.passed
                    status = "n/a" if not r.ran else "ok" if r.passed else "FAILED"
                    print(line.format(r.family, r.what, device, r.backend, status, r.detail),
                          file=out, flush=True)  # fmt: skip
    print(f"\n{'all checks passed' if failures == 0 else f'{failures} checks FAILED'}", file=out)
    return 1 if failures else 0
