"""What an error message shows of a value it received: a tensor's or an array's type,
shape and dtype, never its elements; any other value's repr, bounded. A numpy array
(or a list of numbers) where a tensor is expected is described so and the message
says how to make a tensor of it, for every public function and drop-in: it once
printed the whole array (tens of kilobytes for a 10000-element one)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import parascan as ps
from parascan import _core
from parascan.compat import accelerated_scan, fla, heinsen_sequence, mamba_ssm
from parascan.compat import torch_parallel_scan as tps

SHORT = 400  # characters: a message about a 10000-element array stays under this
SENTINEL = 0.123456789  # the array's every element: its digits must not appear


def _r(*shape: int) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(sum(shape)))


def _unit(*shape: int) -> torch.Tensor:
    return F.normalize(_r(*shape) - 0.5, dim=-1)


def _qkv(b: int = 1, t: int = 8, h: int = 2, d: int = 4) -> dict[str, torch.Tensor]:
    return {"q": _r(b, t, h, d), "k": _unit(b, t, h, d), "v": _r(b, t, h, d)}


def _selective() -> dict[str, torch.Tensor]:
    return {"u": _r(2, 3, 5), "delta": _r(2, 3, 5), "A": -_r(3, 4), "B": _r(2, 4, 5),
            "C": _r(2, 4, 5), "D": _r(3), "z": _r(2, 3, 5), "delta_bias": _r(3)}  # fmt: skip


def _step() -> dict[str, torch.Tensor]:
    return {"state": _r(2, 3, 4), "x": _r(2, 3), "dt": _r(2, 3), "A": -_r(3, 4),
            "B": _r(2, 4), "C": _r(2, 4), "D": _r(3), "z": _r(2, 3), "dt_bias": _r(3)}  # fmt: skip


def _ssd() -> dict[str, torch.Tensor]:
    return {"x": _r(1, 6, 2, 3), "dt": _r(1, 6, 2), "A": -_r(2), "B": _r(1, 6, 1, 4),
            "C": _r(1, 6, 1, 4), "D": _r(2), "z": _r(1, 6, 2, 3), "dt_bias": _r(2)}  # fmt: skip


def _add(a: Any, b: Any) -> Any:
    return a + b


# public name -> (the function, its valid keyword arguments); every tensor among them is
# replaced by an array in turn
CASES: dict[str, tuple[Callable[..., Any], Callable[[], dict[str, Any]]]] = {
    "parascan.linear_scan": (
        ps.linear_scan,
        lambda: {"gates": _r(2, 5), "tokens": _r(2, 5), "dim": 1, "initial": _r(2)},
    ),
    "parascan.log_linear_scan": (
        ps.log_linear_scan,
        lambda: {"log_gates": _r(2, 5), "log_tokens": _r(2, 5), "dim": 1, "initial": _r(2)},
    ),
    "parascan.matrix_linear_scan": (
        ps.matrix_linear_scan,
        lambda: {"weights": _r(2, 5, 3, 3), "biases": _r(2, 5, 3), "initial": _r(2, 3)},
    ),
    "parascan.delta_rule_scan": (
        ps.delta_rule_scan,
        lambda: {**_qkv(), "beta": _r(1, 8, 2), "g": -_r(1, 8, 2), "initial": _r(1, 2, 4, 4)},
    ),
    "parascan.linear_attention_scan": (
        ps.linear_attention_scan,
        lambda: {**_qkv(), "g": -_r(1, 8, 2, 4), "initial": _r(1, 2, 4, 4)},
    ),
    "parascan.dplr_delta_rule_scan": (
        ps.dplr_delta_rule_scan,
        lambda: {
            **_qkv(),
            "a": -_unit(1, 8, 2, 4),
            "b": _unit(1, 8, 2, 4) / 2,
            "g": -_r(1, 8, 2),
            "initial": _r(1, 2, 4, 4),
        },
    ),
    "parascan.selective_scan": (
        ps.selective_scan,
        lambda: {**_selective(), "initial": _r(2, 3, 4)},
    ),
    "parascan.selective_state_update": (ps.selective_state_update, _step),
    "parascan.ssd_scan": (ps.ssd_scan, lambda: {**_ssd(), "initial": _r(1, 2, 3, 4)}),
    "parascan.associative_scan": (
        ps.associative_scan,
        lambda: {"combine_fn": _add, "elems": _r(2, 5), "dim": 1},
    ),
    "parascan.associative_reduce": (
        ps.associative_reduce,
        lambda: {"combine_fn": _add, "elems": _r(2, 5), "dim": 1},
    ),
    "parascan.compat.fla.chunk_hgrn": (
        fla.chunk_hgrn,
        lambda: {"x": _r(1, 8, 4), "g": -_r(1, 8, 4), "initial_state": _r(1, 4)},
    ),
    "parascan.compat.fla.fused_recurrent_hgrn": (
        fla.fused_recurrent_hgrn,
        lambda: {"x": _r(1, 8, 4), "g": -_r(1, 8, 4), "initial_state": _r(1, 4)},
    ),
    "parascan.compat.fla.chunk_delta_rule": (
        fla.chunk_delta_rule,
        lambda: {**_qkv(), "beta": _r(1, 8, 2), "initial_state": _r(1, 2, 4, 4)},
    ),
    "parascan.compat.fla.fused_recurrent_delta_rule": (
        fla.fused_recurrent_delta_rule,
        lambda: {**_qkv(), "beta": _r(1, 8, 2), "initial_state": _r(1, 2, 4, 4)},
    ),
    "parascan.compat.fla.chunk_gated_delta_rule": (
        fla.chunk_gated_delta_rule,
        lambda: {**_qkv(), "g": -_r(1, 8, 2), "beta": _r(1, 8, 2), "initial_state": _r(1, 2, 4, 4)},
    ),
    "parascan.compat.fla.fused_recurrent_gated_delta_rule": (
        fla.fused_recurrent_gated_delta_rule,
        lambda: {**_qkv(), "g": -_r(1, 8, 2), "beta": _r(1, 8, 2), "initial_state": _r(1, 2, 4, 4)},
    ),
    "parascan.compat.fla.chunk_kda": (
        fla.chunk_kda,
        lambda: {
            **_qkv(),
            "g": -_r(1, 8, 2, 4),
            "beta": _r(1, 8, 2),
            "initial_state": _r(1, 2, 4, 4),
        },
    ),
    "parascan.compat.fla.fused_recurrent_kda": (
        fla.fused_recurrent_kda,
        lambda: {
            **_qkv(),
            "g": -_r(1, 8, 2, 4),
            "beta": _r(1, 8, 2),
            "initial_state": _r(1, 2, 4, 4),
        },
    ),
    "parascan.compat.mamba_ssm.selective_scan_fn": (mamba_ssm.selective_scan_fn, _selective),
    "parascan.compat.mamba_ssm.selective_scan_ref": (mamba_ssm.selective_scan_ref, _selective),
    "parascan.compat.mamba_ssm.selective_state_update": (mamba_ssm.selective_state_update, _step),
    "parascan.compat.mamba_ssm.mamba_chunk_scan_combined": (
        mamba_ssm.mamba_chunk_scan_combined,
        lambda: {**_ssd(), "chunk_size": 4, "initial_states": _r(1, 2, 3, 4)},
    ),
    "parascan.compat.accelerated_scan.scan": (
        accelerated_scan.scan,
        lambda: {"gates": _r(1, 2, 8), "tokens": _r(1, 2, 8)},
    ),
    "parascan.compat.heinsen_sequence.compute_in_parallel": (
        heinsen_sequence.compute_in_parallel,
        lambda: {"log_coeffs": _r(2, 5), "log_values": _r(2, 6)},
    ),
    "parascan.compat.torch_parallel_scan.prefix_scan": (
        tps.prefix_scan,
        lambda: {"x": _r(2, 5), "prefix_func": _add, "dim": 1},
    ),
    "parascan.compat.torch_parallel_scan.reduce_scan": (
        tps.reduce_scan,
        lambda: {"x": _r(2, 5), "reduce_func": _add, "dim": 1},
    ),
}

TENSOR_ARGUMENTS = [
    pytest.param(
        public,
        name,
        id=f"{public.removeprefix('parascan.')}-{name}",
    )
    for public, (_, make) in CASES.items()
    for name, value in make().items()
    if isinstance(value, torch.Tensor)
]


def _message(public: str, **change: Any) -> str:
    fn, make = CASES[public]
    kwargs = {**make(), **change}
    with pytest.raises((TypeError, ValueError)) as info:
        fn(**kwargs)
    return str(info.value)


@pytest.mark.parametrize("public", list(CASES))
def test_the_valid_calls_run(public: str) -> None:
    """Each case's arguments are valid as they are: the array alone is wrong."""
    fn, make = CASES[public]
    fn(**make())


@pytest.mark.parametrize(("public", "name"), TENSOR_ARGUMENTS)
def test_a_numpy_array_is_described_by_shape_and_dtype(public: str, name: str) -> None:
    np = pytest.importorskip("numpy")
    array = np.full((100, 100), SENTINEL, dtype=np.float32)
    message = _message(public, **{name: array})
    assert message.startswith(f"{public}: "), message
    assert name in message, message
    assert "numpy.ndarray(shape=(100, 100), dtype=float32)" in message, message
    assert "pass a torch.Tensor (torch.from_numpy)" in message, message
    assert "0.1234" not in message, message
    assert len(message) < SHORT, message


@pytest.mark.parametrize(("public", "name"), TENSOR_ARGUMENTS)
def test_a_long_list_of_numbers_is_shown_bounded(public: str, name: str) -> None:
    message = _message(public, **{name: [SENTINEL] * 10_000})
    if public in ("parascan.associative_scan", "parascan.associative_reduce"):
        # elems is a pytree: a list is a structure, and its first leaf is what is wrong
        assert message.endswith("but it holds float 0.123456789"), message
        return
    assert message.startswith(f"{public}: "), message
    assert "list [0.123456789, " in message and "(10000 items)" in message, message
    assert "pass a torch.Tensor (torch.tensor)" in message, message
    assert len(message) < SHORT, message


def test_a_numpy_array_of_offsets_as_cu_seqlens() -> None:
    np = pytest.importorskip("numpy")
    message = _message(
        "parascan.linear_scan", gates=_r(1, 5), tokens=_r(1, 5), initial=None,
        cu_seqlens=np.array([0, 2, 5]),
    )  # fmt: skip
    assert message.startswith("parascan.linear_scan: expected cu_seqlens"), message
    assert "numpy.ndarray(shape=(3,), dtype=int64); pass a torch.Tensor (torch.from_numpy)" in (
        message
    )


def test_thousands_of_bad_offsets_are_shown_bounded() -> None:
    offsets = torch.arange(10_000).flip(0)  # decreasing
    message = _message(
        "parascan.linear_scan", gates=_r(1, 5), tokens=_r(1, 5), initial=None, cu_seqlens=offsets
    )
    assert "non-decreasing offsets" in message and "(10000 items)" in message, message
    assert len(message) < SHORT, message


@pytest.mark.parametrize(
    ("value", "description"),
    [
        ("x" * 10_000, "str 'xxxxxxxxxxxxxxxxxxxxxxxxxxx...xxxxxxxxxxxxxxxxxxxxxxxxxxxx'"),
        (dict.fromkeys(range(100), 0), "dict {0: 0, 1: 0, 2: 0, 3: 0, 4: 0, 5: 0, ...} "
                                       "(100 items)"),
        ((1.5, 2), "tuple (1.5, 2)"),
        (10**500, "int of 1661 bits"),
        (None, "NoneType None"),
        ([torch.ones(2)] * 3, "list [Tensor(shape=(2,), dtype=torch.float32, device=cpu), "
                              "Tensor(shape=(2,), dtype=torch.float32, device=cpu), "
                              "Tensor(shape=(2,), dtype=torch.float32, device=cpu)]"),
    ],
    ids=["long str", "dict", "tuple", "huge int", "None", "list of tensors"],
)  # fmt: skip
def test_describe_bounds_every_value(value: object, description: str) -> None:
    assert _core.describe(value) == description


def test_describe_survives_a_list_that_holds_itself() -> None:
    loop: list[Any] = []
    loop.append(loop)
    assert _core.describe(loop) == "list [[[[...]]]]"
    assert _core.tensor_hint(loop) == ""


def test_numpy_scalars_show_their_value_and_arrays_never_their_elements() -> None:
    np = pytest.importorskip("numpy")
    assert _core.describe(np.float32(0.5)) == "numpy.float32 np.float32(0.5)"
    assert _core.describe(np.array(0.5)) == "numpy.ndarray array(0.5)"
    assert _core.describe(np.ma.ones(3)) == "numpy.ma.MaskedArray(shape=(3,), dtype=float64)"
    in_a_list = "list [numpy.ndarray(shape=(10000,), dtype=float64)]"
    assert _core.describe([np.zeros(10_000)]) == in_a_list
    assert _core.tensor_hint(np.float32(0.5)) == "; pass a torch.Tensor (torch.as_tensor)"
    assert _core.tensor_hint(np.zeros(3)) == "; pass a torch.Tensor (torch.from_numpy)"


@pytest.mark.parametrize(
    ("value", "hint"),
    [
        ([[1.0, 2.0]], "; pass a torch.Tensor (torch.tensor)"),
        ((torch.ones(2), torch.ones(2)), "; pass a torch.Tensor (torch.stack)"),
        ([], ""),
        ("tokens", ""),
        (torch.ones(2), ""),
    ],
    ids=["nested numbers", "tensors", "empty", "str", "tensor"],
)
def test_tensor_hint(value: object, hint: str) -> None:
    assert _core.tensor_hint(value) == hint


def test_a_bad_device_for_backends_is_shown_bounded() -> None:
    with pytest.raises(ValueError, match=r"parascan\.backends: .*\(10000 items\)$") as info:
        ps.backends(list(range(10_000)))  # type: ignore[arg-type]
    assert len(str(info.value)) < SHORT


def test_a_bad_backend_is_shown_bounded() -> None:
    with pytest.raises(ValueError, match=r"expected backend to be one of .*\(1000 items\)$"):
        ps.linear_scan(_r(2, 5), _r(2, 5), 1, backend=list(range(1000)))  # type: ignore[arg-type]
