"""log_linear_scan as a PyTorch citizen: gradcheck, gradgradcheck, opcheck, vmap,
torch.func (grad, per-sample gradients, jacrev, jvp) and torch.compile."""

from __future__ import annotations

import math

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

import parascan as ps
from parascan.first_order.ops import backward_op, forward_op
from parascan.first_order.semiring import LOG

from conftest import assert_matches, random_gates, random_tokens
from oracles import log_loop


def _log_inputs(shape, dtype, gen):
    gates = random_gates(shape, dtype, gen)
    tokens = random_tokens(shape, dtype, gen)
    return gates.log(), (tokens.log() if dtype.is_complex else tokens)


# complex128 under `pytest -m slow`: gradgradcheck of the complex log-space scan takes 2 to 5 s
# a case (40 s in all); float64 keeps every backend, layout and direction in the default suite
@pytest.mark.parametrize(
    "dtype", [torch.float64, pytest.param(torch.complex128, marks=pytest.mark.slow)], ids=str
)
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("layout", [((2, 6, 3), 1), ((3, 9), -1)])
def test_gradcheck_and_gradgradcheck(target, dtype, reverse, layout, gen) -> None:
    shape, dim = layout
    d = dim % len(shape)
    la, lb = _log_inputs(shape, dtype, gen)
    h0 = _log_inputs(shape[:d] + shape[d + 1 :], dtype, gen)[1]
    inputs = tuple(t.to(target.device).requires_grad_() for t in (la, lb, h0))

    def fn(a, b, h):
        return ps.log_linear_scan(
            a, b, dim, initial=h, reverse=reverse, return_final=True, backend=target.backend
        )

    if target.backend == "triton" and dtype.is_complex:  # real logs only
        with pytest.raises(RuntimeError, match="'triton' is not available for complex"):
            fn(*inputs)
        return

    assert gradcheck(fn, inputs)
    assert gradgradcheck(fn, inputs)


def test_gradcheck_with_a_log_zero_prefix(target, gen) -> None:
    """Tokens -inf for the first steps (h = log 0 there): finite differences agree
    with the gradient on the finite inputs, first and second order."""
    la, lb = _log_inputs((2, 9), torch.float64, gen)
    mask = torch.zeros(2, 9, dtype=torch.bool, device=target.device)
    mask[:, :3] = True

    def fn(a, b):
        b = b.masked_fill(mask, -math.inf)
        return ps.log_linear_scan(a, b, -1, backend=target.backend).exp()

    inputs = (la.to(target.device).requires_grad_(), lb.to(target.device).requires_grad_())
    assert gradcheck(fn, inputs)
    assert gradgradcheck(fn, inputs)


# 3 to 5 s a backend: the C kernel's by default; the op (its schema, fake kernel and
# autograd registration) is one for every backend, the others' with the slow tests
@pytest.mark.targets(slow_backends=("torch", "loop"))
def test_opcheck_raw_ops(target, gen) -> None:
    backend, device = target.backend, target.device
    for dtype in [torch.float64, torch.complex64, torch.bfloat16]:
        if backend == "triton" and dtype.is_complex:
            continue  # the Triton kernels take real logs only
        for shape, dim in [((2, 5, 3), -2), ((4, 6), -1), ((3, 0, 2), -2)]:
            la, lb = (t.to(device) for t in _log_inputs(shape, dtype, gen))
            state = shape[:dim] + shape[dim + 1 :] if dim != -1 else shape[:-1]
            h0 = _log_inputs(state, dtype, gen)[1].to(device)
            for initial, reverse in ((None, False), (h0, True)):
                args = (la, lb, initial, dim, reverse, backend)
                torch.library.opcheck(forward_op(LOG), args)
                out = forward_op(LOG)(*args)
                grad_out = torch.randn(out.shape, generator=gen).to(device, dtype)
                torch.library.opcheck(
                    backward_op(LOG),
                    (la, lb, out, grad_out, initial, dim, reverse, backend),
                )


def test_vmap_matches_batched_call(target, gen) -> None:
    backend = target.backend
    la, lb = (t.to(target.device) for t in _log_inputs((6, 4, 30), torch.float32, gen))
    h0 = random_tokens((6, 4), torch.float32, gen).to(target.device)

    def one(a, b, h):
        return ps.log_linear_scan(a, b, -1, initial=h, return_final=True, backend=backend)

    out, final = torch.func.vmap(one)(la, lb, h0)
    want_out, want_final = one(la, lb, h0)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(final, want_final)
    shared = la[0]
    out = torch.func.vmap(
        lambda a, b: ps.log_linear_scan(a, b, -1, backend=backend), in_dims=(None, 1)
    )(shared, lb.movedim(0, 1))
    torch.testing.assert_close(out, ps.log_linear_scan(shared, lb, -1, backend=backend))


def test_per_sample_gradients(target, gen) -> None:
    n, steps, channels = 5, 23, 3
    la = _log_inputs((steps, channels), torch.float64, gen)[0]
    lb = random_tokens((n, steps, channels), torch.float64, gen)
    targets = random_tokens((n, steps, channels), torch.float64, gen)

    def loss(a, b, y):
        return ((ps.log_linear_scan(a, b, 0, backend=target.backend) - y) ** 2).sum()

    per_sample = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1)), in_dims=(None, 0, 0))(
        *(t.to(target.device) for t in (la, lb, targets))
    )
    for i in range(n):
        a = la.clone().requires_grad_()
        b = lb[i].clone().requires_grad_()
        ref = ((log_loop(a, b, 0)[0] - targets[i]) ** 2).sum()
        ga, gb = torch.autograd.grad(ref, (a, b))
        assert_matches(per_sample[0][i], ga, torch.float64)
        assert_matches(per_sample[1][i], gb, torch.float64)


def test_jacrev_and_jvp(target, gen) -> None:
    backend, device = target.backend, target.device
    la, lb = _log_inputs((7,), torch.float64, gen)
    h0 = torch.tensor(0.3, dtype=torch.float64)
    on = tuple(t.to(device) for t in (la, lb, h0))
    jac = torch.func.jacrev(lambda b: ps.log_linear_scan(on[0], b, 0, backend=backend))(on[1])
    want = torch.func.jacrev(lambda b: log_loop(la, b, 0)[0])(lb)
    assert_matches(jac, want, torch.float64)
    tangents = tuple(random_tokens(t.shape, torch.float64, gen) for t in (la, lb, h0))

    def mine(a, b, h):
        return ps.log_linear_scan(a, b, 0, initial=h, backend=backend)

    _, jvp = torch.func.jvp(mine, on, tuple(t.to(device) for t in tangents))
    _, want_jvp = torch.func.jvp(lambda a, b, h: log_loop(a, b, 0, h)[0], (la, lb, h0), tangents)
    assert jvp.abs().max() > 0
    assert_matches(jvp, want_jvp, torch.float64)


def test_compile_fullgraph_forward_and_backward(target, gen) -> None:
    torch._dynamo.reset()
    device = target.device
    la, lb = (t.to(device).requires_grad_() for t in _log_inputs((3, 40, 8), torch.float32, gen))
    h0 = random_tokens((3, 8), torch.float32, gen).to(device).requires_grad_()

    def step(a, b, h):
        out, final = ps.log_linear_scan(
            torch.nn.functional.logsigmoid(a), b, 1, initial=h, return_final=True,
            backend=target.backend,
        )  # fmt: skip
        return out.square().mean() + final.sum()

    compiled = torch.compile(step, fullgraph=True)
    loss = compiled(la, lb, h0)
    grads = torch.autograd.grad(loss, (la, lb, h0))
    want_loss = step(la, lb, h0)
    want = torch.autograd.grad(want_loss, (la, lb, h0))
    torch.testing.assert_close(loss, want_loss)
    for g, w in zip(grads, want, strict=True):
        torch.testing.assert_close(g, w)


def test_inputs_are_never_modified(target, gen) -> None:
    device = target.device
    for dtype in [torch.float32, torch.complex64, torch.float16]:
        if target.backend == "triton" and dtype.is_complex:
            continue  # the Triton kernels take real logs only
        la, lb = (t.to(device).requires_grad_() for t in _log_inputs((3, 20, 4), dtype, gen))
        h0 = random_tokens((3, 4), dtype, gen).to(device).requires_grad_()
        before = [t.detach().clone() for t in (la, lb, h0)]
        out, final = ps.log_linear_scan(
            la, lb, 1, initial=h0, return_final=True, backend=target.backend
        )
        grad_out = torch.ones_like(out)
        torch.autograd.backward((out, final), (grad_out, torch.ones_like(final)))
        for t, b in zip((la, lb, h0), before, strict=True):
            assert torch.equal(t.detach(), b)
        assert torch.equal(grad_out, torch.ones_like(out))


def test_fused_backward_equals_the_weights_identity(gen) -> None:
    """The cpu kernel's fused backward against composed_backward on the loop."""
    from parascan.first_order import cpu
    from parascan.first_order.ops import composed_backward
    from parascan.first_order.reference import linear_loop, log_loop

    if "cpu" not in ps.backends("cpu"):
        pytest.skip("the cpu backend is not built")
    for dtype in [torch.float64, torch.complex128]:
        for reverse in (False, True):
            la, lb = _log_inputs((3, 31, 5), dtype, gen)
            h0 = random_tokens((3, 5), dtype, gen)
            out = log_loop(la, lb, h0, -2, reverse)
            g = random_tokens((3, 31, 5), dtype, gen)
            fused = cpu.backward(LOG, la, lb, out, g, h0, -2, reverse)
            composed = composed_backward(LOG, linear_loop, la, lb, out, g, h0, -2, reverse)
            for x, y in zip(fused, composed, strict=True):
                torch.testing.assert_close(x, y)
