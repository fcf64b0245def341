"""The ``torch`` backend for linear_scan: a parallel chunked scan in pure PyTorch.

Summary of algorithm. The pair (a, b) stands for the affine map x -> a*x + b, and
composing maps is associative: (a2, b2) after (a1, b1) = (a2*a1, a2*b1 + b2). So:
  1. fold the initial state into the first token: b[0] += a[0] * initial;
  2. split time into chunks of CHUNK steps (padding the tail with the identity map
     a=1, b=0) and scan inside every chunk at once with log2(CHUNK) doubling steps
     (Hillis-Steele), giving each step's map from the chunk start;
  3. the chunks' total maps form a recurrence CHUNK times shorter: scan it the same
     way (recursively), giving the state entering each chunk;
  4. apply each step's map to the state entering its chunk.
Work is O(T log CHUNK), depth O(log T); every step is a batched tensor op, so it
runs on any device. Never divides by a gate, so zeros and tiny gates are exact.
"""

from __future__ import annotations

import torch

from parascan._checks import accumulate_dtype

__all__ = ["forward"]

CHUNK = 16


def _scan_chunks(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Inclusive scan of affine maps along dim 1 by doubling."""
    length = a.shape[1]
    shift = 1
    while shift < length:
        b = torch.cat([b[:, :shift], torch.addcmul(b[:, shift:], a[:, shift:], b[:, :-shift])], 1)
        a = torch.cat([a[:, :shift], a[:, shift:] * a[:, :-shift]], 1)
        shift *= 2
    return a, b


def _scan_time_first(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """x[t] = a[t] x[t-1] + b[t] along dim 0 from a zero state."""
    steps, rest = a.shape[0], a.shape[1:]
    if steps <= CHUNK:
        return _scan_chunks(a.unsqueeze(0), b.unsqueeze(0))[1].squeeze(0)
    pad = -steps % CHUNK
    if pad:
        a = torch.cat([a, a.new_ones((pad, *rest))])
        b = torch.cat([b, b.new_zeros((pad, *rest))])
    chunks = a.shape[0] // CHUNK
    a_in, b_in = _scan_chunks(a.reshape(chunks, CHUNK, *rest), b.reshape(chunks, CHUNK, *rest))
    ends = _scan_time_first(a_in[:, -1], b_in[:, -1])
    entering = torch.cat([ends.new_zeros((1, *rest)), ends[:-1]])
    x = torch.addcmul(b_in, a_in, entering.unsqueeze(1))
    return x.reshape(chunks * CHUNK, *rest)[:steps]


def forward(
    gates: torch.Tensor,
    tokens: torch.Tensor,
    initial: torch.Tensor | None,
    dim: int,
    reverse: bool,
) -> torch.Tensor:
    """Same contract as ``reference.forward``."""
    dtype = tokens.dtype
    acc = accumulate_dtype(dtype)
    a = gates.movedim(dim, 0).to(acc)
    b = tokens.movedim(dim, 0).to(acc)
    if reverse:
        a, b = a.flip(0), b.flip(0)
    out = torch.empty(tokens.shape, dtype=dtype, device=tokens.device)
    if b.shape[0] == 0:
        return out
    if initial is not None:
        b = torch.cat([(b[0] + a[0] * initial.to(acc)).unsqueeze(0), b[1:]])
    x = _scan_time_first(a, b)
    if reverse:
        x = x.flip(0)
    return out.copy_(x.movedim(0, dim))
