"""The shared tests of the checkpointed scans (ps.selective_scan, ps.ssd_scan,
ps.delta_rule_scan and the families to come): each against its float64 loop
(oracles.py) on every backend of its row that runs here (conftest.targets).

A family is described once by a ``ScanSpec``: how to draw a float64 problem of a
given batch, length and family options (packed: batch 1, and one initial state per
sequence), the public function and its oracle, the inputs held in the state's
precision, the optional arguments, the inputs that have steps, the checkpoint
intervals to straddle and the backends. ``shared_tests(spec)`` makes the test class
of the cases every family owes; a family's file assigns it to a ``Test*`` name and
keeps only the tests that are its own. A family plugs in as, say::

    LINEAR_ATTENTION = ScanSpec(
        name="linear_attention_scan",
        function=ps.linear_attention_scan,
        oracle=oracles.linear_attention_loop,
        draw=_draw,  # (gen, *, batch, length, states, gate="head", ...) -> dict
        positional=("q", "k", "v"),
        timed=along(1, "q", "k", "v", "g"),
        optional=("g", "initial"),
        checkpoints={b: CHECKPOINT_STEPS[b] for b in ops.ROW.backends},
        backends=tuple(ops.ROW.backends),
        forms={"none": {"gate": "none"}, "head": {"gate": "head"},
               "channel": {"gate": "channel"}},
        tiny={"hk": 1, "hv": 2, "dk": 3, "dv": 2},
        vmapped=("v", "k"),
    )
    TestShared = shared_tests(LINEAR_ATTENTION)

The cases, each on every target (``spec.forms``, the family's forms such as the
delta rule's gates, crossed where said):

- lengths around every checkpoint interval K (0, 1, 2, 3, K - 1, K, K + 1, 2K + 1 of
  the smallest, and the family's own), each form, against the loop in float32;
- float16, bfloat16, float32 and float64 inputs, each form: the outputs in the input
  dtype, the state in float32 (float64), with conftest.assert_matches' tolerances;
- packed sequences (empty ones, on checkpoint edges, many tiny ones; with and without
  initial states) against the loop; packed equal to each sequence run alone, and one
  sequence spanning everything equal to the unpacked scan, each form;
- the gradient of every input against autograd through the float64 loop (the
  family's cases, or each form), and of a loss of one output alone;
- torch.autograd.gradcheck in float64, fast mode across the checkpoints (unpacked
  across the smallest interval, packed across the target's own), each form; the
  whole Jacobian on a tiny case for the backends whose backward is written by hand;
- forward mode (torch.func.jvp, forward_ad, jacfwd, a Hessian-vector product)
  against the loop's, harness.forward_mode_checks; dual tensors and gradients of an
  empty scan; second derivatives refused with the contract's message;
- torch.vmap (with torch.func.grad, and vmap of grad), packed too;
  torch.compile(fullgraph=True), outputs and gradients equal to eager ones, packed too;
- decoding: calls of one step each, chaining the state, equal the scan, each form;
- the inputs left untouched (values and versions) by forward and backward; "auto"
  the first backend of the row that runs on the CPU;
- every optional argument absent and present (none, each alone, each left out, all),
  packed too, forward and backward against the loop in float64.

A case a backend cannot run (``spec.refuses``, such as a complex state on the Triton
kernels) checks instead that the call raises the contract's RuntimeError naming the
function and the backend.

The default suite (10 minutes on 2 cores) runs forward mode, torch.compile and the
gradcheck of the forms other than the main one on the first target of each device (the
C kernel on the CPU); their cases on the other targets are marked slow (``pytest -m
slow``): see ``_first_per_device``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

import parascan as ps

from conftest import DTYPES, Target, assert_matches, oracle_threads, targets
from harness import forward_mode_checks

F64 = torch.float64
F32 = torch.float32
Options = Mapping[str, Any]
Problem = dict[str, Any]

# The shared tests whose problems ``ScanSpec.overrides`` can change, by key.
OVERRIDABLE = {
    "lengths": "test_lengths_against_loop",
    "dtypes": "test_dtypes_against_loop",
    "packed": "test_packed_against_loop",
    "separate": "test_packed_equals_each_sequence_alone",
    "gradients": "test_gradients_against_loop",
    "one_output": "test_gradients_of_one_output_alone",
    "gradcheck": "test_gradcheck_float64",
    "jvp": "test_forward_mode_against_loop",
    "empty": "test_dual_tensors_of_an_empty_scan, test_gradients_of_an_empty_scan",
    "second": "test_second_derivatives_raise",
    "vmap": "test_vmap_and_grad, test_vmap_packed",
    "compile": "test_compile_fullgraph",
    "decode": "test_decode_steps_equal_the_scan",
    "untouched": "test_inputs_untouched",
    "auto": "test_auto_is_the_first_backend_that_runs",
    "optional": "test_optional_arguments_absent_or_present",
}

# ---------------------------------------------------------------------------------------
# The spec
# ---------------------------------------------------------------------------------------


def along(dim: int, *names: str) -> Callable[[str, torch.Tensor], int | None]:
    """A ``ScanSpec.timed`` for inputs ``names`` that have their steps along ``dim``."""
    return lambda name, tensor: dim if name in names else None


@dataclass(frozen=True)
class ScanSpec:
    """A checkpointed scan as the shared tests see it.

    draw(gen, *, batch, length, states, **options): a float64 problem, a dict of the
    function's keyword arguments (tensors, None for an absent optional one, plain
    values such as flags); ``states``: the rows of ``initial`` (None: ``batch``).
    function: the public function, called as ``function(*positional, **rest,
    return_final=True, cu_seqlens=..., backend=...)``; oracle: the float64 loop,
    ``oracle(**problem, cu_seqlens=...)`` (without cu_seqlens unless ``packs``),
    returning (out, final).
    timed(name, tensor): the dim of ``tensor``'s steps (None: it has none).
    wide: the inputs held in the state's precision (float32 for the half types);
    complex inputs are always in the state's precision.
    optional: the optional tensor arguments (None when absent).
    checkpoints: backend -> checkpoint interval; blocks: other lengths the
    backends cut the steps into (lengths on and around them are checked too).
    forms: named family options crossed by the lengths, dtypes, packed, gradient,
    gradcheck and decoding cases; ``main`` names the form the other cases use (the
    last one by default); ``optional_forms`` those of the optional-argument cases.
    tiny: options of a tiny problem (gradcheck, forward mode, optional arguments).
    overrides: per shared test (a key of OVERRIDABLE), options merged into its
    problems (such as a length, sizes, or qk_l2norm=True); a case's own options (its
    length in the lengths cases, say) still win.
    gradient_cases / jvp_cases: named options of the gradient and forward-mode cases
    (default: each form; the main form across the checkpoints, unpacked and packed).
    vmapped: two inputs to vmap over (the first also jacfwd's and the hessian's).
    handwritten: backends whose backward is written by hand (whole-Jacobian gradcheck).
    refuses(target, options): True where the backend must refuse the problem.
    """

    name: str
    function: Callable[..., Any]
    oracle: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    draw: Callable[..., Problem]
    positional: tuple[str, ...]
    timed: Callable[[str, torch.Tensor], int | None]
    optional: tuple[str, ...]
    checkpoints: Mapping[str, int]
    backends: tuple[str, ...]
    vmapped: tuple[str, str]
    wide: tuple[str, ...] = ("initial",)
    differentiable: tuple[str, ...] | None = None  # None: every tensor input
    packs: bool = True
    blocks: tuple[int, ...] = ()
    lengths: tuple[int, ...] = ()  # more lengths of the family's own
    length: int = 70  # the length of a case that names none
    forms: Mapping[str, Options] = field(default_factory=lambda: {"": {}})
    main: str | None = None
    optional_forms: tuple[str, ...] | None = None
    tiny: Options = field(default_factory=dict)
    overrides: Mapping[str, Options] = field(default_factory=dict)
    gradient_cases: Mapping[str, Options] | None = None
    jvp_cases: Mapping[str, Options] | None = None
    handwritten: tuple[str, ...] = ("cpu",)
    refuses: Callable[[Target, Options], bool] = lambda target, options: False

    @property
    def public(self) -> str:
        """The function's name as its errors start (a regular expression)."""
        return rf"parascan\.{self.name}"

    def main_form(self) -> Options:
        return self.forms[self.main if self.main is not None else list(self.forms)[-1]]

    def targets(self) -> list[Target]:
        return [t for t in targets() if t.backend in self.backends]

    def all_lengths(self) -> list[int]:
        """0, 1, 2, 3; K - 1, K, K + 1 of every checkpoint interval and block, 2K + 1 of
        the smallest interval; the family's own."""
        ks = sorted({*self.checkpoints.values(), *self.blocks})
        around = {k + d for k in ks for d in (-1, 0, 1)}
        return sorted({0, 1, 2, 3, *around, 2 * min(self.checkpoints.values()) + 1, *self.lengths})

    def packings(self) -> dict[str, tuple[int, ...]]:
        """cu_seqlens of the packed cases, over a length past two checkpoints."""
        k = min(self.checkpoints.values())
        total = max(150, 2 * k + 22)
        tiny, step = [0, 1], 1
        while tiny[-1] + step < total:
            tiny.append(tiny[-1] + step)
            step += 1
        return {
            "one-spanning-all": (0, total),
            "with-empties": (0, 0, 3, k + 6, k + 6, total - 1, total, total),
            "at-checkpoint-edges": (0, k, 2 * k, 2 * k + 1, total),
            "tiny": (*tiny, total),
            "all-empty-but-one": (0, 0, 0, total, total),
        }

    def options(self, test: str, *parts: Options, own: Options | None = None) -> dict[str, Any]:
        """The options of a case of the shared test ``test`` (a key of OVERRIDABLE):
        ``parts`` merged in order, then the spec's overrides for ``test``, then the
        case's ``own`` options (what the case is about, such as its length)."""
        merged: dict[str, Any] = {}
        for part in (*parts, self.overrides.get(test, {}), own or {}):
            merged.update(part)
        return merged

    def __post_init__(self) -> None:
        unknown = set(self.overrides) - set(OVERRIDABLE)
        assert not unknown, f"{self.name}: overrides of no shared test: {sorted(unknown)}"


# ---------------------------------------------------------------------------------------
# Problems, calls and the oracle
# ---------------------------------------------------------------------------------------


def draw(spec: ScanSpec, gen: torch.Generator, options: Options) -> Problem:
    """A float64 problem of ``options``: the family's, and ``length`` (default
    ``spec.length``), ``batch`` (2), ``states`` (the initial state's rows: batch) or
    ``cu`` (packed: batch 1, one initial state per sequence); ``initial=False`` leaves
    the initial state out."""
    rest = dict(options)
    cu = rest.pop("cu", None)
    with_initial = rest.pop("initial", True)
    batch, length = rest.pop("batch", 2), rest.pop("length", spec.length)
    states = rest.pop("states", None)
    if cu is not None:
        batch, length, states = 1, cu[-1], len(cu) - 1
    p = spec.draw(gen, batch=batch, length=length, states=states, **rest)
    if not with_initial:
        p["initial"] = None
    return p


def tensors(p: Problem) -> dict[str, torch.Tensor]:
    return {k: v for k, v in p.items() if isinstance(v, torch.Tensor)}


def to(p: Problem, device: str | torch.device | None) -> Problem:
    """The problem's tensors on ``device`` (None: where they are)."""
    if device is None:
        return dict(p)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in p.items()}


def state_dtype(dtype: torch.dtype, is_complex: bool = False) -> torch.dtype:
    """The state's dtype for inputs of ``dtype``: float32 for the half types."""
    wide = F64 if dtype == F64 else F32
    if is_complex:
        return torch.complex128 if wide == F64 else torch.complex64
    return wide


def cast(spec: ScanSpec, p: Problem, dtype: torch.dtype) -> Problem:
    """The problem's inputs in ``dtype``; ``spec.wide`` and complex ones in the state's
    precision."""
    out = dict(p)
    for k, v in tensors(p).items():
        if v.is_complex():
            out[k] = v.to(state_dtype(dtype, True))
        else:
            out[k] = v.to(state_dtype(dtype) if k in spec.wide else dtype)
    return out


def call(
    spec: ScanSpec, p: Problem, backend: str, cu: torch.Tensor | None = None,
    return_final: bool = True,
) -> Any:  # fmt: skip
    """The public function on ``p`` as it is (no moving, no casting)."""
    q = dict(p)
    args = [q.pop(k) for k in spec.positional]
    if spec.packs:
        q["cu_seqlens"] = cu
    return spec.function(*args, **q, return_final=return_final, backend=backend)


def run(
    spec: ScanSpec, p: Problem, backend: str, device: str | None = None,
    cu: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """(out, final) of ``p`` on ``backend``, its tensors moved to ``device`` (None:
    where they are); the outputs must come back there, and are handed back on the
    device of ``p``'s first input (differentiably: gradients, tangents, gradcheck, vmap
    and compile pass through), so that CPU float64 problems run on a CUDA target."""
    first = p[spec.positional[0]]
    home = first.device if isinstance(first, torch.Tensor) else None  # None: an error case
    q = to(p, device)
    there = q[spec.positional[0]].device if home is not None else device
    cu_t = None if cu is None else torch.tensor(list(cu), device=there)
    out, final = call(spec, q, backend, cu_t)
    assert out.device == final.device == there, (out.device, final.device, there)
    return out.to(home), final.to(home)


def oracle(
    spec: ScanSpec, p: Problem, cu: Sequence[int] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The float64 (complex128) loop on the CPU, on ``p``'s values (differentiably)."""
    wide = {
        k: v.to("cpu", torch.complex128 if v.is_complex() else F64) if isinstance(v, torch.Tensor)
        else v
        for k, v in p.items()
    }  # fmt: skip
    with oracle_threads():
        if spec.packs:
            return spec.oracle(**wide, cu_seqlens=None if cu is None else list(cu))
        assert cu is None
        return spec.oracle(**wide)


def assert_refused(spec: ScanSpec, p: Problem, target: Target) -> None:
    """The contract's RuntimeError, naming the function and the backend."""
    pattern = rf"^{spec.public}: backend '{target.backend}' is not available"
    with pytest.raises(RuntimeError, match=pattern):
        run(spec, cast(spec, p, F32), target.backend, target.device)


def check_forward(
    spec: ScanSpec, p: Problem, target: Target, dtype: torch.dtype = F32,
    cu: Sequence[int] | None = None,
) -> None:  # fmt: skip
    """(out, final) of the float64 problem ``p`` in ``dtype`` on ``target`` against the
    loop on the same rounded inputs: out in ``dtype``, the state in its precision."""
    q = cast(spec, p, dtype)
    want_out, want_final = oracle(spec, q, cu)
    out, final = run(spec, q, target.backend, target.device, cu)
    state = state_dtype(dtype, any(v.is_complex() for v in tensors(q).values()))
    assert out.dtype == dtype and final.dtype == state, (out.dtype, final.dtype)
    assert_matches(out, want_out, dtype)
    assert_matches(final, want_final, state)


def loss_weights(outputs: Sequence[torch.Tensor], use: Sequence[str]) -> list[torch.Tensor | None]:
    """Random weights of a loss of the outputs named in ``use`` (of "out", "final"),
    drawn on the CPU in float64 and rounded to each output's dtype (a comparison's
    other side takes the same numbers); None for an output left out."""
    gen = torch.Generator().manual_seed(7)
    drawn = [torch.randn(t.shape, generator=gen, dtype=F64).to(t.dtype) for t in outputs]
    return [w if name in use else None for name, w in zip(("out", "final"), drawn, strict=True)]


def gradients(
    spec: ScanSpec, p: Problem, fn: Callable[[Problem], tuple[torch.Tensor, torch.Tensor]],
    weights: Callable[[Sequence[torch.Tensor]], Sequence[torch.Tensor | None]],
) -> dict[str, torch.Tensor]:  # fmt: skip
    """d/d(input) of the sum of output * weight over the outputs with a weight
    (``weights(outputs)``; zeros where an input does not reach the loss), ``fn`` run on
    fresh leaves of ``p``."""
    names = spec.differentiable or list(tensors(p))
    leaves = {k: p[k].detach().clone().requires_grad_() for k in names if p.get(k) is not None}
    outputs = fn({**p, **leaves})
    loss = sum(
        (t * w.to(t.device, t.dtype).conj()).real.sum()
        for t, w in zip(outputs, weights(outputs), strict=True)
        if w is not None
    )
    assert isinstance(loss, torch.Tensor)
    found = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True,
                                materialize_grads=True)  # fmt: skip
    return dict(zip(leaves, found, strict=True))


def check_gradients(
    spec: ScanSpec, p: Problem, target: Target, cu: Sequence[int] | None = None,
    use: tuple[str, ...] = ("out", "final"), dtype: torch.dtype = F32,
) -> None:  # fmt: skip
    """Every input's gradient (finite, of its shape) of a random weighted sum of the
    outputs named in ``use``, the scan in ``dtype`` on ``target``, against autograd
    through the float64 loop on the same rounded inputs and weights."""
    q = cast(spec, p, dtype)
    drawn: list[torch.Tensor | None] = []

    def weights(outputs: Sequence[torch.Tensor]) -> list[torch.Tensor | None]:
        drawn.extend(loss_weights(outputs, use))
        return drawn

    got = gradients(spec, q, lambda r: run(spec, r, target.backend, target.device, cu), weights)
    with oracle_threads():
        want = gradients(spec, q, lambda r: oracle(spec, r, cu), lambda outputs: drawn)
    assert set(got) == set(want)
    for name, g in got.items():
        assert g.shape == q[name].shape, name
        assert g.isfinite().all(), name
        tolerance = state_dtype(dtype, g.is_complex()) if dtype != F64 else g.dtype
        try:
            assert_matches(g, want[name], tolerance)
        except AssertionError as error:
            raise AssertionError(f"gradient of {name}: {error}") from None


# ---------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One shared case: the spec, the target, the problem's options (the family's, and
    length / batch / cu / initial: ``draw``), the dtype, and what else the test varies."""

    spec: ScanSpec
    target: Target
    options: Options
    label: str = ""
    dtype: torch.dtype = F32
    flag: Any = None
    slow: bool = False  # with the slow tests (``pytest -m slow``): see ``_first_per_device``

    def __str__(self) -> str:
        return "-".join(part for part in (str(self.target), self.label) if part)

    @property
    def cu(self) -> list[int] | None:
        cu = self.options.get("cu")
        return None if cu is None else list(cu)

    @property
    def refused(self) -> bool:
        return self.spec.refuses(self.target, self.options)

    def problem(self, gen: torch.Generator) -> Problem:
        return draw(self.spec, gen, self.options)


def _label(*parts: object) -> str:
    return "-".join(str(p) for p in parts if p not in ("", None))


def _first_per_device(spec: ScanSpec) -> set[Target]:
    """The first of ``spec``'s targets on each device type (the C kernel on the CPU).

    The default suite (10 minutes on 2 cores) runs the costliest shared cases (forward
    mode, gradcheck of every form, torch.compile) there only, where running them on
    every target repeats the same code: every backend's tangents come from forward-mode
    AD through the torch backend's forward (parascan._core.jvp_through), and the
    gradients of every form on every target are checked by the cheaper
    test_gradients_against_loop. The other targets' cases are marked slow (``pytest -m
    slow`` runs them)."""
    first: dict[str, Target] = {}
    for t in spec.targets():
        first.setdefault(t.device, t)
    return set(first.values())


# (case generator, test body) of every shared test, by the test's name
Body = Callable[[Case, torch.Generator], None]
SHARED: dict[str, tuple[Callable[[ScanSpec], list[Case]], Body]] = {}


def shared(cases: Callable[[ScanSpec], list[Case]]) -> Callable[[Body], Body]:
    """Registers a test body (named test_*) with the generator of its cases."""

    def register(body: Body) -> Body:
        SHARED[body.__name__] = (cases, body)
        return body

    return register


def _refusing(body: Body) -> Body:
    """A body that checks the refusal instead where the case's backend refuses it."""

    def checked(case: Case, gen: torch.Generator) -> None:
        if case.refused:
            assert_refused(case.spec, case.problem(gen), case.target)
            return
        body(case, gen)

    checked.__name__, checked.__doc__ = body.__name__, body.__doc__
    return checked


def shared_tests(spec: ScanSpec) -> type:
    """The test class of ``spec``'s shared cases: one parametrized method per shared
    test that has cases for it (pytest's ids: the target, then the case's label)."""
    namespace: dict[str, Any] = {
        "__doc__": f"The shared cases of parascan.{spec.name} (tests/checkpointed.py).",
        "spec": spec,
    }
    for name, (cases, body) in SHARED.items():
        found = cases(spec)
        if not found:
            continue
        params = [
            pytest.param(c.target, c, id=str(c), marks=[pytest.mark.slow] if c.slow else [])
            for c in found
        ]
        namespace[name] = pytest.mark.parametrize(("where", "case"), params)(_method(name, body))
    return type("TestShared", (), namespace)


def _method(name: str, body: Body) -> Callable[..., None]:
    def test(self: object, where: Target, case: Case, gen: torch.Generator) -> None:
        assert where is case.target
        body(case, gen)

    test.__name__ = test.__qualname__ = name
    test.__doc__ = body.__doc__
    return test


# --- forward ---------------------------------------------------------------------------


def _lengths(spec: ScanSpec) -> list[Case]:
    return [
        Case(spec, t, spec.options("lengths", form, own={"length": n}), _label(name, f"L{n}"))
        for t in spec.targets()
        for name, form in spec.forms.items()
        for n in spec.all_lengths()
    ]


@shared(_lengths)
@_refusing
def test_lengths_against_loop(case: Case, gen: torch.Generator) -> None:
    """Lengths around every checkpoint interval, in float32, against the loop."""
    check_forward(case.spec, case.problem(gen), case.target)


def _dtypes(spec: ScanSpec) -> list[Case]:
    return [
        Case(spec, t, spec.options("dtypes", form), _label(name, str(d)[6:]), dtype=d)
        for t in spec.targets()
        for name, form in spec.forms.items()
        for d in DTYPES
        if not d.is_complex
    ]


@shared(_dtypes)
@_refusing
def test_dtypes_against_loop(case: Case, gen: torch.Generator) -> None:
    """Inputs of every float dtype, the state in float32 (float64 for float64): the
    loop runs on the same rounded inputs."""
    check_forward(case.spec, case.problem(gen), case.target, case.dtype)


# --- packed sequences ---------------------------------------------------------------------


def _packed(spec: ScanSpec) -> list[Case]:
    if not spec.packs:
        return []
    return [
        Case(
            spec,
            t,
            spec.options("packed", spec.main_form(), own={"cu": cu, "initial": initial}),
            _label(name, "initial" if initial else "no-initial"),
        )
        for t in spec.targets()
        for name, cu in spec.packings().items()
        for initial in (False, True)
    ]


@shared(_packed)
@_refusing
def test_packed_against_loop(case: Case, gen: torch.Generator) -> None:
    """Packed sequences (cu_seqlens), with and without initial states, against the loop."""
    check_forward(case.spec, case.problem(gen), case.target, cu=case.cu)


def _separate(spec: ScanSpec) -> list[Case]:
    if not spec.packs:
        return []
    cu = spec.packings()["with-empties"]
    return [
        Case(spec, t, spec.options("separate", form, own={"cu": cu}), name)
        for t in spec.targets()
        for name, form in spec.forms.items()
    ]


@shared(_separate)
@_refusing
def test_packed_equals_each_sequence_alone(case: Case, gen: torch.Generator) -> None:
    """Packed sequences give each sequence's own scan (empty ones included), one
    sequence spanning everything gives the unpacked scan's bits, and the packed scan
    in float64 matches the loop."""
    spec, where, cu = case.spec, case.target, case.cu
    assert cu is not None
    p = case.problem(gen)
    check_forward(spec, p, where, F64, cu)
    q = cast(spec, p, F32)
    out, final = run(spec, q, where.backend, where.device, cu)
    for s, (lo, hi) in enumerate(itertools.pairwise(cu)):
        alone = slice_steps(spec, q, lo, hi)
        alone["initial"] = None if q["initial"] is None else q["initial"][s : s + 1]
        o, f = run(spec, alone, where.backend, where.device)
        torch.testing.assert_close(out[:, lo:hi], o, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final[s : s + 1], f, rtol=1e-5, atol=1e-5)
    one = {**q, "initial": None if q["initial"] is None else q["initial"][:1]}
    whole = run(spec, one, where.backend, where.device)
    spanning = run(spec, one, where.backend, where.device, [0, cu[-1]])
    torch.testing.assert_close(spanning, whole, rtol=0, atol=0)


def slice_steps(spec: ScanSpec, p: Problem, lo: int, hi: int) -> Problem:
    """Steps lo .. hi - 1 of every input that has steps (``spec.timed``)."""
    out = dict(p)
    for k, v in tensors(p).items():
        dim = spec.timed(k, v)
        if dim is not None:
            out[k] = v.narrow(dim, lo, hi - lo)
    return out


# --- gradients ----------------------------------------------------------------------------


def _gradients(spec: ScanSpec) -> list[Case]:
    named = spec.gradient_cases if spec.gradient_cases is not None else spec.forms
    return [
        Case(spec, t, spec.options("gradients", spec.forms.get(name, {}), own=options), name)
        for t in spec.targets()
        for name, options in named.items()
    ]


@shared(_gradients)
@_refusing
def test_gradients_against_loop(case: Case, gen: torch.Generator) -> None:
    """The gradient of every input (the initial state's included) in float32 against
    autograd through the float64 loop."""
    check_gradients(case.spec, case.problem(gen), case.target, case.cu)


def _one_output(spec: ScanSpec) -> list[Case]:
    k = min(spec.checkpoints.values())
    return [
        Case(
            spec,
            t,
            spec.options("one_output", spec.main_form(), own={"length": k + 5}),
            use,
            flag=use,
        )
        for t in spec.targets()
        for use in ("out", "final")
    ]


@shared(_one_output)
@_refusing
def test_gradients_of_one_output_alone(case: Case, gen: torch.Generator) -> None:
    """A loss of only out, or only the final state: the other output's gradient never
    arrives (no zeros are materialized for it) and the gradients still match the loop's."""
    check_gradients(case.spec, case.problem(gen), case.target, use=(case.flag,))


def _across_checkpoints(spec: ScanSpec, target: Target) -> list[tuple[str, Options]]:
    """Problems that cross a checkpoint: one sequence across the smallest interval, and
    packed sequences (an empty one among them) across the target's own; without
    packed sequences, one across the target's own (batch 2 there, else 1: the
    gradcheck and forward-mode cases are the suite's slowest per step)."""
    own = spec.checkpoints[target.backend]
    if not spec.packs:
        return [("", {"length": own + 3})]
    k = min(spec.checkpoints.values())
    return [
        ("", {"batch": 1, "length": k + 3}),
        ("packed", {"cu": (0, k // 2 - 2, k // 2 - 2, own + 3)}),
    ]


def _gradcheck(spec: ScanSpec) -> list[Case]:
    """Fast mode across the checkpoints: the main form on every target, the other forms
    on the first target of each device in the default suite (on the others with the
    slow tests); the whole Jacobian on the hand-written backwards."""
    cases = []
    first = _first_per_device(spec)
    main = spec.main_form()
    for t in spec.targets():
        short: list[tuple[str, Options]] = [("", {"length": 9})]
        if spec.packs:
            short.append(("packed", {"cu": (0, 3, 3, 9)}))
        for name, form in spec.forms.items():
            slow = t not in first and form is not main
            for packed, options in _across_checkpoints(spec, t):
                opts = spec.options("gradcheck", spec.tiny, form, own=options)
                label = _label(name, packed, "fast")
                cases.append(Case(spec, t, opts, label, flag=True, slow=slow))
            if t.backend in spec.handwritten:
                for packed, options in short:
                    opts = spec.options("gradcheck", spec.tiny, form, own=options)
                    cases.append(Case(spec, t, opts, _label(name, packed, "whole"), flag=False))
    return cases


@shared(_gradcheck)
@_refusing
def test_gradcheck_float64(case: Case, gen: torch.Generator) -> None:
    """torch.autograd.gradcheck in float64: random projections of the Jacobian (fast
    mode) across the checkpoints (``_across_checkpoints``); the whole Jacobian on a
    tiny case where the backward is written by hand. The problem stays on the CPU; ``run`` moves
    it to the target's device and the outputs back."""
    spec, where, cu = case.spec, case.target, case.cu
    p = case.problem(gen)
    names = [k for k in (spec.differentiable or tensors(p)) if p.get(k) is not None]

    def fn(*ts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return run(spec, {**p, **dict(zip(names, ts, strict=True))}, where.backend,
                   where.device, cu)  # fmt: skip

    leaves = tuple(p[k].detach().clone().requires_grad_() for k in names)
    assert torch.autograd.gradcheck(fn, leaves, fast_mode=case.flag)


# --- forward mode, empty scans, second derivatives ----------------------------------------


def _jvp(spec: ScanSpec) -> list[Case]:
    """Each case on every target; in the default suite on the first target of each
    device only (every backend's tangents come from the same forward-mode AD through
    the torch backend's forward: ``_first_per_device``)."""
    cases = []
    first = _first_per_device(spec)
    for t in spec.targets():
        named = spec.jvp_cases
        if named is None:
            named = dict(_across_checkpoints(spec, t))
        for name, options in named.items():
            opts = spec.options("jvp", spec.tiny, spec.main_form(), own=options)
            cases.append(Case(spec, t, opts, name, slow=t not in first))
    return cases


@shared(_jvp)
@_refusing
def test_forward_mode_against_loop(case: Case, gen: torch.Generator) -> None:
    """torch.func.jvp, torch.autograd.forward_ad, jacfwd and a Hessian-vector product
    against the float64 loop's (harness.forward_mode_checks), the problem on the CPU
    (``run`` moves it to the target's device and the outputs back)."""
    spec, where, cu = case.spec, case.target, case.cu
    forward_mode_checks(
        lambda q: run(spec, q, where.backend, where.device, cu),
        lambda q: oracle(spec, q, cu), case.problem(gen), spec.vmapped[0], spec.public, gen,
    )  # fmt: skip


def _empty(spec: ScanSpec) -> list[Case]:
    return [
        Case(spec, t, spec.options("empty", spec.main_form(), own={"length": 0}), use, flag=use)
        for t in spec.targets()
        for use in ("final", "no-final")
    ]


@shared(_empty)
@_refusing
def test_dual_tensors_of_an_empty_scan(case: Case, gen: torch.Generator) -> None:
    """L = 0 under torch.autograd.forward_ad, every input a dual tensor: out has no
    steps, and the final state is the initial one, its tangent the initial's."""
    spec, where = case.spec, case.target
    p = to(case.problem(gen), where.device)
    fwd = torch.autograd.forward_ad
    tangents = {k: torch.randn(v.shape, generator=gen, dtype=v.dtype).to(where.device)
                for k, v in tensors(p).items()}  # fmt: skip
    with fwd.dual_level():
        q = {**p, **{k: fwd.make_dual(p[k], t) for k, t in tangents.items()}}
        got = call(spec, q, where.backend, return_final=case.flag == "final")
        out, final = got if case.flag == "final" else (got, None)
        assert out.numel() == 0
        tangent = fwd.unpack_dual(out).tangent
        assert tangent is None or not tangent.numel()
        if final is not None:
            torch.testing.assert_close(fwd.unpack_dual(final).primal, p["initial"])
            torch.testing.assert_close(fwd.unpack_dual(final).tangent, tangents["initial"])


def _empty_with_final(spec: ScanSpec) -> list[Case]:
    return [c for c in _empty(spec) if c.flag == "final"]


@shared(_empty_with_final)
@_refusing
def test_gradients_of_an_empty_scan(case: Case, gen: torch.Generator) -> None:
    """L = 0 with an initial state: the final state is the initial one, so d(initial)
    is the final state's gradient and every other gradient is zero (handed back as a
    new tensor: an output aliasing an input is refused by torch.library)."""
    spec, where = case.spec, case.target
    q = to(cast(spec, case.problem(gen), F32), where.device)
    leaves = {k: v.requires_grad_() for k, v in tensors(q).items()}
    out, final = run(spec, q, where.backend)
    assert out.numel() == 0
    torch.testing.assert_close(final, q["initial"].detach())
    seed = torch.randn(final.shape, generator=gen, dtype=F64).to(final.device, final.dtype)
    found = torch.autograd.grad(final, list(leaves.values()), seed, allow_unused=True)
    for (k, v), g in zip(leaves.items(), found, strict=True):
        want = seed if k == "initial" else torch.zeros_like(v)
        torch.testing.assert_close(torch.zeros_like(v) if g is None else g, want)


def _second(spec: ScanSpec) -> list[Case]:
    return [
        Case(spec, t, spec.options("second", spec.main_form(), own={"length": 5}))
        for t in spec.targets()
    ]


@shared(_second)
@_refusing
def test_second_derivatives_raise(case: Case, gen: torch.Generator) -> None:
    """A backward through the backward (create_graph) raises the contract's error."""
    spec, where = case.spec, case.target
    p = to(case.problem(gen), where.device)
    x = p[spec.vmapped[0]].requires_grad_()
    (g,) = torch.autograd.grad(run(spec, p, where.backend)[0].square().sum(), x,
                               create_graph=True)  # fmt: skip
    with pytest.raises(RuntimeError, match=rf"{spec.public}: second derivatives"):
        g.sum().backward()


# --- vmap and compile -----------------------------------------------------------------------


def _vmap(spec: ScanSpec) -> list[Case]:
    return [
        Case(spec, t, spec.options("vmap", spec.main_form(), own={"batch": 1}))
        for t in spec.targets()
    ]


@shared(_vmap)
@_refusing
def test_vmap_and_grad(case: Case, gen: torch.Generator) -> None:
    """torch.vmap over two inputs equals a loop of calls; torch.func.grad equals
    autograd's; vmap of grad gives per-example gradients."""
    spec, where = case.spec, case.target
    first, second = spec.vmapped
    drawn = [to(cast(spec, case.problem(gen), F32), where.device) for _ in range(3)]
    p = drawn[0]
    xs = torch.stack([d[first] for d in drawn])
    ys = torch.stack([d[second] for d in drawn])

    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return run(spec, {**p, first: x, second: y}, where.backend)[0]

    got = torch.vmap(f)(xs, ys)
    assert got.device == xs.device
    torch.testing.assert_close(got, torch.stack([f(xs[i], ys[i]) for i in range(3)]))
    grad = torch.func.grad(lambda y: f(xs[0], y).square().sum())(ys[0])
    y0 = ys[0].clone().requires_grad_()
    f(xs[0], y0).square().sum().backward()
    torch.testing.assert_close(grad, y0.grad)
    per = torch.vmap(torch.func.grad(lambda x, y: f(x, y).sum()))(xs, ys)
    assert per.shape == xs.shape


def _vmap_packed(spec: ScanSpec) -> list[Case]:
    if not spec.packs:
        return []
    options = spec.options("vmap", spec.main_form(), own={"cu": (0, 5, 5, 70)})
    return [Case(spec, t, options, "packed") for t in spec.targets()]


@shared(_vmap_packed)
@_refusing
def test_vmap_packed(case: Case, gen: torch.Generator) -> None:
    """torch.vmap over the first input of packed sequences equals a loop of calls."""
    spec, where, cu = case.spec, case.target, case.cu
    first = spec.positional[0]
    p = to(cast(spec, case.problem(gen), F32), where.device)
    xs = torch.stack([p[first], torch.randn(p[first].shape, generator=gen).to(p[first])])
    got = torch.vmap(lambda x: run(spec, {**p, first: x}, where.backend, cu=cu))(xs)
    for i in range(2):
        want = run(spec, {**p, first: xs[i]}, where.backend, cu=cu)
        torch.testing.assert_close(got[0][i], want[0])
        torch.testing.assert_close(got[1][i], want[1])


def _compile(spec: ScanSpec) -> list[Case]:
    """Unpacked and packed on every target; in the default suite on the first target of
    each device only (a compilation costs seconds: ``_first_per_device``)."""
    packings: list[tuple[str, Options]] = [("", {"batch": 1})]
    if spec.packs:
        packings.append(("packed", {"cu": (0, 10, 10, 70)}))
    first = _first_per_device(spec)
    return [
        Case(
            spec,
            t,
            spec.options("compile", spec.main_form(), own=options),
            name,
            slow=t not in first,
        )
        for t in spec.targets()
        for name, options in packings
    ]


@shared(_compile)
@_refusing
def test_compile_fullgraph(case: Case, gen: torch.Generator) -> None:
    """torch.compile(fullgraph=True) (aot_eager): the outputs and every gradient equal
    the eager ones."""
    spec, where, cu = case.spec, case.target, case.cu
    p = to(cast(spec, case.problem(gen), F32), where.device)
    cu_t = None if cu is None else torch.tensor(cu, device=where.device)

    def f(q: Problem, cu_seqlens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        return call(spec, q, where.backend, cu_seqlens)

    # every family's cases compile this one code object: without a reset the ninth
    # compilation hits dynamo's recompile limit, which fullgraph=True makes an error
    torch.compiler.reset()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    leaves = {k: v.clone().requires_grad_() for k, v in tensors(p).items()}
    out, final = compiled({**p, **leaves}, cu_t)
    assert out.device == final.device == p[spec.positional[0]].device
    eager = {k: v.clone().requires_grad_() for k, v in tensors(p).items()}
    want_out, want_final = f({**p, **eager}, cu_t)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(final, want_final)
    (out.sum() + final.sum()).backward()
    (want_out.sum() + want_final.sum()).backward()
    for k, v in leaves.items():
        assert v.grad is not None, k
        torch.testing.assert_close(v.grad, eager[k].grad)


# --- decoding, inputs, "auto", optional arguments ------------------------------------------


def _decode(spec: ScanSpec) -> list[Case]:
    return [
        Case(spec, t, spec.options("decode", form, own={"length": 9}), name)
        for t in spec.targets()
        for name, form in spec.forms.items()
    ]


@shared(_decode)
@_refusing
def test_decode_steps_equal_the_scan(case: Case, gen: torch.Generator) -> None:
    """Calls of one step each (L = 1), each from the state the one before returned,
    equal the scan: its outputs step by step, and its final state."""
    spec, where = case.spec, case.target
    p = to(cast(spec, case.problem(gen), F32), where.device)  # the steps too
    out, final = run(spec, p, where.backend)
    time = spec.timed(spec.positional[0], p[spec.positional[0]])
    assert time is not None
    state = p["initial"]
    for t in range(out.shape[time]):
        o, state = run(spec, {**slice_steps(spec, p, t, t + 1), "initial": state}, where.backend)
        torch.testing.assert_close(o, out.narrow(time, t, 1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, final, rtol=1e-5, atol=1e-5)


def _untouched(spec: ScanSpec) -> list[Case]:
    packings: list[tuple[str, Options]] = [("", {})]
    if spec.packs:
        packings.append(("packed", {"cu": (0, 10, 10, 70)}))
    return [
        Case(spec, t, spec.options("untouched", spec.main_form(), own=options), name)
        for t in spec.targets()
        for name, options in packings
    ]


@shared(_untouched)
@_refusing
def test_inputs_untouched(case: Case, gen: torch.Generator) -> None:
    """Forward and backward leave every input as it was: its values and its version
    counter (no write, not even of the same values)."""
    spec, where = case.spec, case.target
    p = to(cast(spec, case.problem(gen), F32), where.device)
    inputs = tensors(p)
    saved = {k: (v.clone(), v._version) for k, v in inputs.items()}

    def unchanged() -> None:
        for k, v in inputs.items():
            assert torch.equal(v.detach(), saved[k][0]), k
            assert v._version == saved[k][1], k

    with torch.no_grad():
        run(spec, p, where.backend, cu=case.cu)
    unchanged()
    for v in inputs.values():
        v.requires_grad_()
    out, final = run(spec, p, where.backend, cu=case.cu)
    (out.sum() + final.sum()).backward()
    unchanged()


def _auto(spec: ScanSpec) -> list[Case]:
    return [Case(spec, Target("auto", "cpu"), spec.options("auto", spec.main_form()))]


@shared(_auto)
def test_auto_is_the_first_backend_that_runs(case: Case, gen: torch.Generator) -> None:
    """backend="auto" on CPU tensors takes the row's first backend that runs on the
    CPU: the same bits."""
    spec = case.spec
    p = cast(spec, case.problem(gen), F32)
    first = next(b for b in spec.backends if b in ps.backends("cpu"))
    for got, want in zip(run(spec, p, "auto"), run(spec, p, first), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def combinations(optional: Sequence[str]) -> list[tuple[str, ...]]:
    """None, each alone, all but each, all (each optional argument absent and present,
    alone and with all the others)."""
    found = [(), tuple(optional)]
    found += [(name,) for name in optional]
    found += [tuple(n for n in optional if n != name) for name in optional]
    return list(dict.fromkeys(found))


def _optional(spec: ScanSpec) -> list[Case]:
    forms = spec.optional_forms
    if forms is None:
        forms = (spec.main if spec.main is not None else list(spec.forms)[-1],)
    packings: list[tuple[str, Options]] = [("", {"length": 9})]
    if spec.packs:
        packings.append(("packed", {"cu": (0, 3, 3, 9)}))
    return [
        Case(
            spec,
            t,
            spec.options("optional", spec.tiny, spec.forms[form], own=options),
            _label(form, "+".join(present) or "none", packed),
            flag=present,
        )
        for t in spec.targets()
        for form in forms
        for present in combinations(spec.optional)
        for packed, options in packings
    ]


@shared(_optional)
@_refusing
def test_optional_arguments_absent_or_present(case: Case, gen: torch.Generator) -> None:
    """Each optional argument absent or present, alone and with the others: forward and
    the backward of every present input in float64 against the loop."""
    spec, where, cu = case.spec, case.target, case.cu
    p = case.problem(gen)
    for name in spec.optional:
        if name not in case.flag:
            p[name] = None
    check_forward(spec, p, where, F64, cu)
    check_gradients(spec, p, where, cu, dtype=F64)
