"""linear_scan as a PyTorch citizen: gradcheck, gradgradcheck, opcheck, vmap,
torch.func (grad, per-sample gradients, jacrev, jvp) and torch.compile."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.autograd import gradcheck, gradgradcheck

import parascan as ps
from parascan.first_order.ops import backward_op, forward_op
from parascan.first_order.semiring import LINEAR

from conftest import assert_matches, random_gates, random_tokens
from oracles import linear_loop, log_loop


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex128], ids=str)
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("layout", [((2, 7, 3), 1), ((4, 9), -1)])
def test_gradcheck_and_gradgradcheck(target, dtype, reverse, layout, gen) -> None:
    shape, dim = layout
    state = shape[: dim % len(shape)] + shape[dim % len(shape) + 1 :]
    inputs = tuple(
        t.to(target.device).requires_grad_()
        for t in (
            random_gates(shape, dtype, gen),
            random_tokens(shape, dtype, gen),
            random_tokens(state, dtype, gen),
        )
    )

    def fn(a, b, h):
        return ps.linear_scan(
            a, b, dim, initial=h, reverse=reverse, return_final=True, backend=target.backend
        )

    # The whole Jacobians for the C kernels' backward; the other backends' against
    # random projections of them (fast_mode), which halves this test's time.
    fast = target.backend != "cpu"
    assert gradcheck(fn, inputs, fast_mode=fast)
    assert gradgradcheck(fn, inputs, fast_mode=fast)


def test_gradcheck_with_broadcast_inputs(target, gen) -> None:
    gates = random_gates((5, 1), torch.float64, gen)
    tokens = random_tokens((2, 5, 3), torch.float64, gen)
    initial = random_tokens((3,), torch.float64, gen)
    assert gradcheck(
        lambda a, b, h: ps.linear_scan(a, b, -2, initial=h, backend=target.backend),
        tuple(t.to(target.device).requires_grad_() for t in (gates, tokens, initial)),
    )


def _op_samples(backend: str, device: str, gen: torch.Generator):
    """Every dtype with every shape, the four (initial, reverse) pairs taken in turn (the
    whole product cost 7 s a backend: opcheck is about 0.1 s a call)."""
    shapes = [((2, 5, 3), -2), ((4, 6), -1), ((3, 0, 2), -2)]
    dtypes = [torch.float32, torch.float64, torch.complex64, torch.bfloat16]
    for i, (dtype, (shape, dim)) in enumerate(itertools.product(dtypes, shapes)):
        a = random_gates(shape, dtype, gen).to(device)
        b = random_tokens(shape, dtype, gen).to(device)
        state = shape[:dim] + shape[dim + 1 :] if dim != -1 else shape[:-1]
        h = random_tokens(state, dtype, gen).to(device)
        yield (a, b, h if i % 2 else None, dim, bool(i // 2 % 2), backend)


# 3 to 5 s a backend: the C kernel's by default; the op (its schema, fake kernel and
# autograd registration) is one for every backend, the others' with the slow tests
@pytest.mark.targets(slow_backends=("torch", "loop"))
def test_opcheck_raw_ops(target, gen) -> None:
    for args in _op_samples(target.backend, target.device, gen):
        torch.library.opcheck(forward_op(LINEAR), args)
        a, _, initial, dim, reverse, backend = args
        out = forward_op(LINEAR)(*args)
        grad_out = torch.randn(out.shape, generator=gen).to(out.device, out.dtype)
        torch.library.opcheck(
            backward_op(LINEAR), (a, None, out, grad_out, initial, dim, reverse, backend)
        )


def test_vmap_matches_batched_call(target, gen) -> None:
    backend = target.backend
    gates = random_gates((6, 4, 30), torch.float32, gen).to(target.device)
    tokens = random_tokens((6, 4, 30), torch.float32, gen).to(target.device)
    initial = random_tokens((6, 4), torch.float32, gen).to(target.device)

    def one(a, b, h):
        return ps.linear_scan(a, b, -1, initial=h, return_final=True, backend=backend)

    out, final = torch.func.vmap(one)(gates, tokens, initial)
    want_out, want_final = one(gates, tokens, initial)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(final, want_final)
    # vmap over a middle dim, gates shared by every sample (in_dims=None)
    shared = gates[0]
    out = torch.func.vmap(
        lambda a, b: ps.linear_scan(a, b, -1, backend=backend), in_dims=(None, 1)
    )(shared, tokens.movedim(0, 1))
    torch.testing.assert_close(out, ps.linear_scan(shared, tokens, -1, backend=backend))


def test_per_sample_gradients(target, gen) -> None:
    """torch.func.vmap(torch.func.grad(loss)) against one oracle gradient per sample."""
    n, steps, channels = 5, 23, 3
    gates = random_gates((steps, channels), torch.float64, gen)  # shared parameters
    tokens = random_tokens((n, steps, channels), torch.float64, gen)
    targets = random_tokens((n, steps, channels), torch.float64, gen)

    def loss(a, b, y):
        return ((ps.linear_scan(a, b, 0, backend=target.backend) - y) ** 2).sum()

    per_sample = torch.func.vmap(torch.func.grad(loss, argnums=(0, 1)), in_dims=(None, 0, 0))(
        *(t.to(target.device) for t in (gates, tokens, targets))
    )
    for i in range(n):
        a = gates.clone().requires_grad_()
        b = tokens[i].clone().requires_grad_()
        ref = ((linear_loop(a, b, 0)[0] - targets[i]) ** 2).sum()
        ga, gb = torch.autograd.grad(ref, (a, b))
        assert_matches(per_sample[0][i], ga, torch.float64)
        assert_matches(per_sample[1][i], gb, torch.float64)


def test_jacrev_and_jvp(target, gen) -> None:
    backend, device = target.backend, target.device
    gates = random_gates((7,), torch.float64, gen)
    tokens = random_tokens((7,), torch.float64, gen)
    a, b = gates.to(device), tokens.to(device)
    jac = torch.func.jacrev(lambda x: ps.linear_scan(a, x, 0, backend=backend))(b)
    want = torch.func.jacrev(lambda x: linear_loop(gates, x, 0)[0])(tokens)
    assert_matches(jac, want, torch.float64)
    tangent = random_tokens((7,), torch.float64, gen)
    _, jvp = torch.func.jvp(
        lambda x: ps.linear_scan(x, b, 0, backend=backend), (a,), (tangent.to(device),)
    )
    _, want_jvp = torch.func.jvp(lambda x: linear_loop(x, tokens, 0)[0], (gates,), (tangent,))
    assert jvp.abs().max() > 0
    assert_matches(jvp, want_jvp, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("op", ["linear", "log"])
def test_dual_tensors_keep_their_tangents(op, dtype, gen) -> None:
    # torch.autograd.forward_ad outside torch.func: plain CPU tensors that need no
    # gradient (what the direct kernel call takes) but carry tangents, which a
    # kernel called without autograd would drop.
    import torch.autograd.forward_ad as fwad

    shape = (3, 40)
    gates = random_gates(shape, dtype, gen)
    tokens = random_tokens(shape, dtype, gen)
    dg, dt = random_tokens(shape, dtype, gen), random_tokens(shape, dtype, gen)
    if op == "linear":
        scan = ps.linear_scan
        oracle = lambda a, b: linear_loop(a, b, 1)[0]  # noqa: E731
    else:
        gates = gates.abs().log()
        scan = ps.log_linear_scan
        oracle = lambda a, b: log_loop(a, b, 1)[0]  # noqa: E731
    with fwad.dual_level():
        got = fwad.unpack_dual(scan(fwad.make_dual(gates, dg), fwad.make_dual(tokens, dt), 1))
        want = fwad.unpack_dual(
            oracle(
                fwad.make_dual(gates.double(), dg.double()),
                fwad.make_dual(tokens.double(), dt.double()),
            )
        )
    assert got.tangent is not None
    assert_matches(got.primal, want.primal, dtype)
    assert_matches(got.tangent, want.tangent, dtype)


def test_compile_fullgraph_forward_and_backward(target, gen) -> None:
    torch._dynamo.reset()
    gates, tokens, initial = (
        t.to(target.device).requires_grad_()
        for t in (
            random_gates((3, 40, 8), torch.float32, gen),
            random_tokens((3, 40, 8), torch.float32, gen),
            random_tokens((3, 8), torch.float32, gen),
        )
    )

    def step(a, b, h):
        out, final = ps.linear_scan(
            a.sigmoid(), b, 1, initial=h, return_final=True, backend=target.backend
        )
        return out.square().mean() + final.sum()

    compiled = torch.compile(step, fullgraph=True)  # raises on any graph break
    loss = compiled(gates, tokens, initial)
    grads = torch.autograd.grad(loss, (gates, tokens, initial))
    want_loss = step(gates, tokens, initial)
    want = torch.autograd.grad(want_loss, (gates, tokens, initial))
    torch.testing.assert_close(loss, want_loss)
    for g, w in zip(grads, want, strict=True):
        torch.testing.assert_close(g, w)


def test_compile_python_number_gate_and_reverse(gen) -> None:
    torch._dynamo.reset()
    tokens = random_tokens((2, 50), torch.float32, gen)
    fn = torch.compile(lambda b: ps.linear_scan(0.9, b, -1, reverse=True), fullgraph=True)
    torch.testing.assert_close(fn(tokens), ps.linear_scan(0.9, tokens, -1, reverse=True))


def test_compile_complex_conjugate_views(target, gen) -> None:
    """Lazy conj views reach the kernels resolved, in eager mode and compiled."""
    torch._dynamo.reset()
    gates = random_gates((2, 30, 3), torch.complex64, gen).to(target.device).requires_grad_()
    tokens = random_tokens((2, 30, 3), torch.complex64, gen).to(target.device).requires_grad_()

    def step(a, b):
        return ps.linear_scan(a.conj(), b, 1, backend=target.backend).abs().sum()

    loss = torch.compile(step, fullgraph=True)(gates, tokens)
    grads = torch.autograd.grad(loss, (gates, tokens))
    a = gates.detach().cpu().to(torch.complex128).requires_grad_()
    b = tokens.detach().cpu().to(torch.complex128).requires_grad_()
    want_loss = linear_loop(a.conj(), b, 1)[0].abs().sum()
    want = torch.autograd.grad(want_loss, (a, b))
    assert_matches(loss, want_loss, torch.complex64)
    for g, w in zip(grads, want, strict=True):
        assert_matches(g, w, torch.complex64)


def test_inputs_are_never_modified(target, gen) -> None:
    for dtype in [torch.float32, torch.complex64, torch.float16]:
        gates, tokens, initial = (
            t.to(target.device).requires_grad_()
            for t in (
                random_gates((3, 20, 4), dtype, gen),
                random_tokens((3, 20, 4), dtype, gen),
                random_tokens((3, 4), dtype, gen),
            )
        )
        before = [t.detach().clone() for t in (gates, tokens, initial)]
        out, final = ps.linear_scan(
            gates, tokens, 1, initial=initial, return_final=True, backend=target.backend
        )
        grad_out = torch.ones_like(out)
        torch.autograd.backward((out, final), (grad_out, torch.ones_like(final)))
        for t, b in zip((gates, tokens, initial), before, strict=True):
            assert torch.equal(t.detach(), b)
        assert torch.equal(grad_out, torch.ones_like(out))


def test_fused_backward_equals_reverse_scan_identity(gen) -> None:
    """The cpu backend's fused backward against composed_backward on the loop."""
    from parascan.first_order import cpu
    from parascan.first_order.ops import composed_backward
    from parascan.first_order.reference import linear_loop

    if "cpu" not in ps.backends("cpu"):
        pytest.skip("the cpu backend is not built")
    for dtype in [torch.float64, torch.complex128]:
        for reverse in (False, True):
            a = random_gates((3, 31, 5), dtype, gen)
            b = random_tokens((3, 31, 5), dtype, gen)
            h = random_tokens((3, 5), dtype, gen)
            out = linear_loop(a, b, h, -2, reverse)
            g = random_tokens((3, 31, 5), dtype, gen)
            fused = cpu.backward(LINEAR, a, None, out, g, h, -2, reverse)
            composed = composed_backward(LINEAR, linear_loop, a, None, out, g, h, -2, reverse)
            for x, y in zip(fused, composed, strict=True):
                torch.testing.assert_close(x, y)
