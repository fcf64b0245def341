"""The CPU matrix-product kernel behind associative_reduce(torch.matmul, ...), against
the float64 left fold of torch.matmul (oracles.matmul_fold): sizes around the tile
widths, segment counts around the kernel's constants, layouts, thread counts,
infinities, and when it is not used."""

from __future__ import annotations

import pytest
import torch

import parascan as ps
from parascan.generic import cpu as matmul
from parascan.generic.cpu import matrix_product_fast_path

from harness import constants
from oracles import matmul_fold as fold64

TOL = {torch.float32: 2e-5, torch.float64: 1e-12}
# The kernel's work split (kernel_constants()): a batch of at least ITEMS sequences
# is shared by sequence; a smaller one is cut into segments of at least SEGMENT.
ITEMS, SEGMENT = constants()["PRODUCT_ITEMS"], constants()["PRODUCT_MIN_SEGMENT"]


def well_conditioned(*shape, dtype, seed):
    """Orthogonal matrices with their columns scaled by about 1 +- 10%: products of
    hundreds stay near norm 1, so an error is not hidden by over- or underflow."""
    g = torch.Generator().manual_seed(seed)
    *batch, d, _ = shape
    q = torch.linalg.qr(torch.randn(*batch, d, d, generator=g, dtype=torch.float64))[0]
    scale = torch.exp(0.1 * torch.randn(*batch, 1, d, generator=g, dtype=torch.float64))
    return (q * scale).to(dtype)


@pytest.fixture(params=[True, False], ids=["simd", "portable"])
def block_products(request, monkeypatch):
    """Both block-product kernels: AVX2 where the CPU has it, and the portable one."""
    monkeypatch.setenv("PARASCAN_SIMD", "1" if request.param else "0")


def assert_product(got, x, dim):
    want = fold64(x, dim)
    assert got is not None and got.dtype == x.dtype and got.shape == want.shape
    tol = TOL[x.dtype] * max(1.0, want.abs().max().item())
    torch.testing.assert_close(got.double(), want, rtol=0, atol=tol)


@pytest.mark.parametrize("n", [2, 3, SEGMENT, SEGMENT + 1, 2 * SEGMENT + 1, 100])
@pytest.mark.parametrize("d", [1, 3, 4, 5, 8, 9, 16, 17, 33])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_kernel_matches_the_fold(block_products, dtype, d, n) -> None:
    # d around the tile widths (4 rows; 8 float32 or 4 float64 columns, two vectors
    # wide) and n around the segment length (one batch element: up to ITEMS segments).
    x = well_conditioned(n, d, d, dtype=dtype, seed=d * 1000 + n)
    before = x.clone()
    assert_product(matrix_product_fast_path(torch.matmul, x, 0), x, 0)
    assert torch.equal(x, before)  # the input is untouched


@pytest.mark.parametrize("batch", [2, 5, ITEMS - 1, ITEMS, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_batches_with_and_without_segments(block_products, dtype, batch) -> None:
    # Fewer than ITEMS sequences are cut into segments; ITEMS or more are not.
    x = well_conditioned(batch, 37, 12, 12, dtype=dtype, seed=batch)
    assert_product(matrix_product_fast_path(torch.matmul, x, 1), x, 1)


@pytest.mark.parametrize(
    "layout", ["middle dim", "negative dim", "transposed", "every other step", "broadcast batch"]
)
def test_layouts_read_in_place_or_copied(layout) -> None:
    base = well_conditioned(3, 50, 4, 16, 16, dtype=torch.float32, seed=1)
    dim = 1
    if layout == "middle dim":
        x = base  # (3, 50, 4, d, d): batch dims on both sides of dim
    elif layout == "negative dim":
        x, dim = base, -4
    elif layout == "transposed":
        x = base.transpose(-1, -2)  # unit row stride: every matrix is copied
    elif layout == "every other step":
        x = base[:, ::2]
    else:
        x = base[:1].expand(6, -1, -1, -1, -1)  # batch stride 0
    # the fast path takes the dim as the public function normalized it
    assert_product(matrix_product_fast_path(torch.matmul, x, dim % x.dim()), x, dim)
    assert_product(ps.associative_reduce(torch.matmul, x, dim), x, dim)


@pytest.mark.parametrize("shape", [(1, 1000, 32, 32), (20, 30, 24, 24), (3, 200, 5, 5)])
def test_same_bits_with_any_number_of_threads(shape) -> None:
    x = well_conditioned(*shape, dtype=torch.float32, seed=2)
    threads = torch.get_num_threads()
    try:
        results = []
        for n in (1, 2, 3, 4):
            torch.set_num_threads(n)
            results.append(matrix_product_fast_path(torch.matmul, x, 1))
    finally:
        torch.set_num_threads(threads)
    assert_product(results[0], x, 1)
    for r in results[1:]:
        assert torch.equal(r, results[0])


@pytest.mark.parametrize("d", [5, 8])
def test_infinities_stay_where_the_fold_puts_them(block_products, d) -> None:
    # Row-stochastic matrices keep the product finite; an infinity in row 0 of the
    # first one makes row 0 of the result +inf and nothing else. The padding of a
    # block (d = 5: 3 columns) holds inf * 0 = NaN beside such a row, and must never
    # be read back into it. 5 segments' worth of matrices, so the segment products
    # are multiplied too.
    x = torch.rand(5 * SEGMENT, d, d, generator=torch.Generator().manual_seed(d)) + 0.1
    x /= x.sum(-1, keepdim=True)
    x[0, 0, 0] = float("inf")
    got = matrix_product_fast_path(torch.matmul, x, 0)
    torch.testing.assert_close(got.double(), fold64(x, 0), equal_nan=True)
    assert (got[0] == float("inf")).all() and torch.isfinite(got[1:]).all()


@pytest.mark.parametrize(
    "why",
    ["another combine", "needs grad", "float16", "not square", "dim in the matrix", "too large"],
)
def test_other_calls_take_the_tree(why) -> None:
    x = torch.randn(6, 4, 4)
    combine = torch.matmul
    dim = 0
    if why == "another combine":
        combine = torch.add
    elif why == "needs grad":
        x.requires_grad_()
    elif why == "float16":
        x = x.half()
    elif why == "not square":
        x = torch.randn(6, 4, 3)
    elif why == "dim in the matrix":
        dim = 1
    else:
        x = torch.randn(2, 257, 257)
    assert matrix_product_fast_path(combine, x, dim) is None


def test_operator_and_method_forms_and_no_grad() -> None:
    import operator

    x = well_conditioned(20, 6, 6, dtype=torch.float64, seed=3)
    for combine in (operator.matmul, torch.Tensor.matmul):
        assert_product(matrix_product_fast_path(combine, x, 0), x, 0)
    w = x.clone().requires_grad_()
    with torch.no_grad():
        assert_product(matrix_product_fast_path(torch.matmul, w, 0), x, 0)


def test_compiled_and_vmapped_reduce_use_the_tree() -> None:
    x = well_conditioned(4, 33, 8, 8, dtype=torch.float32, seed=4)
    compiled = torch.compile(lambda w: ps.associative_reduce(torch.matmul, w, 1), fullgraph=True)
    assert_product(compiled(x), x, 1)
    vmapped = torch.func.vmap(lambda w: ps.associative_reduce(torch.matmul, w, 0))(x)
    assert_product(vmapped, x, 1)


def test_dual_tensors_keep_their_tangents() -> None:
    # Forward-mode AD outside torch.func: the tensor needs no gradient but carries a
    # tangent, so the product must take the differentiable tree.
    import torch.autograd.forward_ad as fwad

    x = well_conditioned(30, 6, 6, dtype=torch.float64, seed=5)
    dx = torch.randn(x.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    with fwad.dual_level():
        got = fwad.unpack_dual(ps.associative_reduce(torch.matmul, fwad.make_dual(x, dx), 0))
        want = fwad.unpack_dual(fold64(fwad.make_dual(x, dx), 0))
    assert got.tangent is not None
    torch.testing.assert_close(got.primal, want.primal)
    torch.testing.assert_close(got.tangent, want.tangent)


# --- regressions: the fast path takes exactly the calls the tree takes --------------


@pytest.mark.parametrize(
    "shape, dim",
    [((1, 4096, 2, 2), -1), ((3, 3, 3), -1), ((4, 5, 5), -2), ((2, 6, 3, 3), -1), ((6, 4, 4), 2)],
)
def test_a_dim_inside_the_matrices_never_reaches_the_kernel(shape, dim) -> None:
    # Before the fix, -1 and -2 passed the fast path's guard and the kernel wrote past
    # its output (a heap overflow; SIGABRT for (1, 4096, 2, 2)). Now such a call is
    # the tree's, which multiplies slices along dim and fails as a lambda does.
    x = torch.randn(shape, dtype=torch.float64)
    with pytest.raises(RuntimeError) as via_lambda:
        ps.associative_reduce(lambda a, b: a @ b, x, dim)
    with pytest.raises(RuntimeError) as via_matmul:
        ps.associative_reduce(torch.matmul, x, dim)
    assert str(via_matmul.value) == str(via_lambda.value)


@pytest.mark.parametrize("dim", [0, -3])
def test_negative_dims_before_the_matrices_use_the_kernel(monkeypatch, dim) -> None:
    x = well_conditioned(9, 5, 5, dtype=torch.float64, seed=3)
    calls = []
    real = matmul.kernel
    monkeypatch.setattr(matmul, "kernel", lambda *a: calls.append(a) or real(*a))
    assert_product(ps.associative_reduce(torch.matmul, x, dim), x, 0)
    assert calls  # the C kernel ran


@pytest.mark.parametrize("n", [2, 3, 7])
def test_negative_views_keep_their_sign(n) -> None:
    # x.imag of a conj view is a lazy negative view: equal to m, but its memory holds
    # -m. Before the fix the kernel read the memory: -(m0 @ m1 @ m2) for odd n.
    m = well_conditioned(n, 4, 4, dtype=torch.float64, seed=n)
    view = torch.complex(torch.zeros_like(m), -m).conj().imag
    assert view.is_neg() and torch.equal(view, m)
    assert_product(ps.associative_reduce(torch.matmul, view, 0), m, 0)
    assert_product(matrix_product_fast_path(torch.matmul, view, 0), m, 0)
