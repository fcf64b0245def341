"""parascan.compat.fla's HGRN drop-ins against a float64 loop written from
flash-linear-attention's documented semantics: h[t] = exp(g[t]) * h[t-1] + x[t] over
(B, T, D), o[t] = h[t], an initial state (N, D), the final state (N, D), and packed
sequences (cu_seqlens, B == 1) each starting from its own state."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parascan.compat.fla import chunk_hgrn, fused_recurrent_hgrn

from conftest import assert_matches

FUNCTIONS = [fused_recurrent_hgrn, chunk_hgrn]


def hgrn_loop(x, g, h0, cu):  # type: ignore[no-untyped-def]
    """The documented recurrence, one step at a time, per sequence, in float64."""
    x, g = x.double(), g.double()
    batch, steps, width = x.shape
    bounds = (
        [(b, 0, steps) for b in range(batch)]
        if cu is None
        else [(0, cu[s], cu[s + 1]) for s in range(len(cu) - 1)]
    )
    out = torch.zeros_like(x)
    finals = []
    for n, (b, lo, hi) in enumerate(bounds):
        h = torch.zeros(width, dtype=torch.float64) if h0 is None else h0[n].double()
        for t in range(lo, hi):
            h = torch.exp(g[b, t]) * h + x[b, t]
            out[b, t] = h
        finals.append(h)
    return out, torch.stack(finals)


@pytest.mark.parametrize("fn", FUNCTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("cu", [None, [0, 5, 5, 6, 40]])
def test_matches_the_documented_recurrence(fn, dtype, cu) -> None:
    gen = torch.Generator().manual_seed(2)
    batch = 3 if cu is None else 1
    x = torch.randn(batch, 40, 7, generator=gen).to(dtype)
    g = F.logsigmoid(torch.randn(batch, 40, 7, generator=gen)).to(dtype)
    n = batch if cu is None else len(cu) - 1
    h0 = torch.randn(n, 7, generator=gen).to(dtype)
    cu_t = None if cu is None else torch.tensor(cu)
    for initial in (None, h0):
        o, final = fn(x, g, initial_state=initial, output_final_state=True, cu_seqlens=cu_t)
        want, want_final = hgrn_loop(x, g, initial, cu)
        assert o.dtype == dtype and final.dtype == dtype and final.shape == (n, 7)
        assert_matches(o, want, dtype)
        assert_matches(final, want_final, dtype)
        o, none = fn(x, g, initial_state=initial, cu_seqlens=cu_t)
        assert none is None


@pytest.mark.parametrize("fn", FUNCTIONS)
@pytest.mark.parametrize("cu", [None, [0, 2, 2, 9]])
def test_gradients_of_x_g_and_the_initial_state(fn, cu) -> None:
    gen = torch.Generator().manual_seed(4)
    batch = 2 if cu is None else 1
    n = batch if cu is None else len(cu) - 1
    leaves = [
        torch.randn(batch, 9, 3, generator=gen, dtype=torch.float64),
        F.logsigmoid(torch.randn(batch, 9, 3, generator=gen, dtype=torch.float64)),
        torch.randn(n, 3, generator=gen, dtype=torch.float64),
    ]
    cu_t = None if cu is None else torch.tensor(cu)

    def f(x, g, h0):  # type: ignore[no-untyped-def]
        return fn(x, g, initial_state=h0, output_final_state=True, cu_seqlens=cu_t)

    assert torch.autograd.gradcheck(f, [t.clone().requires_grad_() for t in leaves])
    got = [t.clone().requires_grad_() for t in leaves]
    o, final = f(*got)
    (o.square().sum() + final.sum()).backward()
    want = [t.clone().requires_grad_() for t in leaves]
    o, final = hgrn_loop(*want, cu)
    (o.square().sum() + final.sum()).backward()
    for a, b in zip(got, want, strict=True):
        assert_matches(a.grad, b.grad, torch.float64)


@pytest.mark.parametrize("fn", FUNCTIONS)
def test_bad_input_raises_naming_the_function(fn) -> None:
    name = f"parascan.compat.fla.{fn.__name__}"
    x = torch.randn(2, 4, 3)
    with pytest.raises(ValueError, match=f"{name}: expected x of shape"):
        fn(x[0], x[0])
    with pytest.raises(ValueError, match=f"{name}: expected x and g of one shape"):
        fn(x, x[:, :3])
    with pytest.raises(ValueError, match=f"{name}: with cu_seqlens .* batch of one"):
        fn(x, x, cu_seqlens=torch.tensor([0, 4]))
    with pytest.raises(ValueError, match=f"{name}: expected initial_state of shape"):
        fn(x, x, initial_state=torch.zeros(3, 3))
    with pytest.raises(ValueError, match=f"{name}: expected initial_state of shape"):
        fn(x[:1], x[:1], initial_state=torch.zeros(1, 3), cu_seqlens=torch.tensor([0, 1, 4]))
    with pytest.raises(ValueError, match=f"{name}: expected cu_seqlens to be non-decreasing"):
        fn(x[:1], x[:1], cu_seqlens=torch.tensor([0, 3]))
    # integer or bool inputs: before, an integer x was scanned in float32 and the result
    # cast back to x's dtype (ones with gate 0.5 gave 1, 1, 1 for 1, 1.5, 1.75)
    ones = torch.ones(1, 4, 1, dtype=torch.int64)
    with pytest.raises(TypeError, match=f"{name}: expected x to have a floating"):
        fn(ones, torch.full((1, 4, 1), 0.5).log())
    with pytest.raises(TypeError, match=f"{name}: expected x to have a floating"):
        fn(ones.bool(), torch.zeros(1, 4, 1))
    with pytest.raises(TypeError, match=f"{name}: expected g to have a floating"):
        fn(torch.ones(1, 4, 1), torch.zeros(1, 4, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match=f"{name}: expected all tensors on one device"):
        fn(x, x, initial_state=torch.zeros(2, 3, device="meta"))
    with pytest.raises(TypeError, match=f"{name}: expected a real initial_state"):
        fn(x, x, initial_state=torch.zeros(2, 3, dtype=torch.complex64))
    with pytest.raises(TypeError, match=f"{name}: expected a real g with a real x"):
        fn(x, x.to(torch.complex64))
