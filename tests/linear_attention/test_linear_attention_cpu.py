"""Linear attention's C kernel (backend "cpu", linear_attention/cpu.c) against the float64
loop (oracles.linear_attention_loop): outputs, final states and every gradient on the
shapes that exercise its register blocks (K around their rows, V around the column
blocks and the vector widths, 1 and 3 included), lengths around the 64-step chunks,
grouped heads, every gate form, with and without an initial state, packed sequences with
empty ones, both instruction-set builds, the same bits with any thread count, decays
that leave the kernel's frames (strong, -inf resets, growth), the decoding step, NaN
causality, the plain inference path, and the guard in front of the kernel."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import pytest
import torch

import parascan as ps
from parascan._native import arg_struct, kernel
from parascan.linear_attention import api
from parascan.linear_attention import cpu as la_cpu

from conftest import assert_matches, simd_path, threads
from harness import assert_within_scale, kernel_against_loop
from oracles import linear_attention_loop

F64 = torch.float64
NAMES = ("q", "k", "v", "g", "initial")
SCALE = 0.5


def _problem(
    seed: int, batch: int, length: int, hk: int, hv: int, dk: int, dv: int, gate: str,
    states: int | None = None, initial: bool = True,
) -> dict[str, torch.Tensor]:  # fmt: skip
    """Float64 operands; gate "none", "head" or "channel" (log decays in [-2, 0])."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=F64)

    p = {
        "q": rand(batch, length, hk, dk),
        "k": rand(batch, length, hk, dk) * dk**-0.5,
        "v": rand(batch, length, hv, dv),
    }
    if gate == "head":
        p["g"] = -2 * torch.rand(batch, length, hv, generator=gen, dtype=F64)
    elif gate == "channel":
        p["g"] = -2 * torch.rand(batch, length, hv, dk, generator=gen, dtype=F64)
    if initial:
        p["initial"] = rand(batch if states is None else states, hv, dk, dv)
    return p


def _grads(
    p: dict[str, torch.Tensor], dtype: torch.dtype, backend: str | None, cu: list[int] | None
) -> list[torch.Tensor]:
    """out, final and the gradients of every input under fixed output weights, by
    ``backend`` in ``dtype`` (None: the float64 loop)."""
    leaves = {k: v.detach().to(dtype).requires_grad_() for k, v in p.items()}
    if backend is None:
        out, final = linear_attention_loop(**leaves, scale=SCALE, cu_seqlens=cu)
    else:
        cu_t = None if cu is None else torch.tensor(cu)
        out, final = ps.linear_attention_scan(
            leaves["q"], leaves["k"], leaves["v"], g=leaves.get("g"), scale=SCALE,
            initial=leaves.get("initial"), return_final=True, cu_seqlens=cu_t, backend=backend,
        )  # fmt: skip
    gen = torch.Generator().manual_seed(7)
    w_out = torch.randn(out.shape, generator=gen, dtype=F64).to(out.dtype)
    w_fin = torch.randn(final.shape, generator=gen, dtype=F64).to(final.dtype)
    loss = (out * w_out).sum() + (final * w_fin).sum()
    if loss.requires_grad:  # not for the loop on an empty input without a state
        loss.backward()
    # the loop reaches no q, k, v or g of an empty sequence: zeros
    grads = [leaves[k].grad for k in NAMES if k in leaves]
    zeros = [torch.zeros_like(leaves[k]) for k in NAMES if k in leaves]
    return [
        out.detach(), final.detach(),
        *(z if t is None else t for t, z in zip(grads, zeros, strict=True)),
    ]  # fmt: skip


def _check(
    p: dict[str, torch.Tensor], dtype: torch.dtype, cu: list[int] | None = None, key: object = None
) -> None:
    """The kernel against the loop (``key``: the problem's name, its loop run once)."""
    named = None if key is None else (__name__, key)
    names = ("out", "final", *(k for k in NAMES if k in p))
    kernel_against_loop(_grads, names, p, dtype, cu, named, 2e-5)


# K and V through 1, 3, 65 and 129 (register blocks of 4 or 8 rows; column blocks of 8 to
# 32 lanes, by level and type), each pair with a length around the 64-step chunks.
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
        p = _problem(1, batch, length, 1, hv, dk, dv, gate, initial=dk != 3)
        _check(p, dtype, key=("awkward", shape))


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("gate", ["none", "head", "channel"])
@pytest.mark.parametrize("initial", [True, False], ids=["initial", "zeros"])
@pytest.mark.parametrize("length", LENGTHS)
def test_lengths_against_loop(length: int, initial: bool, gate: str, dtype: torch.dtype) -> None:
    p = _problem(2, 2 if length < 100 else 1, length, 1, 2, 9, 35, gate, initial=initial)
    _check(p, dtype, key=("lengths", length, initial, gate))


# The column blocks' edges (16 or 32 floats, 8 or 16 doubles on the vector levels, 8 and
# 4 on the baseline) and the register blocks' (4 or 8 rows).
@pytest.mark.parametrize("simd", [True, False], ids=["simd", "portable"])
@pytest.mark.parametrize("dv", [4, 8, 15, 16, 17, 32, 33, 64])
@pytest.mark.parametrize("dk", [4, 5, 8, 9])
def test_block_edges_against_loop(dk: int, dv: int, simd: bool) -> None:
    with simd_path(simd):
        _check(_problem(3, 1, 66, 1, 2, dk, dv, "channel"), torch.float32, key=("edges", dk, dv))


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


@pytest.mark.parametrize("gate", ["head", "channel"])
def test_decays_that_leave_the_frames(gate: str) -> None:
    """The kernel reads the state in frames rescaled by the decays since the last rebase
    (cpu.c): strong decays (a rebase every step or two), -inf resets, decays that grow
    the state and long runs of weak ones all give the loop's results."""
    p = _problem(5, 1, 150, 1, 2, 12, 40, gate)
    gen = torch.Generator().manual_seed(9)
    g = p["g"].clone()
    g[:, 10:30] *= 15  # down to -30 a step
    g[:, 40:100] *= 0.01  # weak: one frame over a whole chunk
    g[:, 35] = -torch.inf  # a reset
    g[:, 110:120] = 0.3 * torch.rand(g[:, 110:120].shape, generator=gen, dtype=F64)  # growth
    p["g"] = g
    want = _grads(p, F64, None, None)
    for dtype, tol in ((torch.float32, 2e-5), (F64, 1e-11)):
        got = _grads(p, dtype, "cpu", None)
        assert_within_scale(("out", "final", *NAMES), want, got, tol)


@pytest.mark.parametrize(
    "shape", [(2, 150, 2, 6, 16, 70), (1, 130, 1, 1, 24, 100)], ids=["grouped", "one-head"]
)
@pytest.mark.parametrize("gate", ["none", "head", "channel"])
def test_the_same_bits_with_any_thread_count(shape: tuple[int, ...], gate: str) -> None:
    """Grouped heads (their q and k gradients summed in head order) and a single head
    (its column blocks split between threads in the forward)."""
    batch, length, hk, hv, dk, dv = shape
    p = _problem(6, batch, length, hk, hv, dk, dv, gate)
    runs = []
    for n in (1, 2, 3):
        with threads(n):
            runs.append(_grads(p, torch.float32, "cpu", None))
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            assert torch.equal(a, b)


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


@pytest.mark.parametrize("simd", [True, False], ids=["simd", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("gate", ["none", "head", "channel"])
@pytest.mark.parametrize(
    "shape", [(2, 3, 6, 64, 128), (1, 2, 2, 17, 100), (1, 1, 1, 5, 3)], ids=["128", "100", "3"]
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
    last = {k: v[:, -1:].contiguous() for k, v in p.items() if k != "initial"}
    with simd_path(simd), torch.no_grad():
        out, final = ps.linear_attention_scan(
            p["q"], p["k"], p["v"], g=p.get("g"), scale=SCALE, initial=p["initial"],
            return_final=True,
        )  # fmt: skip
        head = {k: v[:, :-1].contiguous() for k, v in p.items() if k != "initial"}
        _, state = ps.linear_attention_scan(
            head["q"], head["k"], head["v"], g=head.get("g"), scale=SCALE, initial=p["initial"],
            return_final=True,
        )  # fmt: skip
        step = ps.linear_attention_scan(
            last["q"], last["k"], last["v"], g=last.get("g"), scale=SCALE, initial=state,
            return_final=True,
        )  # fmt: skip
        args = (last["q"] * SCALE, last["k"], last["v"], last.get("g"), state, None)
        general = la_cpu.forward(*args, keep=True)
        single = la_cpu.forward(*args, keep=False)
        no_final = la_cpu.forward(*args, want_final=False, keep=False)
    assert torch.equal(single[0], general[0]) and torch.equal(single[1], general[1])
    assert torch.equal(no_final[0], general[0]) and no_final[1].shape[0] == 0
    assert_matches(step[0], out[:, -1:].double(), dtype)
    assert_matches(step[1], final.double(), dtype)


@pytest.mark.parametrize(
    ("gate", "operand"),
    [
        (gate, operand)
        for gate in ("none", "head", "channel")
        for operand in "qkvg"
        if gate != "none" or operand != "g"
    ],
)
def test_a_nan_leaves_the_outputs_before_it_finite(gate: str, operand: str) -> None:
    """A NaN at step t (in any operand) reaches the outputs from t on, never those
    before it (the frames and the chunks' sums look at no later step)."""
    p = {k: v.float() for k, v in _problem(9, 1, 150, 1, 2, 20, 40, gate).items()}
    for t in (0, 5, 63, 64, 100):
        bad = {k: v.clone() for k, v in p.items()}
        bad[operand][:, t] = torch.nan
        with torch.no_grad():
            out = ps.linear_attention_scan(
                bad["q"], bad["k"], bad["v"], g=bad.get("g"), initial=bad["initial"], backend="cpu"
            )
        assert torch.isfinite(out[:, :t]).all(), (operand, t)
        assert torch.isnan(out[:, t]).any(), (operand, t)


def test_empty_inputs() -> None:
    """L = 0 (the final state is the initial one) and packed offsets [0] (no sequence)."""
    q, v = torch.randn(1, 0, 1, 4), torch.randn(1, 0, 2, 3)
    h0 = torch.randn(1, 2, 4, 3)
    out, final = ps.linear_attention_scan(q, q, v, initial=h0, return_final=True, backend="cpu")
    assert out.shape == (1, 0, 2, 3) and torch.equal(final, h0)
    cu = torch.tensor([0])
    leaves = [t.clone().requires_grad_() for t in (q, q, v)]
    out, final = ps.linear_attention_scan(*leaves, cu_seqlens=cu, return_final=True, backend="cpu")
    assert out.shape == (1, 0, 2, 3) and final.shape == (0, 2, 4, 3)
    (out.sum() + final.sum()).backward()
    assert all(t.grad is not None and t.grad.shape == t.shape for t in leaves)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("gate", ["none", "head", "channel"])
@pytest.mark.parametrize("length", [1, 70])
def test_a_plain_inference_call_goes_to_the_kernel_at_once(
    monkeypatch: pytest.MonkeyPatch, length: int, gate: str, dtype: torch.dtype
) -> None:
    """An eager call that nothing differentiates, on contiguous CPU tensors of one float
    dtype (a decoding step's), skips the general path's validation and casts: the same
    bits as that path (which scales q in the kernel too), which the calls it declines
    still take (and which raises on bad input)."""
    p = {k: v.to(dtype) for k, v in _problem(10, 2, length, 2, 4, 17, 33, gate).items()}
    args = [p.pop(k) for k in ("q", "k", "v")]
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
        got = ps.linear_attention_scan(*args, **kwargs)
        monkeypatch.setattr(api, "plain_inference", general)
        want = ps.linear_attention_scan(*args, **kwargs)
        for a, b in zip(got, want, strict=True) if options["return_final"] else [(got, want)]:
            assert torch.equal(a, b)
    assert taken == [True] * 5

    monkeypatch.setattr(api, "plain_inference", spy)
    q, k, v = args
    declined = [
        ((torch.cat([q, q], -1)[..., : q.shape[-1]], k, v), {}),  # strided q
        ((q, k, v.to(torch.bfloat16)), {}),  # a dtype to cast
        ((q, k, v), {"backend": "torch"}),
        ((q, k, v), {"return_final": 1}),  # not a flag: the general path raises
    ]
    for call_args, options in declined:
        taken.clear()
        if "return_final" in options:
            with pytest.raises(TypeError, match="return_final"):
                ps.linear_attention_scan(*call_args, **p, **options)
        else:
            ps.linear_attention_scan(*call_args, **p, **options)
        assert taken == [False]
    leaf = q.clone().requires_grad_()
    taken.clear()
    ps.linear_attention_scan(leaf, k, v, **p)
    with torch.no_grad():
        ps.linear_attention_scan(leaf, k, v, **p)
    assert taken == [False, True]


def test_auto_picks_the_kernel_on_cpu() -> None:
    p = {k: v.float() for k, v in _problem(11, 1, 70, 1, 2, 8, 24, "channel").items()}
    leaves = [p[k].clone().requires_grad_() for k in ("q", "k", "v")]
    auto = ps.linear_attention_scan(*leaves, g=p["g"], initial=p["initial"])
    cpu = ps.linear_attention_scan(*leaves, g=p["g"], initial=p["initial"], backend="cpu")
    assert torch.equal(auto, cpu)


def test_without_the_kernel_library_torch_takes_over() -> None:
    """PARASCAN_KERNEL_LIBRARY naming no file: "auto" falls back to the torch backend,
    the plain inference path included."""
    code = (
        "import torch, parascan as ps\n"
        "q = torch.randn(1, 5, 1, 4); v = torch.randn(1, 5, 2, 3)\n"
        "with torch.no_grad():\n"
        "    o = ps.linear_attention_scan(q, q, v, g=-torch.rand(1, 5, 2))\n"
        "o2 = ps.linear_attention_scan(q.requires_grad_(), q, v)\n"
        "o2.sum().backward()\n"
        "try:\n"
        "    ps.linear_attention_scan(q, q, v, backend='cpu')\n"
        "except Exception as e:\n"
        "    print('refused', type(e).__name__)\n"
        "print(tuple(o.shape))\n"
    )
    env = {**os.environ, "PARASCAN_KERNEL_LIBRARY": "/nonexistent/x.so"}
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert "refused" in done.stdout and "(1, 5, 2, 3)" in done.stdout


def test_bad_operands_reaching_the_kernel_raise() -> None:
    """The guard in front of the kernel (cpu.py) and the kernel's own checks refuse what
    the public function never hands them, rather than read out of bounds."""
    q, v = torch.randn(1, 10, 2, 4), torch.randn(1, 10, 4, 3)
    g = torch.randn(1, 10, 4)
    with pytest.raises(RuntimeError, match="internal error"):
        la_cpu.forward(q, q[:, :, :1], v, None, None, None)  # k's shape
    with pytest.raises(RuntimeError, match="internal error"):
        la_cpu.forward(q, q, v, g[..., :3], None, None)  # g's
    with pytest.raises(RuntimeError, match="internal error"):
        la_cpu.forward(q, q, v, None, torch.randn(2, 4, 4, 3), None)  # initial's rows
    with pytest.raises(RuntimeError, match="internal error"):
        la_cpu.forward(q, q, v[:, :, :3], None, None, None)  # 3 value heads for 2
    with pytest.raises(RuntimeError, match="internal error"):
        la_cpu.forward(q, q, v.double(), None, None, None)  # dtypes
    with pytest.raises(RuntimeError, match="kernel failed"):
        la_cpu.forward(q, q, v, None, None, torch.tensor([0, 6, 4, 10]))  # offsets decrease
    with pytest.raises(RuntimeError, match="kernel failed"):
        la_cpu.forward(q, q, v, None, None, torch.tensor([0, 4, 11]))  # past L
    out, _, checkpoints = la_cpu.forward(q, q, v, None, None, None)
    with pytest.raises(RuntimeError, match="internal error"):
        la_cpu.backward(q, q, v, None, None, None, checkpoints[:, :0], out, out[:0])
    # the kernel's own checks, on structs the bindings never build
    fwd = kernel("linear_attention_fwd", torch.float32)
    one = int.from_bytes(bytearray(ctypes.c_double(1.0)), "little")
    plain = {
        "batch": 1, "length": 10, "kheads": 2, "dk": 4, "dv": 3, "chunk": 64, "scale_bits": one,
        "q": q.data_ptr(), "k": q.data_ptr(), "v": v.data_ptr(),
    }  # fmt: skip
    assert fwd(arg_struct("linear_attention", **plain, heads=3)) == -1  # 2 does not divide 3
    assert fwd(arg_struct("linear_attention", **plain, heads=4, gate=3)) == -1
    assert fwd(arg_struct("linear_attention", **plain, heads=4)) == -1  # no out
    nan = int.from_bytes(bytearray(ctypes.c_double(float("nan"))), "little")
    assert fwd(arg_struct("linear_attention", **{**plain, "scale_bits": nan}, heads=4)) == -1
    bwd = kernel("linear_attention_bwd", torch.float32)
    two = int.from_bytes(bytearray(ctypes.c_double(2.0)), "little")
    assert bwd(arg_struct("linear_attention", **{**plain, "scale_bits": two}, heads=4)) == -1
