"""ps.selective_state_update (the decoding step, parascan.mixer.step): its errors, its
C kernel against a float64 formula, the torch path under autograd, and gradcheck.
(That steps equal the scan is in tests/selective/test_selective_scan.py.)"""

from __future__ import annotations

import pytest
import torch

import parascan as ps


def test_state_update_errors(gen):
    state = torch.zeros(2, 6, 3)
    x = torch.randn(2, 6)
    with pytest.raises(ValueError, match=r"parascan\.selective_state_update: expected B"):
        ps.selective_state_update(state, x, x, -torch.rand(6, 3), torch.randn(2, 4, 3),
                                  torch.randn(2, 3))  # fmt: skip
    with pytest.raises(ValueError, match=r"parascan\.selective_state_update: expected x"):
        ps.selective_state_update(state, x[:, :5], x, -torch.rand(6, 3), torch.randn(2, 3),
                                  torch.randn(2, 3))  # fmt: skip


# --- the decoding step's C kernel (no autograd) against a float64 formula ----------------


def _step_oracle(state, x, dt, A, B, C, D, z, dt_bias, softplus):  # type: ignore[no-untyped-def]
    """(new state, out) of one decoding step in float64, heads layout, from the formula
    (written here, independent of the code under test)."""
    heads, groups = state.shape[1], B.shape[1]
    step = dt.double() + (0 if dt_bias is None else dt_bias.double())
    if softplus:
        step = torch.where(step > 20, step, torch.log1p(torch.exp(step)))
    rows = heads // groups
    Bh = B.double().repeat_interleave(rows, dim=1)[:, :, None]
    Ch = C.double().repeat_interleave(rows, dim=1)[:, :, None]
    new = (
        torch.exp(step[..., None] * A.double()) * state.double()
        + (step * x.double())[..., None] * Bh
    )
    y = (new * Ch).sum(-1) + (0 if D is None else D.double() * x.double())
    if z is not None:
        y = y * z.double() * torch.sigmoid(z.double())
    return new, y


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t``'s values in a tensor whose every dimension has a stride of 2 or more
    (the kernel must read through strides, not assume packed rows)."""
    big = torch.full([2 * s for s in t.shape], float("nan"), dtype=t.dtype)
    view = big[tuple(slice(None, None, 2) for _ in t.shape)]
    view.copy_(t)
    return view


@pytest.mark.parametrize(
    ("layout", "n", "state_dtype", "x_dtype", "strided", "extras"),
    [
        ("dim", 16, torch.float32, torch.float32, False, True),
        ("dim", 3, torch.float32, torch.float32, True, True),
        ("dim", 1, torch.float64, torch.float64, False, False),
        ("heads", 16, torch.float32, torch.float32, False, True),
        ("heads", 17, torch.float32, torch.bfloat16, True, True),
        ("heads", 70, torch.float64, torch.float64, True, False),
        ("heads", 8, torch.float32, torch.float16, False, False),
    ],
)  # fmt: skip
def test_state_update_kernel_matches_the_formula(layout, n, state_dtype, x_dtype, strided,
                                                 extras, gen, monkeypatch):  # fmt: skip
    """The C decoding step (taken without autograd on a float CPU state) against the
    float64 formula: both layouts, N around the vector width and past a tile (70),
    blocks of units that cross head and batch boundaries (headdim 3, 5 heads), groups
    (B and C in different ones: a regression, the kernel once read C in B's groups),
    strided and broadcast (stride 0) operands, a lower-precision x, with and without
    D, z, dt_bias and softplus."""
    from parascan.mixer import step as api

    calls = []
    real_kernel = api._step_kernel
    monkeypatch.setattr(api, "_step_kernel", lambda *a: calls.append(1) or real_kernel(*a))
    batch, heads, headdim, groups = 3, 5, 3, 5
    if layout == "dim":
        heads, headdim, groups = 7, 1, 1

    def r(*shape, scale=1.0):  # type: ignore[no-untyped-def]
        return torch.randn(shape, generator=gen, dtype=torch.float64) * scale

    args = dict(
        x=r(batch, heads, headdim).to(x_dtype),
        # one step size per head, broadcast over its rows (stride 0), as Mamba-2 calls it
        dt=r(batch, heads, 1, scale=0.5).expand(batch, heads, headdim).to(x_dtype),
        A=-r(heads, headdim, n).abs(),
        B=r(batch, groups, n).to(x_dtype),
        # C in other groups than B (here one, shared by every head)
        C=r(batch, 1 if n % 2 else groups, n).to(x_dtype),
        D=r(heads, headdim) if extras else None,
        z=r(batch, heads, headdim).to(x_dtype) if extras else None,
        dt_bias=r(heads, headdim, scale=0.1) if extras else None,
    )
    if layout == "heads":
        args["A"] = args["A"][:, :1, :1].expand(heads, headdim, n)  # one decay per head
    if strided:
        args = {k: None if v is None else _strided(v.contiguous()) for k, v in args.items()}
    args["A"] = args["A"].to(state_dtype)
    state = r(batch, heads, headdim, n).to(state_dtype)
    want_state, want_out = _step_oracle(state, **args, softplus=extras)
    if layout == "dim":
        drop = {"x": 2, "dt": 2, "z": 2, "A": 1, "D": 1, "dt_bias": 1, "B": None, "C": None}
        args = {k: v if v is None or drop[k] is None else v.squeeze(drop[k])
                for k, v in args.items()}  # fmt: skip
        state, want_state, want_out = state[:, :, 0], want_state[:, :, 0], want_out[:, :, 0]
    if strided:
        state = _strided(state)
    with torch.no_grad():
        out = ps.selective_state_update(state, **args, dt_softplus=extras)
    assert calls, "the C decoding step was not taken"
    assert out.dtype == x_dtype and out.shape == args["x"].shape
    tol = dict(rtol=1e-12, atol=1e-12) if state_dtype == torch.float64 else dict(
        rtol=2e-5, atol=2e-5)  # fmt: skip
    torch.testing.assert_close(state.double(), want_state, **tol)
    out_tol = tol if x_dtype in (torch.float32, torch.float64) else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out.double(), want_out, **out_tol)


def test_state_update_with_autograd_takes_the_torch_path(gen):
    """A step whose inputs need gradients is differentiable (the C step is not), and
    its results equal the C step's."""
    state = torch.randn(2, 6, 4, generator=gen)
    x = torch.randn(2, 6, generator=gen, requires_grad=True)
    dt = torch.rand(2, 6, generator=gen)
    A = -torch.rand(6, 4, generator=gen)
    B, C = torch.randn(2, 4, generator=gen), torch.randn(2, 4, generator=gen)
    s1, s2 = state.clone(), state.clone()
    y = ps.selective_state_update(s1, x, dt, A, B, C, dt_softplus=True)
    y.sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    with torch.no_grad():
        y2 = ps.selective_state_update(s2, x, dt, A, B, C, dt_softplus=True)
    torch.testing.assert_close(y2, y.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(s2, s1, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("grad", [False, True])
def test_state_update_refuses_an_overlapping_state(gen, grad):
    """A state whose elements share memory (an expanded tensor) cannot be updated in
    place: a parascan error naming the strides before anything runs, never a race in
    the kernel, with or without autograd."""
    state = torch.zeros(1, 1, 4).expand(3, 6, 4)
    x = torch.randn(3, 6, generator=gen, requires_grad=grad)
    with (
        torch.set_grad_enabled(grad),
        pytest.raises(ValueError, match=r"parascan.selective_state_update: .*strides \(0, 0, 1\)"),
    ):
        ps.selective_state_update(state, x, x, -torch.rand(6, 4), torch.randn(3, 4),
                                  torch.randn(3, 4))  # fmt: skip
    assert not state.any()


def test_state_update_refuses_a_leaf_that_requires_grad(gen):
    """A state that is a leaf requiring grad cannot be written in place while grad mode
    is on: a parascan error (it was autograd's, naming no function); under no_grad the
    step runs."""
    state = torch.zeros(3, 6, 4, requires_grad=True)
    x = torch.randn(3, 6, generator=gen)
    args = (x, x.abs(), -torch.rand(6, 4), torch.randn(3, 4), torch.randn(3, 4))
    with pytest.raises(ValueError, match=r"parascan.selective_state_update: .*leaf requiring"):
        ps.selective_state_update(state, *args)
    assert not state.any()
    with torch.no_grad():
        ps.selective_state_update(state, *args)
    assert state.any()
    # a view of such a leaf: autograd's "a view of a leaf Variable ..." before
    leaf = torch.zeros(2, 3, 6, 4, requires_grad=True)
    with pytest.raises(ValueError, match=r"parascan.selective_state_update: .*view of a leaf"):
        ps.selective_state_update(leaf[1], *args)
    assert not leaf.any()
    # a state computed from one (not a leaf, not a view of one) is written as before
    computed = leaf[1] * 1.0
    ps.selective_state_update(computed, *args)
    assert computed.any() and not leaf.any()


@pytest.mark.parametrize("heads_layout", [False, True])
@pytest.mark.parametrize("shared", ["B", "C", "x", "D"])
def test_operands_that_share_the_states_memory(gen, heads_layout, shared):
    """An operand that is a view into the state itself (B = state[:, 0], say) reads the
    state as it was before the step, as the torch ops do: the C kernel (float32, no
    grad) wrote the state while still reading B and C from it (0.02 off here)."""
    lead = (2, 3) if heads_layout else (4,)
    state = torch.randn(2, *lead, 5, generator=gen)
    x, dt = torch.randn(2, *lead, generator=gen), torch.rand(2, *lead, generator=gen)
    A = -torch.rand(*lead, 5, generator=gen)
    B, C = torch.randn(2, 1, 5, generator=gen), torch.randn(2, 1, 5, generator=gen)
    D = torch.randn(lead, generator=gen)
    views = {  # the same values, as views into the state
        "B": lambda s: s.reshape(2, -1, 5)[:, :1], "C": lambda s: s.reshape(2, -1, 5)[:, 1:2],
        "x": lambda s: s[..., 0], "D": lambda s: s[0, ..., 1],
    }  # fmt: skip
    operands = {"x": x, "B": B, "C": C, "D": D}
    operands[shared] = views[shared](state).clone()
    want_state = state.clone()
    want = ps.selective_state_update(want_state, operands["x"], dt, A, operands["B"],
                                     operands["C"], operands["D"])  # fmt: skip
    operands[shared] = views[shared](state)  # the live view
    before = operands[shared].clone()
    with torch.no_grad():
        got = ps.selective_state_update(state, operands["x"], dt, A, operands["B"],
                                        operands["C"], operands["D"])  # fmt: skip
    torch.testing.assert_close(got, want.detach())
    torch.testing.assert_close(state, want_state.detach())
    assert not torch.equal(views[shared](state), before)  # the view did change: a real case


@pytest.mark.parametrize("heads_layout", [False, True])
def test_state_update_gradcheck(gen, heads_layout):
    """The differentiable step (every operand but the cache needing gradients, the
    cache a plain tensor as in decoding) in float64: its output and the new state.
    Before, the product with the old state saved the state itself, which the in-place
    write then bumped: backward raised autograd's version error whenever dt (or A)
    needed a gradient."""
    f64 = torch.float64
    batch, n = 2, 3
    lead = (2, 3) if heads_layout else (4,)
    state = torch.randn(batch, *lead, n, generator=gen, dtype=f64)
    ops_ = {
        "x": torch.randn(batch, *lead, generator=gen, dtype=f64),
        "dt": torch.rand(batch, *lead, generator=gen, dtype=f64),
        "A": -torch.rand(*lead, n, generator=gen, dtype=f64),
        "B": torch.randn(batch, 1, n, generator=gen, dtype=f64),
        "C": torch.randn(batch, 2, n, generator=gen, dtype=f64),
        "D": torch.randn(*lead, generator=gen, dtype=f64),
        "z": torch.randn(batch, *lead, generator=gen, dtype=f64),
        "dt_bias": torch.randn(*lead, generator=gen, dtype=f64),
    }
    if heads_layout:  # one state decay per head, as Mamba-2's A
        ops_["A"] = ops_["A"][:, :1, :1].expand(*lead, n).contiguous()
    names = list(ops_)

    def step(*ts):
        s = state.clone()
        y = ps.selective_state_update(s, **dict(zip(names, ts, strict=True)), dt_softplus=True)
        return y, s

    inputs = tuple(t.requires_grad_() for t in ops_.values())
    assert torch.autograd.gradcheck(step, inputs)
