"""Other ways people compute x[t] = a[t] x[t-1] + b[t], for ``parascan bench``.

Written here from their published math (the Heinsen log-space formula, a
first-order combine for torch's associative_scan), or imported when installed
(accelerated-scan's reference, and for CUDA tensors its CUDA and Triton kernels,
``pip install 'parascan[peers]'``). Each returns x
for x[-1] = 0 and is differentiable with ordinary autograd; ``None`` means the
peer does not handle that call (and says why in ``unsupported``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

import torch

__all__ = ["CUDA_ONLY", "LOG_PEERS", "PEERS", "unsupported"]

Scan = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


def heinsen(gates: torch.Tensor, tokens: torch.Tensor, dim: int) -> torch.Tensor:
    """Heinsen (arXiv 2311.06281), real form: with a* = cumsum(log a),
    log x = a* + logcumsumexp(log b - a*). Needs positive gates and tokens."""
    return torch.exp(heinsen_log(torch.log(gates), torch.log(tokens), dim))


def heinsen_complex(gates: torch.Tensor, tokens: torch.Tensor, dim: int) -> torch.Tensor:
    """The same formula on complex logarithms, which allows negative values."""
    complex_dtype = torch.complex128 if gates.dtype == torch.float64 else torch.complex64
    log_x = heinsen_log(
        torch.log(gates.to(complex_dtype)), torch.log(tokens.to(complex_dtype)), dim
    )
    return torch.exp(log_x).real.to(tokens.dtype)


def heinsen_log(log_gates: torch.Tensor, log_tokens: torch.Tensor, dim: int) -> torch.Tensor:
    """Heinsen's formula kept in log space (what log-space users such as minGRU
    implementations compute): log x = a* + logcumsumexp(log b - a*)."""
    a_star = torch.cumsum(log_gates, dim)
    return a_star + torch.logcumsumexp(log_tokens - a_star, dim)


def torch_associative_scan(gates: torch.Tensor, tokens: torch.Tensor, dim: int) -> torch.Tensor:
    """torch's own associative_scan over (a, b) pairs of affine maps."""
    from torch._higher_order_ops.associative_scan import associative_scan

    def combine(
        first: tuple[torch.Tensor, torch.Tensor], second: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return first[0] * second[0], second[0] * first[1] + second[1]

    result = associative_scan(combine, (gates, tokens), dim=dim, combine_mode="generic")
    return result[1]


# accelerated-scan's modules: its reference loop, its CUDA kernel and its Triton kernel.
_ACCELERATED_SCAN = {
    "accelerated-scan ref": "ref",
    "accelerated-scan cuda": "warp",
    "accelerated-scan triton": "scalar",
}


def _accelerated_scan(module: str) -> Scan:
    """The ``scan`` of ``accelerated_scan.<module>``, imported when called (the GPU
    kernels' on contiguous copies)."""

    def scan(gates: torch.Tensor, tokens: torch.Tensor, dim: int) -> torch.Tensor:
        run = importlib.import_module(f"accelerated_scan.{module}").scan
        if module != "ref":
            gates, tokens = gates.contiguous(), tokens.contiguous()
        return run(gates, tokens)  # type: ignore[no-any-return]

    return scan


def unsupported(name: str, gates: torch.Tensor, dim: int) -> str | None:
    """Why peer ``name`` cannot compute this call, or None."""
    if name.startswith("heinsen") and gates.dtype.is_complex:
        return "complex inputs"
    module = _ACCELERATED_SCAN.get(name)
    if module is None:
        return None
    gpu = module != "ref"
    if gpu and gates.device.type != "cuda":
        return "CUDA tensors only"
    try:
        importlib.import_module(f"accelerated_scan.{module}")
    except ImportError:
        return "not installed (pip install 'parascan[peers]')"
    steps = gates.shape[dim]
    fits = gates.dim() == 3 and dim % 3 == 2 and not steps & (steps - 1)
    if gpu and not (fits and 32 <= steps <= 65536):
        return "needs (B, C, T) along the last dim, T a power of two in [32, 65536]"
    return None if fits else "needs (B, C, T) along the last dim with T a power of two"


# Peers with GPU kernels only (listed for CUDA cases only).
CUDA_ONLY = frozenset({"accelerated-scan cuda", "accelerated-scan triton"})

# Peers of log_linear_scan: (log_gates, log_tokens, dim) -> log x.
LOG_PEERS: dict[str, Scan] = {"heinsen (log)": heinsen_log}

PEERS: dict[str, Scan] = {
    **{name: _accelerated_scan(module) for name, module in _ACCELERATED_SCAN.items()},
    "heinsen": heinsen,
    "heinsen complex": heinsen_complex,
    "torch assoc_scan": torch_associative_scan,
}
