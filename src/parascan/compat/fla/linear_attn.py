"""Drop-ins for ``fla.ops.linear_attn``: per step and head, ``S = S + k v^T``,
``o = scale * S^T q``, with ``normalize`` divided by ``scale * q . z + 1e-10``,
``z = z + k`` the running sum of the keys; computed by
:func:`parascan.linear_attention_scan` (the layouts, and what differs from the
originals: :mod:`parascan.compat.fla`)."""

from __future__ import annotations

from dataclasses import replace
from functools import reduce

import torch
from torch import Tensor

from parascan._core import check_flag, check_shape, check_tensor, describe
from parascan.compat.fla._common import (
    PREFIX,
    StateScan,
    check_same_heads,
    check_state_scan,
    compute_dtype,
    run_linear,
    same_device,
)

__all__ = ["chunk_linear_attn", "fused_chunk_linear_attn", "fused_recurrent_linear_attn"]

State = Tensor | tuple[Tensor | None, Tensor] | None


def chunk_linear_attn(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float | None = None,
    initial_state: Tensor | tuple[Tensor | None, Tensor | None] | None = None,
    output_final_state: bool = False,
    normalize: bool = True,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, State]:
    """Linear attention (``fla.ops.linear_attn.chunk_linear_attn``): per step and head,
    ``S = S + k v^T``, ``o = scale * S^T q``; with ``normalize`` (the default here)
    ``o / (scale * q . z + 1e-10)``, ``z`` the running sum of the keys.

    Args:
        q, k: ``(B, T, H, K)``.
        v: ``(B, T, H, V)``.
        scale: the factor of ``q``; ``K ** -0.5`` by default.
        initial_state: ``(N, H, K, V)``: N = B, or the number of sequences with
            ``cu_seqlens``; with ``normalize``, also a tuple ``(kv_state, z_state)``,
            ``z_state`` ``(N, 1, H, K)`` the keys' sum so far (either may be None).
        output_final_state: also return the final ``(N, H, K, V)`` state.
        normalize: divide by ``scale * q . z + 1e-10``.
        cu_seqlens: ``(N + 1,)`` integer offsets of packed sequences along T (B == 1).

    Returns:
        ``(o, final_state)``, ``o`` ``(B, T, H, V)`` in q's dtype (promoted with k's
        by ``normalize``), ``final_state`` float32 (float64 for a float64 v) or None;
        with ``normalize``, ``(o, (final_state, z_state))`` as the original returns
        it, ``z_state`` ``(N, 1, H, K)`` in k's dtype, whatever ``output_final_state``.

    Example:
        >>> import torch
        >>> from parascan.compat.fla import chunk_linear_attn
        >>> ones = torch.ones(1, 3, 1, 1)
        >>> o, (none, z) = chunk_linear_attn(ones, ones, 2 * ones)
        >>> o.flatten(), none, z.flatten()
        (tensor([2., 2., 2.]), None, tensor([3.]))
    """
    return _linear_attn(
        "chunk_linear_attn", q, k, v, scale, initial_state, output_final_state, False,
        normalize, cu_seqlens, out="q",
    )  # fmt: skip


def fused_recurrent_linear_attn(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float | None = None,
    initial_state: Tensor | tuple[Tensor | None, Tensor | None] | None = None,
    output_final_state: bool = False,
    reverse: bool = False,
    normalize: bool = False,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, State]:
    """Linear attention (``fla.ops.linear_attn.fused_recurrent_linear_attn``): the
    recurrence of :func:`chunk_linear_attn`, ``normalize`` off by default; ``reverse``
    scans each sequence from its last step to its first (then ``z`` sums the keys from
    the end, and the final states are those after the first step). ``o`` has q's
    dtype (promoted with k's by ``normalize``)."""
    return _linear_attn(
        "fused_recurrent_linear_attn", q, k, v, scale, initial_state, output_final_state,
        reverse, normalize, cu_seqlens, out="q",
    )  # fmt: skip


def fused_chunk_linear_attn(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    scale: float | None = None,
    initial_state: Tensor | tuple[Tensor | None, Tensor | None] | None = None,
    output_final_state: bool = False,
    normalize: bool = True,
    cu_seqlens: Tensor | None = None,
) -> tuple[Tensor, State]:
    """Linear attention (``fla.ops.linear_attn.fused_chunk_linear_attn``): the
    recurrence of :func:`chunk_linear_attn` (``normalize`` on by default); ``o`` has
    v's dtype (promoted with q's and k's by ``normalize``), as the original's."""
    return _linear_attn(
        "fused_chunk_linear_attn", q, k, v, scale, initial_state, output_final_state, False,
        normalize, cu_seqlens, out="v",
    )  # fmt: skip


def _linear_attn(
    function: str,
    q: object,
    k: object,
    v: object,
    scale: object,
    initial_state: object,
    output_final_state: object,
    reverse: object,
    normalize: object,
    cu_seqlens: object,
    *,
    out: str,
) -> tuple[Tensor, State]:
    """The three drop-ins (``function``: the one called; ``out``: whose dtype ``o``
    has before ``normalize``)."""
    fn = PREFIX + function
    (q_t, k_t), v_t = check_same_heads(fn, [("q", q), ("k", k)], v)
    norm = check_flag(fn, "normalize", normalize)
    kv_init, z_init = initial_state, None
    if isinstance(initial_state, tuple):
        if not norm or len(initial_state) != 2:
            what = "a Tensor or None" if not norm else "a Tensor, None or a pair"
            raise TypeError(
                f"{fn}: a (kv_state, z_state) pair is an initial state with normalize=True: "
                f"expected initial_state to be {what}, but got {describe(initial_state)} "
                f"with normalize={norm}"
            )
        kv_init, z_init = initial_state
    base = q_t.dtype if out == "q" else v_t.dtype
    run = check_state_scan(
        fn, q_t, v_t, out_dtype=base, scale=scale, initial_state=kv_init,
        output_final_state=output_final_state, reverse=reverse, cu_seqlens=cu_seqlens,
    )  # fmt: skip
    n = q_t.shape[0] if run.cu_seqlens is None else run.cu_seqlens.numel() - 1
    z_t = None
    if z_init is not None:
        z_t = check_tensor(fn, "z_state", z_init)
        check_shape(fn, "z_state", z_t, (n, 1, *q_t.shape[2:]), "(N, 1, H, K)")
    same_device(fn, [("q", q_t), ("k", k_t), ("v", v_t), ("initial_state", run.initial_state),
                     ("z_state", z_t)])  # fmt: skip
    if not norm:
        return run_linear(run, q_t, k_t, v_t)
    return _normalized(run, q_t, k_t, v_t, z_t, n, base)


def _normalized(
    run: StateScan, q: Tensor, k: Tensor, v: Tensor, z_init: Tensor | None, n: int,
    base: torch.dtype,
) -> tuple[Tensor, tuple[Tensor | None, Tensor]]:  # fmt: skip
    """Linear attention with ``normalize``: one scan of v with a column of ones added,
    whose state's last column is then the keys' running sum z (and its output
    ``scale * q . z``, the denominator); ``n`` states."""
    batch, steps, heads, dv = v.shape
    dk = q.shape[-1]
    cd = compute_dtype(v)
    ones = torch.ones(batch, steps, heads, 1, dtype=cd, device=v.device)
    wide = torch.cat([v.to(cd), ones], -1)
    initial = None
    if run.initial_state is not None or z_init is not None:
        kv = (
            torch.zeros(n, heads, dk, dv, dtype=cd, device=v.device)
            if run.initial_state is None
            else run.initial_state.to(cd)
        )
        z = (
            torch.zeros(n, heads, dk, 1, dtype=cd, device=v.device)
            if z_init is None
            else z_init.to(cd).permute(0, 2, 3, 1)
        )
        initial = torch.cat([kv, z], -1)
    o, final = run_linear(
        replace(run, initial_state=initial, output_final_state=True, out_dtype=cd), q, k, wide
    )
    assert final is not None
    dtypes = [base, q.dtype, k.dtype] + ([] if z_init is None else [z_init.dtype])
    o = (o[..., :dv] / (o[..., dv:] + 1e-10)).to(reduce(torch.promote_types, dtypes))
    z_dtype = k.dtype if z_init is None else torch.promote_types(k.dtype, z_init.dtype)
    z_state = final[..., dv].unsqueeze(1).to(z_dtype).contiguous()
    kv_final = final[..., :dv].contiguous() if run.output_final_state else None
    return o, (kv_final, z_state)
