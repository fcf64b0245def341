"""The ``triton`` backend of the selective scan: the Triton kernels of
triton_kernels.py (imported when the backend first runs), with canonical.py's
contract.

``forward`` and ``backward`` take CUDA tensors, or CPU tensors in Triton's
interpreter (``TRITON_INTERPRET=1`` set before triton is imported). Real ``A``, ``B``
and ``C`` only (``SUPPORTS_COMPLEX``): complex ones raise NotImplementedError, and the
caller routes them to another backend.

How the work is cut (triton_kernels.py): one program per block of channels of one
batch row, the channels dealt out so that no block straddles a group of a variable
``B`` or ``C``; time in tiles of ``Plan.steps`` steps, checkpoints every ``Plan.chunk``
steps (``CHECKPOINT_STEPS["triton"]``, a multiple of the tile). The kernels read u,
delta, z, grad_out and a variable B or C contiguous: other layouts are copied first.
The backward writes per-program partial sums of the gradients of shared operands,
which are summed here with torch (deterministic: no atomics).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from parascan._core import on_their_device
from parascan.selective.canonical import CHECKPOINT_STEPS, EMPTY

__all__ = [
    "INTERPRETED_TILES", "SUPPORTS_COMPLEX", "TILES", "Launch", "Plan", "Tiles", "backward",
    "backward_launch", "forward", "forward_launch", "plan",
]  # fmt: skip

SUPPORTS_COMPLEX = False

Opt = Tensor | None


@dataclass(frozen=True)
class Tiles:
    """A program's tile, ``channels`` (BLOCK_D) x the padded states x ``steps``
    (BLOCK_T), the warps that run it and the registers a thread may use (ptxas's
    ``.maxnreg``: left to itself, ptxas aims at a higher occupancy and spills)."""

    channels: int
    steps: int
    warps: int
    registers: int


# (forward, backward) per compute dtype on a GPU, for N = 16 (a tile of channels x 16
# states x steps): float32, the forward 8 x 16 x 16 on 4 warps (16 elements of each
# tile-sized tensor per thread), the backward, which keeps about twice as many
# tensors, 8 x 16 x 8 on 8 warps (4 per thread); float64, 2 x 16 x 16 on 4 warps and
# 4 x 16 x 8 on 8 warps (4 and 2 per thread). Each register cap (warps x 32 x cap
# within the 64K registers of an SM) holds every variant without a spill on sm_80
# and sm_90 (tests/test_selective_triton.py compiles them and reports the
# figures); at 128 the float32 backward spilled a few bytes on sm_80.
TILES = {
    torch.float32: (Tiles(8, 16, warps=4, registers=128), Tiles(8, 8, warps=8, registers=168)),
    torch.float64: (Tiles(2, 16, warps=4, registers=168), Tiles(4, 8, warps=8, registers=255)),
}
# In Triton's interpreter each element of a tl.associative_scan costs Python calls,
# and each loop iteration many more: tiles that keep the tests' shapes quick, with
# several channel blocks and tiles.
INTERPRETED_TILES = Tiles(channels=2, steps=4, warps=1, registers=255)


@dataclass(frozen=True)
class Plan:
    """A pass's launch: blocks of ``channels`` channels within cells of ``cell``
    channels (``blocks`` per cell), ``states`` (N padded to a power of 2), tiles of
    ``steps`` steps, checkpoints every ``chunk`` steps."""

    channels: int
    states: int
    steps: int
    warps: int
    registers: int
    cell: int
    blocks: int
    chunk: int

    def chunks(self, length: int) -> int:
        """The checkpoints of ``length`` steps."""
        return -(-length // self.chunk)


def plan(
    dim: int,
    n: int,
    group_b: int,
    group_c: int,
    dtype: torch.dtype,
    backward: bool,
    chunk: int | None = None,
    interpreted: bool | None = None,
) -> Plan:
    """The launch of a pass over ``dim`` channels of ``n`` states whose B and C rows
    are shared by ``group_b`` and ``group_c`` channels (``dim`` when invariant).
    ``chunk``: the checkpoint interval (default ``CHECKPOINT_STEPS["triton"]``)."""
    if interpreted is None:
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    tiles = INTERPRETED_TILES if interpreted else TILES[dtype][backward]
    chunk = CHECKPOINT_STEPS["triton"] if chunk is None else chunk
    if chunk < 1:
        raise ValueError(f"parascan.selective_scan: expected chunk >= 1, but got {chunk}")
    cell = max(math.gcd(group_b, group_c), 1)  # 0 without channels
    channels = min(tiles.channels, _next_power_of_2(cell))
    return Plan(
        channels=channels,
        states=_next_power_of_2(n),
        steps=math.gcd(tiles.steps, chunk),  # the largest power of 2 <= steps dividing chunk
        warps=tiles.warps,
        registers=tiles.registers,
        cell=cell,
        blocks=-(-cell // channels),
        chunk=chunk,
    )


def _next_power_of_2(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


@dataclass
class Launch:
    """A kernel launch: the grid, the positional arguments (tensors and ints, as the
    kernel's parameters before its constexprs) and the constexprs."""

    grid: tuple[int]
    args: list[Any]
    constexprs: dict[str, Any]
    warps: int
    registers: int

    def options(self) -> dict[str, Any]:
        """The launch options (ignored by the interpreter)."""
        return dict(num_warps=self.warps, maxnreg=self.registers)


def _check(u: Tensor, A: Tensor, B: Tensor, C: Tensor) -> None:
    if u.dtype not in TILES:
        raise TypeError(
            "parascan.selective_scan: the 'triton' backend computes in float32 or float64, "
            f"but got u {u.dtype}"
        )
    if A.is_complex() or B.is_complex() or C.is_complex():
        raise NotImplementedError(
            "parascan.selective_scan: the 'triton' backend supports real A, B and C only, "
            f"but got A {A.dtype}, B {B.dtype}, C {C.dtype}; call parascan.selective_scan "
            "with another backend for a complex A"
        )


def _group(X: Tensor, dim: int) -> int:
    """The channels that share a row of B or C: dim // G when variable, dim when not."""
    return dim // X.shape[1] if X.dim() == 4 else dim


def _strides(X: Opt, count: int) -> list[int]:
    """``X``'s strides, zeros where it is absent."""
    return list(X.stride()) if X is not None else [0] * count


def _contiguous(X: Opt) -> Opt:
    return X.contiguous() if X is not None else None


def _constexprs(
    u: Tensor, B: Tensor, C: Tensor, D: Opt, z: Opt, delta_bias: Opt, softplus: bool, p: Plan
) -> dict[str, Any]:
    import triton.language as tl

    length = u.shape[2]
    # the largest offset within a program's rows: a tile of its channels' steps, its
    # B or C row, its checkpoints
    widest = max(p.channels * length, p.states * length, p.channels * p.chunks(length) * p.states)
    return dict(
        B_VARIABLE=B.dim() == 4, C_VARIABLE=C.dim() == 4, HAS_D=D is not None,
        HAS_Z=z is not None, HAS_BIAS=delta_bias is not None, SOFTPLUS=softplus,
        WIDE=widest + p.steps >= 2**31,
        ACC=tl.float64 if u.dtype == torch.float64 else tl.float32,
        BLOCK_D=p.channels, BLOCK_N=p.states, BLOCK_T=p.steps,
    )  # fmt: skip


def _launch(
    p: Plan, u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Opt, z: Opt,
    delta_bias: Opt, softplus: bool, own: list[Any], **flags: bool,
) -> Launch:  # fmt: skip
    """A kernel's launch, from contiguous u, delta and z. Its arguments: u, delta, z,
    A, B, C (each with its strides; a variable B or C contiguous), D and delta_bias
    with theirs (an absent operand replaced by u, never read), the pass's ``own``,
    then the sizes; its constexprs: ``flags`` and the operands'."""
    batch, dim, length = u.shape
    Bk = B.contiguous() if B.dim() == 4 else B
    Ck = C.contiguous() if C.dim() == 4 else C
    return Launch(
        grid=(dim // p.cell * p.blocks * batch,),
        args=[
            u, delta, z if z is not None else u, A, *A.stride(),
            Bk, *Bk.stride()[:2], Ck, *Ck.stride()[:2],
            D if D is not None else u, *_strides(D, 1),
            delta_bias if delta_bias is not None else u, *_strides(delta_bias, 1),
            *own,
            dim, length, A.shape[1], p.cell, p.blocks, _group(B, dim), _group(C, dim),
            p.chunk, p.chunks(length),
        ],
        constexprs={**flags, **_constexprs(u, B, C, D, z, delta_bias, softplus, p)},
        warps=p.warps,
        registers=p.registers,
    )  # fmt: skip


def forward_launch(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Opt, z: Opt, delta_bias: Opt,
    initial: Opt, softplus: bool, chunk: int | None = None,
) -> tuple[Launch, Tensor, Tensor, Tensor]:  # fmt: skip
    """The forward kernel's launch and its outputs (out, final, checkpoints), still
    to be written. Works on meta tensors too (the compile-for-GPU test uses it)."""
    batch, dim, length = u.shape
    n = A.shape[1]
    p = plan(dim, n, _group(B, dim), _group(C, dim), u.dtype, False, chunk)
    new: dict[str, Any] = dict(dtype=u.dtype, device=u.device)
    out = torch.empty((batch, dim, length), **new)
    final = torch.empty((batch, dim, n), **new)
    checkpoints = torch.empty((batch, dim, p.chunks(length), n), **new)
    u, delta, z = u.contiguous(), delta.contiguous(), _contiguous(z)
    own = [initial if initial is not None else u, *_strides(initial, 3), out, final, checkpoints]
    launch = _launch(
        p, u, delta, A, B, C, D, z, delta_bias, softplus, own, HAS_INIT=initial is not None
    )
    return launch, out, final, checkpoints


@on_their_device
def forward(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Opt, z: Opt, delta_bias: Opt,
    initial: Opt, softplus: bool, *, chunk: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """canonical.py's forward: (out, final, checkpoints), checkpoints every ``chunk``
    steps (default ``CHECKPOINT_STEPS["triton"]``; give ``backward`` the same)."""
    _check(u, A, B, C)
    from parascan.selective import triton_kernels as kernels

    launch, out, final, checkpoints = forward_launch(
        u, delta, A, B, C, D, z, delta_bias, initial, softplus, chunk
    )
    if out.numel() == 0:  # no steps, or no channels
        final.copy_(initial if initial is not None else torch.zeros_like(final))
    else:
        kernels.forward_kernel[launch.grid](*launch.args, **launch.constexprs, **launch.options())
    return out, final, checkpoints


@dataclass
class _Gradients:
    """The backward kernel's outputs: per-step gradients, and the rows and partial
    sums ``backward`` reduces."""

    u: Tensor
    delta: Tensor
    z: Tensor
    initial: Tensor
    A: Tensor  # (batch, dim, N), summed over the batch
    B: Tensor  # invariant: (batch, dim, N); variable: (batch x programs, N, L)
    C: Tensor
    D: Tensor  # (batch, dim)
    delta_bias: Tensor


def backward_launch(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Opt, z: Opt, delta_bias: Opt,
    softplus: bool, checkpoints: Tensor, grad_out: Tensor, grad_final: Tensor,
    chunk: int | None = None,
) -> tuple[Launch, _Gradients, Plan]:  # fmt: skip
    """The backward kernel's launch and the buffers it writes. Works on meta tensors
    too."""
    batch, dim, length = u.shape
    n = A.shape[1]
    p = plan(dim, n, _group(B, dim), _group(C, dim), u.dtype, True, chunk)
    n_chunks = p.chunks(length)
    if tuple(checkpoints.shape) != (batch, dim, n_chunks, n):
        raise ValueError(
            "parascan.selective_scan: expected checkpoints of shape "
            f"{(batch, dim, n_chunks, n)} (checkpoints every {p.chunk} steps), but got "
            f"{tuple(checkpoints.shape)}"
        )
    new: dict[str, Any] = dict(dtype=u.dtype, device=u.device)
    programs = dim // p.cell * p.blocks
    rows = torch.empty((4, batch, dim, n), **new)
    per_channel = torch.empty((2, batch, dim), **new)
    g = _Gradients(
        u=torch.empty((batch, dim, length), **new),
        delta=torch.empty((batch, dim, length), **new),
        z=torch.empty((batch, dim, length), **new) if z is not None else EMPTY(u),
        initial=rows[0],
        A=rows[1],
        B=torch.empty((batch * programs, n, length), **new) if B.dim() == 4 else rows[2],
        C=torch.empty((batch * programs, n, length), **new) if C.dim() == 4 else rows[3],
        D=per_channel[0],
        delta_bias=per_channel[1],
    )
    scratch = torch.empty(batch * programs * (p.chunk // p.steps) * p.channels * p.states, **new)
    u, delta, z = u.contiguous(), delta.contiguous(), _contiguous(z)
    own = [
        checkpoints.contiguous(), grad_out.contiguous(), grad_final, *grad_final.stride(),
        g.u, g.delta, g.z if z is not None else g.u, g.initial, g.A, g.B, g.C, g.D,
        g.delta_bias, scratch,
    ]  # fmt: skip
    return _launch(p, u, delta, A, B, C, D, z, delta_bias, softplus, own), g, p


@on_their_device
def backward(
    u: Tensor, delta: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Opt, z: Opt, delta_bias: Opt,
    initial: Opt, softplus: bool, checkpoints: Tensor, grad_out: Tensor, grad_final: Tensor,
    *, chunk: int | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """canonical.py's backward: the gradients of (u, delta, A, B, C, D, z, delta_bias,
    initial), from the checkpoints ``forward`` stored with the same ``chunk``."""
    _check(u, A, B, C)
    from parascan.selective import triton_kernels as kernels

    batch, dim, length = u.shape
    n = A.shape[1]
    launch, g, p = backward_launch(
        u, delta, A, B, C, D, z, delta_bias, softplus, checkpoints, grad_out, grad_final, chunk
    )  # fmt: skip
    if g.u.numel() == 0:  # no steps, or no channels: nothing reaches the operands
        g.initial.copy_(grad_final)
        for x in (g.A, g.B, g.C, g.D, g.delta_bias):
            x.zero_()
    else:
        kernels.backward_kernel[launch.grid](*launch.args, **launch.constexprs, **launch.options())

    def shared(X: Tensor, partial: Tensor) -> Tensor:
        if X.dim() != 4:  # (batch, dim, N) rows
            return partial.sum(0)
        # a group's programs are consecutive: (batch, G, programs per group, N, L)
        per_group = dim // X.shape[1] // p.cell * p.blocks
        return partial.view(batch, X.shape[1], per_group, n, length).sum(2)

    return (
        g.u, g.delta, g.A.sum(0), shared(B, g.B), shared(C, g.C),
        g.D.sum(0) if D is not None else EMPTY(u), g.z,
        g.delta_bias.sum(0) if delta_bias is not None else EMPTY(u),
        g.initial if initial is not None else EMPTY(u),
    )  # fmt: skip
