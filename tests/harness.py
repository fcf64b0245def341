"""The harness: any op against its float64 oracle on the standard lengths, layouts and
dtypes, on every target (backend and device, conftest.targets).

An op is described once by an ``OpSpec``: how to draw its inputs, how to call it,
its oracle (oracles.py), the layouts it is checked on, its dtypes and which
(target, dtype) pairs it does not support. ``grid(spec)`` lists the cases and
``check(case)`` runs one:

- outputs and final states against the oracle run in float64 / complex128 on the
  same (already rounded) inputs, with the one tolerance table (conftest.assert_matches);
  the result has the input dtype and is contiguous;
- every gradient, of a random linear loss of all outputs, against autograd through
  the oracle, each reduced to its input's own shape;
- the inputs are left as they were;
- an unsupported (target, dtype) pair raises the contract's RuntimeError naming the
  op and the backend, before any kernel runs.

Lengths: T in {0, 1, 2, 3, 17, 33, 63, 64, 65, 127, 257, 1031 (a prime, past many
tiles)} and on and around the kernels' real block constants, read from the built
library (``kernel_constants()``): around the time tile (TILE) and two tiles; row
counts one past the time-contiguous kernels' row group (ROWS + 1) and channel counts
one past the time-major kernels' channel block (BLOCK + 1). The long-row constants
(LONG_*) need lengths of 2**16 and more: first_order/test_long_rows.py places lengths
there. (The generic scans, which have no C kernel, take GENERIC_LENGTHS.)

Layouts: time-major, time-contiguous (dim=-1) and a positive dim; transposed,
strided (each element beside a NaN it must never read), lazily conjugated and
negative views; broadcast shapes and stride-0 (expanded) inputs; negative dims.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree

import parascan as ps
from parascan._native import kernel_constants

from conftest import (
    DTYPES,
    Target,
    assert_matches,
    oracle_dtype,
    oracle_threads,
    random_gates,
    random_tokens,
    targets,
)
from oracles import fold, fold_scan, linear_loop, log_loop, matrix_loop

REAL = [torch.float32, torch.float64]
COMPLEX = [torch.complex64, torch.complex128]

# ---------------------------------------------------------------------------------------
# Lengths and sizes, from the kernels' own constants
# ---------------------------------------------------------------------------------------


@functools.cache
def constants() -> dict[str, int]:
    """The C kernels' block constants (``kernel_constants()``); empty when the
    library is not built (native/test_kernel_constants.py fails the run then, and
    the sizes below fall back to small ones of no meaning to any kernel)."""
    try:
        return kernel_constants()
    except Exception:
        return {}


def _constant(name: str, fallback: int) -> int:
    return constants().get(name, fallback)


def standard_lengths() -> list[int]:
    tile = _constant("TILE", 5)
    around = [tile - 1, tile, tile + 1, 2 * tile - 1, 2 * tile + 1]
    return sorted({0, 1, 2, 3, 17, 33, 63, 64, 65, 127, 257, 1031, *around})


def rows() -> int:
    """Rows of a time-contiguous layout: one full row group and one more."""
    return _constant("ROWS", 2) + 1


def wide() -> int:
    """Channels of a time-major layout: one past the channel block."""
    return _constant("BLOCK", 40) + 1


def one_past_a_tile() -> int:
    return _constant("TILE", 5) + 1


# The Triton interpreter runs a kernel step by step in Python: a few short lengths;
# T = 33 already spans several of the Triton kernels' chunks (the carry pass between
# them).
INTERPRETER_LENGTHS = (0, 1, 2, 3, 17, 33)

# (reverse, initial) of a layout's i-th length: every combination over a few lengths.
FIRST_ORDER_VARIANTS = ((False, False), (True, True), (False, True), (True, False))

# ---------------------------------------------------------------------------------------
# Layouts: shapes with "T" for the time length, and the memory each input is read from
# ---------------------------------------------------------------------------------------

Shape = tuple[int | str, ...]


@dataclass(frozen=True)
class Layout:
    """Input name -> shape (with ``"T"`` for time; None: the input is not given) and
    the views each input is handed over as (see ``_encode``), the time ``dim``, and
    its own lengths (None: the op's standard lengths)."""

    name: str
    shapes: Mapping[str, Shape | None]
    dim: int = 0
    views: Mapping[str, Sequence[str]] = field(default_factory=dict)
    lengths: Callable[[], Sequence[int]] | None = None
    # The lengths the Triton interpreter runs by default; the rest of
    # INTERPRETER_LENGTHS (up to the layout's own lengths) run under -m slow.
    interpreter: tuple[int, ...] = ()
    # Lengths whose cases cost seconds each (the oracle's loop over many steps of many
    # channels): in the default suite in float32 only, every dtype under -m slow.
    heavy: tuple[int, ...] = ()

    def shape(self, name: str, steps: int) -> tuple[int, ...] | None:
        template = self.shapes.get(name)
        if template is None:
            return None
        return tuple(steps if s == "T" else s for s in template)  # type: ignore[misc]


def _encode(
    kind: str, value: torch.Tensor, shape: tuple[int, ...]
) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """(memory, view): ``view(memory)`` equals ``value`` (expanded to ``shape``) and is
    a view of ``kind``. The view is differentiable: gradients flow back to memory."""
    if kind == "transposed" and value.dim() >= 2:  # first and last dims swapped
        return value.transpose(0, -1).contiguous(), lambda m: m.transpose(0, -1)
    if kind == "mT":  # column-major matrices
        return value.mT.contiguous(), lambda m: m.mT
    if kind == "strided":  # every other element; the ones between are NaN
        return torch.stack([value, torch.full_like(value, math.nan)], -1), lambda m: m[..., 0]
    if kind == "conj" and value.is_complex():  # a lazy conjugate view
        return value.conj().resolve_conj(), torch.conj
    if kind == "neg":  # a lazy negative view: the memory holds -value
        return -value, lambda m: m._neg_view()
    if kind == "expand0":  # stride 0 along the first dim (drawn with size 1 there)
        return value, lambda m: m.expand(shape)
    return value, lambda m: m


def _memory(
    kinds: Sequence[str], value: torch.Tensor, shape: tuple[int, ...]
) -> tuple[torch.Tensor, Callable[[torch.Tensor], torch.Tensor]]:
    """``_encode`` of each kind in turn; the view undoes them in reverse order."""
    views = []
    for kind in kinds:
        value, view = _encode(kind, value, shape)
        views.append(view)
    return value, lambda m: functools.reduce(lambda x, v: v(x), reversed(views), m)


# ---------------------------------------------------------------------------------------
# Ops
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    spec: OpSpec
    target: Target
    dtype: torch.dtype
    layout: Layout
    steps: int
    reverse: bool = False
    initial: bool = False

    def __str__(self) -> str:
        parts = [
            *([self.spec.label] if self.spec.label else []),
            str(self.target), str(self.dtype).removeprefix("torch."), self.layout.name,
            f"T{self.steps}", *(["reverse"] if self.reverse else []),
            *(["initial"] if self.initial else []),
        ]  # fmt: skip
        if not self.spec.supports(self.target, self.dtype):
            parts.append("unsupported")
        return "-".join(parts)


@dataclass(frozen=True)
class OpSpec:
    """One op as the harness sees it.

    values(name, shape, dtype, gen): a float64 / complex128 input at ``dtype``'s values.
    run(inputs, case): the op on the inputs (a dict by name), a tuple of tensors.
    oracle(inputs, case): the same from oracles.py, on float64 / complex128 inputs.
    observe(output, case): what is compared and differentiated of the op's output
    (for complex logs: exp, since a log's phase is defined modulo 2 pi).
    supports(target, dtype): False where the op must raise RuntimeError instead.
    """

    name: str
    values: Callable[[str, tuple[int, ...], torch.dtype, torch.Generator], torch.Tensor]
    run: Callable[[dict[str, torch.Tensor], Case], tuple[torch.Tensor, ...]]
    oracle: Callable[[dict[str, torch.Tensor], Case], tuple[torch.Tensor, ...]]
    layouts: tuple[Layout, ...]
    dtypes: tuple[torch.dtype, ...] = tuple(DTYPES)
    supports: Callable[[Target, torch.dtype], bool] = lambda target, dtype: True
    observe: Callable[[torch.Tensor, Case], torch.Tensor] = lambda out, case: out
    variants: tuple[tuple[bool, bool], ...] = FIRST_ORDER_VARIANTS
    backends: tuple[str, ...] | None = None  # None: takes no backend argument
    lengths: Callable[[], Sequence[int]] = standard_lengths
    min_steps: int = 0
    contiguous: bool = True  # the contract promises a contiguous result
    label: str = ""  # what tells cases of specs with the same name apart
    # Lengths from this one on run in the default suite in float32 only, every dtype
    # under -m slow (None: every length in every dtype).
    long_from: int | None = None

    def targets(self) -> list[Target]:
        if self.backends is None:  # one target per device, the op's own choice
            devices = dict.fromkeys(t.device for t in targets())
            return [Target("auto", device) for device in devices]
        return targets(backends=self.backends, interpreter=True)


def grid(spec: OpSpec) -> list[Any]:
    """Every case of ``spec``, as pytest parameters with readable ids; the Triton
    interpreter's longer cases, and but in float32 the interpreter's cases past one
    step, a layout's heavy lengths and the lengths from ``spec.long_from`` on, are
    marked slow (the default suite's 10 minutes on 2 cores: ``pytest -m slow`` runs
    them)."""
    params = []
    for target in spec.targets():
        for dtype in spec.dtypes:
            if not spec.supports(target, dtype):
                case = Case(spec, target, dtype, spec.layouts[0], 3)
                params.append(pytest.param(case, id=str(case)))
                continue
            for layout in spec.layouts:
                lengths = [n for n in (layout.lengths or spec.lengths)() if n >= spec.min_steps]
                slow: set[int] = set()
                if target.interpreted:
                    if not layout.interpreter:
                        continue
                    short = INTERPRETER_LENGTHS if layout.lengths is None else lengths
                    lengths = [n for n in short if n <= max(INTERPRETER_LENGTHS)]
                    slow = set(lengths) - set(layout.interpreter)
                for i, steps in enumerate(lengths):
                    reverse, initial = spec.variants[i % len(spec.variants)]
                    initial = initial and layout.shapes.get("initial") is not None
                    case = Case(spec, target, dtype, layout, steps, reverse, initial)
                    # the interpreter's longest case and those past one step run in
                    # float32 by default; the other dtypes' (1 to 4 s each) with the
                    # slow tests
                    longer = target.interpreted and (steps == max(lengths) or steps > 1)
                    long = spec.long_from is not None and steps >= spec.long_from
                    heavy = longer or long or steps in layout.heavy
                    heavy = heavy and dtype != torch.float32
                    # and 17 steps (one past a block) there: 33 crosses two
                    heavy = heavy or (target.interpreted and steps == 17)
                    marks = [pytest.mark.slow] if steps in slow or heavy else []
                    params.append(pytest.param(case, id=str(case), marks=marks))
    return params


def _inputs(case: Case, gen: torch.Generator) -> dict[str, Any]:
    """(memory, view) per input name: float64 / complex128 memory holding values of
    the case's dtype, and the view each input is handed over as."""
    found = {}
    for name in case.layout.shapes:
        shape = case.layout.shape(name, case.steps)
        if shape is None or (name == "initial" and not case.initial):
            continue
        kinds = case.layout.views.get(name, ())
        drawn = (1, *shape[1:]) if "expand0" in kinds else shape
        value = case.spec.values(name, drawn, case.dtype, gen).to(case.dtype)
        found[name] = _memory(kinds, value.to(oracle_dtype(case.dtype)), shape)
    return found


def _gradients(loss: Any, inputs: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """d loss / d inputs; zeros where the loss does not depend on an input (an empty
    output, say, need not be connected to the inputs at all)."""
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad:
        return tuple(torch.zeros_like(t) for t in inputs)
    return torch.autograd.grad(loss, inputs, allow_unused=True, materialize_grads=True)


def check(case: Case, gen: torch.Generator) -> None:
    """One case: see the module docstring."""
    spec, target, dtype = case.spec, case.target, case.dtype
    memory = _inputs(case, gen)
    device = torch.device(target.device)
    if not spec.supports(target, dtype):
        inputs = {k: view(m.to(device, dtype)) for k, (m, view) in memory.items()}
        pattern = rf"^parascan\.{spec.name}: backend '{target.backend}' is not available"
        with pytest.raises(RuntimeError, match=pattern):
            spec.run(inputs, case)
        return

    mine = {k: m.to(device, dtype).requires_grad_() for k, (m, _) in memory.items()}
    high = {k: m.clone().requires_grad_() for k, (m, _) in memory.items()}
    before = {k: m.detach().clone() for k, m in mine.items()}
    got = spec.run({k: memory[k][1](m) for k, m in mine.items()}, case)
    with oracle_threads():
        want = spec.oracle({k: memory[k][1](m) for k, m in high.items()}, case)
    assert len(got) == len(want)
    observed = []
    for out, ref in zip(got, want, strict=True):
        assert out.dtype == dtype, (out.dtype, dtype)
        assert out.device.type == device.type
        assert out.is_contiguous() or not spec.contiguous
        observed.append(spec.observe(out, case))
        assert_matches(observed[-1], ref, dtype)

    # Weights drawn in the case's dtype, so that both sides take the same numbers.
    weights = [random_tokens(tuple(ref.shape), dtype, gen) for ref in want]
    loss = sum((o * w.to(o.device)).real.sum() for o, w in zip(observed, weights, strict=True))
    ref_loss = sum((r * w.to(r.dtype)).real.sum() for r, w in zip(want, weights, strict=True))
    grads = _gradients(loss, list(mine.values()))
    with oracle_threads():
        ref_grads = _gradients(ref_loss, list(high.values()))
    for name, g, ref in zip(mine, grads, ref_grads, strict=True):
        assert g.shape == mine[name].shape, name
        assert_matches(g, ref, dtype)  # 0 for the NaN memory between strided elements
    for name, m in mine.items():  # unchanged, NaN memory included
        torch.testing.assert_close(m.detach(), before[name], rtol=0, atol=0, equal_nan=True)


# ---------------------------------------------------------------------------------------
# The ops of parascan
# ---------------------------------------------------------------------------------------


def _first_order_layouts() -> tuple[Layout, ...]:
    r, c = rows(), 19  # 19 channels: 16 and a tail of 3, for every vector width
    short = lambda: [0, 1, one_past_a_tile(), 2 * one_past_a_tile() - 1]  # noqa: E731
    broadcast = [  # (gates, tokens, initial, dim): gradients reduce to each input's shape
        ("one gate", (), (4, "T", 5), (5,), 1),
        ("gate per step", ("T", 1), (4, "T", 5), (5,), 1),
        ("gate per channel", (5,), (4, "T", 5), (4, 1), -2),
        ("tokens shared", (4, "T", 5), ("T", 5), (), -2),
        ("both broadcast", (4, 1, 5), (1, "T", 1), (4, 5), 1),
        ("no initial", (6, 1), (6, "T"), None, 1),
    ]
    return (
        Layout(
            "time-major",
            {"gates": (2, "T", c), "tokens": (2, "T", c), "initial": (2, c)},
            1,
            interpreter=(0, 1, 2, 3),
        ),
        Layout(
            "time-contiguous",
            {"gates": (r, "T"), "tokens": (r, "T"), "initial": (r,)},
            -1,
            interpreter=INTERPRETER_LENGTHS,
        ),
        Layout(
            "time-contiguous-3d",
            {"gates": (2, r, "T"), "tokens": (2, r, "T"), "initial": (2, r)},
            2,
        ),
        Layout(
            "channel-block",
            {"gates": (1, "T", wide()), "tokens": (1, "T", wide()), "initial": (1, wide())},
            -2,
            # 33 steps: enough elements for the kernels to use several threads
            lengths=lambda: [1, 2, 33],
            heavy=(33,),
        ),
        Layout(
            "strided",
            {"gates": (6, "T"), "tokens": (6, "T"), "initial": (6,)},
            -1,
            views={"gates": ("transposed", "conj"), "tokens": ("strided",), "initial": ("neg",)},
            lengths=short,
            interpreter=(0, 1),
        ),
        Layout(
            "expanded",
            {"gates": (3, "T", 5), "tokens": (3, "T", 5), "initial": (3, 5)},
            -2,
            views={"gates": ("expand0",), "initial": ("expand0",)},
            lengths=lambda: [1, one_past_a_tile()],
            interpreter=(1,),
        ),
        *(
            Layout(
                f"broadcast {name}",
                {"gates": a, "tokens": b, "initial": h},
                dim,
                lengths=lambda: [1, 2, 37],
            )
            for name, a, b, h, dim in broadcast
        ),
    )


# T = 257 and 1031 (4 and 16 time tiles: a second each in the loops) in float32 by
# default; every dtype crosses one and two tiles (63 to 129 steps).
FIRST_ORDER_LONG = 257


def _first_order_values(name, shape, dtype, gen):  # type: ignore[no-untyped-def]
    return (random_gates if name == "gates" else random_tokens)(shape, dtype, gen)


def _run_linear(inputs, case):  # type: ignore[no-untyped-def]
    return ps.linear_scan(
        inputs["gates"], inputs["tokens"], case.layout.dim, initial=inputs.get("initial"),
        reverse=case.reverse, return_final=True, backend=case.target.backend,
    )  # fmt: skip


def _linear_oracle(inputs, case):  # type: ignore[no-untyped-def]
    return linear_loop(
        inputs["gates"], inputs["tokens"], case.layout.dim, inputs.get("initial"), case.reverse
    )


LINEAR_SCAN = OpSpec(
    name="linear_scan",
    values=_first_order_values,
    run=_run_linear,
    oracle=_linear_oracle,
    layouts=_first_order_layouts(),
    backends=("cpu", "triton", "torch", "loop"),
    long_from=FIRST_ORDER_LONG,
)


def _log_values(name, shape, dtype, gen):  # type: ignore[no-untyped-def]
    """Logs of |gates| in [0.5, 1) and of tokens: real logs of positive values (any
    real number), or complex logs of complex (so also negative) values."""
    if name == "gates":
        return random_gates(shape, oracle_dtype(dtype), gen).log()
    tokens = random_tokens(shape, oracle_dtype(dtype), gen)
    return tokens.log() if dtype.is_complex else tokens


def _run_log(inputs, case):  # type: ignore[no-untyped-def]
    return ps.log_linear_scan(
        inputs["gates"], inputs["tokens"], case.layout.dim, initial=inputs.get("initial"),
        reverse=case.reverse, return_final=True, backend=case.target.backend,
    )  # fmt: skip


def _log_oracle(inputs, case):  # type: ignore[no-untyped-def]
    """Real: the log-space loop. Complex: the linear loop of the exponentials, which
    the op's exp(h) is compared with."""
    a, b, h = inputs["gates"], inputs["tokens"], inputs.get("initial")
    if a.is_complex():
        return linear_loop(a.exp(), b.exp(), case.layout.dim, None if h is None else h.exp(),
                           case.reverse)  # fmt: skip
    return log_loop(a, b, case.layout.dim, h, case.reverse)


LOG_LINEAR_SCAN = OpSpec(
    name="log_linear_scan",
    values=_log_values,
    run=_run_log,
    oracle=_log_oracle,
    observe=lambda out, case: out.exp() if out.is_complex() else out,
    layouts=_first_order_layouts(),
    backends=("cpu", "triton", "torch", "loop"),
    long_from=FIRST_ORDER_LONG,
    # the Triton kernels take real logs only
    supports=lambda target, dtype: not (target.backend == "triton" and dtype.is_complex),
)


def _matrix_values(name, shape, dtype, gen):  # type: ignore[no-untyped-def]
    """Weights scaled to keep the states bounded; biases and initial states N(0, 1)."""
    if name != "weights":
        return random_tokens(shape, dtype, gen).to(oracle_dtype(dtype))
    d = shape[-1]
    w = torch.randn(shape, generator=gen, dtype=torch.float64) / (1.2 * d**0.5)
    if dtype.is_complex:
        imag = torch.randn(shape, generator=gen, dtype=torch.float64) / (1.2 * d**0.5)
        w = torch.complex(w, imag) / 2**0.5
    return w


def _run_matrix(inputs, case):  # type: ignore[no-untyped-def]
    return ps.matrix_linear_scan(
        inputs["weights"], inputs["biases"], initial=inputs.get("initial"),
        reverse=case.reverse, return_final=True, backend=case.target.backend,
    )  # fmt: skip


def _matrix_oracle(inputs, case):  # type: ignore[no-untyped-def]
    return matrix_loop(inputs["weights"], inputs["biases"], inputs.get("initial"), case.reverse)


def _matrix_layouts() -> tuple[Layout, ...]:
    d = 5
    short = lambda: [0, 1, one_past_a_tile()]  # noqa: E731
    return (
        Layout("one sequence", {"weights": ("T", d, d), "biases": ("T", d), "initial": (d,)}),
        Layout(
            "broadcast batch",
            {"weights": (2, 1, "T", d, d), "biases": (3, "T", d), "initial": (2, 3, d)},
            lengths=short,
        ),
        Layout(
            "shared weights",
            {"weights": ("T", d, d), "biases": (4, "T", d), "initial": (4, 1)},
            lengths=short,
        ),
        Layout(
            "transposed",
            {"weights": (2, "T", d, d), "biases": (2, "T", d), "initial": (2, d)},
            views={"weights": ("mT",), "biases": ("transposed",), "initial": ("neg",)},
            lengths=short,
        ),
        Layout(
            "expanded",
            {"weights": (3, "T", d, d), "biases": (3, "T", d), "initial": (3, d)},
            views={"weights": ("expand0",)},
            lengths=short,
        ),
    )


MATRIX_LINEAR_SCAN = OpSpec(
    name="matrix_linear_scan",
    values=_matrix_values,
    run=_run_matrix,
    oracle=_matrix_oracle,
    layouts=_matrix_layouts(),
    backends=("cpu", "triton", "torch", "loop"),
    # no Triton kernel; the C kernel takes real dtypes
    supports=lambda target, dtype: (
        target.backend != "triton" and not (target.backend == "cpu" and dtype.is_complex)
    ),
)


# --- associative_scan and associative_reduce, one spec per combine function -------------


def first_order(x, y):  # type: ignore[no-untyped-def]
    """(a, b) pairs of x[t] = a[t] x[t-1] + b[t]."""
    return x[0] * y[0], y[0] * x[1] + y[1]


def affine(x, y):  # type: ignore[no-untyped-def]
    """(W, b) pairs of x[t] = W[t] x[t-1] + b[t]: apply x, then y."""
    (w1, b1), (w2, b2) = x, y
    return w2 @ w1, (w2 @ b1.unsqueeze(-1)).squeeze(-1) + b2


def quaternion(p, q):  # type: ignore[no-untyped-def]
    """Hamilton product over the last dim (w, x, y, z): associative, not commutative."""
    a1, b1, c1, d1 = p.unbind(-1)
    a2, b2, c2, d2 = q.unbind(-1)
    return torch.stack(
        [
            a1 * a2 - b1 * b2 - c1 * c2 - d1 * d2,
            a1 * b2 + b1 * a2 + c1 * d2 - d1 * c2,
            a1 * c2 - b1 * d2 + c1 * a2 + d1 * b2,
            a1 * d2 + b1 * c2 - c1 * b2 + d1 * a2,
        ],
        -1,
    )


def first_order_dict(x, y):  # type: ignore[no-untyped-def]
    a, b = first_order((x["gate"], x["state"][0]), (y["gate"], y["state"][0]))
    return {"gate": a, "state": [b]}


@dataclass(frozen=True)
class Combine:
    """A combine function, its operands (shapes with "T", dim), how its elements are
    drawn, how the dict of inputs becomes the pytree it takes, and its dtypes."""

    fn: Callable[[Any, Any], Any]
    shapes: Mapping[str, Shape]
    dim: int
    draw: Callable[[str, tuple[int, ...], torch.Generator], torch.Tensor]
    tree: Callable[[dict[str, torch.Tensor]], Any] = lambda x: x["x"]
    dtypes: tuple[torch.dtype, ...] = (*REAL, *COMPLEX)


def _normal(scale: float = 1.0):  # type: ignore[no-untyped-def]
    return lambda name, shape, gen: torch.randn(shape, generator=gen, dtype=torch.float64) / scale


def _pair_draw(name, shape, gen):  # type: ignore[no-untyped-def]
    if name in ("a", "gate"):
        return torch.rand(shape, generator=gen, dtype=torch.float64) * 1.8 - 0.9
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def _quaternion_draw(name, shape, gen):  # type: ignore[no-untyped-def]
    q = torch.randn(shape, generator=gen, dtype=torch.float64)
    return q / q.norm(dim=-1, keepdim=True)


def _affine_draw(name, shape, gen):  # type: ignore[no-untyped-def]
    return torch.randn(shape, generator=gen, dtype=torch.float64) / (2 if name == "w" else 1)


COMBINES: dict[str, Combine] = {
    "add": Combine(torch.add, {"x": (3, "T", 2)}, 1, _normal()),
    "max": Combine(torch.maximum, {"x": (4, "T")}, -1, _normal(), dtypes=tuple(REAL)),
    "logaddexp": Combine(torch.logaddexp, {"x": ("T", 300)}, 0, _normal(), dtypes=tuple(REAL)),
    "matmul": Combine(torch.matmul, {"x": ("T", 5, 5)}, 0, _normal(2.2)),
    "matmul_batched": Combine(torch.matmul, {"x": (2, "T", 9, 9)}, 1, _normal(3.0)),
    "affine": Combine(
        affine, {"w": (2, "T", 4, 4), "b": (2, "T", 4)}, 1, _affine_draw,
        tree=lambda x: (x["w"], x["b"]),
    ),
    "quaternion": Combine(quaternion, {"x": ("T", 4)}, 0, _quaternion_draw, dtypes=tuple(REAL)),
    "first_order": Combine(
        first_order, {"a": (3, 2, "T"), "b": (3, 2, "T")}, -1, _pair_draw,
        tree=lambda x: (x["a"], x["b"]),
    ),
    "first_order_time_major": Combine(
        first_order, {"a": ("T", 3, 100), "b": ("T", 3, 100)}, 0, _pair_draw,
        tree=lambda x: [x["a"], x["b"]],
    ),
    "pytree_dict": Combine(
        first_order_dict, {"gate": (2, "T"), "state": (2, "T")}, 1, _pair_draw,
        tree=lambda x: {"gate": x["gate"], "state": [x["state"]]},
    ),
}  # fmt: skip


# The generic scans run in Python (a pairwise tree, or chunks of about sqrt(T) steps
# for large elements) and have no C kernel (the matrix product behind
# associative_reduce has one: generic/test_matrix_product.py): lengths around powers
# of two, odd and prime ones.
GENERIC_LENGTHS = (0, 1, 2, 3, 5, 16, 17, 63, 64, 65, 97, 257)
GENERIC_LONG = 63  # from here on: float32 only, but under -m slow


def _few() -> list[int]:
    return [1, 2, one_past_a_tile()]


def _associative_spec(name: str, combine: Combine, reduce: bool) -> OpSpec:
    def values(input_name, shape, dtype, gen):  # type: ignore[no-untyped-def]
        value = combine.draw(input_name, shape, gen)
        if dtype.is_complex:
            value = torch.complex(value, combine.draw(input_name, shape, gen))
            value = value / 2**0.5
        return value

    def run(inputs, case):  # type: ignore[no-untyped-def]
        elems = combine.tree(inputs)
        if reduce:
            out = ps.associative_reduce(combine.fn, elems, case.layout.dim)
        else:
            out = ps.associative_scan(combine.fn, elems, case.layout.dim, reverse=case.reverse)
        return tuple(pytree.tree_leaves(out))

    def oracle(inputs, case):  # type: ignore[no-untyped-def]
        elems = combine.tree(inputs)
        if reduce:
            return tuple(pytree.tree_leaves(fold(combine.fn, elems, case.layout.dim)))
        return tuple(
            pytree.tree_leaves(fold_scan(combine.fn, elems, case.layout.dim, case.reverse))
        )

    ranks = {len(shape) for shape in combine.shapes.values()}
    layouts = [Layout("as given", dict(combine.shapes), combine.dim)]
    if len(ranks) == 1:  # a negative dim names the same axis of every operand
        (rank,) = ranks
        negative = combine.dim - rank if combine.dim >= 0 else combine.dim
        layouts.append(Layout("negative dim", dict(combine.shapes), negative, lengths=_few))
    transposed = {k: ("transposed",) for k in combine.shapes}
    layouts.append(Layout("transposed", dict(combine.shapes), combine.dim, transposed, _few))
    return OpSpec(
        name=("associative_reduce" if reduce else "associative_scan"),
        label=name,
        values=values,
        run=run,
        oracle=oracle,
        layouts=tuple(layouts),
        dtypes=combine.dtypes,
        variants=((False, False),) if reduce else ((False, False), (True, False)),
        lengths=lambda: GENERIC_LENGTHS,
        min_steps=1 if reduce else 0,
        contiguous=False,
        # the scans run the same torch code in every dtype: every dtype on the short
        # lengths, the long ones (the chunked path's, seconds each for the large
        # elements) in float32 by default (every combine takes it)
        long_from=GENERIC_LONG,
    )


ASSOCIATIVE_SCANS = [_associative_spec(n, c, reduce=False) for n, c in COMBINES.items()]
ASSOCIATIVE_REDUCES = [_associative_spec(n, c, reduce=True) for n, c in COMBINES.items()]

OPS = [LINEAR_SCAN, LOG_LINEAR_SCAN, MATRIX_LINEAR_SCAN, *ASSOCIATIVE_SCANS, *ASSOCIATIVE_REDUCES]


__all__ = [
    "ASSOCIATIVE_REDUCES",
    "ASSOCIATIVE_SCANS",
    "COMBINES",
    "LINEAR_SCAN",
    "LOG_LINEAR_SCAN",
    "MATRIX_LINEAR_SCAN",
    "OPS",
    "Case",
    "Layout",
    "OpSpec",
    "assert_within_scale",
    "check",
    "forward_mode_checks",
    "grid",
]


def forward_mode_checks(
    fn: Callable, oracle: Callable, p: dict, x_name: str, public: str, gen: torch.Generator
) -> None:
    """Forward-mode AD of ``fn`` (the scan on a float64 problem ``p``) against the
    oracle's, through torch.func.jvp and torch.autograd.forward_ad, every tensor input
    moving; jacfwd against jacrev in ``x_name``; and a hessian's clear refusal."""
    names = [
        k
        for k, v in p.items()
        if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())
    ]
    primals = tuple(p[k] for k in names)
    tangents = tuple(torch.randn(t.shape, generator=gen, dtype=t.dtype) for t in primals)

    def at(f):
        return lambda *ts: f({**p, **dict(zip(names, ts, strict=True))})

    with oracle_threads():
        _, want = torch.func.jvp(at(oracle), primals, tangents)
    _, got = torch.func.jvp(at(fn), primals, tangents)
    with torch.autograd.forward_ad.dual_level():
        duals = [
            torch.autograd.forward_ad.make_dual(a, t)
            for a, t in zip(primals, tangents, strict=True)
        ]
        dual_out = at(fn)(*duals)
        got_dual = [torch.autograd.forward_ad.unpack_dual(o).tangent for o in dual_out]
    for g, d, w in zip(got, got_dual, want, strict=True):
        torch.testing.assert_close(g, w)
        torch.testing.assert_close(d, w)

    # jacfwd against jacrev on a block of the Jacobian: six entries of x in, six of the
    # first output out (the whole of it cost a backward call per output element)
    x = p[x_name]
    rows = torch.randperm(fn(p)[0].numel(), generator=gen)[:6]
    cols = torch.randperm(x.numel(), generator=gen)[:6]

    def block(s):
        return fn({**p, x_name: x.flatten().index_put((cols,), s).view_as(x)})[0].flatten()[rows]

    torch.testing.assert_close(
        torch.func.jacfwd(block)(x.flatten()[cols]), torch.func.jacrev(block)(x.flatten()[cols])
    )

    # reverse over forward (the tangents' own computation differentiated): the
    # oracle's second derivatives (were silently zero: the tangents were computed
    # under no_grad); forward over reverse (torch.func.hessian) refuses
    def total(f):  # type: ignore[no-untyped-def]
        return lambda v: f({**p, x_name: v})[0].real.sum()

    direction = torch.randn(x.shape, generator=gen, dtype=x.dtype)

    def hvp(f):  # type: ignore[no-untyped-def]  # grad of a jvp: one Hessian-vector product
        return torch.func.grad(lambda v: torch.func.jvp(total(f), (v,), (direction,))[1])(x)

    with oracle_threads():
        want_hvp = hvp(oracle)
    torch.testing.assert_close(hvp(fn), want_hvp)
    with pytest.raises(RuntimeError, match=rf"{public}: second derivatives"):
        torch.func.hessian(total(fn))(x)


_ONCE: dict[object, Any] = {}


def oracle_once(key: object, compute: Callable[[], Any]) -> Any:
    """``compute()`` (a float64 oracle's results) on one thread (``oracle_threads``),
    once per ``key`` for the session: the kernels' tests check one problem in several
    dtypes and builds, and the loop is their time. ``key`` must name everything the
    problem depends on (the caller's module among it); None computes anew."""
    if key is not None and key in _ONCE:
        return _ONCE[key]
    with oracle_threads():
        result = compute()
    if key is not None:
        _ONCE[key] = result
    return result


Grads = Callable[
    [dict[str, torch.Tensor], torch.dtype, "str | None", "list[int] | None"], list[torch.Tensor]
]


def kernel_against_loop(
    grads: Grads,
    names: Sequence[str],
    p: dict[str, torch.Tensor],
    dtype: torch.dtype,
    cu: list[int] | None,
    key: object,
    tol: float,
    tol64: float = 1e-11,
) -> None:
    """A C kernel's outputs and gradients (``grads(p, dtype, "cpu", cu)``, named by
    ``names``) against the float64 loop's (``grads(p, float64, None, cu)``) within ``tol``
    (``tol64`` in float64) of each tensor's scale. ``key`` names the problem (the caller's
    module among it; None: none): its loop results, the tests' time, are then computed
    once for every dtype and build (``oracle_once``)."""
    named = None if key is None else (key, None if cu is None else tuple(cu))
    want = oracle_once(named, lambda: grads(p, torch.float64, None, cu))
    got = grads(p, dtype, "cpu", cu)
    assert_within_scale(names, want, got, tol64 if dtype == torch.float64 else tol)


def assert_within_scale(
    names: Sequence[str], want: Sequence[torch.Tensor], got: Sequence[torch.Tensor], tol: float
) -> None:
    """Each of ``got`` against the float64 tensor of ``want`` at its place: the largest
    error within ``tol`` times the largest magnitude of that tensor (at least 1); an
    empty one passes. A failure names the tensor by ``names``."""
    for name, w, o in zip(names, want, got, strict=True):
        scale = max(w.abs().max().item(), 1.0) if w.numel() else 1.0
        err = (o.double() - w).abs().max().item() if w.numel() else 0.0
        assert err <= tol * scale, f"{name}: error {err:.3g} (scale {scale:.3g})"
