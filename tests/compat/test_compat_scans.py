"""parascan.compat.accelerated_scan and parascan.compat.torch_parallel_scan: the
originals' calls, checked against the sequential loops of oracles.py (and against
accelerated-scan's own reference where that package is installed)."""

from __future__ import annotations

import pytest
import torch

from parascan.compat import accelerated_scan, torch_parallel_scan

from oracles import fold_scan, linear_loop, matrix_loop


@pytest.mark.parametrize("steps", [1, 7, 100, 4097])
def test_accelerated_scan_any_length(steps) -> None:
    g = torch.Generator().manual_seed(steps)
    gates = torch.rand(2, 3, steps, generator=g)
    tokens = torch.randn(2, 3, steps, generator=g)
    expected, _ = linear_loop(gates.double(), tokens.double(), -1)
    torch.testing.assert_close(accelerated_scan.scan(gates, tokens), expected.float())


def test_accelerated_scan_matches_its_reference_and_gradients() -> None:
    ref = pytest.importorskip("accelerated_scan.ref")
    g = torch.Generator().manual_seed(0)
    gates = torch.rand(2, 4, 64, generator=g, dtype=torch.float64, requires_grad=True)
    tokens = torch.randn(2, 4, 64, generator=g, dtype=torch.float64, requires_grad=True)
    ours = accelerated_scan.scan(gates, tokens)
    theirs = ref.scan(gates, tokens)
    torch.testing.assert_close(ours, theirs)
    w = torch.randn(2, 4, 64, generator=g, dtype=torch.float64)
    torch.testing.assert_close(
        torch.autograd.grad((ours * w).sum(), (gates, tokens)),
        torch.autograd.grad((theirs * w).sum(), (gates, tokens)),
    )


def test_accelerated_scan_errors() -> None:
    x = torch.ones(2, 3, 4)
    with pytest.raises(ValueError, match=r"accelerated_scan\.scan: expected gates of shape"):
        accelerated_scan.scan(x[0], x[0])
    with pytest.raises(ValueError, match=r"one shape.*\(2, 3, 4\).*\(2, 3, 3\)"):
        accelerated_scan.scan(x, x[..., :3])
    with pytest.raises(TypeError, match=r"accelerated_scan\.scan: expected gates to have a float"):
        accelerated_scan.scan(x.long(), x)


@pytest.mark.parametrize(
    ("shape", "dim"), [((100, 4, 4), -3), ((100, 4, 4), 0), ((2, 37, 3, 3), 1)]
)
def test_prefix_and_reduce_scan_of_matrices(shape, dim) -> None:
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64) / 2
    expected = fold_scan(torch.matmul, x, dim)  # x[0], x[0] @ x[1], ...
    torch.testing.assert_close(torch_parallel_scan.prefix_scan(x, torch.matmul, dim=dim), expected)
    reduced = torch_parallel_scan.reduce_scan(x, torch.matmul, dim=dim)
    torch.testing.assert_close(reduced, expected.select(dim, -1))


def test_prefix_scan_last_dim_and_pad_value_is_harmless() -> None:
    x = torch.randn(3, 13, dtype=torch.float64)
    for pad in (0, 1.0, float("nan")):
        out = torch_parallel_scan.prefix_scan(x, torch.maximum, dim=-1, pad_value=pad)
        torch.testing.assert_close(out, torch.cummax(x, -1).values)


def test_non_diagonal_recurrence_recipe() -> None:
    # The original's README recipe: x[t] = W[t] x[t-1] + b[t] as products of augmented
    # matrices, multiplied on the right, scanned with prefix_scan.
    g = torch.Generator().manual_seed(2)
    n, d = 50, 4
    x0 = torch.randn(d, generator=g, dtype=torch.float64)
    w = torch.randn(n, d, d, generator=g, dtype=torch.float64) / d
    b = torch.randn(n, d, generator=g, dtype=torch.float64)
    mod_w = torch.cat(
        [
            torch.nn.functional.pad(w.mT, (0, 1), value=0),
            torch.nn.functional.pad(b, (0, 1), value=1).unsqueeze(-2),
        ],
        dim=-2,
    )
    mod_x = torch.nn.functional.pad(x0, (0, 1), value=1) @ torch_parallel_scan.prefix_scan(
        mod_w, torch.matmul, dim=-3
    )
    expected, _ = matrix_loop(w, b, x0)
    torch.testing.assert_close(mod_x[:, :-1], expected)


def test_torch_parallel_scan_errors() -> None:
    with pytest.raises(TypeError, match=r"prefix_scan: expected x to be a Tensor"):
        torch_parallel_scan.prefix_scan([1.0], torch.add, 0)
    with pytest.raises(TypeError, match=r"reduce_scan: expected a callable"):
        torch_parallel_scan.reduce_scan(torch.ones(3), "add", 0)
