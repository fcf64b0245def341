"""Bad input raises a clear error before any kernel runs: the public name, what was
expected and what was received."""

from __future__ import annotations

import pytest
import torch

import parascan as ps
from parascan import _core, _native

T = torch.ones(2, 5)


@pytest.mark.parametrize(
    ("call", "exc", "fragments"),
    [
        (lambda: ps.linear_scan(T.long(), T, 1), TypeError, ["gates", "int64"]),
        (lambda: ps.linear_scan(T, T.bool(), 1), TypeError, ["tokens", "bool"]),
        (lambda: ps.linear_scan(T, T.to(torch.complex32), 1), TypeError, ["complex32"]),
        (lambda: ps.linear_scan(T, [1.0, 2.0], 1), TypeError, ["tokens", "Tensor", "list"]),
        (lambda: ps.linear_scan("0.5", T, 1), TypeError, ["gates", "str"]),
        (lambda: ps.linear_scan(True, T, 1), TypeError, ["gates", "bool"]),
        # an int no float holds: a named error, not Python's OverflowError
        (lambda: ps.linear_scan(10**400, T, 1), ValueError, ["gates", "float can hold", "bits"]),
        (lambda: ps.linear_scan(T, T, 1, initial=-(10**400)), ValueError, ["initial", "bits"]),
        (lambda: ps.linear_scan(T, 1.0, 0), TypeError, ["tokens", "float"]),
        (lambda: ps.linear_scan(torch.ones(3), T, 1), ValueError, ["broadcast", "(3,)", "(2, 5)"]),
        (lambda: ps.linear_scan(T, T, 2), ValueError, ["dim", "[-2, 1]", "got 2"]),
        (lambda: ps.linear_scan(T, T, -3), IndexError, ["dim", "-3"]),  # like torch.cumsum
        (lambda: ps.linear_scan(T, T, 1.0), TypeError, ["dim", "float"]),
        (lambda: ps.linear_scan(T, T, None), TypeError, ["dim", "NoneType"]),
        (
            lambda: ps.linear_scan(T, T, 1, initial=torch.ones(5)),
            ValueError,
            ["initial", "(2,)", "(5,)"],
        ),
        (
            lambda: ps.linear_scan(T, T, 1, initial=torch.ones(1, 2)),
            ValueError,
            ["initial", "(1, 2)"],
        ),
        (
            lambda: ps.linear_scan(T, T, 1, initial=torch.ones(2, dtype=torch.complex64)),
            TypeError,
            ["initial", "complex64", "float32"],
        ),
        (lambda: ps.linear_scan(T, T, 1, initial=torch.ones(2).int()), TypeError, ["initial"]),
        (lambda: ps.linear_scan(T, T, 1, backend="gpu"), ValueError, ["backend", "'gpu'"]),
        (lambda: ps.linear_scan(T, T, 1, backend=None), ValueError, ["backend", "None"]),
        (lambda: ps.linear_scan(T, T, 1, reverse=1), TypeError, ["reverse", "int"]),
        (lambda: ps.linear_scan(T, T, 1, return_final="yes"), TypeError, ["return_final"]),
        (
            lambda: ps.linear_scan(T, T.to("meta"), 1),
            ValueError,
            ["one device", "cpu", "meta"],
        ),
    ],
)
def test_bad_input_raises_clear_error(call, exc, fragments) -> None:
    with pytest.raises(exc) as info:
        call()
    message = str(info.value)
    assert message.startswith("parascan.linear_scan: "), message
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_unavailable_triton_backend_says_why(monkeypatch) -> None:
    # Without the interpreter flag, Triton runs on CUDA tensors only (or is not installed).
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(RuntimeError) as info:
        ps.linear_scan(T, T, 1, backend="triton")
    message = str(info.value)
    assert message.startswith("parascan.linear_scan: backend 'triton' is not available: ")
    assert "CUDA tensors" in message or "not installed" in message, message


def test_errors_come_before_any_kernel(monkeypatch) -> None:
    calls = []
    from dataclasses import replace

    from parascan.first_order.ops import ROWS

    linear = ROWS["linear"].backends
    monkeypatch.setitem(linear, "torch", replace(linear["torch"], forward=calls.append))
    with pytest.raises(ValueError):
        ps.linear_scan(T, T, 1, initial=torch.ones(3), backend="torch")
    assert calls == []


def test_backends_lists_what_runs() -> None:
    assert ps.backends() == ps.backends("cpu") == ps.backends(torch.device("cpu"))
    assert ps.backends("cpu")[-2:] == ["torch", "loop"]
    assert "triton" not in ps.backends("cpu")
    if not torch.cuda.is_available():
        assert ps.backends("cuda") == []
    assert ps.backends("meta") == ["torch", "loop"]


def test_missing_kernel_library_makes_cpu_unavailable(monkeypatch) -> None:
    monkeypatch.setattr(_native, "_load", lambda: (None, "no kernels here (test)"))
    monkeypatch.setattr(_core, "kernel_library_error", _native.kernel_library_error)
    monkeypatch.setattr(
        _core, "_kernel_library_error", lambda: _native.kernel_library_error() or ""
    )
    assert ps.backends("cpu") == ["torch", "loop"]
    with pytest.raises(RuntimeError, match=r"backend 'cpu' is not available: no kernels here"):
        ps.linear_scan(T, T, 1, backend="cpu")
    # auto falls back to the torch backend
    torch.testing.assert_close(ps.linear_scan(T, T, 1), T.cumsum(1))


def test_auto_picks_the_compiled_kernel_on_cpu() -> None:
    if _native.kernel_library_error() is None:
        assert ps.backends("cpu")[0] == "cpu"


def test_meta_tensors_give_shapes_without_computing() -> None:
    gates = torch.empty(3, 7, 4, device="meta")
    out, final = ps.linear_scan(gates, gates, 1, return_final=True)
    assert out.shape == (3, 7, 4) and final.shape == (3, 4) and out.device.type == "meta"


def test_uninitialized_memory_is_nan_in_tests() -> None:
    """The guard the whole suite relies on: outputs a kernel forgets to write are NaN."""
    assert torch.empty(4).isnan().all()
    assert torch.empty(2, dtype=torch.complex64).isnan().all()
