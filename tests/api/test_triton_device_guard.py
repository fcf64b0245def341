"""Triton launches its kernels on the current CUDA device, not on the tensors': every
Triton backend's entry point makes its tensors' device current (``on_their_device``),
so that tensors on cuda:1 while cuda:0 is current are not read from the wrong GPU.
Found by reading, not on a GPU: the one GPU parascan has run on had one device."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import parascan  # noqa: F401  (registers every op's row of the backend table)
from parascan._core import on_their_device, table


def test_every_triton_entry_point_is_guarded() -> None:
    rows = [row for row in table().values() if "triton" in row.backends]
    assert {row.op for row in rows} >= {
        "parascan.linear_scan", "parascan.log_linear_scan", "parascan.selective_scan",
        "parascan.ssd_scan",
    }  # fmt: skip
    for row in rows:
        entry = row.backends["triton"]
        for fn in (entry.forward, entry.backward):
            if fn is not None:
                assert getattr(fn, "on_their_device", False), (row.op, fn)


def test_the_guard_makes_the_first_tensors_device_current(monkeypatch) -> None:
    entered = []

    @contextmanager
    def device(d):  # type: ignore[no-untyped-def]
        entered.append(d)
        yield

    monkeypatch.setattr(torch.cuda, "device", device)
    seen = []

    @on_their_device
    def entry(name, x, y):  # type: ignore[no-untyped-def]
        seen.append((name, len(entered)))
        return x

    with FakeTensorMode():  # CUDA tensors' metadata, on a machine without CUDA
        x, y = torch.empty(3, device="cuda:1"), torch.empty(3, device="cuda:1")
    assert entry("ring", x, y) is x
    assert entered == [torch.device("cuda:1")] and seen == [("ring", 1)]
    cpu = torch.empty(3)
    assert entry("ring", cpu, cpu) is cpu and entered == [torch.device("cuda:1")]
    assert entry.__name__ == "entry"


if torch.cuda.device_count() >= 2:  # defined only where it can run (a skip fails the suite)

    def test_tensors_on_a_second_gpu_are_scanned_there() -> None:
        import parascan as ps

        a = torch.rand(4, 300, device="cuda:1") * 0.5 + 0.5
        b = torch.randn(4, 300, device="cuda:1")
        with torch.cuda.device(0):
            out = ps.linear_scan(a, b, -1, backend="triton")
        want = ps.linear_scan(a.double().cpu(), b.double().cpu(), -1, backend="torch")
        torch.testing.assert_close(out.cpu().double(), want, rtol=1e-5, atol=1e-5)
