"""Every optional tensor argument of every differentiable scan, absent and present, in
every combination, on every backend (the Triton kernels in the interpreter, CUDA
where there is one): the forward and the backward of every present operand against
autograd through the float64 loop (tests/oracles.py).

The delta rule's ``torch`` and ``loop`` backends once crashed in backward when both
``g`` and ``initial`` were absent (one empty placeholder for two absent gradients:
a custom op's returns may not alias). The family tests always passed one of them;
this matrix leaves no combination out.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

import parascan as ps
from parascan.delta_rule import autograd as delta_ops
from parascan.selective import autograd as selective_ops
from parascan.ssd import autograd as ssd_ops

from conftest import Target, assert_matches, targets
from oracles import delta_rule_loop, linear_loop, packed_loop, selective_loop, ssd_loop

F64 = torch.float64
CU = [0, 2, 2, 5]  # three packed sequences, one empty, in a batch of one


@dataclass(frozen=True)
class Family:
    """A scan: its required operands and its optional ones, made for a problem (batch
    1 when packed), how the public function and the loop take them."""

    name: str
    optional: tuple[str, ...]
    make: Callable[[torch.Generator, bool], dict[str, torch.Tensor]]
    call: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    oracle: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    backends: tuple[str, ...]
    packs: bool = False  # takes cu_seqlens


def _rand(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=F64)


def _unit(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.rand(shape, generator=gen, dtype=F64)


def _selective(gen: torch.Generator, packed: bool) -> dict[str, torch.Tensor]:
    b, d, n, t = 2, 3, 2, 5
    return {
        "u": _rand(gen, b, d, t), "delta": 0.5 * _unit(gen, b, d, t), "A": -_unit(gen, d, n),
        "B": _rand(gen, b, n, t), "C": _rand(gen, b, n, t), "D": _rand(gen, d),
        "z": _rand(gen, b, d, t), "delta_bias": 0.1 * _rand(gen, d),
        "initial": _rand(gen, b, d, n),
    }  # fmt: skip


def _ssd(gen: torch.Generator, packed: bool) -> dict[str, torch.Tensor]:
    b, t, h, p, g, n = (1 if packed else 2), 5, 2, 3, 1, 2
    return {
        "x": _rand(gen, b, t, h, p), "dt": 0.5 * _unit(gen, b, t, h), "A": -_unit(gen, h),
        "B": _rand(gen, b, t, g, n), "C": _rand(gen, b, t, g, n), "D": _rand(gen, h),
        "z": _rand(gen, b, t, h, p), "dt_bias": 0.1 * _rand(gen, h),
        "initial": _rand(gen, len(CU) - 1 if packed else b, h, p, n),
    }  # fmt: skip


def _delta(gen: torch.Generator, packed: bool) -> dict[str, torch.Tensor]:
    b, t, hk, hv, dk, dv = (1 if packed else 2), 5, 1, 2, 3, 2
    return {
        "q": _rand(gen, b, t, hk, dk),
        "k": torch.nn.functional.normalize(_rand(gen, b, t, hk, dk), dim=-1),
        "v": _rand(gen, b, t, hv, dv), "beta": _unit(gen, b, t, hv),
        "g": -_unit(gen, b, t, hv), "g_channel": -_unit(gen, b, t, hv, dk),
        "initial": _rand(gen, len(CU) - 1 if packed else b, hv, dk, dv),
    }  # fmt: skip


def _first_order(gen: torch.Generator, packed: bool) -> dict[str, torch.Tensor]:
    steps, rows = 5, 3  # time along dim 0; packed: (num_seqs, rows) states
    return {
        "gates": 0.5 + 0.5 * _unit(gen, steps, rows), "tokens": _rand(gen, steps, rows),
        "initial": _rand(gen, len(CU) - 1, rows) if packed else _rand(gen, rows),
    }  # fmt: skip


def _matrix(gen: torch.Generator, packed: bool) -> dict[str, torch.Tensor]:
    return {
        "weights": 0.5 * _rand(gen, 2, 5, 3, 3), "biases": _rand(gen, 2, 5, 3),
        "initial": _rand(gen, 2, 3),
    }  # fmt: skip


def _delta_call(oracle: bool) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    def call(q, k, v, beta, g=None, g_channel=None, initial=None, cu=None, backend="auto"):  # type: ignore[no-untyped-def]
        gate = g if g_channel is None else g_channel
        if oracle:
            return delta_rule_loop(q, k, v, beta, gate, qk_l2norm=True, initial=initial,
                                   cu_seqlens=cu)  # fmt: skip
        cu_t = None if cu is None else torch.tensor(cu, device=v.device)
        return ps.delta_rule_scan(q, k, v, beta, g=gate, qk_l2norm=True, initial=initial,
                                  cu_seqlens=cu_t, return_final=True, backend=backend)  # fmt: skip

    return call


def _ssd_call(q, cu=None, backend="auto"):  # type: ignore[no-untyped-def]
    cu_t = None if cu is None else torch.tensor(cu, device=q["x"].device)
    return ps.ssd_scan(**q, dt_softplus=True, cu_seqlens=cu_t, return_final=True, backend=backend)


def _ssd_oracle(q, cu=None):  # type: ignore[no-untyped-def]
    return ssd_loop(**q, dt_softplus=True, cu_seqlens=cu)


def _selective_call(q, cu=None, backend="auto"):  # type: ignore[no-untyped-def]
    return ps.selective_scan(**q, delta_softplus=True, return_final=True, backend=backend)


def _selective_oracle(q, cu=None):  # type: ignore[no-untyped-def]
    return selective_loop(**q, delta_softplus=True)


def _linear_call(q, cu=None, backend="auto"):  # type: ignore[no-untyped-def]
    cu_t = None if cu is None else torch.tensor(cu, device=q["tokens"].device)
    initial = q.get("initial")
    return ps.linear_scan(q["gates"], q["tokens"], 0, initial=initial, return_final=True,
                          cu_seqlens=cu_t, backend=backend)  # fmt: skip


def _linear_oracle(q, cu=None):  # type: ignore[no-untyped-def]
    if cu is None:
        return linear_loop(q["gates"], q["tokens"], 0, q.get("initial"))
    initial = q.get("initial")
    initials = None if initial is None else list(initial)
    return packed_loop(linear_loop, q["gates"], q["tokens"], 0, cu, initials)


def _matrix_call(q, cu=None, backend="auto"):  # type: ignore[no-untyped-def]
    return ps.matrix_linear_scan(q["weights"], q["biases"], initial=q.get("initial"),
                                 return_final=True, backend=backend)  # fmt: skip


def _matrix_oracle(q, cu=None):  # type: ignore[no-untyped-def]
    from oracles import matrix_loop

    return matrix_loop(q["weights"], q["biases"], q.get("initial"))


FAMILIES = [
    Family("selective_scan", ("D", "z", "delta_bias", "initial"), _selective, _selective_call,
           _selective_oracle, tuple(selective_ops.ROW.backends)),
    Family("ssd_scan", ("D", "z", "dt_bias", "initial"), _ssd, _ssd_call, _ssd_oracle,
           tuple(ssd_ops.ROW.backends), packs=True),
    Family("delta_rule_scan", ("g", "g_channel", "initial"), _delta, _delta_call(False),
           _delta_call(True), tuple(delta_ops.ROW.backends), packs=True),
    Family("linear_scan", ("initial",), _first_order, _linear_call, _linear_oracle,
           ("cpu", "torch", "loop", "triton"), packs=True),
    Family("matrix_linear_scan", ("initial",), _matrix, _matrix_call, _matrix_oracle,
           ("cpu", "torch", "loop")),
]  # fmt: skip


def _cases() -> list[object]:
    cases = []
    for fam in FAMILIES:
        for where in targets(interpreter=True):
            if where.backend not in fam.backends:  # targets() runs on this machine
                continue
            for count in range(len(fam.optional) + 1):
                for present in itertools.combinations(fam.optional, count):
                    if {"g", "g_channel"} <= set(present):
                        continue  # one gate form at a time
                    # in the interpreter (1 to 2 s a case) none and all of them by
                    # default (each alone on the other targets); the other subsets
                    # with the slow tests
                    some = count not in (0, len(fam.optional))
                    marks = [pytest.mark.slow] if where.interpreted and some else []
                    for packed in (False, True) if fam.packs else (False,):
                        flags = "+".join(present) or "none"
                        ident = f"{fam.name}-{where}-{flags}{'-packed' if packed else ''}"
                        cases.append(
                            pytest.param(fam, where, present, packed, id=ident, marks=marks)
                        )
    return cases


def _common(fam: Family, gen: torch.Generator, present: tuple[str, ...], packed: bool) -> dict:
    made = fam.make(gen, packed)
    return {k: v for k, v in made.items() if k not in fam.optional or k in present}


@pytest.mark.parametrize(("fam", "where", "present", "packed"), _cases())
def test_backward_with_each_optional_argument_absent_or_present(
    fam: Family, where: Target, present: tuple[str, ...], packed: bool, gen: torch.Generator
) -> None:
    p = _common(fam, gen, present, packed)
    cu = CU if packed else None
    leaves = {k: v.clone().to(where.device).requires_grad_() for k, v in p.items()}
    exact = {k: v.clone().requires_grad_() for k, v in p.items()}
    if fam.name == "delta_rule_scan":
        out, final = fam.call(**leaves, cu=cu, backend=where.backend)
        want_out, want_final = fam.oracle(**exact, cu=cu)
    else:
        out, final = fam.call(leaves, cu=cu, backend=where.backend)
        want_out, want_final = fam.oracle(exact, cu=cu)
    assert out.device.type == where.device
    assert_matches(out, want_out, F64)
    assert_matches(final, want_final, F64)
    w_out = torch.randn(want_out.shape, generator=gen, dtype=F64)
    w_fin = torch.randn(want_final.shape, generator=gen, dtype=F64)
    got = torch.autograd.grad(
        (out.cpu() * w_out).sum() + (final.cpu() * w_fin).sum(), list(leaves.values())
    )
    want = torch.autograd.grad(
        (want_out * w_out).sum() + (want_final * w_fin).sum(), list(exact.values())
    )
    for name, g, w in zip(leaves, got, want, strict=True):
        assert g.shape == leaves[name].shape, name
        assert_matches(g, w, F64)
