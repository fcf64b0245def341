"""The generalized delta rule's C kernel (backend "cpu", dplr/cpu.c) against the float64
loop (oracles.dplr_delta_rule_loop): outputs, final states and every gradient on the
shapes that exercise its column blocks (V around the vector widths and blocks, K odd and
even, 1 and 3 included), lengths around the 64-step chunks, grouped heads, every gate
form, with and without an initial state, packed sequences with empty ones, both
instruction-set builds, the same bits with any thread count, the decoding step, NaN
causality, the plain inference path, and the guard in front of the kernel."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

import parascan as ps
from parascan._native import arg_struct, kernel
from parascan.dplr import api
from parascan.dplr import cpu as dplr_cpu

from conftest import assert_matches, simd_path, threads
from harness import assert_within_scale, kernel_against_loop
from oracles import dplr_delta_rule_loop

F64 = torch.float64
NAMES = ("q", "k", "v", "a", "b", "g", "initial")
SCALE = 0.5


def _problem(
    seed: int, batch: int, length: int, hk: int, hv: int, dk: int, dv: int, gate: str,
    states: int | None = None, initial: bool = True,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """Float64 operands: RWKV-7's form (a = -kk, b = kk * rate, kk unit rows, rate in
    (0, 1)) with a random sign flip of b on odd seeds (a transition that may grow);
    gate "none", "head" or "channel" (log decays in [-1, 0])."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=F64)

    keyed = (batch, length, hk, dk)
    kk = F.normalize(rand(*keyed), dim=-1)
    rate = torch.rand(keyed, generator=gen, dtype=F64)
    p = {
        "q": rand(*keyed),
        "k": rand(*keyed) * dk**-0.5,
        "v": rand(batch, length, hv, dv),
        "a": -kk,
        "b": kk * rate * (0.5 if seed % 2 else 1.0),
    }
    if gate == "head":
        p["g"] = -torch.rand(batch, length, hv, generator=gen, dtype=F64)
    elif gate == "channel":
        p["g"] = -torch.rand(batch, length, hv, dk, generator=gen, dtype=F64)
    if initial:
        p["initial"] = rand(batch if states is None else states, hv, dk, dv)
    return p


def _grads(
    p: dict[str, torch.Tensor], dtype: torch.dtype, backend: str | None, cu: list[int] | None
) -> list[torch.Tensor]:
    """out, final and the gradients of every input under fixed output weights, by
    ``backend`` in ``dtype`` (None: the float64 loop)."""
    leaves = {k: v.detach().to(dtype).requires_grad_() for k, v in p.items()}
    operands = [leaves[k] for k in ("q", "k", "v", "a", "b")]
    if backend is None:
        out, final = dplr_delta_rule_loop(
            *operands, g=leaves.get("g"), scale=SCALE, initial=leaves.get("initial"),
            cu_seqlens=cu,
        )  # fmt: skip
    else:
        cu_t = None if cu is None else torch.tensor(cu)
        out, final = ps.dplr_delta_rule_scan(
            *operands, g=leaves.get("g"), scale=SCALE, initial=leaves.get("initial"),
            return_final=True, cu_seqlens=cu_t, backend=backend,
        )  # fmt: skip
    gen = torch.Generator().manual_seed(7)
    w_out = torch.randn(out.shape, generator=gen, dtype=F64).to(out.dtype)
    w_fin = torch.randn(final.shape, generator=gen, dtype=F64).to(final.dtype)
    loss = (out * w_out).sum() + (final * w_fin).sum()
    if loss.requires_grad:  # not for the loop on an empty input without a state
        loss.backward()
    # the loop reaches no operand of an empty sequence: zeros
    return [
        out.detach(), final.detach(),
        *(torch.zeros_like(leaves[k]) if leaves[k].grad is None else leaves[k].grad
          for k in NAMES if k in leaves),
    ]  # fmt: skip


def _check(
    p: dict[str, torch.Tensor], dtype: torch.dtype, cu: list[int] | None = None, key: object = None
) -> None:
    """The kernel against the loop (``key``: the problem's name, its loop run once)."""
    named = None if key is None else (__name__, key)
    names = ("out", "final", *(k for k in NAMES if k in p))
    kernel_against_loop(_grads, names, p, dtype, cu, named, 5e-5)


# K and V through 1, 3, 65 and 129 (column blocks of 8 to 32 lanes, by level and type;
# the sweeps take rows in pairs), each pair with a length around the 64-step chunks.
SIZES = (1, 3, 65, 129)
LENGTHS = (0, 1, 2, 63, 64, 65, 129)
SHAPES = [
    (dk, dv, LENGTHS[(i * 4 + j) % len(LENGTHS)], ("none", "head", "channel")[(i + j) % 3])
    for i, dk in enumerate(SIZES)
    for j, dv in enumerate(SIZES)
]


@pytest.mark.parametrize("simd", [True, False], ids=["simd", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "K{}-V{}-L{}-{}".format(*s))
def test_awkward_shapes_against_loop(
    shape: tuple[int, int, int, str], dtype: torch.dtype, simd: bool
) -> None:
    dk, dv, length, gate = shape
    hv = 2 if (dk + dv) % 2 else 1  # grouped value heads on half of them
    batch = 2 if length < 100 else 1  # the loop's time
    with simd_path(simd):
        p = _problem(dk, batch, length, 1, hv, dk, dv, gate, initial=dk != 3)
        _check(p, dtype, key=("awkward", shape))


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("gate", ["none", "head", "channel"])
@pytest.mark.parametrize("initial", [True, False], ids=["initial", "zeros"])
@pytest.mark.parametrize("length", (1, 63, 65, 129))
def test_lengths_against_loop(length: int, initial: bool, gate: str, dtype: torch.dtype) -> None:
    _check(
        _problem(length, 2 if length < 100 else 1, length, 1, 2, 9, 35, gate, initial=initial),
        dtype,
        key=("lengths", length, initial, gate),
    )


# The column blocks' edges: 8 to 32 lanes by level and type.
@pytest.mark.parametrize("simd", [True, False], ids=["simd", "portable"])
@pytest.mark.parametrize("dv", [4, 8, 15, 16, 17, 32, 33, 64])
def test_block_edges_against_loop(dv: int, simd: bool) -> None:
    with simd_path(simd):
        _check(_problem(dv, 1, 66, 2, 4, 6, dv, "channel"), torch.float32, key=("edges", dv))


# The backward sweeps a step's column blocks together, as many as a chunk's rebuilt
# states of 1 MiB hold (dplr/cpu_kernel.h): at K = 33, V = 129 and full 64-step chunks,
# groups of 7 and 2 of 9 blocks (AVX2, float32), 3 and 2 of 5 (AVX-512), 15 and 2 of 17
# (portable); float64 7, 7, 3 (AVX2), 3, 3, 3 (AVX-512), 15, 15, 3 (portable); with K's
# last rows past a multiple of the vector width, every gate form, and packed sequences
# ending inside a chunk.
@pytest.mark.parametrize("simd", [True, False], ids=["simd", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("gate", ["none", "head", "channel"])
def test_column_block_groups_against_loop(gate: str, dtype: torch.dtype, simd: bool) -> None:
    cu = [0, 70, 70, 150]
    p = _problem(15, 1, cu[-1], 1, 1, 33, 129, gate, states=len(cu) - 1)
    with simd_path(simd):
        _check(p, dtype, cu, key=("block groups", gate))


# The forward's frames (dplr/cpu.c): a channel's decays summed since its frame began,
# log lam, stay within +-16 (float32) or +-32 (float64), else the step rebases. Per key
# channel: a decay that leaves the bound in one step, none at all (a frame for the whole
# chunk), growth, slow and middling decays; per head, each of those on its own.
FRAME_DECAYS = {"leaves": -40.0, "none": 0.0, "grows": 0.3, "slow": -1e-3, "middling": -3.0}


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("gate", ["head", "channel"])
@pytest.mark.parametrize("decay", [*FRAME_DECAYS, "mixed"])
def test_frames_against_loop(decay: str, gate: str, dtype: torch.dtype) -> None:
    p = _problem(13, 1, 100, 1, 2, 5, 20, gate)
    values = torch.tensor(list(FRAME_DECAYS.values()), dtype=F64)
    if decay != "mixed":
        p["g"] = torch.full_like(p["g"], FRAME_DECAYS[decay])
    elif gate == "channel":  # a column each
        p["g"] = values.expand_as(p["g"]).clone()
    else:  # a run of steps each
        p["g"] = values.repeat_interleave(20)[: p["g"].shape[1], None].expand_as(p["g"]).clone()
    _check(p, dtype, key=("frames", decay, gate))


@pytest.mark.parametrize("gate", ["head", "channel"])
def test_a_decay_of_zero_against_loop(gate: str) -> None:
    """g = -inf (d = 0, log lam not finite: the step rebases) at steps 30 and 70: the
    state keeps only b a^T S there, and no frame carries anything else over."""
    p = {k: v.float() for k, v in _problem(14, 1, 100, 1, 2, 9, 20, gate).items()}
    p["g"][:, [30, 70]] = -torch.inf
    with torch.no_grad():
        out, final = _call(p, p["initial"], return_final=True)
    want, want_final = dplr_delta_rule_loop(
        *(p[k].double() for k in ("q", "k", "v", "a", "b")), g=p["g"].double(),
        scale=SCALE, initial=p["initial"].double(),
    )  # fmt: skip
    assert torch.isfinite(out).all()
    assert_matches(out, want, torch.float32)
    assert_matches(final, want_final, torch.float32)


# Packed sequences: empty ones, boundaries on, before and after the checkpoints at 64 and
# 128, a sequence of one step.
PACKED = [
    [0, 0, 64, 65, 130, 130, 131, 200],
    [0, 63, 64, 128, 129, 129],
    [0, 1, 140],
]


@pytest.mark.parametrize("simd", [True, False], ids=["simd", "portable"])
@pytest.mark.parametrize("gate", ["none", "head", "channel"])
@pytest.mark.parametrize("cu", PACKED, ids=str)
def test_packed_against_loop(cu: list[int], gate: str, simd: bool) -> None:
    p = _problem(4, 1, cu[-1], 1, 2, 9, 35, gate, states=len(cu) - 1)
    with simd_path(simd):
        _check(p, torch.float32, cu, key=("packed", gate))
        _check(p, F64, cu, key=("packed", gate))
        del p["initial"]
        _check(p, torch.float32, cu, key=("packed", gate, "no initial"))


@pytest.mark.parametrize(
    "shape", [(2, 150, 2, 6, 16, 70), (1, 130, 1, 1, 24, 100)], ids=["grouped", "one-head"]
)
@pytest.mark.parametrize("gate", ["none", "head", "channel"])
def test_the_same_bits_with_any_thread_count(shape: tuple[int, ...], gate: str) -> None:
    """Grouped heads (their q, k, a and b gradients summed in head order) and a single
    head (its column blocks split between threads in the forward)."""
    batch, length, hk, hv, dk, dv = shape
    p = _problem(6, batch, length, hk, hv, dk, dv, gate)
    runs = []
    for n in (1, 2, 3):
        with threads(n):
            runs.append(_grads(p, torch.float32, "cpu", None))
    for other in runs[1:]:
        for x, y in zip(runs[0], other, strict=True):
            assert torch.equal(x, y)


@pytest.mark.parametrize("gate", ["none", "channel"])
def test_a_decoding_step_gives_the_same_bits_with_any_thread_count(gate: str) -> None:
    """RWKV-7 2.9B's step (40 heads of 64 x 64, 2^17.3 state elements) on the inference
    path, no autograd: it went from one thread to several when the kernels' threshold
    came down to 2^16 elements."""
    p = {k: t.float() for k, t in _problem(8, 1, 1, 40, 40, 64, 64, gate).items()}
    runs = []
    for n in (1, 2, 3):
        with threads(n), torch.no_grad():
            runs.append(
                ps.dplr_delta_rule_scan(
                    p["q"], p["k"], p["v"], p["a"], p["b"], g=p.get("g"), initial=p["initial"],
                    return_final=True,
                )
            )  # fmt: skip
    for other in runs[1:]:
        assert all(torch.equal(x, y) for x, y in zip(runs[0], other, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("gate", ["none", "head", "channel"])
def test_the_baseline_build_agrees_with_the_vector_one(gate: str, dtype: torch.dtype) -> None:
    p = _problem(7, 1, 100, 1, 2, 37, 53, gate)
    with simd_path(False):
        portable = _grads(p, dtype, "cpu", None)
    with simd_path(True):
        vector = _grads(p, dtype, "cpu", None)
    names = ("out", "final", *(k for k in NAMES if k in p))
    tol = 1e-12 if dtype == F64 else 1e-5
    assert_within_scale(names, [t.double() for t in portable], vector, tol)


def _call(p: dict[str, torch.Tensor], initial: torch.Tensor | None, **kw: object) -> object:
    return ps.dplr_delta_rule_scan(
        p["q"], p["k"], p["v"], p["a"], p["b"], g=p.get("g"), scale=SCALE, initial=initial,
        **kw,
    )  # fmt: skip


@pytest.mark.parametrize("simd", [True, False], ids=["simd", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("gate", ["none", "head", "channel"])
@pytest.mark.parametrize(
    "shape", [(1, 4, 4, 64, 64), (1, 2, 2, 17, 100), (1, 1, 1, 5, 3)], ids=["64", "100", "3"]
)
def test_the_decoding_step_is_the_scans_step(
    shape: tuple[int, ...], gate: str, dtype: torch.dtype, simd: bool
) -> None:
    """A call of one step from a state that nothing differentiates (a decoding step,
    which reads and writes the state in place, streamed where aligned) gives the bits of
    the same step through the kernel's general path (kept for a backward), and continues
    a scan: the scan's last output and final state, to rounding."""
    batch, hk, hv, dk, dv = shape
    p = {k: v.to(dtype) for k, v in _problem(8, batch, 40, hk, hv, dk, dv, gate).items()}
    steps = {k: v for k, v in p.items() if k != "initial"}
    last = {k: v[:, -1:].contiguous() for k, v in steps.items()}
    head = {k: v[:, :-1].contiguous() for k, v in steps.items()}
    with simd_path(simd), torch.no_grad():
        out, final = _call(p, p["initial"], return_final=True)
        _, state = _call(head, p["initial"], return_final=True)
        step = _call(last, state, return_final=True)
        args = (last["q"] * SCALE, last["k"], last["v"], last["a"], last["b"], last.get("g"),
                state, None)  # fmt: skip
        general = dplr_cpu.forward(*args, keep=True)
        single = dplr_cpu.forward(*args, keep=False)
        no_final = dplr_cpu.forward(*args, want_final=False, keep=False)
    assert torch.equal(single[0], general[0]) and torch.equal(single[1], general[1])
    assert torch.equal(no_final[0], general[0]) and no_final[1].shape[0] == 0
    assert_matches(step[0], out[:, -1:].double(), dtype)
    assert_matches(step[1], final.double(), dtype)


@pytest.mark.parametrize(
    ("gate", "operand"),
    [
        (gate, operand)
        for gate in ("none", "channel")
        for operand in ("q", "k", "v", "a", "b", "g")
        if gate != "none" or operand != "g"
    ],
)
def test_a_nan_leaves_the_outputs_before_it_finite(gate: str, operand: str) -> None:
    """A NaN at step t (in any operand) reaches the outputs from t on, never those
    before it."""
    p = {k: v.float() for k, v in _problem(9, 1, 150, 1, 2, 20, 40, gate).items()}
    for t in (0, 5, 63, 64, 100):
        bad = {k: v.clone() for k, v in p.items()}
        bad[operand][:, t] = torch.nan
        with torch.no_grad():
            out = _call(bad, bad["initial"], backend="cpu")
        assert isinstance(out, torch.Tensor)
        assert torch.isfinite(out[:, :t]).all(), (operand, t)
        assert torch.isnan(out[:, t:]).any(), (operand, t)


def test_empty_inputs() -> None:
    """L = 0 (the final state is the initial one) and packed offsets [0] (no sequence)."""
    q, v = torch.randn(1, 0, 1, 4), torch.randn(1, 0, 2, 3)
    h0 = torch.randn(1, 2, 4, 3)
    out, final = ps.dplr_delta_rule_scan(
        q, q, v, q, q, initial=h0, return_final=True, backend="cpu"
    )
    assert out.shape == (1, 0, 2, 3) and torch.equal(final, h0)
    cu = torch.tensor([0])
    leaves = [t.clone().requires_grad_() for t in (q, q, v, q, q)]
    out, final = ps.dplr_delta_rule_scan(*leaves, cu_seqlens=cu, return_final=True, backend="cpu")
    assert out.shape == (1, 0, 2, 3) and final.shape == (0, 2, 4, 3)
    (out.sum() + final.sum()).backward()
    assert all(t.grad is not None and t.grad.shape == t.shape for t in leaves)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("gate", ["none", "channel"])
@pytest.mark.parametrize("length", [1, 70])
def test_a_plain_inference_call_goes_to_the_kernel_at_once(
    monkeypatch: pytest.MonkeyPatch, length: int, gate: str, dtype: torch.dtype
) -> None:
    """An eager call that nothing differentiates, on contiguous CPU tensors of one float
    dtype (a decoding step's), skips the general path's validation and casts: the same
    bits as that path (which scales q in the kernel too), which the calls it declines
    still take (and which raises on bad input)."""
    p = {k: v.to(dtype) for k, v in _problem(10, 2, length, 2, 4, 17, 33, gate).items()}
    args = [p.pop(k) for k in ("q", "k", "v", "a", "b")]
    check = api.plain_inference
    taken: list[bool] = []

    def spy(*a: object) -> object:
        result = check(*a)
        taken.append(result is not None)
        return result

    def general(*a: object) -> None:
        return None

    for options in (
        {"return_final": True},
        {"scale": 0.3, "return_final": False},
        {"scale": 2, "return_final": True, "backend": "cpu"},
        {"initial": None, "return_final": True},
        {"initial": None, "g": None, "return_final": False},
    ):
        kwargs = {**p, **options}
        monkeypatch.setattr(api, "plain_inference", spy)
        got = ps.dplr_delta_rule_scan(*args, **kwargs)
        monkeypatch.setattr(api, "plain_inference", general)
        want = ps.dplr_delta_rule_scan(*args, **kwargs)
        for x, y in zip(got, want, strict=True) if options["return_final"] else [(got, want)]:
            assert torch.equal(x, y)
    assert taken == [True] * 5

    monkeypatch.setattr(api, "plain_inference", spy)
    q, k, v, a, b = args
    declined = [
        ((q, k, v, torch.cat([a, a], -1)[..., : a.shape[-1]], b), {}),  # strided a
        ((q, k, v, a, b.to(torch.bfloat16)), {}),  # a dtype to cast
        ((q, k, v, a, b), {"backend": "torch"}),
        ((q, k, v, a, b), {"return_final": 1}),  # not a flag: the general path raises
    ]
    for call_args, options in declined:
        taken.clear()
        if "return_final" in options:
            with pytest.raises(TypeError, match="return_final"):
                ps.dplr_delta_rule_scan(*call_args, **p, **options)
        else:
            ps.dplr_delta_rule_scan(*call_args, **p, **options)
        assert taken == [False]
    leaf = b.clone().requires_grad_()
    taken.clear()
    ps.dplr_delta_rule_scan(q, k, v, a, leaf, **p)
    with torch.no_grad():
        ps.dplr_delta_rule_scan(q, k, v, a, leaf, **p)
    assert taken == [False, True]


def test_auto_picks_the_kernel_on_cpu() -> None:
    p = {k: v.float() for k, v in _problem(11, 1, 70, 1, 2, 8, 24, "channel").items()}
    leaves = [p[k].clone().requires_grad_() for k in ("q", "k", "v", "a", "b")]
    auto = ps.dplr_delta_rule_scan(*leaves, g=p["g"], initial=p["initial"])
    cpu = ps.dplr_delta_rule_scan(*leaves, g=p["g"], initial=p["initial"], backend="cpu")
    assert torch.equal(auto, cpu)


def test_bad_operands_reaching_the_kernel_raise() -> None:
    """The guard in front of the kernel (cpu.py) and the kernel's own checks refuse what
    the public function never hands them, rather than read out of bounds."""
    q, v = torch.randn(1, 10, 2, 4), torch.randn(1, 10, 4, 3)
    g = torch.randn(1, 10, 4)
    with pytest.raises(RuntimeError, match="internal error"):
        dplr_cpu.forward(q, q, v, q[:, :, :1], q, None, None, None)  # a's shape
    with pytest.raises(RuntimeError, match="internal error"):
        dplr_cpu.forward(q, q, v, q, q[..., :3], None, None, None)  # b's
    with pytest.raises(RuntimeError, match="internal error"):
        dplr_cpu.forward(q, q, v, q, q, g[..., :3], None, None)  # g's
    with pytest.raises(RuntimeError, match="internal error"):
        dplr_cpu.forward(q, q, v, q, q, None, torch.randn(2, 4, 4, 3), None)  # initial's rows
    with pytest.raises(RuntimeError, match="internal error"):
        dplr_cpu.forward(q, q, v[:, :, :3], q, q, None, None, None)  # 3 value heads for 2
    with pytest.raises(RuntimeError, match="internal error"):
        dplr_cpu.forward(q, q, v, q.double(), q, None, None, None)  # dtypes
    with pytest.raises(RuntimeError, match="kernel failed"):
        dplr_cpu.forward(q, q, v, q, q, None, None, torch.tensor([0, 6, 4, 10]))  # decreasing
    with pytest.raises(RuntimeError, match="kernel failed"):
        dplr_cpu.forward(q, q, v, q, q, None, None, torch.tensor([0, 4, 11]))  # past L
    out, _, checkpoints = dplr_cpu.forward(q, q, v, q, q, None, None, None)
    with pytest.raises(RuntimeError, match="internal error"):
        dplr_cpu.backward(q, q, v, q, q, None, None, None, checkpoints[:, :0], out, out[:0])
    # the kernel's own checks, on structs the bindings never build
    fwd = kernel("dplr_fwd", torch.float32)
    one = int.from_bytes(bytearray(ctypes.c_double(1.0)), "little")
    plain = {
        "batch": 1, "length": 10, "kheads": 2, "dk": 4, "dv": 3, "chunk": 64, "scale_bits": one,
        "q": q.data_ptr(), "k": q.data_ptr(), "v": v.data_ptr(), "a": q.data_ptr(),
        "b": q.data_ptr(),
    }  # fmt: skip
    assert fwd(arg_struct("dplr", **plain, heads=3)) == -1  # 2 does not divide 3
    assert fwd(arg_struct("dplr", **plain, heads=4, gate=3)) == -1
    assert fwd(arg_struct("dplr", **plain, heads=4)) == -1  # no out
    assert fwd(arg_struct("dplr", **{**plain, "a": 0}, heads=4)) == -1  # no a
    nan = int.from_bytes(bytearray(ctypes.c_double(float("nan"))), "little")
    assert fwd(arg_struct("dplr", **{**plain, "scale_bits": nan}, heads=4)) == -1
    bwd = kernel("dplr_bwd", torch.float32)
    two = int.from_bytes(bytearray(ctypes.c_double(2.0)), "little")
    assert bwd(arg_struct("dplr", **{**plain, "scale_bits": two}, heads=4)) == -1
