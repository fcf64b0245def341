"""The raw matrix_linear_scan op, registered with torch.library.

``parascan::matrix_linear_scan`` takes validated inputs of one dtype whose batch
dims have one rank (they broadcast), ``initial`` or None, and a concrete backend.
It carries a fake kernel (torch.compile) and a vmap rule; api.py puts an
autograd.Function around it (see first_order/ops.py for why not register_autograd).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from parascan._core import (
    FLOAT_DTYPES,
    Backend,
    OpBackends,
    accumulate_dtype,
    batch_first,
    custom_op,
    register,
    resolved,
)
from parascan.matrix import chunked, cpu, reference

__all__ = ["ROW", "matrix_linear_scan_op"]

# The backend table's row of matrix_linear_scan. The C kernel takes real dtypes (half
# types run in float32); the backward runs through the forward (api.py).
ROW = register(
    OpBackends(
        op="parascan.matrix_linear_scan",
        backends={
            "cpu": Backend(
                cpu.forward,
                dtypes=tuple(d for d in FLOAT_DTYPES if accumulate_dtype(d) in cpu.DTYPES),
                unsupported="{dtype}: its kernel takes real dtypes; use 'torch' or 'loop' "
                "(or 'auto')",
            ),
            "torch": Backend(chunked.forward),
            "loop": Backend(reference.forward),
        },
        missing={
            "triton": "matrix_linear_scan has no Triton kernel; use 'torch' or 'loop' (or "
            "'auto', which chooses between them on GPUs)"
        },
    )
)


def _forward(
    weights: Tensor, biases: Tensor, initial: Tensor | None, reverse: bool, backend: str
) -> Tensor:
    """x[t] = weights[t] @ x[t-1] + biases[t]; a new contiguous tensor. Half types
    are computed in float32."""
    dtype = biases.dtype
    acc = accumulate_dtype(dtype)
    weights, biases = resolved(weights).to(acc), resolved(biases).to(acc)
    initial = None if initial is None else resolved(initial).to(acc)
    out: Tensor = ROW.backends[backend].forward(weights, biases, initial, reverse)
    return out.to(dtype)


def _fake(weights: Tensor, biases: Tensor, initial: Tensor | None, *_: object) -> Tensor:
    torch._check(weights.dtype == biases.dtype, lambda: "parascan::matrix_linear_scan: dtypes")
    batch = torch.broadcast_shapes(
        weights.shape[:-3], biases.shape[:-2], () if initial is None else initial.shape[:-1]
    )
    return torch.empty((*batch, *biases.shape[-2:]), dtype=biases.dtype, device=biases.device)


def _vmap_rule(op: Any) -> Any:
    def rule(
        info: Any, in_dims: tuple[Any, ...], weights: Tensor, biases: Tensor,
        initial: Tensor | None, reverse: bool, backend: str,
    ) -> tuple[Tensor, int]:  # fmt: skip
        n = info.batch_size
        operands = (weights, biases, initial)
        w, b, h = (batch_first(t, d, n) for t, d in zip(operands, in_dims[:3], strict=True))
        return op(w, b, h, reverse, backend), 0

    return rule


matrix_linear_scan_op = custom_op(
    "matrix_linear_scan",
    "(Tensor weights, Tensor biases, Tensor? initial, bool reverse, str backend) -> Tensor",
    _forward,
    _fake,
    _vmap_rule,
)
