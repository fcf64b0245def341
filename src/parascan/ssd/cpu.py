"""The ``cpu`` backend of the SSD scan: ctypes bindings to cpu.c.

Both functions take the canonical operands of canonical.py and return new
contiguous tensors. The kernel reads contiguous operands only: any other strides are
copied here first (one pass over an input, small next to the scan's N multiply-adds
per element). It runs on torch's thread count (``torch.get_num_threads()``) and gives
the same bits with any count.
"""

from __future__ import annotations

import torch
from torch import Tensor

from parascan._native import ChunkedOperands, check_operands, dense, run_kernel
from parascan.ssd.canonical import CHECKPOINT_STEPS, EMPTY

__all__ = ["backward", "forward"]

_K = CHECKPOINT_STEPS["cpu"]

Opt = Tensor | None


class _Operands(ChunkedOperands):
    """The canonical operands made contiguous and checked by the guard, with the
    struct's members they fill (the tensors are held here while the kernel runs)."""

    kind = "ssd"

    def __init__(
        self, entry: str, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Opt,
        z: Opt, initial: Opt, cu_seqlens: Opt,
    ) -> None:  # fmt: skip
        x, dt, A, B, C = (dense(t) for t in (x, dt, A, B, C))
        D, z, initial = (None if t is None else dense(t) for t in (D, z, initial))
        if x.dim() != 4 or B.dim() != 4:
            raise RuntimeError(
                f"parascan: internal error: the {entry} CPU kernel takes x (batch, L, heads, "
                f"headdim) and B (batch, L, groups, N), but was handed x {tuple(x.shape)} "
                f"and B {tuple(B.shape)}"
            )
        batch, length, heads, headdim = x.shape
        groups, n = B.shape[2], B.shape[3]
        super().__init__(entry, cu_seqlens, batch)
        self.dtype = x.dtype
        self.shape = (batch, length, heads, headdim, groups, n)
        check_operands(
            entry, x.dtype, (x, tuple(x.shape)), (dt, (batch, length, heads)), (A, (heads,)),
            (B, (batch, length, groups, n)), (C, (batch, length, groups, n)),
            (D, (heads, headdim)), (z, (batch, length, heads, headdim)),
            (initial, (self.states, heads, headdim, n)),
        )  # fmt: skip
        if groups < 1 or heads % groups != 0 or self.misfit:
            raise RuntimeError(
                f"parascan: internal error: the {entry} CPU kernel got {heads} heads in "
                f"{groups} groups, batch {batch}, packed {self.cu is not None}"
            )
        self.x, self.dt, self.A, self.B, self.C = x, dt, A, B, C
        self.D, self.z, self.initial = D, z, initial
        self.state_shape = (self.states, heads, headdim, n)
        self.checkpoint_shape = (batch, -(-length // _K), heads, headdim, n)  # n_chunks

    def args(self, **tensors: Opt) -> object:
        batch, length, heads, headdim, groups, n = self.shape
        plain = {
            "batch": batch, "length": length, "heads": heads, "headdim": headdim,
            "groups": groups, "nstate": n, "chunk": _K,
        }  # fmt: skip
        operands = {
            "cu_seqlens": self.cu, "x": self.x, "dt": self.dt, "A": self.A, "B": self.B,
            "C": self.C, "D": self.D, "z": self.z, "initial": self.initial, **tensors,
        }  # fmt: skip
        return self.struct(plain, operands)

    def run(self, entry: str, args: object) -> None:
        run_kernel(entry, self.dtype, args, ("x", self.x), ("B", self.B))


def forward(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Opt, z: Opt, initial: Opt,
    cu_seqlens: Opt, want_final: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The SSD scan of canonical operands (canonical.py): ``(out, final,
    checkpoints)``, checkpoints every CHECKPOINT_STEPS["cpu"] steps. Without
    ``want_final`` the kernel stores no final state and ``final`` has no rows."""
    ops = _Operands("ssd_fwd", x, dt, A, B, C, D, z, initial, cu_seqlens)
    out = torch.empty(ops.x.shape, dtype=ops.dtype)
    final = ops.final_rows(want_final)
    checkpoints = torch.empty(ops.checkpoint_shape, dtype=ops.dtype)
    ops.run("ssd_fwd", ops.args(out=out, final=final, checkpoints=checkpoints))
    return out, final, checkpoints


def backward(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Opt, z: Opt, initial: Opt,
    cu_seqlens: Opt, checkpoints: Tensor, grad_out: Tensor, grad_final: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """The gradients of ``x, dt, A, B, C, D, z, initial`` (canonical.py; EMPTY for
    an absent operand) from the forward's ``checkpoints``, ``grad_out`` and
    ``grad_final`` (with no rows: zeros, which the kernel then never reads)."""
    ops = _Operands("ssd_bwd", x, dt, A, B, C, D, z, initial, cu_seqlens)
    checkpoints, grad_out, grad_final = ops.backward_inputs(
        checkpoints, grad_out, grad_final, tuple(ops.x.shape)
    )
    grads = {
        "grad_x": torch.empty_like(ops.x),
        "grad_dt": torch.empty_like(ops.dt),
        "grad_A": torch.empty_like(ops.A),
        "grad_B": torch.empty_like(ops.B),
        "grad_C": torch.empty_like(ops.C),
        "grad_D": None if ops.D is None else torch.empty_like(ops.D),
        "grad_z": None if ops.z is None else torch.empty_like(ops.z),
        "grad_initial": ops.grad_initial(ops.initial),
    }  # fmt: skip
    ops.run(
        "ssd_bwd",
        ops.args(checkpoints=checkpoints, grad_out=grad_out, grad_final=grad_final, **grads),
    )
    del checkpoints, grad_out, grad_final  # held until the kernel returned
    g = [EMPTY(ops.x) if t is None else t for t in grads.values()]
    return g[0], g[1], g[2], g[3], g[4], g[5], g[6], g[7]
