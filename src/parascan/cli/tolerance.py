"""The one per-dtype tolerance table for comparisons with the float64 reference
loop, used by ``parascan check``, ``parascan bench`` and the test suite.

The reference runs on the same (already rounded) inputs, so the error is the
accumulation plus the rounding of the output; it is measured relative to the
largest magnitude of the reference, since it grows with the running state rather
than with each element.
"""

from __future__ import annotations

import torch

__all__ = ["TOLERANCE", "relative_error"]

# dtype -> (rtol, atol); atol is scaled by max(1, max |reference|).
TOLERANCE: dict[torch.dtype, tuple[float, float]] = {
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
    torch.float32: (2e-5, 2e-5),
    torch.complex64: (2e-5, 2e-5),
    torch.float64: (1e-10, 1e-10),
    torch.complex128: (1e-10, 1e-10),
}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max(1, max |want|); 0 for empty tensors."""
    if want.numel() == 0:
        return 0.0
    scale = max(1.0, want.abs().max().item())
    return (got.to(want.dtype) - want).abs().max().item() / scale
