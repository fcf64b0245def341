"""Drop-ins for the two functions of Heinsen's "Efficient Parallelization of an
Ubiquitous Sequential Computation" (arXiv 2311.06281), as given in its README:

    from parascan.compat.heinsen_sequence import compute_in_parallel

Same arguments and results, computed by :func:`parascan.log_linear_scan` instead
of ``cumsum`` + ``logcumsumexp``: one pass, its error bounded at any length (the
original loses precision as the cumulative sum of the log coefficients grows), with
exact finite gradients where a value is zero. In float32 with coefficients near 1
the state's rounding over the ~1 / (1 - a) steps it remembers adds up (a relative
1e-4 at a = 0.9999, where a cumsum accumulated in double stays near 1e-6): pass
float64 there (README, log space).

``log_coeffs`` holds log a_1..a_n along the last dim; ``log_values`` holds
log x_0, log b_1..log b_n (one longer). The result holds x_0..x_n, with
x_t = a_t x_{t-1} + b_t.
"""

from __future__ import annotations

import torch
from torch import Tensor

from parascan._core import describe, tensor_hint
from parascan.compat._checks import errors_as
from parascan.first_order import log_linear_scan

__all__ = ["compute_in_parallel", "compute_in_parallel_special_case"]


def _log_x(fn: str, log_coeffs: Tensor, log_values: Tensor) -> Tensor:
    for name, t in (("log_coeffs", log_coeffs), ("log_values", log_values)):
        if not isinstance(t, Tensor) or t.dim() == 0:
            raise TypeError(
                f"{fn}: expected {name} to be a Tensor with a time dim, but got {describe(t)}"
                f"{tensor_hint(t)}"
            )
    n = log_coeffs.shape[-1]
    if log_values.shape[-1] != n + 1:
        raise ValueError(
            f"{fn}: expected log_values to be one longer than log_coeffs along the last dim "
            f"({n + 1}: log x0 first), but got {describe(log_values)} and {describe(log_coeffs)}"
        )
    log_x0 = log_values[..., :1]
    names = {"log_gates": "log_coeffs", "log_tokens": "log_values[..., 1:]",
             "initial": "log_values[..., 0]"}  # fmt: skip
    with errors_as(fn, "parascan.log_linear_scan", names):
        log_x = log_linear_scan(log_coeffs, log_values[..., 1:], -1, initial=log_x0.squeeze(-1))
    return torch.cat([log_x0.to(log_x.dtype).expand(*log_x.shape[:-1], 1), log_x], -1)


def compute_in_parallel(log_coeffs: Tensor, log_values: Tensor) -> Tensor:
    """x_0..x_n (the real part) from complex (or real) logs of coefficients and
    values; pass ``v.to(torch.complex64).log()`` when any input is negative."""
    return torch.exp(
        _log_x("parascan.compat.heinsen_sequence.compute_in_parallel", log_coeffs, log_values)
    ).real


def compute_in_parallel_special_case(log_coeffs: Tensor, log_values: Tensor) -> Tensor:
    """x_0..x_n from real logs (no input is negative)."""
    return torch.exp(
        _log_x(
            "parascan.compat.heinsen_sequence.compute_in_parallel_special_case",
            log_coeffs,
            log_values,
        )
    )
