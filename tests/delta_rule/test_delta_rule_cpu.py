"""The delta rule's C kernel (backend "cpu", delta_rule/cpu.c) against the float64 loop
(oracles.delta_rule_loop), beyond the backend-generic tests of test_delta_rule_scan.py:
the shapes that exercise its column blocks (V around the column blocks and the vector
widths, K not a multiple of any), both instruction-set builds, every gradient in
float32 and float64, packed boundaries on and next to the 64-step checkpoints, the
same bits with any thread count (grouped heads, heads split between threads), and the
forward without a final state."""

from __future__ import annotations

import pytest
import torch

import parascan as ps
from parascan.delta_rule import cpu as delta_cpu

from conftest import assert_matches, simd_path, threads
from harness import kernel_against_loop
from oracles import delta_rule_loop

F64 = torch.float64
NAMES = ("q", "k", "v", "beta", "g", "initial")


def _problem(
    seed: int, batch: int, length: int, hk: int, hv: int, dk: int, dv: int, gate: str,
    states: int | None = None,
) -> dict[str, torch.Tensor]:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=F64)

    def unit(*shape: int) -> torch.Tensor:
        return torch.rand(shape, generator=gen, dtype=F64)

    p = {
        "q": rand(batch, length, hk, dk),
        "k": torch.nn.functional.normalize(rand(batch, length, hk, dk), dim=-1),
        "v": rand(batch, length, hv, dv),
        "beta": 2 * unit(batch, length, hv),
        "initial": rand(batch if states is None else states, hv, dk, dv),
    }
    if gate == "head":
        p["g"] = -2 * unit(batch, length, hv)
    elif gate == "channel":
        p["g"] = -2 * unit(batch, length, hv, dk)
    return p


def _grads(
    p: dict[str, torch.Tensor], dtype: torch.dtype, backend: str | None, cu: list[int] | None
) -> list[torch.Tensor]:
    """out, final and the gradients of every input under fixed output weights, by
    ``backend`` in ``dtype`` (None: the float64 loop)."""
    leaves = {k: v.detach().to(dtype).requires_grad_() for k, v in p.items()}
    if backend is None:
        out, final = delta_rule_loop(**leaves, cu_seqlens=cu)
    else:
        cu_t = None if cu is None else torch.tensor(cu)
        out, final = ps.delta_rule_scan(
            leaves["q"], leaves["k"], leaves["v"], leaves["beta"], g=leaves.get("g"),
            initial=leaves["initial"], return_final=True, cu_seqlens=cu_t, backend=backend,
        )  # fmt: skip
    gen = torch.Generator().manual_seed(7)
    w_out = torch.randn(out.shape, generator=gen, dtype=F64).to(out.dtype)
    w_fin = torch.randn(final.shape, generator=gen, dtype=F64).to(final.dtype)
    ((out * w_out).sum() + (final * w_fin).sum()).backward()
    grads = [leaves[k].grad for k in NAMES if k in leaves]
    assert all(t is not None for t in grads)
    return [out.detach(), final.detach(), *(t for t in grads if t is not None)]


def _check(
    p: dict[str, torch.Tensor], dtype: torch.dtype, cu: list[int] | None = None, key: object = None
) -> None:
    """The kernel against the loop (``key``: the problem's name, its loop run once)."""
    named = None if key is None else (__name__, key)
    names = ("out", "final", *(k for k in NAMES if k in p))
    kernel_against_loop(_grads, names, p, dtype, cu, named, 2e-5)


# (batch, L, Hk, Hv, K, V): Qwen3.5's head (128 x 128), V around the column blocks (64
# floats and 32 doubles with AVX-512, 32 and 16 with AVX2) and below one vector, K not a
# multiple of any vector width, grouped value heads.
SHAPES = [
    (1, 70, 1, 2, 128, 128),
    (2, 65, 2, 4, 17, 33),
    (1, 20, 1, 2, 9, 65),
    (1, 66, 3, 3, 3, 31),
    (2, 20, 1, 3, 100, 5),
    (1, 9, 2, 2, 33, 64),
]


@pytest.mark.parametrize("simd", [True, False], ids=["simd", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("gate", ["none", "head", "channel"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_shapes_against_loop(
    shape: tuple[int, ...], gate: str, dtype: torch.dtype, simd: bool
) -> None:
    with simd_path(simd):
        _check(_problem(1, *shape, gate=gate), dtype, key=(shape, gate))


# Packed sequences: empty ones, boundaries on, before and after the checkpoint at 64 and
# 128, a sequence of one step.
PACKED = [
    [0, 0, 64, 65, 130, 130, 131, 200],
    [0, 63, 64, 128, 129, 129],
    [0, 1, 140],
]


@pytest.mark.parametrize("simd", [True, False], ids=["simd", "portable"])
@pytest.mark.parametrize("gate", ["head", "channel"])
@pytest.mark.parametrize("cu", PACKED, ids=str)
def test_packed_against_loop(cu: list[int], gate: str, simd: bool) -> None:
    p = _problem(2, 1, cu[-1], 1, 2, 9, 35, gate=gate, states=len(cu) - 1)
    with simd_path(simd):
        _check(p, torch.float32, cu, key=gate)
        _check(p, F64, cu, key=gate)


@pytest.mark.parametrize(
    "shape", [(2, 150, 2, 6, 16, 70), (1, 130, 1, 1, 24, 100)], ids=["grouped", "one-head"]
)
@pytest.mark.parametrize("gate", ["head", "channel"])
def test_the_same_bits_with_any_thread_count(shape: tuple[int, ...], gate: str) -> None:
    """Grouped heads (their q and k gradients summed after the units) and a single head
    (its column blocks split between threads in the forward)."""
    p = _problem(3, *shape, gate=gate)
    runs = []
    for n in (1, 2, 4):
        with threads(n):
            runs.append(_grads(p, torch.float32, "cpu", None))
    for other in runs[1:]:
        for a, b in zip(runs[0], other, strict=True):
            assert torch.equal(a, b)


def test_forward_without_a_final_state() -> None:
    p = {k: v.float() for k, v in _problem(4, 1, 140, 1, 2, 8, 40, gate="channel").items()}
    cu = torch.tensor([0, 70, 70, 140])
    p["initial"] = torch.randn(3, 2, 8, 40)
    args = [p[k] for k in ("q", "k", "v", "beta", "g", "initial")]
    out, final, _ = delta_cpu.forward(*args, cu, want_final=False)
    assert final.shape[0] == 0
    want, want_final, _ = delta_cpu.forward(*args, cu)
    assert torch.equal(out, want)
    assert torch.equal(want_final[1], p["initial"][1])  # the empty sequence's: its initial
    loop_final = delta_rule_loop(*args[:5], initial=args[5], cu_seqlens=[0, 70, 70, 140])[1]
    assert_matches(want_final, loop_final, torch.float32)


@pytest.mark.parametrize("l2norm", [True, False])
@pytest.mark.parametrize("gate", ["none", "channel"])
def test_a_call_nothing_differentiates_normalizes_in_the_kernel(gate: str, l2norm: bool) -> None:
    """Without autograd the public function hands the kernel raw q and k (normalized and
    scaled there, no checkpoints stored): the same results, to rounding, as the op's
    path, whose torch ops normalize first."""
    p = {k: v.float() for k, v in _problem(5, 2, 70, 2, 4, 24, 40, gate=gate).items()}
    args = [p.pop(k) for k in ("q", "k", "v", "beta")]
    options = {"qk_l2norm": l2norm, "scale": 0.3, "return_final": True, "backend": "cpu"}
    fast = ps.delta_rule_scan(*args, **p, **options)
    tracked = [t.clone().requires_grad_() for t in args]
    slow = ps.delta_rule_scan(*tracked, **p, **options)
    for a, b in zip(fast, slow, strict=True):
        assert_matches(a, b.detach().double(), torch.float32)


def test_no_sequence_at_all() -> None:
    """cu_seqlens [0] with L = 0 (zero sequences), which the public checks accept: empty
    results, as on the other backends (the kernel once refused it)."""
    q, v, beta = torch.randn(1, 0, 1, 4), torch.randn(1, 0, 2, 3), torch.rand(1, 0, 2)
    cu = torch.tensor([0])
    out, final = ps.delta_rule_scan(q, q, v, beta, cu_seqlens=cu, return_final=True, backend="cpu")
    assert out.shape == (1, 0, 2, 3) and final.shape == (0, 2, 4, 3)
    leaves = [t.clone().requires_grad_() for t in (q, q, v, beta)]
    out, final = ps.delta_rule_scan(*leaves, cu_seqlens=cu, return_final=True, backend="cpu")
    (out.sum() + final.sum()).backward()
    assert all(t.grad is not None and t.grad.shape == t.shape for t in leaves)


@pytest.mark.parametrize("simd", [True, False], ids=["simd", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("gate", ["none", "head", "channel"])
@pytest.mark.parametrize(
    "shape", [(2, 3, 6, 128, 128), (1, 2, 2, 17, 100), (1, 1, 1, 5, 31)], ids=["128", "100", "31"]
)
def test_the_decoding_step_gives_the_bits_of_the_tile_path(
    shape: tuple[int, ...], gate: str, dtype: torch.dtype, simd: bool
) -> None:
    """A call of one step with a state that nothing differentiates reads the state in
    place (whole column blocks; the partial last one, V = 100 or 31, goes through a
    tile): its output and final state have the bits of the tile path, which the same
    call takes when it keeps checkpoints for a backward; and they match the loop."""
    batch, hk, hv, dk, dv = shape
    p = {k: v.to(dtype) for k, v in _problem(6, batch, 1, hk, hv, dk, dv, gate=gate).items()}
    args = [p.get(k) for k in NAMES]
    with simd_path(simd):
        for raw in ((True, 0.25), None):
            tiled = delta_cpu.forward(*args, None, keep=True, raw=raw)
            single = delta_cpu.forward(*args, None, keep=False, raw=raw)
            no_final = delta_cpu.forward(*args, None, want_final=False, keep=False, raw=raw)
            assert torch.equal(single[0], tiled[0]) and torch.equal(single[1], tiled[1])
            assert torch.equal(no_final[0], tiled[0])
    # the last, raw=None: q and k as they are, unscaled
    f64 = {k: v.double() for k, v in p.items()}
    out, final = delta_rule_loop(
        *(f64.get(k) for k in NAMES[:5]), scale=1.0, initial=f64["initial"]
    )
    assert_matches(single[0], out, dtype)
    assert_matches(single[1], final, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("gate", ["none", "head", "channel"])
@pytest.mark.parametrize("length", [1, 70])
def test_a_plain_inference_call_goes_to_the_kernel_at_once(
    monkeypatch: pytest.MonkeyPatch, length: int, gate: str, dtype: torch.dtype
) -> None:
    """An eager call that nothing differentiates, on contiguous CPU tensors of one
    float dtype (a decoding step's), skips the general path's validation and casts:
    the same bits as that path, which the calls it declines still take (and which
    raises on bad input)."""
    from parascan.delta_rule import api

    p = {k: v.to(dtype) for k, v in _problem(8, 2, length, 2, 4, 17, 33, gate=gate).items()}
    args = [p.pop(k) for k in ("q", "k", "v", "beta")]
    check = api._plain_inference
    taken: list[bool] = []

    def spy(*a: object) -> object:
        result = check(*a)
        taken.append(result is not None)
        return result

    def general(*a: object) -> None:
        return None

    # the kernel's struct comes from a template per shape and options (cpu.infer):
    # calls that alternate options on one shape must each get their own
    for options in (
        {"qk_l2norm": True, "return_final": True},
        {"scale": 0.3, "return_final": False},
        {"qk_l2norm": True, "scale": 2, "return_final": True, "backend": "cpu"},
        {"initial": None, "return_final": True},
        {"qk_l2norm": True, "return_final": True},
        {"initial": None, "g": None, "return_final": False},
        # one template (shape, gate, form) with and without initial and the final state
        {"qk_l2norm": True, "return_final": False},
        {"qk_l2norm": True, "initial": None, "return_final": True},
        {"qk_l2norm": True, "initial": None, "return_final": False},
    ):
        kwargs = {**p, **options}
        monkeypatch.setattr(api, "_plain_inference", spy)
        got = ps.delta_rule_scan(*args, **kwargs)
        monkeypatch.setattr(api, "_plain_inference", general)
        want = ps.delta_rule_scan(*args, **kwargs)
        for a, b in zip(got, want, strict=True) if options["return_final"] else [(got, want)]:
            assert torch.equal(a, b)
    assert taken == [True] * 9

    # declined: each call below takes the general path, with the same results
    monkeypatch.setattr(api, "_plain_inference", spy)
    q, k, v, beta = args
    declined = [
        ((torch.cat([q, q], -1)[..., : q.shape[-1]], k, v, beta), {}),  # strided q
        ((q, k, v.to(torch.bfloat16), beta), {}),  # a dtype to cast
        ((q, k, v, beta), {"backend": "torch"}),
        ((q, k, v, beta), {"qk_l2norm": 1}),  # not a flag: the general path raises
    ]
    for call_args, options in declined:
        taken.clear()
        if "qk_l2norm" in options:
            with pytest.raises(TypeError, match="expected qk_l2norm to be a bool"):
                ps.delta_rule_scan(*call_args, **p, **options)
        else:
            ps.delta_rule_scan(*call_args, **p, **options)
        assert taken == [False]
    leaf = q.clone().requires_grad_()
    taken.clear()
    ps.delta_rule_scan(leaf, k, v, beta, **p)
    with torch.no_grad():
        ps.delta_rule_scan(leaf, k, v, beta, **p)
    assert taken == [False, True]
