"""The ``triton`` backend of the first-order scans: the chunked Triton kernels of
triton_kernels.py (imported here, when the backend first runs), whose ``MODE`` is
the semiring's code; packed sequences (``packed_forward``, ``packed_backward``) in
the same launches, the kernels restarting the state where a sequence starts."""

from __future__ import annotations

import torch

from parascan._ops import conj, state_shape
from parascan.first_order.semiring import LOG, Semiring

__all__ = ["backward", "forward", "packed_backward", "packed_forward"]


def forward(
    ring: Semiring,
    gates: torch.Tensor,
    tokens: torch.Tensor,
    initial: torch.Tensor | None,
    dim: int,
    reverse: bool,
) -> torch.Tensor:
    """Same contract as ``reference.loop``; tensors of one shape and dtype (real
    ones in the log semiring)."""
    from parascan.first_order import triton_kernels as kernels

    return kernels.forward(ring.code, gates, tokens, initial, dim, reverse)


def backward(
    ring: Semiring,
    gates: torch.Tensor,
    tokens: torch.Tensor | None,
    out: torch.Tensor,
    grad_out: torch.Tensor,
    initial: torch.Tensor | None,
    dim: int,
    reverse: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fused backward: one chunked pass the other way, g[t] = G[t] + conj(w[t+1]) g[t+1]
    with w the step's derivative in its previous state (a[t]; in log space
    wu[t] = exp(log a[t] + h[t-1] - h[t])), writing the gradients of tokens and
    gates; then dL/dinitial = conj(w[0]) g[0]."""
    from parascan.first_order import triton_kernels as kernels

    grad_tokens, grad_gates = kernels.backward(
        kernels.BACKWARD + ring.code, gates, grad_out, out,
        tokens if ring.backward_reads_tokens else None, initial, dim, not reverse,
    )  # fmt: skip
    steps = out.shape[dim]
    if steps == 0 or (ring is LOG and initial is None):
        return grad_gates, grad_tokens, out.new_zeros(state_shape(out, dim))
    first = steps - 1 if reverse else 0
    if ring is LOG:
        # the gates' gradient g wu already holds conj(w[0]) g[0] (real)
        return grad_gates, grad_tokens, grad_gates.select(dim, first).clone()
    grad_initial = conj(gates.select(dim, first)) * grad_tokens.select(dim, first)
    return grad_gates, grad_tokens, grad_initial


def _sequence_ids(cu_seqlens: torch.Tensor, steps: int, device: torch.device) -> torch.Tensor:
    """Each step's sequence (int32, (steps,)), as the kernels read it."""
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    ids = torch.arange(cu.numel() - 1, dtype=torch.int32, device=device)
    return torch.repeat_interleave(ids, cu[1:] - cu[:-1], output_size=steps)


def packed_forward(
    ring: Semiring, gates: torch.Tensor, tokens: torch.Tensor, initial: torch.Tensor | None,
    dim: int, reverse: bool, cu_seqlens: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """``forward`` of packed sequences (packed.py): ``initial`` has the result's shape
    with ``dim`` (non-negative) of size num_seqs."""
    from parascan.first_order import triton_kernels as kernels

    seq = _sequence_ids(cu_seqlens, tokens.shape[dim], tokens.device)
    return kernels.forward(ring.code, gates, tokens, initial, dim, reverse, seq=seq)


def packed_backward(
    ring: Semiring, gates: torch.Tensor, tokens: torch.Tensor | None, out: torch.Tensor,
    grad_out: torch.Tensor, initial: torch.Tensor | None, dim: int, reverse: bool,
    cu_seqlens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``backward`` of packed sequences: the chains restart at each sequence's last
    step; each initial state's gradient is read off its sequence's first step (0 for
    an empty sequence)."""
    from parascan.first_order import triton_kernels as kernels

    steps = out.shape[dim]
    seq = _sequence_ids(cu_seqlens, steps, out.device)
    grad_tokens, grad_gates = kernels.backward(
        kernels.BACKWARD + ring.code, gates, grad_out, out,
        tokens if ring.backward_reads_tokens else None, initial, dim, not reverse, seq=seq,
    )  # fmt: skip
    cu = cu_seqlens.to(device=out.device, dtype=torch.int64)
    nseq = cu.numel() - 1
    seq_shape = (*out.shape[:dim], nseq, *out.shape[dim + 1 :])
    if steps == 0 or nseq == 0 or (ring is LOG and initial is None):
        return grad_gates, grad_tokens, out.new_zeros(seq_shape)
    nonempty = cu[1:] > cu[:-1]
    first = torch.where(nonempty, cu[1:] - 1 if reverse else cu[:-1], 0)
    if ring is LOG:
        grad_initial = grad_gates.index_select(dim, first)
    else:
        grad_initial = conj(gates.index_select(dim, first)) * grad_tokens.index_select(dim, first)
    view = [1] * out.dim()
    view[dim] = nseq
    return grad_gates, grad_tokens, torch.where(nonempty.view(view), grad_initial, 0)
