"""The guard in front of every C entry (parascan._native.check_operands): the public
functions validate first, so these hand the backends' own entry points what no public
call can; each must raise, never read or write out of bounds."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch


def _guarded_calls() -> dict[str, Callable[[], Any]]:
    from parascan.delta_rule import cpu as delta_cpu
    from parascan.first_order import cpu
    from parascan.first_order.semiring import LINEAR, LOG
    from parascan.matrix import cpu as matrix_cpu
    from parascan.ssd import layer as ssd_layer

    a, b = torch.rand(4, 9, 5), torch.rand(4, 9, 5)
    neg = torch.complex(torch.zeros_like(a), -a).conj().imag  # a lazy negative view
    w, bias = torch.rand(2, 6, 3, 3), torch.rand(2, 6, 3)
    x, taps, y = torch.rand(2, 7, 6), torch.rand(6, 4), torch.rand(2, 7, 6)
    pieces, rstd = (
        (torch.rand(2, 7, 4), torch.rand(2, 7, 1), torch.rand(2, 7, 1)),
        torch.rand(2, 7, 2),
    )
    dq, dv, dbeta = torch.rand(1, 5, 2, 3), torch.rand(1, 5, 4, 6), torch.rand(1, 5, 4)
    return {
        "delta fwd: k shorter": lambda: delta_cpu.forward(
            dq, dq[:, :4], dv, dbeta, None, None, None
        ),
        "delta fwd: heads not dividing": lambda: delta_cpu.forward(
            dq, dq, dv[:, :, :3], dbeta[..., :3], None, None, None
        ),
        "delta fwd: g of another shape": lambda: delta_cpu.forward(
            dq, dq, dv, dbeta, torch.rand(1, 5, 4, 2), None, None
        ),
        "delta fwd: packed batch of two": lambda: delta_cpu.forward(
            *(t.expand(2, *t.shape[1:]) for t in (dq, dq, dv, dbeta)),
            None,
            None,
            torch.tensor([0, 5]),
        ),
        "delta bwd: checkpoints of another length": lambda: delta_cpu.backward(
            dq, dq, dv, dbeta, None, None, None, torch.rand(1, 2, 4, 3, 6), dv, dv[:0]
        ),
        "ssd conv fwd: weight of another dtype": lambda: ssd_layer.conv_forward(
            x, taps.double(), None, True, (4, 1, 1)
        ),
        "ssd conv fwd: pieces not the channels": lambda: ssd_layer.conv_forward(
            x, taps, None, True, (4, 1, 2)
        ),
        "ssd conv fwd: channels strided": lambda: ssd_layer.conv_forward(
            x.transpose(1, 2).contiguous().transpose(1, 2), taps, None, True, (4, 1, 1)
        ),
        "ssd conv bwd: grad_x shorter": lambda: ssd_layer.conv_backward(
            x, taps, None, True, pieces, x[:, :5]
        ),
        "ssd conv bwd: bias too long": lambda: ssd_layer.conv_backward(
            x, taps, torch.rand(7), True, pieces, torch.empty_like(x)
        ),
        "ssd norm fwd: z shorter": lambda: ssd_layer.norm_forward(
            y, y[:, :4], y[0, 0], 1e-6, 2, False
        ),
        "ssd norm fwd: groups not dividing": lambda: ssd_layer.norm_forward(
            y, y, y[0, 0], 1e-6, 4, False
        ),
        "ssd norm bwd: rstd of another batch": lambda: ssd_layer.norm_backward(
            y, y, y[0, 0], rstd[:1], y, False, torch.empty_like(y)
        ),
        "ssd norm bwd: grad_z of another dtype": lambda: ssd_layer.norm_backward(
            y, y, y[0, 0], rstd, y, False, torch.empty_like(y).double()
        ),
        "linear fwd: gates shorter": lambda: cpu.forward(LINEAR, a[:, :4], b, None, 1, False),
        "linear fwd: gates of another dtype": lambda: cpu.forward(
            LINEAR, a.half(), b, None, 1, False
        ),
        "linear fwd: initial too small": lambda: cpu.forward(LINEAR, a, b, a[:2, 0], 1, False),
        "linear fwd: negative view": lambda: cpu.forward(LINEAR, neg, b, None, 1, False),
        "linear fwd: dim out of range": lambda: cpu.forward(LINEAR, a, b, None, 3, False),
        "linear fwd: meta tokens": lambda: cpu.forward(LINEAR, a, b.to("meta"), None, 1, False),
        "linear bwd: grad shorter": lambda: cpu.backward(
            LINEAR, a, None, b, b[:, :3], None, 1, False
        ),
        "log fwd: tokens longer": lambda: cpu.forward(LOG, a, torch.rand(4, 10, 5), None, 1, False),
        "log bwd: conj view": lambda: cpu.backward(
            LOG, a.cdouble(), a.cdouble(), a.cdouble().conj(), a.cdouble(), None, 1, False
        ),
        "matrix: biases of another length": lambda: matrix_cpu.forward(w, bias[:, :5], None, False),
        "matrix: weights of another dtype": lambda: matrix_cpu.forward(
            w.double(), bias, None, False
        ),
    }


@pytest.mark.parametrize("what", list(_guarded_calls()))
def test_every_c_entry_checks_what_it_is_handed(what: str) -> None:
    with pytest.raises(RuntimeError, match=r"^parascan: internal error: the .* CPU kernel"):
        _guarded_calls()[what]()
