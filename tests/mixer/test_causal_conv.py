"""The depthwise causal convolution (+ bias, + silu) behind the Mamba drop-ins
(parascan.mixer.conv.causal_conv1d): its C path (plain CPU float32/64 tensors, no
seq_idx) and its torch path (everything else) against the float64 loop
(oracles.causal_conv_loop), and both differentiable twice (create_graph) with correct
second derivatives."""

from __future__ import annotations

import pytest
import torch

from parascan.mixer import conv

from oracles import causal_conv_loop


def strided(batch: int, length: int, channels: int, dtype: torch.dtype,
            gen: torch.Generator) -> torch.Tensor:  # fmt: skip
    """x (batch, L, channels) as the mixers pass it: a slice of a wider projection."""
    wide = torch.randn(batch, length, 2 * channels + 3, generator=gen, dtype=torch.float64)
    return wide.to(dtype)[:, :, 3 : 3 + channels]


@pytest.mark.parametrize("length", [0, 1, 3, 4, 70, 129])
@pytest.mark.parametrize("channels", [1, 17, 64, 70])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_c_path_matches_a_float64_loop(length, channels, dtype) -> None:
    """Widths 1 to 5, with and without bias and silu: the C path is the one taken (its
    own backward node), its outputs and gradients match the loop's."""
    gen = torch.Generator().manual_seed(length * 100 + channels)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {}
    for width in (1, 2, 4, 5):
        for silu in (False, True):
            x = strided(2, length, channels, dtype, gen).requires_grad_(True)
            weight = torch.randn(channels, width, generator=gen, dtype=dtype).requires_grad_()
            bias = torch.randn(channels, generator=gen, dtype=dtype).requires_grad_()
            for b in (None, bias):
                got = conv.causal_conv1d(x, weight, b, None, silu)
                assert type(got.grad_fn).__name__ == "_NativeCausalConv1dBackward"
                x64, w64, b64 = (
                    None if t is None else t.detach().double().requires_grad_()
                    for t in (x, weight, b)
                )
                want = causal_conv_loop(x64, w64, b64, silu)
                torch.testing.assert_close(got.double(), want.detach(), **tol)
                grad = torch.randn(got.shape, generator=gen, dtype=torch.float64)
                inputs = [x, weight] + ([b] if b is not None else [])
                inputs64 = [x64, w64] + ([b64] if b64 is not None else [])
                got_grads = torch.autograd.grad(got, inputs, grad.to(dtype))
                want_grads = torch.autograd.grad(want, inputs64, grad, materialize_grads=True)
                for g, w in zip(got_grads, want_grads, strict=True):
                    torch.testing.assert_close(g.double(), w, **tol)


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("path", ["c", "torch", "torch_seq_idx"])
def test_second_derivatives(silu, with_bias, path) -> None:
    """gradcheck and gradgradcheck in float64 on both paths. The torch path's silu once
    saved its pre-activation without a graph: its second derivatives were silently
    wrong (zero through the pre-activation)."""
    gen = torch.Generator().manual_seed(7)
    x = strided(2, 6, 3, torch.float64, gen).detach().requires_grad_(True)
    weight = torch.randn(3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(3, generator=gen, dtype=torch.float64, requires_grad=True)
    seq_idx = torch.tensor([[0, 0, 1, 1, 1, 2], [0, 0, 0, 0, 0, 0]])

    def f(x, w, *b):  # type: ignore[no-untyped-def]
        b = b[0] if b else None
        if path == "c":
            out = conv.causal_conv1d(x, w, b, None, silu)
            assert type(out.grad_fn).__name__ == "_NativeCausalConv1dBackward"
            return out
        return conv._CausalConv1d.apply(x, w, b, seq_idx if path == "torch_seq_idx" else None,
                                             silu)[0]  # fmt: skip

    inputs = (x, weight, bias) if with_bias else (x, weight)
    assert torch.autograd.gradcheck(f, inputs)
    assert torch.autograd.gradgradcheck(f, inputs)
    if path == "torch_seq_idx":
        got = f(*inputs)
        want = causal_conv_loop(x, weight, bias if with_bias else None, silu, seq_idx)
        torch.testing.assert_close(got, want)


def test_other_dtypes_take_the_torch_path() -> None:
    """bfloat16 (no C kernel) and mixed dtypes go through torch, with the same values."""
    gen = torch.Generator().manual_seed(3)
    x = strided(1, 9, 8, torch.float32, gen)
    weight, bias = torch.randn(8, 4, generator=gen), torch.randn(8, generator=gen)
    want = conv.causal_conv1d(x, weight, bias, None, True)
    low = conv.causal_conv1d(x.bfloat16().requires_grad_(), weight.bfloat16(),
                                        bias.bfloat16(), None, True)  # fmt: skip
    assert type(low.grad_fn).__name__ == "_CausalConv1dBackward"
    torch.testing.assert_close(low.float(), want, rtol=2e-2, atol=2e-2)


def _func_checks(x, weight, bias, seq_idx) -> None:  # type: ignore[no-untyped-def]
    from torch.func import grad, jacrev, vmap

    def loss(x, w):  # type: ignore[no-untyped-def]
        return conv.causal_conv1d(x, w, bias, seq_idx, True).square().sum()

    got = grad(loss, argnums=(0, 1))(x, weight)
    xs, ws = x.clone().requires_grad_(), weight.clone().requires_grad_()
    want = torch.autograd.grad(loss(xs, ws), (xs, ws))
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w)
    jac = jacrev(lambda w: conv.causal_conv1d(x, w, bias, seq_idx, True))(weight)
    want_jac = torch.autograd.functional.jacobian(
        lambda w: conv.causal_conv1d(x, w, bias, seq_idx, True), weight
    )
    torch.testing.assert_close(jac, want_jac)
    if seq_idx is None:  # one row at a time, as a batch of one
        per_row = vmap(lambda xi: loss(xi[None], weight))(x)
        torch.testing.assert_close(per_row.sum(), loss(x, weight))


def test_torch_func_transforms() -> None:
    """torch.func.grad, vmap and jacrev run the convolution (its torch path: the C
    kernels do not see functorch's tensors) and agree with autograd, seq_idx included."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, 7, 5, generator=gen, dtype=torch.float64)
    weight = torch.randn(5, 4, generator=gen, dtype=torch.float64)
    bias = torch.randn(5, generator=gen, dtype=torch.float64)
    seq_idx = torch.tensor([[0, 0, 0, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1, 1]])
    _func_checks(x, weight, bias, None)
    _func_checks(x, weight, bias, seq_idx)
    want = causal_conv_loop(x, weight, bias, True, seq_idx)
    torch.testing.assert_close(conv.causal_conv1d(x, weight, bias, seq_idx, True), want)
