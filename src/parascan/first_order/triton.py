"""The ``triton`` backend of the first-order scans: the chunked Triton kernels of
triton_kernels.py (imported here, when the backend first runs), whose ``MODE`` is
the semiring's code; packed sequences (``cu_seqlens``) in the same launches, the
kernels restarting the state where a sequence starts."""

from __future__ import annotations

import torch
from torch import Tensor

from parascan._core import conj, on_their_device, state_shape
from parascan.first_order.semiring import LOG, Semiring

__all__ = ["backward", "forward"]


def _sequence_ids(cu_seqlens: Tensor | None, steps: int, device: torch.device) -> Tensor | None:
    """Each step's sequence (int32, (steps,)), as the kernels read it (None: unpacked)."""
    if cu_seqlens is None:
        return None
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    ids = torch.arange(cu.numel() - 1, dtype=torch.int32, device=device)
    return torch.repeat_interleave(ids, cu[1:] - cu[:-1], output_size=steps)


@on_their_device
def forward(
    ring: Semiring, gates: Tensor, tokens: Tensor, initial: Tensor | None, dim: int,
    reverse: bool, cu_seqlens: Tensor | None = None,
) -> Tensor:  # fmt: skip
    """Same contract as ``reference.loop``; tensors of one shape and dtype (real
    ones in the log semiring). Packed sequences (``cu_seqlens``, packed.py): ``dim``
    non-negative, ``initial`` the result's shape with ``dim`` of size num_seqs."""
    from parascan.first_order import triton_kernels as kernels

    seq = _sequence_ids(cu_seqlens, tokens.shape[dim], tokens.device)
    out, _ = kernels.run(ring.code, gates, tokens, None, None, initial, dim, reverse, seq=seq)
    return out


@on_their_device
def backward(
    ring: Semiring, gates: Tensor, tokens: Tensor | None, out: Tensor, grad_out: Tensor,
    initial: Tensor | None, dim: int, reverse: bool, cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """Fused backward: one chunked pass the other way, g[t] = G[t] + conj(w[t+1]) g[t+1]
    with w the step's derivative in its previous state (a[t]; in log space
    wu[t] = exp(log a[t] + h[t-1] - h[t])), writing the gradients of tokens and
    gates; then dL/dinitial = conj(w[0]) g[0]. Packed sequences: the chains restart at
    each sequence's last step; each initial state's gradient is read off its
    sequence's first step (0 for an empty sequence)."""
    from parascan.first_order import triton_kernels as kernels

    steps = out.shape[dim]
    grad_tokens, grad_gates = kernels.run(
        kernels.BACKWARD + ring.code, gates, grad_out, out, tokens, initial, dim, not reverse,
        seq=_sequence_ids(cu_seqlens, steps, out.device),
    )  # fmt: skip
    assert grad_gates is not None  # a backward pass writes both
    if cu_seqlens is None:
        if steps == 0 or (ring is LOG and initial is None):
            return grad_gates, grad_tokens, out.new_zeros(state_shape(out, dim))
        first = steps - 1 if reverse else 0
        if ring is LOG:
            # the gates' gradient g wu already holds conj(w[0]) g[0] (real)
            return grad_gates, grad_tokens, grad_gates.select(dim, first).clone()
        grad_initial = conj(gates.select(dim, first)) * grad_tokens.select(dim, first)
        return grad_gates, grad_tokens, grad_initial
    cu = cu_seqlens.to(device=out.device, dtype=torch.int64)
    nseq = cu.numel() - 1
    if steps == 0 or nseq == 0 or (ring is LOG and initial is None):
        seq_shape = (*out.shape[:dim], nseq, *out.shape[dim + 1 :])
        return grad_gates, grad_tokens, out.new_zeros(seq_shape)
    nonempty = cu[1:] > cu[:-1]
    firsts = torch.where(nonempty, cu[1:] - 1 if reverse else cu[:-1], 0)
    if ring is LOG:
        grad_initial = grad_gates.index_select(dim, firsts)
    else:
        grad_initial = conj(gates.index_select(dim, firsts)) * grad_tokens.index_select(dim, firsts)
    view = [1] * out.dim()
    view[dim] = nseq
    return grad_gates, grad_tokens, torch.where(nonempty.view(view), grad_initial, 0)
