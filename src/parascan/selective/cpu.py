"""The ``cpu`` backend of the selective scan: ctypes bindings to cpu.c.

Both functions take the canonical operands of canonical.py (any strides: the kernel
reads every tensor through its own strides, so nothing is copied) and return new
contiguous tensors. The kernel runs on torch's thread count
(``torch.get_num_threads()``); its backward gives the same bits with any count.
"""

from __future__ import annotations

import torch
from torch import Tensor

from parascan._core import resolved, resolved_optional
from parascan._native import arg_struct, check_operands, kernel
from parascan.selective.canonical import CHECKPOINT_STEPS, EMPTY, n_chunks, state_dtype

__all__ = ["DTYPES", "SUPPORTS_COMPLEX", "backward", "forward"]

# The compute dtypes the kernel takes (the state: these, or their complex types).
DTYPES = (torch.float32, torch.float64)
SUPPORTS_COMPLEX = True

_K = CHECKPOINT_STEPS["cpu"]

Opt = Tensor | None
# u, delta, A, B, C, D, z, delta_bias, initial (canonical.py)
_Canonical = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Opt, Opt, Opt, Opt]


def _ptr(t: Opt, ndim: int) -> tuple[int, ...]:
    """A tensor's (data pointer, strides) as the kernel's struct holds it; zeros for
    None. ``ndim`` strides: a time-invariant B or C (2-d) fills the last two with 0."""
    if t is None:
        return (0,) * (1 + ndim)
    strides = t.stride()
    return (t.data_ptr(), *strides, *(0,) * (ndim - len(strides)))


def _bc_shape(t: Tensor, batch: int, dim: int, n: int, length: int) -> tuple[int, ...]:
    """The shape the kernel indexes B or C by: (dim, N) or (batch, G, N, L)."""
    return (dim, n) if t.dim() == 2 else (batch, t.shape[1], n, length)


def _bc_dtype(t: Tensor, cd: torch.dtype, sd: torch.dtype) -> torch.dtype:
    """B's or C's dtype as the kernel takes it: real, or complex with a complex state."""
    return sd if t.is_complex() and sd.is_complex else cd


class _Operands:
    """The canonical operands, checked by the guard, and ps_selective_operands'
    members for them (the tensors are held here while the kernel runs)."""

    def __init__(self, entry: str, operands: _Canonical, softplus: bool) -> None:
        u, delta, A, B, C = (resolved(t) for t in operands[:5])
        D, z, delta_bias, initial = (resolved_optional(t) for t in operands[5:])
        if u.dim() != 3 or A.dim() != 2:
            raise RuntimeError(
                f"parascan: internal error: the {entry} CPU kernel takes u (batch, dim, L) and "
                f"A (dim, N), but was handed u {tuple(u.shape)} and A {tuple(A.shape)}"
            )
        batch, dim, length = u.shape
        n = A.shape[1]
        self.cd, self.sd = u.dtype, state_dtype(A, u)
        self.batch, self.dim, self.length, self.n = batch, dim, length, n
        bshape, cshape = _bc_shape(B, batch, dim, n, length), _bc_shape(C, batch, dim, n, length)
        seq, chan = (batch, dim, length), (dim,)
        check_operands(entry, self.cd, (u, seq), (delta, seq), (z, seq), (D, chan),
                       (delta_bias, chan))  # fmt: skip
        check_operands(entry, self.sd, (A, (dim, n)), (initial, (batch, dim, n)))
        check_operands(entry, _bc_dtype(B, self.cd, self.sd), (B, bshape))
        check_operands(entry, _bc_dtype(C, self.cd, self.sd), (C, cshape))
        self.B, self.C, self.D, self.z = B, C, D, z
        self.delta_bias, self.initial = delta_bias, initial
        self.keep = (u, delta, A, B, C, D, z, delta_bias, initial)
        self.members: dict[str, int | tuple[int, ...]] = {
            "batch": batch, "dim": dim, "length": length, "nstate": n, "chunk": _K,
            "u": _ptr(u, 3), "delta": _ptr(delta, 3), "A": _ptr(A, 2),
            "B": _ptr(B, 4), "B_groups": B.shape[1] if B.dim() == 4 else 0,
            "B_complex": int(B.is_complex()),
            "C": _ptr(C, 4), "C_groups": C.shape[1] if C.dim() == 4 else 0,
            "C_complex": int(C.is_complex()),
            "D": _ptr(D, 1), "z": _ptr(z, 3), "delta_bias": _ptr(delta_bias, 1),
            "initial": _ptr(initial, 3), "softplus": int(softplus),
            "nthreads": torch.get_num_threads(),
        }  # fmt: skip

    def run(self, entry: str, **tensors: tuple[int, ...]) -> None:
        """The C entry ``entry`` on these operands and the pass's own ``tensors``."""
        if kernel(entry, self.sd)(arg_struct(entry, **self.members, **tensors)) != 0:
            raise RuntimeError(
                f"parascan: the {entry} CPU kernel rejected u "
                f"{(self.batch, self.dim, self.length)} with N {self.n}, B {tuple(self.B.shape)} "
                f"and C {tuple(self.C.shape)}"
            )

    def nchunks(self) -> int:
        return n_chunks(self.length, "cpu")


def forward(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Opt, z: Opt, delta_bias: Opt,
    initial: Opt, softplus: bool,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """The selective scan of canonical operands (canonical.py): ``(out, final,
    checkpoints)``, checkpoints every CHECKPOINT_STEPS["cpu"] steps."""
    ops = _Operands("selective_fwd", (u, delta, A, B, C, D, z, delta_bias, initial), softplus)
    batch, dim, length, n = ops.batch, ops.dim, ops.length, ops.n
    out = torch.empty((batch, dim, length), dtype=ops.cd)
    final = torch.empty((batch, dim, n), dtype=ops.sd)
    checkpoints = torch.empty((batch, dim, ops.nchunks(), n), dtype=ops.sd)
    ops.run(
        "selective_fwd", out=_ptr(out, 3), final=_ptr(final, 3), checkpoints=_ptr(checkpoints, 4)
    )
    return out, final, checkpoints


def backward(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Opt, z: Opt, delta_bias: Opt,
    initial: Opt, softplus: bool, checkpoints: Tensor, grad_out: Tensor, grad_final: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """The gradients of ``u, delta, A, B, C, D, z, delta_bias, initial`` (canonical.py;
    EMPTY for an absent operand) from the forward's ``checkpoints``, ``grad_out`` and
    ``grad_final``."""
    ops = _Operands("selective_bwd", (u, delta, A, B, C, D, z, delta_bias, initial), softplus)
    batch, dim, length, n = ops.batch, ops.dim, ops.length, ops.n
    checkpoints, grad_out, grad_final = (
        resolved(checkpoints), resolved(grad_out), resolved(grad_final)
    )  # fmt: skip
    check_operands("selective_bwd", ops.sd, (checkpoints, (batch, dim, ops.nchunks(), n)),
                   (grad_final, (batch, dim, n)))  # fmt: skip
    check_operands("selective_bwd", ops.cd, (grad_out, (batch, dim, length)))
    seq = (batch, dim, length)
    grad_u = torch.empty(seq, dtype=ops.cd)
    grad_delta = torch.empty(seq, dtype=ops.cd)
    grad_A = torch.empty((dim, n), dtype=ops.sd)
    grad_B = torch.empty(ops.B.shape, dtype=ops.B.dtype)
    grad_C = torch.empty(ops.C.shape, dtype=ops.C.dtype)
    grad_D = None if ops.D is None else torch.empty(dim, dtype=ops.cd)
    grad_z = None if ops.z is None else torch.empty(seq, dtype=ops.cd)
    grad_bias = None if ops.delta_bias is None else torch.empty(dim, dtype=ops.cd)
    grad_initial = None if ops.initial is None else torch.empty((batch, dim, n), dtype=ops.sd)
    ops.run(
        "selective_bwd", checkpoints=_ptr(checkpoints, 4), grad_out=_ptr(grad_out, 3),
        grad_final=_ptr(grad_final, 3), grad_u=_ptr(grad_u, 3), grad_delta=_ptr(grad_delta, 3),
        grad_A=_ptr(grad_A, 2), grad_B=_ptr(grad_B, 4), grad_C=_ptr(grad_C, 4),
        grad_D=_ptr(grad_D, 1), grad_z=_ptr(grad_z, 3), grad_delta_bias=_ptr(grad_bias, 1),
        grad_initial=_ptr(grad_initial, 3),
    )  # fmt: skip
    del checkpoints, grad_out, grad_final  # held until the kernel returned

    def given(g: Tensor | None) -> Tensor:
        return EMPTY(u) if g is None else g

    return (
        grad_u, grad_delta, grad_A, grad_B, grad_C, given(grad_D), given(grad_z),
        given(grad_bias), given(grad_initial),
    )  # fmt: skip
