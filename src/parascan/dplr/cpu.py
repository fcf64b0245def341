"""The ``cpu`` backend of the generalized delta rule: ctypes bindings to cpu.c.

Both functions take the canonical operands of canonical.py and return new contiguous
tensors. The kernel reads contiguous operands only: any other strides are copied here
first (one pass over an input, small next to the scan's 4 K V multiply-adds per step
and head). It runs on torch's thread count (``torch.get_num_threads()``) and gives the
same bits with any count.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

from parascan._checkpointed import EMPTY
from parascan._native import (
    ARG_FIELDS,
    ChunkedOperands,
    arg_struct,
    check_operands,
    dense,
    run_kernel,
    simd,
)
from parascan.dplr.canonical import CHECKPOINT_STEPS
from parascan.linear_attention.cpu import gate_kind, plain_members

__all__ = ["backward", "forward", "infer"]

_C = CHECKPOINT_STEPS["cpu"]
_KIND = "dplr"

Opt = Tensor | None


class _Operands(ChunkedOperands):
    """The canonical operands made contiguous and checked by the guard, with the
    struct's members they fill (the tensors are held here while the kernel runs)."""

    kind = _KIND

    def __init__(
        self, entry: str, q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, g: Opt,
        initial: Opt, cu_seqlens: Opt,
    ) -> None:  # fmt: skip
        q, k, v, a, b = (dense(t) for t in (q, k, v, a, b))
        g, initial = (None if t is None else dense(t) for t in (g, initial))
        if q.dim() != 4 or v.dim() != 4:
            raise RuntimeError(
                f"parascan: internal error: the {entry} CPU kernel takes q (batch, L, Hk, K) "
                f"and v (batch, L, Hv, V), but was handed q {tuple(q.shape)} and v "
                f"{tuple(v.shape)}"
            )
        batch, length, hk, dk = q.shape
        hv, dv = v.shape[2], v.shape[3]
        super().__init__(entry, cu_seqlens, batch)
        self.gate = gate_kind(g)
        gate_shape = (batch, length, hv) if self.gate == 1 else (batch, length, hv, dk)
        keyed = (batch, length, hk, dk)
        check_operands(
            entry, v.dtype, (q, keyed), (k, keyed), (a, keyed), (b, keyed),
            (v, (batch, length, hv, dv)), (g, gate_shape), (initial, (self.states, hv, dk, dv)),
        )  # fmt: skip
        if hv % hk != 0 or self.misfit:
            raise RuntimeError(
                f"parascan: internal error: the {entry} CPU kernel got {hv} value heads for "
                f"{hk} q/k heads, batch {batch}, packed {self.cu is not None}"
            )
        self.q, self.k, self.v, self.a, self.b = q, k, v, a, b
        self.g, self.initial = g, initial
        self.dtype = v.dtype
        self.shape = (batch, length, hk, hv, dk, dv)
        self.state_shape = (self.states, hv, dk, dv)
        self.checkpoint_shape = (batch, -(-length // _C), hv, dk, dv)  # n_chunks

    def run(self, entry: str, tensors: dict[str, Opt], scale: float = 1.0) -> None:
        plain = plain_members(self.shape, self.gate, scale, _C)
        operands = {
            "cu_seqlens": self.cu, "q": self.q, "k": self.k, "v": self.v, "a": self.a,
            "b": self.b, "g": self.g, "initial": self.initial, **tensors,
        }  # fmt: skip
        run_kernel(entry, self.dtype, self.struct(plain, operands), ("q", self.q), ("v", self.v))


def forward(
    q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, g: Opt, initial: Opt,
    cu_seqlens: Opt, want_final: bool = True, keep: bool = True, scale: float = 1.0,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The generalized delta rule of canonical operands (canonical.py): ``(out, final,
    checkpoints)``, checkpoints every CHECKPOINT_STEPS["cpu"] steps. Without
    ``want_final`` the kernel stores no final state and ``final`` has no rows; without
    ``keep`` (a call no backward follows) it stores no checkpoints, and ``checkpoints``
    is empty. ``scale`` multiplies q in the kernel (q as the public function takes it,
    in a call no backward follows)."""
    ops = _Operands("dplr_fwd", q, k, v, a, b, g, initial, cu_seqlens)
    out = torch.empty(ops.v.shape, dtype=ops.dtype)
    final = ops.final_rows(want_final)
    checkpoints = torch.empty(ops.checkpoint_shape if keep else (0,), dtype=ops.dtype)
    ops.run("dplr_fwd", {"out": out, "final": final, "checkpoints": checkpoints}, scale)
    return out, final, checkpoints


# where each operand's pointer sits in the struct (infer fills them)
_AT = {name: ARG_FIELDS[_KIND].index(name) for name in
       ("q", "k", "v", "a", "b", "g", "initial", "out", "final")}  # fmt: skip


@functools.lru_cache(maxsize=32)
def _template(
    shape: tuple[int, int, int, int, int, int], gate: int, scale: float, nthreads: int,
    vector: bool,
) -> object:  # fmt: skip
    """infer's struct for one shape, its pointers left NULL (a generation loop calls
    with the same shape on every token)."""
    return arg_struct(_KIND, **plain_members(shape, gate, scale, _C), nthreads=nthreads,
                      simd=int(vector))  # fmt: skip


def infer(
    q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, g: Opt, initial: Opt,
    want_final: bool, scale: float,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """``forward(..., keep=False, scale=scale)[:2]`` for a call that
    dplr_delta_rule_scan's plain inference path (api.py) has vouched for: contiguous
    strided CPU tensors of one float32 or float64 dtype and no lazy negative bit, with
    the shapes the kernel indexes (what this module's guard, check_operands, checks),
    and no packing. The struct comes from a template per shape with the pointers
    written in: a decoding step's Python time is a few microseconds."""
    batch, length, hk, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    out = torch.empty(v.shape, dtype=v.dtype)
    final = torch.empty((batch if want_final else 0, hv, dk, dv), dtype=v.dtype)
    template = _template(
        (batch, length, hk, hv, dk, dv), gate_kind(g), scale, torch.get_num_threads(), simd()
    )
    args = type(template).from_buffer_copy(template)  # type: ignore[attr-defined]
    for name, t in (("q", q), ("k", k), ("v", v), ("a", a), ("b", b), ("g", g),
                    ("initial", initial), ("out", out)):  # fmt: skip
        if t is not None:
            args[_AT[name]] = t.data_ptr()
    if want_final:
        args[_AT["final"]] = final.data_ptr()
    run_kernel("dplr_fwd", v.dtype, args, ("q", q), ("v", v))
    return out, final


def backward(
    q: Tensor, k: Tensor, v: Tensor, a: Tensor, b: Tensor, g: Opt, initial: Opt,
    cu_seqlens: Opt, checkpoints: Tensor, grad_out: Tensor, grad_final: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """The gradients of ``q, k, v, a, b, g, initial`` (canonical.py; EMPTY for an absent
    operand) from the forward's ``checkpoints``, ``grad_out`` and ``grad_final`` (with
    no rows: zeros, which the kernel then never reads)."""
    ops = _Operands("dplr_bwd", q, k, v, a, b, g, initial, cu_seqlens)
    checkpoints, grad_out, grad_final = ops.backward_inputs(
        checkpoints, grad_out, grad_final, tuple(ops.v.shape)
    )
    grads = {
        "grad_q": torch.empty_like(ops.q),
        "grad_k": torch.empty_like(ops.k),
        "grad_v": torch.empty_like(ops.v),
        "grad_a": torch.empty_like(ops.a),
        "grad_b": torch.empty_like(ops.b),
        "grad_g": None if ops.g is None else torch.empty_like(ops.g),
        "grad_initial": ops.grad_initial(ops.initial),
    }  # fmt: skip
    ops.run(
        "dplr_bwd",
        {"checkpoints": checkpoints, "grad_out": grad_out, "grad_final": grad_final, **grads},
    )
    del checkpoints, grad_out, grad_final  # held until the kernel returned
    g_ = [EMPTY(ops.v) if t is None else t for t in grads.values()]
    return g_[0], g_[1], g_[2], g_[3], g_[4], g_[5], g_[6]
