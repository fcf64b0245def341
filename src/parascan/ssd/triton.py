"""The ``triton`` backend of the SSD scan: the Triton kernels of
triton_kernels.py (imported when the backend first runs), with canonical.py's
contract.

``forward`` and ``backward`` take CUDA tensors, or CPU tensors in Triton's
interpreter (``TRITON_INTERPRET=1`` set before triton is imported), in float32 or
float64 (the canonical operands' compute dtype).

How the work is cut (triton_kernels.py): one program per (batch row, head, block
of ``Plan.rows`` rows of the head's (headdim, N) state), walking L with its tile of
the state in registers; checkpoints every ``CHECKPOINT_STEPS["triton"]`` steps. Two
forwards, both with the same checkpoints (so one backward serves both):

- "sequential": one step at a time. Per step a multiply-add over the tile and a
  reduction over N, a short dependent chain (the loads of the next steps are
  software-pipelined), so the walk is latency-bound: its time is about L times one
  step's chain, whatever the width of the head, and the GPU is filled by programs
  (batch x heads x row blocks of them).
- "chunked" (not packed): the state-space dual form in blocks of 16 steps, whose
  work inside a block is four matrix products (tl.dot), so the serial chain is one
  block's, 16 times fewer links, for about the same multiply-adds at headdim = N =
  64 (per step 16 (N + headdim) + 2 headdim N against 3 headdim N). Its block
  weights reach exp(16 max(dt A)): a state growing that fast (dt A > 0, allowed by
  the contract) walks step by step instead (``chunked.dual_form_steps``).

On an H200 (tools/gpu/ssd_check.py) the dual form's forward was the faster at every
shape timed, a Mamba-2 2.7B layer's included, and forward + backward the same or
slightly faster (BENCHMARKS.md, "GPU" and "Figures the source cites"). It stays opt-in:
it must first learn whether the state grows too fast for its blocks
(``chunked.dual_form_steps``), a host synchronization per call that the walk does not
need (and that CUDA-graph capture refuses), until that test runs on the device.
``PARASCAN_SSD_TRITON_FORWARD`` (the environment) picks; packed sequences always walk
step by step (their boundaries would cut the blocks). The backward walks
step by step. Packed sequences: the kernels read ``cu_seqlens`` and, per step, the
sequence holding it (``_sequence_of_steps``, computed here on the device).

Gradients of the operands shared across programs (B and C by the heads of a group
and the row blocks, dt by the row blocks, A and D by the batch and time) are
per-program partial rows summed here with torch: deterministic, no atomics. Their
cost: the partials of dL/dB and dL/dC are (batch, L, heads x row blocks, N) each.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from parascan._core import on_their_device
from parascan.selective.triton import Launch
from parascan.ssd.canonical import (
    CHECKPOINT_STEPS,
    EMPTY,
    drops_final,
    states,
    zero_rows_as_zeros,
)
from parascan.ssd.chunked import dual_form_steps

__all__ = [
    "CHUNKED_TILES",
    "INTERPRETED_CHUNKED",
    "INTERPRETED_TILES",
    "TILES",
    "Plan",
    "Tiles",
    "backward",
    "backward_launch",
    "forward",
    "forward_launch",
    "plan",
]

_FN = "parascan.ssd_scan"
# The forward's algorithm when not packed, from the environment's
# PARASCAN_SSD_TRITON_FORWARD: "sequential" (the walk step by step, the default: no host
# synchronization) or "chunked" (the state-space dual form in blocks of steps, matrix
# products: its forward was faster on an H200 at every shape ssd_check.py times, but it
# synchronizes with the host to check for a growing state; see the module docstring).
_FORWARD_VARIABLE = "PARASCAN_SSD_TRITON_FORWARD"


@dataclass(frozen=True)
class Tiles:
    """A program's rows of the state (BLOCK_P), the warps that run it, the
    registers a thread may use (ptxas's ``.maxnreg``) and the stages of the walk's
    software pipeline (steps whose loads are in flight together)."""

    rows: int
    warps: int
    registers: int
    stages: int = 3


# (forward, backward) per compute dtype on a GPU, for N = 64 (Mamba-2's usual state).
# Forward: 16 rows x 64 states on 4 warps, 8 float32 elements of the state per thread:
# many small programs (the walk is latency-bound, so parallelism over programs is
# what hides it). Backward: 32 rows on 8 warps (the same 8 per thread), so that a
# head of 64 has 2 row blocks and the partial sums of dL/dB and dL/dC are 2 x
# (batch, L, heads, N) each; it keeps about four tiles live (h[t-1], h[t], g_h and a
# product) and the pointer tile of its scratch. float64: 16 rows, the backward on 8
# warps. Each register cap holds its kernel without a spill on sm_80 and sm_90 in
# every variant (tools/gpu/ssd_compile.py --full; at 128 registers the float32
# backward of 32 rows spilled 24 bytes on sm_90, and float64's of 32 rows 16 at 255).
TILES = {
    torch.float32: (Tiles(16, warps=4, registers=128), Tiles(32, warps=8, registers=168)),
    torch.float64: (Tiles(16, warps=4, registers=168), Tiles(16, warps=8, registers=255)),
}
# In Triton's interpreter every step of the walk costs Python calls: tiles of 2 rows
# so that the tests' tiny heads still have several row blocks.
INTERPRETED_TILES = Tiles(rows=2, warps=1, registers=255)
# The dual form's forward (``algorithm="chunked"``): (rows x steps per block, warps,
# software-pipeline stages) per compute dtype; tl.dot takes no side below 16 (N and
# headdim are padded to 16). Chosen by compiling (tools/gpu/ssd_compile.py), not by timing
# (no GPU yet): float32 32 rows x 16 steps on 4 warps is the largest tile found
# without a spill on sm_80 and sm_90 (64 rows or 32 steps spilled 0.1-6 KB even on
# 8 warps, in both dot precisions); float64 16 x 16.
CHUNKED_TILES = {
    torch.float32: (Tiles(32, warps=4, registers=255, stages=2), 16),
    torch.float64: (Tiles(16, warps=4, registers=255, stages=2), 16),
}
# tl.dot's precision: float32 products as three tf32 products (big x big + big x small
# + small x big: about float32's accuracy on the tensor cores; one tf32 product would
# round the inputs to 10 bits); float64 exact.
PRECISION = {torch.float32: "tf32x3", torch.float64: "ieee"}
INTERPRETED_CHUNKED = (Tiles(rows=16, warps=1, registers=255), 16)


@dataclass(frozen=True)
class Plan:
    """A pass's launch: ``rows`` (BLOCK_P) rows per program, ``blocks`` of them per
    head, ``states`` (N padded to a power of 2), checkpoints every ``chunk`` steps."""

    rows: int
    blocks: int
    states: int
    warps: int
    registers: int
    stages: int
    chunk: int
    steps: int = 1  # the dual form's block of steps (BLOCK_T); 1: the sequential walk


def _next_power_of_2(x: int) -> int:
    return 1 << max(x - 1, 0).bit_length()


def plan(
    headdim: int,
    n: int,
    dtype: torch.dtype,
    backward: bool,
    interpreted: bool | None = None,
    chunked: bool = False,
) -> Plan:
    """The launch of a pass over heads of ``headdim`` rows and ``n`` states
    (``chunked``: the forward by the dual form)."""
    if interpreted is None:
        interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    steps, least = 1, 1
    if chunked:
        tiles, steps = INTERPRETED_CHUNKED if interpreted else CHUNKED_TILES[dtype]
        least = 16
    else:
        tiles = INTERPRETED_TILES if interpreted else TILES[dtype][backward]
    rows = max(min(tiles.rows, _next_power_of_2(headdim)), least)
    return Plan(
        rows=rows,
        blocks=-(-headdim // rows),
        states=max(_next_power_of_2(n), least),
        warps=tiles.warps,
        registers=tiles.registers,
        stages=tiles.stages,
        chunk=CHECKPOINT_STEPS["triton"],
        steps=steps,
    )


def _check(x: Tensor) -> None:
    if x.dtype not in TILES:
        raise TypeError(
            f"{_FN}: the 'triton' backend computes in float32 or float64, but got x {x.dtype}"
        )


def _sequence_of_steps(cu_seqlens: Tensor, length: int, device: torch.device) -> Tensor:
    """(L,) int32: the packed sequence holding each step, the number of sequence ends
    at or before it (empty sequences end where they start, and are passed over).
    Computed on the device, without a synchronization."""
    ends = cu_seqlens[1:].to(device=device, dtype=torch.int64)
    steps = torch.arange(length, device=device, dtype=torch.int64)
    return torch.searchsorted(ends, steps, right=True).to(torch.int32)


def _launch(
    p: Plan, programs: int, x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor,
    D: Tensor | None, z: Tensor | None, initial: Tensor | None, cu_seqlens: Tensor | None,
    *outputs: Tensor,
) -> Launch:  # fmt: skip
    """A pass's launch over ``programs`` programs. The kernels' arguments: the
    operands contiguous (an absent operand is replaced by x, never read): x, dt, A,
    B, C, D, z, initial, cu_seqlens and the steps' sequences (int64 offsets, int32
    sequences); then the pass's ``outputs``; then the sizes."""
    import triton.language as tl

    _batch, length, heads, headdim = x.shape
    groups, n = B.shape[2], B.shape[3]
    if cu_seqlens is not None:
        cu = cu_seqlens.to(device=x.device, dtype=torch.int64).contiguous()
        seq = _sequence_of_steps(cu, length, x.device)
    else:
        cu = seq = x
    return Launch(
        grid=(programs,),
        args=[
            x.contiguous(), dt.contiguous(), A.contiguous(), B.contiguous(), C.contiguous(),
            D.contiguous() if D is not None else x, z.contiguous() if z is not None else x,
            initial.contiguous() if initial is not None else x, cu, seq, *outputs,
            length, heads, headdim, n, groups, heads // groups, p.blocks, p.chunk,
            -(-length // p.chunk),
        ],
        constexprs=dict(
            HAS_D=D is not None, HAS_Z=z is not None, HAS_INIT=initial is not None,
            PACKED=cu_seqlens is not None,
            ACC=tl.float64 if x.dtype == torch.float64 else tl.float32,
            BLOCK_P=p.rows, BLOCK_N=p.states, STAGES=p.stages,
            **({"BLOCK_T": p.steps, "PRECISION": PRECISION[x.dtype]} if p.steps > 1 else {}),
        ),
        warps=p.warps,
        registers=p.registers,
    )  # fmt: skip


def _chunked(algorithm: str | None, cu_seqlens: Tensor | None) -> bool:
    """Whether the forward runs the dual form: ``algorithm`` ("sequential",
    "chunked", or None for the environment's ``PARASCAN_SSD_TRITON_FORWARD``, by
    default "sequential"); packed sequences always walk step by step."""
    if algorithm is None:
        algorithm = os.environ.get(_FORWARD_VARIABLE, "sequential")
    if algorithm not in ("sequential", "chunked"):
        raise ValueError(
            f"{_FN}: expected algorithm 'sequential' or 'chunked', but got {algorithm!r}"
        )
    return algorithm == "chunked" and cu_seqlens is None


def forward_launch(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None,
    z: Tensor | None, initial: Tensor | None, cu_seqlens: Tensor | None,
    algorithm: str | None = None,
) -> tuple[Launch, Tensor, Tensor, Tensor]:  # fmt: skip
    """The forward kernel's launch and its outputs (out, final, checkpoints), still
    to be written. Works on meta tensors too (the compile-for-GPU test uses it)."""
    batch, length, heads, headdim = x.shape
    n = B.shape[3]
    p = plan(headdim, n, x.dtype, False, chunked=_chunked(algorithm, cu_seqlens))
    new: dict[str, Any] = dict(dtype=x.dtype, device=x.device)
    out = torch.empty((batch, length, heads, headdim), **new)
    final = torch.empty((states(x, cu_seqlens), heads, headdim, n), **new)
    checkpoints = torch.empty((batch, -(-length // p.chunk), heads, headdim, n), **new)
    launch = _launch(
        p, batch * heads * p.blocks, x, dt, A, B, C, D, z, initial, cu_seqlens, out, final,
        checkpoints,
    )  # fmt: skip
    return launch, out, final, checkpoints


def _empty_sequences(cu_seqlens: Tensor, device: torch.device) -> Tensor:
    """(num_seqs, 1, 1, 1) bool: the packed sequences without a step."""
    cu = cu_seqlens.to(device)
    return (cu[1:] == cu[:-1]).view(-1, 1, 1, 1)


@drops_final
@on_their_device
def forward(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None,
    z: Tensor | None, initial: Tensor | None, cu_seqlens: Tensor | None, *,
    algorithm: str | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """canonical.py's forward: (out, final, checkpoints). ``algorithm``:
    "sequential" or "chunked" (the dual form; not for packed sequences, nor for a
    state growing too fast for its blocks: ``chunked.dual_form_steps``),
    ``PARASCAN_SSD_TRITON_FORWARD`` when None."""
    _check(x)
    from parascan.ssd import triton_kernels as kernels

    if _chunked(algorithm, cu_seqlens):
        steps = plan(x.shape[3], B.shape[3], x.dtype, False, chunked=True).steps
        if dual_form_steps(dt, A, steps) < steps:  # a growing state: blocks overflow
            algorithm = "sequential"
    launch, out, final, checkpoints = forward_launch(
        x, dt, A, B, C, D, z, initial, cu_seqlens, algorithm
    )
    start = initial if initial is not None else torch.zeros_like(final)
    if out.numel() == 0:  # no steps, no heads or no rows: every final state is the initial
        if final.numel():
            final.copy_(start)
        return out, final, checkpoints
    chunked = "BLOCK_T" in launch.constexprs
    kernel = kernels.chunked_forward_kernel if chunked else kernels.forward_kernel
    kernel[launch.grid](*launch.args, **launch.constexprs, **launch.options())
    if cu_seqlens is not None:  # an empty sequence's final state is its initial state
        final = torch.where(_empty_sequences(cu_seqlens, x.device), start, final)
    return out, final, checkpoints


@dataclass
class _Gradients:
    """The backward kernel's outputs: per-step gradients, and the partial sums
    ``backward`` reduces."""

    x: Tensor
    z: Tensor
    initial: Tensor
    dt: Tensor  # (batch, L, heads, row blocks)
    B: Tensor  # (batch, L, heads x row blocks, N)
    C: Tensor
    A: Tensor  # (batch, heads, row blocks)
    D: Tensor  # (batch, heads, headdim)


def backward_launch(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None,
    z: Tensor | None, initial: Tensor | None, cu_seqlens: Tensor | None,
    checkpoints: Tensor, grad_out: Tensor, grad_final: Tensor,
) -> tuple[Launch, _Gradients, Plan]:  # fmt: skip
    """The backward kernel's launch and the buffers it writes. Works on meta tensors
    too."""
    batch, length, heads, headdim = x.shape
    n = B.shape[3]
    p = plan(headdim, n, x.dtype, True)
    expected = (batch, -(-length // p.chunk), heads, headdim, n)
    if tuple(checkpoints.shape) != expected:
        raise ValueError(
            f"{_FN}: expected checkpoints of shape {expected} (every {p.chunk} steps), but "
            f"got {tuple(checkpoints.shape)}"
        )
    new: dict[str, Any] = dict(dtype=x.dtype, device=x.device)
    grads = _Gradients(
        x=torch.empty((batch, length, heads, headdim), **new),
        z=torch.empty((batch, length, heads, headdim), **new) if z is not None else EMPTY(x),
        initial=torch.empty((states(x, cu_seqlens), heads, headdim, n), **new),
        dt=torch.empty((batch, length, heads, p.blocks), **new),
        B=torch.empty((batch, length, heads * p.blocks, n), **new),
        C=torch.empty((batch, length, heads * p.blocks, n), **new),
        A=torch.empty((batch, heads, p.blocks), **new),
        D=torch.empty((batch, heads, headdim), **new),
    )
    programs = batch * heads * p.blocks
    scratch = torch.empty(programs * p.chunk * p.rows * p.states, **new)
    launch = _launch(
        p, programs, x, dt, A, B, C, D, z, initial, cu_seqlens, checkpoints.contiguous(),
        grad_out.contiguous(), grad_final.contiguous(), grads.x,
        grads.z if z is not None else grads.x, grads.initial, grads.dt, grads.B, grads.C,
        grads.A, grads.D, scratch,
    )  # fmt: skip
    return launch, grads, p


@zero_rows_as_zeros
@on_their_device
def backward(
    x: Tensor, dt: Tensor, A: Tensor, B: Tensor, C: Tensor, D: Tensor | None,
    z: Tensor | None, initial: Tensor | None, cu_seqlens: Tensor | None,
    checkpoints: Tensor, grad_out: Tensor, grad_final: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:  # fmt: skip
    """canonical.py's backward: the gradients of (x, dt, A, B, C, D, z,
    initial), from the checkpoints ``forward`` stored."""
    _check(x)
    from parascan.ssd import triton_kernels as kernels

    batch, length, heads, _ = x.shape
    groups, n = B.shape[2], B.shape[3]
    launch, g, p = backward_launch(
        x, dt, A, B, C, D, z, initial, cu_seqlens, checkpoints, grad_out, grad_final
    )  # fmt: skip
    if g.x.numel() == 0:  # no steps, heads or rows: dL/dinitial = dL/dfinal
        for t in (g.z, g.dt, g.B, g.C, g.A, g.D):
            t.zero_()
        g.initial.copy_(grad_final)
    else:
        kernels.backward_kernel[launch.grid](
            *launch.args, **launch.constexprs, **launch.options()
        )  # fmt: skip
        if cu_seqlens is not None and initial is not None:  # empty: dL/dinitial = dL/dfinal
            g.initial = torch.where(_empty_sequences(cu_seqlens, x.device), grad_final, g.initial)
    per_group = heads // groups * p.blocks
    return (
        g.x,
        g.dt.sum(-1),
        g.A.sum((0, 2)),
        g.B.view(batch, length, groups, per_group, n).sum(3),
        g.C.view(batch, length, groups, per_group, n).sum(3),
        g.D.sum(0) if D is not None else EMPTY(x),
        g.z,
        g.initial if initial is not None else EMPTY(x),
    )
