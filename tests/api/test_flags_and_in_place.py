"""Flags and in-place arguments, checked once for every public function and drop-in.

A flag is a bool: anything else (``"0"``, None, 1, a bool tensor) raises the same
``TypeError`` naming the function, on every backend and path (a decoding step's C
kernel without autograd and its torch ops with it used to read ``"0"`` as False and
as True). An argument written in place whose elements share memory (an expanded or
``as_strided`` view) raises a ``ValueError`` naming the function before anything is
written (its writes used to alias each other)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

import parascan as ps
import parascan.distributed as psd
from parascan.compat import fla, mamba_ssm
from parascan.integrations import transformers as hf

BAD_FLAGS = {"str '0'": "0", "None": None, "int 1": 1, "bool tensor": torch.tensor(True)}
BACKENDS = ["auto", "cpu", "torch", "loop"]


def _rand(*shape: int, grad: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(sum(shape))
    return torch.rand(shape, generator=gen).requires_grad_(grad)


def _selective(grad: bool) -> dict[str, torch.Tensor]:
    return {"u": _rand(2, 4, 5, grad=grad), "delta": _rand(2, 4, 5), "A": -_rand(4, 3),
            "B": _rand(2, 3, 5), "C": _rand(2, 3, 5)}  # fmt: skip


def _ssd(grad: bool) -> dict[str, torch.Tensor]:
    return {"x": _rand(1, 6, 2, 3, grad=grad), "dt": _rand(1, 6, 2), "A": -_rand(2),
            "B": _rand(1, 6, 1, 4), "C": _rand(1, 6, 1, 4)}  # fmt: skip


def _step(grad: bool, heads: bool) -> tuple[torch.Tensor, ...]:
    """(state, x, dt, A, B, C) of a decoding step, Mamba-1's or the multi-head layout."""
    lead = (2, 3) if heads else (4,)
    return (torch.zeros(2, *lead, 3), _rand(2, *lead, grad=grad), _rand(2, *lead),
            -_rand(*lead, 3), _rand(2, 1, 3), _rand(2, 1, 3))  # fmt: skip


def _split_layer(grad: bool) -> dict[str, Any]:
    """A mamba_split_conv1d_scan_combined call: 2 heads of 2, 1 group, state 3."""
    return {"zxbcdt": _rand(1, 5, 4 + 4 + 6 + 2, grad=grad), "conv1d_weight": _rand(10, 4),
            "conv1d_bias": _rand(10), "dt_bias": _rand(2), "A": -_rand(2), "D": _rand(2, 2),
            "chunk_size": 8, "rmsnorm_weight": _rand(4)}  # fmt: skip


def _cases() -> dict[str, tuple[str, list[str], Callable[..., Any]]]:
    """name -> (the function's name in errors, its flags, call(grad, backend, **flag))."""
    lin = "parascan.linear_scan"
    cases: dict[str, tuple[str, list[str], Callable[..., Any]]] = {
        "linear_scan": (lin, ["reverse", "return_final"],
                        lambda g, be, **f: ps.linear_scan(_rand(2, 5, grad=g), _rand(2, 5), 1,
                                                          backend=be, **f)),
        "log_linear_scan": ("parascan.log_linear_scan", ["reverse", "return_final"],
                            lambda g, be, **f: ps.log_linear_scan(-_rand(2, 5, grad=g),
                                                                  _rand(2, 5), 1, backend=be, **f)),
        "packed linear_scan": (lin, ["reverse", "return_final"],
                               lambda g, be, **f: ps.linear_scan(
                                   _rand(1, 5, grad=g), _rand(1, 5), 1, backend=be,
                                   cu_seqlens=torch.tensor([0, 2, 5]), **f)),
        "matrix_linear_scan": ("parascan.matrix_linear_scan", ["reverse", "return_final"],
                               lambda g, be, **f: ps.matrix_linear_scan(
                                   _rand(5, 2, 2, grad=g), _rand(5, 2),
                                   backend="cpu" if be == "auto" else be, **f)),
        "associative_scan": ("parascan.associative_scan", ["reverse"],
                             lambda g, be, **f: ps.associative_scan(
                                 torch.add, _rand(5, 2, grad=g), 0, **f)),
        "selective_scan": ("parascan.selective_scan", ["delta_softplus", "return_final"],
                           lambda g, be, **f: ps.selective_scan(**_selective(g), backend=be, **f)),
        "ssd_scan": ("parascan.ssd_scan", ["dt_softplus", "return_final"],
                     lambda g, be, **f: ps.ssd_scan(**_ssd(g), backend=be, **f)),
        "selective_state_update": (
            "parascan.selective_state_update", ["dt_softplus"],
            lambda g, be, **f: ps.selective_state_update(*_step(g, be == "heads"), **f)),
        "distributed.linear_scan": ("parascan.distributed.linear_scan",
                                    ["reverse", "return_final"],
                                    lambda g, be, **f: psd.linear_scan(
                                        _rand(2, 5, grad=g), _rand(2, 5), 1, **f)),
        "distributed.log_linear_scan": ("parascan.distributed.log_linear_scan",
                                        ["reverse", "return_final"],
                                        lambda g, be, **f: psd.log_linear_scan(
                                            -_rand(2, 5, grad=g), _rand(2, 5), 1, **f)),
        "fla.fused_recurrent_hgrn": ("parascan.compat.fla.fused_recurrent_hgrn",
                                     ["output_final_state"],
                                     lambda g, be, **f: fla.fused_recurrent_hgrn(
                                         _rand(1, 5, 3, grad=g), -_rand(1, 5, 3), **f)),
        "fla.chunk_hgrn": ("parascan.compat.fla.chunk_hgrn", ["output_final_state"],
                           lambda g, be, **f: fla.chunk_hgrn(_rand(1, 5, 3, grad=g),
                                                             -_rand(1, 5, 3), **f)),
    }  # fmt: skip
    for name in ("selective_scan_fn", "selective_scan_ref"):
        cases[f"mamba_ssm.{name}"] = (
            f"parascan.compat.mamba_ssm.{name}", ["delta_softplus", "return_last_state"],
            lambda g, be, _name=name, **f: getattr(mamba_ssm, _name)(*_selective(g).values(), **f),
        )  # fmt: skip
    cases["mamba_ssm.selective_state_update"] = (
        "parascan.compat.mamba_ssm.selective_state_update", ["dt_softplus"],
        lambda g, be, **f: mamba_ssm.selective_state_update(
            *_step(g, True), state_batch_indices=torch.tensor([1, 0]) if be == "heads" else None,
            **f),
    )  # fmt: skip
    cases["mamba_ssm.mamba_chunk_scan_combined"] = (
        "parascan.compat.mamba_ssm.mamba_chunk_scan_combined",
        ["dt_softplus", "return_final_states", "return_varlen_states"],
        lambda g, be, **f: mamba_ssm.mamba_chunk_scan_combined(
            *_ssd(g).values(), chunk_size=8, cu_seqlens=torch.tensor([0, 6]), **f),
    )  # fmt: skip
    cases["mamba_ssm.mamba_split_conv1d_scan_combined"] = (
        "parascan.compat.mamba_ssm.mamba_split_conv1d_scan_combined",
        ["return_final_states", "norm_before_gate"],
        lambda g, be, **f: mamba_ssm.mamba_split_conv1d_scan_combined(**_split_layer(g), **f),
    )  # fmt: skip
    # parascan's replacements of transformers' functions: their flags reach the drop-ins
    # unchanged (they used to be coerced with bool()), so the drop-ins' errors name them
    cases["transformers mamba_selective_scan"] = (
        "parascan.compat.mamba_ssm.selective_scan_fn", ["delta_softplus", "return_last_state"],
        lambda g, be, **f: hf.selective_scan(*_selective(g).values(), **f),
    )  # fmt: skip
    cases["transformers mamba2_chunk_scan"] = (
        "parascan.compat.mamba_ssm.mamba_chunk_scan_combined",
        ["dt_softplus", "return_final_states"],
        lambda g, be, **f: hf.chunk_scan(*_ssd(g).values(), chunk_size=8, **f),
    )  # fmt: skip
    cases["transformers mamba2_selective_state_update"] = (
        "parascan.compat.mamba_ssm.selective_state_update", ["dt_softplus"],
        lambda g, be, **f: hf.multihead_state_update(*_step(g, True), **f),
    )  # fmt: skip
    cases["transformers mamba2_split_conv1d_scan_combined"] = (
        "parascan.compat.mamba_ssm.mamba_split_conv1d_scan_combined",
        ["return_final_states", "norm_before_gate"],
        lambda g, be, **f: hf.split_conv_scan(**_split_layer(g), **f),
    )  # fmt: skip
    return cases


CASES = _cases()
FLAG_CASES = [
    (case, flag, bad)
    for case, (_, flags, _) in CASES.items()
    for flag in flags
    for bad in BAD_FLAGS
]


@pytest.mark.parametrize(("case", "flag", "bad"), FLAG_CASES,
                         ids=[f"{c}: {f}={b}" for c, f, b in FLAG_CASES])  # fmt: skip
def test_a_flag_that_is_not_a_bool_raises_on_every_path(case, flag, bad) -> None:
    name, _, call = CASES[case]
    message = rf"^{re.escape(name)}: expected {flag} to be a bool, but got "
    # the selective_state_update rows take 'heads' for the multi-head layout (or, for the
    # drop-in, state_batch_indices); the scans every backend
    paths = ["auto", "heads"] if "state_update" in case else BACKENDS
    for grad in (False, True):
        for path in paths:
            with pytest.raises(TypeError, match=message):
                call(grad, path, **{flag: BAD_FLAGS[bad]})


def test_the_flags_still_take_bools() -> None:
    """The valid calls of the table run (so a failure above is the flag's alone), with
    Python's bools and numpy's (which mamba_ssm's and fla's functions take too)."""
    np = pytest.importorskip("numpy")
    for case, (_, flags, call) in CASES.items():
        for flag in flags:
            for value in (False, True, np.False_, np.True_):
                if case.endswith("chunk_scan_combined") and flag == "return_varlen_states":
                    continue  # needs seq_idx of the same packing: its own tests
                if case.startswith("distributed"):  # past the checks, it needs a group
                    with pytest.raises(RuntimeError, match="process group"):
                        call(False, "auto", **{flag: value})
                    continue
                call(False, "auto", **{flag: value})


def _overlapping(*shape: int) -> torch.Tensor:
    """A view whose last two dims share memory: element (.., i, j) is at i + j."""
    strides = [0] * len(shape)
    strides[-1], strides[-2] = 1, 1
    for d in range(len(shape) - 3, -1, -1):
        strides[d] = strides[d + 1] * (shape[d + 1] + shape[-1])
    return torch.zeros(1000).as_strided(shape, strides)


def _in_place_cases() -> dict[str, tuple[str, Callable[[torch.Tensor], Any], tuple[int, ...]]]:
    """name -> (the function's name in errors, call(target), the target's shape)."""

    def step(heads: bool, grad: bool) -> Callable[[torch.Tensor], Any]:
        def call(state: torch.Tensor) -> Any:
            _, x, dt, A, B, C = _step(grad, heads)
            with torch.set_grad_enabled(grad):
                return ps.selective_state_update(state, x, dt, A, B, C)

        return call

    def compat_step(indices: bool) -> Callable[[torch.Tensor], Any]:
        def call(state: torch.Tensor) -> Any:
            _, *rest = _step(False, True)
            idx = torch.tensor([1, 0]) if indices else None
            return mamba_ssm.selective_state_update(state, *rest, state_batch_indices=idx)

        return call

    def conv_step(activation: str) -> Callable[[torch.Tensor], Any]:
        def call(conv_state: torch.Tensor) -> Any:
            return hf.causal_conv1d_update(_rand(2, 6, 1), conv_state, _rand(6, 4), None,
                                           activation)  # fmt: skip

        return call

    return {
        "state, Mamba-1 layout (C kernel)": ("parascan.selective_state_update",
                                             step(False, False), (2, 4, 3)),
        "state, Mamba-1 layout (torch, with grad)": ("parascan.selective_state_update",
                                                     step(False, True), (2, 4, 3)),
        "state, multi-head layout (C kernel)": ("parascan.selective_state_update",
                                                step(True, False), (2, 2, 3, 3)),
        "state, multi-head layout (torch, with grad)": ("parascan.selective_state_update",
                                                        step(True, True), (2, 2, 3, 3)),
        "mamba_ssm state": ("parascan.compat.mamba_ssm.selective_state_update",
                            compat_step(False), (2, 2, 3, 3)),
        "mamba_ssm state, state_batch_indices": (
            "parascan.compat.mamba_ssm.selective_state_update", compat_step(True), (2, 2, 3, 3)),
        "transformers causal_conv1d_update conv_state": ("causal_conv1d_update",
                                                         conv_step("silu"), (2, 6, 4)),
        # another activation runs transformers' own step, after the same check
        "transformers causal_conv1d_update conv_state, gelu": ("causal_conv1d_update",
                                                               conv_step("gelu"), (2, 6, 4)),
    }  # fmt: skip


IN_PLACE = _in_place_cases()


@pytest.mark.parametrize("case", list(IN_PLACE))
@pytest.mark.parametrize("view", ["as_strided", "expanded"])
def test_an_argument_written_in_place_must_not_overlap_itself(case, view) -> None:
    name, call, shape = IN_PLACE[case]
    if view == "expanded":
        target = torch.zeros(1, *shape[1:]).expand(shape)
    else:
        target = _overlapping(*shape)
    base = target.as_strided((target.untyped_storage().nbytes() // 4,), (1,), 0)
    before = base.clone()
    with pytest.raises(ValueError, match=rf"^{re.escape(name)}: expected .* do not share memory"):
        call(target)
    assert torch.equal(base, before)  # nothing written
    if not case.endswith("gelu"):  # (transformers' own step: only while patched)
        call(target.clone())  # a clone is taken


def test_the_step_kernel_reads_operands_that_alias_the_state() -> None:
    """An operand that is a view of the state itself (x read from another channel's
    state) gives the torch step's result (which reads every operand before its one
    write) on the C kernel too: the kernel reads its operands before it writes."""
    buffer = torch.randn(30, generator=torch.Generator().manual_seed(0))
    state = buffer[3:27].view(2, 4, 3)
    _, _, dt, A, B, C = _step(False, False)
    x = buffer.as_strided((2, 4), (12, 3))  # x[b, d] is state[b, d - 1, 0] (d > 0)
    want_state = state.clone()
    with torch.enable_grad():  # the torch ops' step (reads all, then writes)
        want = ps.selective_state_update(want_state, x.clone().requires_grad_(), dt, A, B, C)
    got = ps.selective_state_update(state, x, dt, A, B, C)
    torch.testing.assert_close(got, want.detach())
    torch.testing.assert_close(state, want_state)


def test_a_differentiable_step_compiles_with_the_in_place_checks() -> None:
    """torch.compile(fullgraph=True) of a step whose state is computed from a tensor
    requiring grad, under grad mode: the leaf/view check traces (its view test, which
    dynamo cannot trace, was once reached there), and the gradient matches eager's."""
    torch._dynamo.reset()
    _, x, dt, A, B, C = _step(False, False)

    def step(w: torch.Tensor) -> torch.Tensor:
        state = w * 1.0  # not a leaf: written in place, differentiably
        y = ps.selective_state_update(state, x, dt, A, B, C, dt_softplus=True)
        return y.sum() + state.sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    w, w_eager = torch.rand(2, 4, 3, requires_grad=True), None
    w_eager = w.detach().clone().requires_grad_()
    compiled(w).backward()
    step(w_eager).backward()
    torch.testing.assert_close(w.grad, w_eager.grad)


@pytest.mark.parametrize("shape", [(2, 4, 0), (2, 0, 3), (0, 4, 3)])
def test_an_empty_state_is_not_overlapping(shape) -> None:
    """A state with no element shares no memory: the step runs (and returns its empty
    or zero-sized output) as before the overlap check."""
    state = torch.zeros(shape)
    batch, dim, n = shape
    x, dt, A = torch.rand(batch, dim), torch.rand(batch, dim), -torch.rand(dim, n)
    y = ps.selective_state_update(state, x, dt, A, torch.rand(batch, n), torch.rand(batch, n))
    assert y.shape == (batch, dim)


def test_the_in_place_checks_trace_with_dynamic_shapes() -> None:
    """torch.compile(fullgraph=True, dynamic=True) of a decoding step and of the patched
    convolution step: the overlap check runs on symbolic strides (a sorted() with a key
    did not trace)."""
    torch._dynamo.reset()
    _, x, dt, A, B, C = _step(False, False)
    step = torch.compile(
        lambda s, *a: ps.selective_state_update(s, *a, dt_softplus=True),
        fullgraph=True, dynamic=True,
    )  # fmt: skip
    conv = torch.compile(hf.causal_conv1d_update, fullgraph=True, dynamic=True)
    with torch.no_grad():
        got_state, want_state = torch.rand(2, 4, 3), None
        want_state = got_state.clone()
        got = step(got_state, x, dt, A, B, C)
        want = ps.selective_state_update(want_state, x, dt, A, B, C, dt_softplus=True)
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(got_state, want_state)
        hs, weight, cs = _rand(2, 6, 1), _rand(6, 4), _rand(2, 6, 4)
        cs2 = cs.clone()
        want_conv = hf.causal_conv1d_update(hs, cs2, weight, None, "silu")
        torch.testing.assert_close(conv(hs, cs, weight, None, "silu"), want_conv)
        torch.testing.assert_close(cs, cs2)
