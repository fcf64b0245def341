"""The decoding step shared by Mamba-1 and Mamba-2: ``selective_state_update``, one token
through the selective (or SSD) recurrence, in place on a cached state."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from parascan._core import (
    check_flag,
    check_in_place,
    check_shape,
    check_tensor,
    describe,
    eager_no_grad,
)
from parascan._native import arg_struct, kernel, kernel_library_error
from parascan.selective.api import _complex_of

__all__ = ["selective_state_update"]

Opt = Tensor | None

_UPDATE = "parascan.selective_state_update"


def selective_state_update(
    state: Tensor,
    x: Tensor,
    dt: Tensor,
    A: Tensor,
    B: Tensor,
    C: Tensor,
    D: Opt = None,
    z: Opt = None,
    dt_bias: Opt = None,
    dt_softplus: bool = False,
) -> Tensor:
    """One decoding step of the selective scan (or of the SSD scan): updates ``state``
    in place and returns the step's output, in ``x``'s dtype.

    Mamba-1 layout: ``state`` (batch, dim, N), ``x``, ``dt``, ``z`` (batch, dim), ``A``
    (dim, N), ``B``, ``C`` (batch, N) or (batch, G, N), ``D``, ``dt_bias`` (dim,).
    Multi-head layout: ``state`` (batch, heads, headdim, N), ``x``, ``dt``, ``z``
    (batch, heads, headdim), ``A`` (heads, headdim, N), ``B``, ``C`` (batch, G, N),
    ``D``, ``dt_bias`` (heads, headdim). Computed in float32 (float64 for a float64
    state); the new state is written in the state's dtype.
    """
    fn = _UPDATE
    dt_softplus = check_flag(fn, "dt_softplus", dt_softplus)
    state = check_tensor(fn, "state", state, complex_ok=True)
    if state.dim() not in (3, 4):
        raise ValueError(
            f"{fn}: expected state of shape (batch, dim, N) or (batch, heads, headdim, N), "
            f"but got {describe(state)}"
        )
    check_in_place(fn, "state", state)
    heads_layout = state.dim() == 4
    batch, n = state.shape[0], state.shape[-1]
    lead = tuple(state.shape[1:-1])  # (dim,) or (heads, headdim)
    what = "(dim,)" if not heads_layout else "(heads, headdim)"
    x = check_tensor(fn, "x", x)
    check_shape(fn, "x", x, (batch, *lead), f"(batch, *{what})")
    dt = check_tensor(fn, "dt", dt)
    check_shape(fn, "dt", dt, (batch, *lead), f"(batch, *{what})")
    A = check_tensor(fn, "A", A, complex_ok=True)
    check_shape(fn, "A", A, (*lead, n), f"({what[1:-1]}, N)".replace(",,", ","))
    if A.is_complex() != state.is_complex():
        raise TypeError(
            f"{fn}: expected a complex state with a complex A and a real one with a real A, "
            f"but got state {describe(state)} and A {describe(A)}"
        )
    units = lead[0]  # channels (Mamba-1) or heads: what the groups split
    mats = []
    for name, m in (("B", B), ("C", C)):
        m = check_tensor(fn, name, m, complex_ok=True)
        if m.is_complex() and not A.is_complex():
            raise TypeError(f"{fn}: expected a real {name} with a real A, but got {describe(m)}")
        if m.dim() == 2 and not heads_layout:
            check_shape(fn, name, m, (batch, n), "(batch, N)")
            m = m.unsqueeze(1)
        elif m.dim() == 3 and m.shape[1] >= 1 and units % m.shape[1] == 0:
            check_shape(fn, name, m, (batch, m.shape[1], n), "(batch, G, N)")
        else:
            raise ValueError(
                f"{fn}: expected {name} of shape (batch, N) or (batch, G, N) with G dividing "
                f"{units}, but got {describe(m)}"
            )
        mats.append(m)
    extras = {}
    for name, value, shape in (
        ("D", D, lead), ("z", z, (batch, *lead)), ("dt_bias", dt_bias, lead)
    ):  # fmt: skip
        if value is not None:
            t = check_tensor(fn, name, value)
            check_shape(fn, name, t, shape, "(batch, *" + what + ")" if name == "z" else what)
            extras[name] = t
    for name, t in (
        ("x", x),
        ("dt", dt),
        ("A", A),
        ("B", mats[0]),
        ("C", mats[1]),
        *extras.items(),
    ):
        if t.device != state.device:
            raise ValueError(
                f"{fn}: expected all tensors on one device, but state is on {state.device} and "
                f"{name} is on {t.device}"
            )

    cd = torch.float64 if state.dtype in (torch.float64, torch.complex128) else torch.float32
    tensors = (state, x, dt, A, *mats, *extras.values())
    if (
        state.device.type == "cpu"
        and state.dtype == cd
        and eager_no_grad(tensors)
        and not state.is_neg()  # written in place: never through a copy
        and state.numel() > 0  # an empty state: the torch ops (the kernel takes N >= 1)
        and kernel_library_error() is None  # built without the C kernels: the torch ops
    ):
        # the kernel writes the state while it reads the other operands: one that shares
        # the state's memory (B a view into it, say) is read from a copy, as the torch
        # ops read everything before writing (it read half-updated values before)
        def apart(t: Tensor) -> Tensor:
            same = t.untyped_storage().data_ptr() == state.untyped_storage().data_ptr()
            return t.clone() if same else t

        x, dt, A = apart(x), apart(dt), apart(A)
        mats = [apart(m) for m in mats]
        extras = {name: apart(t) for name, t in extras.items()}
        return _step_kernel(state, x, dt, A, mats, extras, dt_softplus, heads_layout)
    step = dt.to(cd)
    if "dt_bias" in extras:
        step = step + extras["dt_bias"].to(cd)
    if dt_softplus:
        step = F.softplus(step)
    a = A.to(_complex_of(cd) if A.is_complex() else cd)
    decay = torch.exp(step[..., None] * a)

    def per_unit(m: Tensor) -> Tensor:
        # (batch, G, N) -> a row per channel/head (a broadcast view when G = 1, the
        # decode step's common case: no copy), then a headdim axis in the multi-head
        # layout: (batch, *lead, N) or broadcastable to it
        m = m.to(_complex_of(cd) if m.is_complex() else cd)
        if m.shape[1] != 1:
            m = m.repeat_interleave(units // m.shape[1], dim=1)
        return m[:, :, None, :] if heads_layout else m

    b_row, c_row = per_unit(mats[0]), per_unit(mats[1])
    xc = x.to(cd)
    # a copy of the old state where autograd records: it keeps it for decay's gradient,
    # and copy_ below overwrites the state itself (decoding, under no_grad, copies nothing)
    old = state.to(decay.dtype, copy=torch.is_grad_enabled())
    new = torch.addcmul(decay * old, (step * xc)[..., None], b_row)
    y = (c_row * new).sum(-1)
    y = 2 * y.real if y.is_complex() else y
    if "D" in extras:
        y = torch.addcmul(y, extras["D"].to(cd), xc)
    if "z" in extras:
        y = y * F.silu(extras["z"].to(cd))
    state.copy_(new)
    return y.to(x.dtype)


def _step_kernel(
    state: Tensor, x: Tensor, dt: Tensor, A: Tensor, mats: list[Tensor],
    extras: dict[str, Tensor], softplus: bool, heads_layout: bool,
) -> Tensor:  # fmt: skip
    """The decoding step on the C kernel (selective/cpu_step.h), in place on a real
    float32 or float64 CPU state: every operand read through its own strides in the
    state's dtype (converted when it has another), Mamba-1's layout as heads of one
    row (a stride of 0 for the row: no views are made, this runs once per token and
    layer). The output in ``x``'s dtype."""
    cd = state.dtype
    keep = []  # converted operands, alive until the kernel has run

    def ptr(t: Tensor | None, row: int, ndim: int) -> tuple[int, ...]:
        """(pointer, strides) of ``t`` in ``cd``; Mamba-1's layout gets a row axis of
        stride 0 at ``row``; zeros for an absent operand of ``ndim`` dimensions."""
        if t is None:
            return (0,) * (1 + ndim)
        if t.dtype != cd or t.is_neg():
            t = t.to(cd).resolve_neg()
            keep.append(t)
        st = t.stride()
        if not heads_layout and row >= 0:
            st = (*st[:row], 0, *st[row:])
        return (t.data_ptr(), *st)

    batch, n = state.shape[0], state.shape[-1]
    heads, headdim = (state.shape[1], state.shape[2]) if heads_layout else (state.shape[1], 1)
    out = torch.empty((batch, heads, headdim), dtype=cd)
    args = arg_struct(
        "selective_step", batch=batch, heads=heads, headdim=headdim, nstate=n,
        B_groups=mats[0].shape[1], C_groups=mats[1].shape[1], state=ptr(state, 2, 4),
        x=ptr(x, 2, 3), dt=ptr(dt, 2, 3), A=ptr(A, 1, 3), B=ptr(mats[0], -1, 3),
        C=ptr(mats[1], -1, 3), D=ptr(extras.get("D"), 1, 2), z=ptr(extras.get("z"), 2, 3),
        dt_bias=ptr(extras.get("dt_bias"), 1, 2), out=ptr(out, -1, 3),
        softplus=int(softplus), nthreads=torch.get_num_threads(),
    )  # fmt: skip
    if kernel("selective_step", cd)(args) != 0:
        raise RuntimeError("parascan.selective_state_update: internal error: the step kernel "
                           "refused its operands")  # fmt: skip
    y = out if heads_layout else out.view(batch, heads)
    return y if x.dtype == cd else y.to(x.dtype)
