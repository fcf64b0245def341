"""The SSD scan's C kernel (backend "cpu", ssd/cpu.c) against the float64 loop
(oracles.ssd_loop), beyond the backend-generic tests of test_ssd_scan.py: the shapes
that exercise its vector blocks (headdim and N around multiples of 4, 8 and 16,
headdim split between threads), both instruction-set builds, packed boundaries on and
next to the checkpoint interval, the same bits with any thread count, and that
``backend="auto"`` picks it for CPU tensors."""

from __future__ import annotations

import pytest
import torch

import parascan as ps
from parascan._core import resolve
from parascan.ssd import autograd as ssd_ops
from parascan.ssd import cpu as ssd_cpu

from conftest import assert_matches, simd_path, threads
from harness import assert_within_scale, kernel_against_loop
from oracles import ssd_loop

F64 = torch.float64
NAMES = ("x", "dt", "A", "B", "C", "D", "z", "initial")


def _problem(
    seed: int, batch: int, length: int, heads: int, headdim: int, groups: int, n: int,
    states: int | None = None, d_per_head: bool = False,
) -> dict[str, torch.Tensor]:  # fmt: skip
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g, dtype=F64)

    return {
        "x": rand(batch, length, heads, headdim),
        "dt": torch.rand(batch, length, heads, generator=g, dtype=F64) * 0.5,
        "A": -0.2 - torch.rand(heads, generator=g, dtype=F64),
        "B": rand(batch, length, groups, n),
        "C": rand(batch, length, groups, n),
        "D": rand(heads) if d_per_head else rand(heads, headdim),
        "z": rand(batch, length, heads, headdim),
        "initial": rand(batch if states is None else states, heads, headdim, n),
    }


def _grads(
    p: dict[str, torch.Tensor], dtype: torch.dtype, backend: str | None, cu: list[int] | None
) -> list[torch.Tensor]:
    """out, final and the gradients of every input under fixed output weights, by
    ``backend`` in ``dtype`` (None: the float64 loop)."""
    leaves = {k: v.detach().to(dtype).requires_grad_() for k, v in p.items()}
    cu_t = None if cu is None else torch.tensor(cu)
    if backend is None:
        out, final = ssd_loop(**leaves, cu_seqlens=cu)
    else:
        out, final = ps.ssd_scan(
            **leaves, return_final=True, cu_seqlens=cu_t, backend=backend
        )  # fmt: skip
    g = torch.Generator().manual_seed(7)
    w_out = torch.randn(out.shape, generator=g, dtype=F64).to(dtype)
    w_fin = torch.randn(final.shape, generator=g, dtype=F64).to(dtype)
    ((out * w_out).sum() + (final * w_fin).sum()).backward()
    grads = [leaves[k].grad for k in NAMES]
    assert all(t is not None for t in grads)
    return [out.detach(), final.detach(), *(t for t in grads if t is not None)]


def _check(
    p: dict[str, torch.Tensor], dtype: torch.dtype, cu: list[int] | None = None, key: object = None
) -> None:
    """The kernel against the loop (``key``: the problem's name, its loop run once)."""
    named = None if key is None else (__name__, key)
    kernel_against_loop(_grads, ("out", "final", *NAMES), p, dtype, cu, named, 3e-5, tol64=1e-10)


# (batch, L, heads, headdim, groups, N): the model's head (64 x 64), headdim not a
# multiple of any vector or block width, N around the lane-sum tree's widths.
SHAPES = [
    (1, 70, 2, 64, 1, 64),
    (2, 65, 4, 70, 2, 17),
    (1, 66, 3, 33, 3, 1),
    (2, 20, 6, 5, 3, 3),
    (1, 9, 2, 48, 1, 33),
]


@pytest.mark.parametrize("simd", [True, False], ids=["simd", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
def test_shapes_against_loop(shape: tuple[int, ...], dtype: torch.dtype, simd: bool) -> None:
    with simd_path(simd):
        _check(_problem(1, *shape), dtype, key=shape)


# Packed sequences: empty ones, boundaries on and next to the checkpoint interval (64).
PACKINGS = [
    [0, 0, 63, 64, 64, 65, 129, 130],
    [0, 1, 2, 128, 130],
    [0, 130, 130],
]


@pytest.mark.parametrize("simd", [True, False], ids=["simd", "portable"])
@pytest.mark.parametrize("cu", PACKINGS, ids=[str(c) for c in PACKINGS])
def test_packed_against_loop(cu: list[int], simd: bool) -> None:
    p = _problem(2, 1, cu[-1], 4, 20, 2, 16, states=len(cu) - 1, d_per_head=True)
    with simd_path(simd):
        _check(p, torch.float32, cu, key="packed")


def test_same_bits_any_thread_count() -> None:
    """Units and every sum are fixed by the shapes: 1 and 2 threads agree bit for
    bit, including the forward split along headdim (one head, two threads)."""
    for shape in [(2, 140, 3, 40, 1, 16), (1, 70, 1, 64, 1, 8)]:
        p = _problem(3, *shape)
        with threads(1):
            one = _grads(p, torch.float32, "cpu", None)
        with threads(2):
            two = _grads(p, torch.float32, "cpu", None)
        for a, b in zip(one, two, strict=True):
            assert torch.equal(a, b)


def test_non_contiguous_and_float64_gradcheck() -> None:
    p = _problem(4, 2, 9, 2, 3, 1, 2)
    x = p["x"].transpose(1, 2).contiguous().transpose(1, 2)  # strided like a view
    B = p["B"][..., ::1].expand(2, 9, 1, 2)
    want = ps.ssd_scan(**{**p, "x": x.contiguous(), "B": B.contiguous()}, backend="loop")
    assert_matches(ps.ssd_scan(**{**p, "x": x, "B": B}, backend="cpu"), want, torch.float64)
    args = tuple(p[k].clone().requires_grad_() for k in NAMES)

    def fn(*a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kw = dict(zip(NAMES, a, strict=True))
        x_, dt_, A_, B_, C_ = (kw.pop(k) for k in ("x", "dt", "A", "B", "C"))
        out, final = ps.ssd_scan(x_, dt_, A_, B_, C_, **kw, return_final=True, backend="cpu")
        return out, final

    assert torch.autograd.gradcheck(fn, args)


def test_auto_picks_the_kernel_on_cpu() -> None:
    for dtype in (torch.float32, F64):
        assert resolve(ssd_ops.ROW, "auto", torch.device("cpu"), dtype) == "cpu"


def test_bad_offsets_raise() -> None:
    """The public function raises ValueError on bad offsets (test_ssd_scan.py); the
    kernel, called directly, rejects them too rather than read out of bounds."""
    p = _problem(5, 1, 10, 2, 3, 1, 2, states=2)
    for cu in ([0, 11, 10], [0, 4, 2], [1, 5, 10], [0, 6, 4]):
        with pytest.raises(RuntimeError, match=r"ssd_fwd CPU kernel failed \(operands"):
            ssd_cpu.forward(*(p[k] for k in NAMES), torch.tensor(cu))


def test_decay_gradient_keeps_its_accuracy_under_strong_decays() -> None:
    """The backward takes a step's decay gradient from running sums of the lane sums
    (cpu_kernel.h, ps_ssd_bwd_chunk), a difference that cancels where a[t] h[t-1] is
    small against B[t] u[t]; those steps take it exactly. With decays down to
    exp(-80), A's and dt's gradients stay within float32 rounding of the loop's,
    relative to their own size (a version without the exact steps was 3.7e-4 off)."""
    p = _problem(11, 1, 300, 3, 16, 1, 8)
    g = torch.Generator().manual_seed(12)
    p["dt"] = torch.rand(1, 300, 3, generator=g, dtype=F64) * 20
    p["A"] = -0.5 - 3.5 * torch.rand(3, generator=g, dtype=F64)
    want = _grads(p, F64, None, None)
    got = _grads(p, torch.float32, "cpu", None)
    for name in ("dt", "A"):
        i = 2 + NAMES.index(name)
        err = (got[i].double() - want[i]).abs().max().item()
        assert err <= 1e-5 * want[i].abs().max().item(), f"{name}: error {err:.3g}"


@pytest.mark.parametrize("initial", [True, False], ids=["initial", "zeros"])
@pytest.mark.parametrize("cu", [None, [0, 0, 5, 70, 71, 71, 140]], ids=["rows", "packed"])
@pytest.mark.parametrize("backend", ["cpu", "portable", "torch", "loop"])
def test_without_the_final_state(backend: str, cu: list[int] | None, initial: bool) -> None:
    """return_final=False: the kernel stores no final state and reads no grad_final
    (zeros), and out and every gradient still match the float64 loop's (an empty
    sequence's initial state then gets zero gradient)."""
    batch, length = (2, 140) if cu is None else (1, cu[-1])
    states = None if cu is None else len(cu) - 1
    p = _problem(9, batch, length, 3, 20, 1, 8, states=states)
    if not initial:
        del p["initial"]
    names = [k for k in NAMES if k in p]
    cu_t = None if cu is None else torch.tensor(cu)
    w = torch.randn(p["x"].shape, generator=torch.Generator().manual_seed(3), dtype=F64)

    def run(dtype: torch.dtype, name: str | None) -> list[torch.Tensor]:
        leaves = {k: p[k].to(dtype, copy=True).requires_grad_() for k in names}
        if name is None:
            out, _ = ssd_loop(**leaves, cu_seqlens=cu)
        else:
            with simd_path(name != "portable"):
                out = ps.ssd_scan(**leaves, cu_seqlens=cu_t,
                                  backend="cpu" if name == "portable" else name)  # fmt: skip
        assert isinstance(out, torch.Tensor)
        (out * w.to(dtype)).sum().backward()
        return [out.detach(), *(leaves[k].grad for k in names)]  # type: ignore[misc]

    want = run(F64, None)
    got = run(torch.float32, backend)
    assert_within_scale(("out", *names), want, got, 3e-5)
    if initial and cu is not None:  # the empty sequences' initial states: zero gradient
        assert got[-1][0].abs().max() == 0 and got[-1][4].abs().max() == 0
    args = [p[k].float() for k in ("x", "dt", "A", "B", "C")]
    out, final, _ = ssd_cpu.forward(*args, None, None, None, cu_t, want_final=False)
    assert final.shape[0] == 0
    assert_matches(out, ssd_cpu.forward(*args, None, None, None, cu_t)[0], torch.float32)


def _states_at(p: dict[str, torch.Tensor], cu: list[int], steps: list[int]) -> torch.Tensor:
    """The loop's state entering each of ``steps`` (a packed problem): h[t - 1] of the
    sequence holding t, or that sequence's initial state where t starts it."""
    states = []
    for t in steps:
        s = max(i for i in range(len(cu) - 1) if cu[i] <= t)
        init = p["initial"][s : s + 1]
        if t == cu[s]:
            states.append(init)
            continue
        part = {k: p[k][:, cu[s] : t] for k in ("x", "dt", "B", "C")}
        states.append(ssd_loop(**part, A=p["A"], initial=init)[1])
    return torch.stack(states, 1)


@pytest.mark.parametrize("simd", [True, False], ids=["simd", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=["f32", "f64"])
def test_forward_keeps_the_decays_in_a_scale(dtype: torch.dtype, simd: bool) -> None:
    """The forward keeps the decays out of the state in a scale (cpu_kernel.h,
    ps_ssd_fwd_task) and folds them back before checkpoints, at sequence ends, and
    where 1 / scale would overflow or vanish. Per head, against the float64 loop: steps
    of dt 0 (decay 1), mild, strong (exp(-60), exp(-200): the kernel's floor), a head
    whose decays are 0 in the loop (dt A = -1e4 .. -1e6), and one that grows for 32
    steps past the dtype's range (e^96 in float32, e^800 in float64: from a tiny
    state), then decays as much; packed sequences of 5, 65, 1, 129 and 133 steps
    (boundaries off and on the checkpoint interval 64). Outputs, final states and
    checkpoints (the backward's true states) within each head's own scale; then every
    gradient, without the growing head."""
    cu = [0, 5, 70, 71, 200, 333]
    p = _problem(21, 1, cu[-1], 5, 40, 1, 16, states=len(cu) - 1)
    g = torch.Generator().manual_seed(22)
    levels = torch.tensor([0.0, 0.01, 0.3, 1.0], dtype=F64)
    p["dt"] = levels[torch.randint(0, 4, (1, cu[-1], 5), generator=g)]
    growth, tiny = (3.0, 1e-30) if dtype == torch.float32 else (25.0, 1e-300)
    p["dt"][0, :, 4] = torch.where(torch.arange(cu[-1]) % 64 < 32, 1.0, -1.0)
    p["A"] = torch.tensor([-0.5, -4.0, -200.0, -1e6, growth], dtype=F64)
    p["x"][:, :, 4] *= tiny
    p["initial"][:, 4] *= tiny
    cast = {k: v.to(dtype) for k, v in p.items()}
    with simd_path(simd):
        out, final, ckpt = ssd_cpu.forward(
            *(cast[k] for k in NAMES), torch.tensor(cu)
        )  # fmt: skip
    want_out, want_final = ssd_loop(**p, cu_seqlens=cu)
    want_ckpt = _states_at(p, cu, list(range(0, cu[-1], ssd_cpu._K)))
    tol = 1e-10 if dtype == F64 else 3e-5
    for name, got, want, head_dim in (
        ("out", out, want_out, 2), ("final", final, want_final, 1),
        ("checkpoints", ckpt, want_ckpt, 2),
    ):  # fmt: skip
        assert got.shape == want.shape, (name, got.shape, want.shape)
        for h in range(5):
            w, o = want.select(head_dim, h), got.select(head_dim, h).double()
            scale = max(w.abs().max().item(), 1.0)
            err = (o - w).abs().max().item()
            assert err <= tol * scale, f"{name}, head {h}: error {err:.3g} (scale {scale:.3g})"
    heads = {"x": 2, "dt": 2, "A": 0, "B": None, "C": None, "D": 0, "z": 2, "initial": 1}
    bounded = {k: v if heads[k] is None else v.narrow(heads[k], 0, 4) for k, v in p.items()}
    with simd_path(simd):
        _check(bounded, dtype, cu, key="scale")
