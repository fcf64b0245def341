"""parascan's speed on a CUDA GPU, every figure a ratio to a limit measured in the same
run: ``python tools/gpu/gpu_bench.py [--quick] [--json FILE]`` on a machine with CUDA
(not collected by pytest; tools/gpu_check.sh runs it).

- First order (``linear_scan``, ``log_linear_scan``): forward and backward of the
  ``triton`` and ``torch`` backends at (8, 1536, 65536) and (8, 4096, 1536), each in
  both layouts (time the last dim, or time-major), against

  - ``add``: ``torch.add(a, b)`` allocating its output, the forward's three tensors
    (5/3 of it for the backward, which reads a, out, grad and writes two gradients);
  - ``copy``: a device-to-device copy over the same bytes (the copy bandwidth);
  - ``cumsum``: ``torch.cumsum(b, dim)``, the scan torch has, over the same layout.

  Results are compared first with the float64 ``torch`` backend on the GPU (the CPU
  suite proves that backend against the float64 loop): a wrong result gets no time.
- Selective scan (Mamba-1: variable B and C, D, z, delta_bias, softplus) against the
  exp limit (``torch.exp`` over batch * dim * L * N elements into a warm buffer) and
  the loop transformers' Mamba runs without CUDA kernels (bench_selective's
  ``reference_loop``, the same math), forward and forward + backward.

Times are per call over back-to-back calls timed by CUDA events (the median of 3
rounds, after a warm-up call), and for the first-order rows also per single call after
a synchronization (``ms_sync``: the host's time per call included, the first GPU run's
method). ``--dry`` runs the script on the
CPU on tiny shapes (the Triton kernels in its interpreter: TRITON_INTERPRET=1), to prove
the script itself before a GPU's time is spent on it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import parascan as ps
from parascan.cli.bench_selective import reference_loop
from parascan.cli.timing import event_back_to_back, event_median
from parascan.cli.tolerance import relative_error

DRY = "--dry" in sys.argv
DEVICE = "cpu" if DRY else "cuda"
FIRST_ORDER = [  # (name, shape, dim)
    ("T=65536 time last", (8, 1536, 65536), -1),
    ("T=65536 time-major", (8, 65536, 1536), 1),
    ("T=4096 time-major", (8, 4096, 1536), 1),
    ("T=4096 time last", (8, 1536, 4096), -1),
]
QUICK_FIRST_ORDER = [("T=4096 time-major", (8, 4096, 1536), 1)]
SELECTIVE = [(2, 1536, 4096, 16)]  # (batch, dim, L, N): a Mamba-130M layer's d_inner
if DRY:
    FIRST_ORDER = QUICK_FIRST_ORDER = [
        ("dry time last", (2, 5, 70), -1),
        ("dry major", (2, 70, 5), 1),
    ]
    SELECTIVE = [(1, 3, 20, 2)]


def cuda_time(fn: Callable[[], object], reps: int = 15, sync: bool = False) -> float:
    """Seconds per call of ``fn`` (CUDA events) after a warm-up call: over ``reps``
    back-to-back calls, the median of 3 rounds (the host's time hidden where the GPU is
    the slower side); with ``sync``, the median of ``reps`` single calls each after a
    synchronization (the host's time included: the first GPU run's method). With
    --dry, one call's wall time on the CPU."""
    if DRY:
        fn()
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start
    return event_median(fn, reps) if sync else event_back_to_back(fn, reps)


def copy_seconds(like: torch.Tensor, tensors: int) -> float:
    """A device-to-device copy moving ``tensors`` times ``like``'s bytes (read + write)."""
    src = torch.empty(like.numel() * like.element_size() // 4, dtype=torch.float32, device=DEVICE)
    dst = torch.empty_like(src)
    return cuda_time(lambda: dst.copy_(src)) * tensors / 2


def first_order(name: str, shape: tuple[int, ...], dim: int, op: str, dtype: torch.dtype,
                rows: list[dict[str, Any]]) -> None:  # fmt: skip
    gen = torch.Generator(DEVICE).manual_seed(0)
    a = 0.9 + 0.1 * torch.rand(shape, generator=gen, device=DEVICE)
    b = torch.rand(shape, generator=gen, device=DEVICE)
    g = torch.rand(shape, generator=gen, device=DEVICE)
    scan: Callable[..., torch.Tensor] = ps.linear_scan
    if op == "log":
        scan, a, b = ps.log_linear_scan, a.log(), b.log()
    a, b, g = a.to(dtype), b.to(dtype), g.to(dtype)

    # the float64 reference (torch backend, on the GPU), out and both gradients
    a64, b64 = (t.double().requires_grad_() for t in (a, b))
    out64 = scan(a64, b64, dim, backend="torch")
    want = [out64.detach(), *torch.autograd.grad(out64, (a64, b64), g.double())]
    del a64, b64, out64

    errors: dict[str, dict[str, float]] = {}
    for backend in ("triton", "torch"):  # checked first: a wrong result gets no time
        ar, br = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
        out = scan(ar, br, dim, backend=backend)
        got = [out.detach(), *torch.autograd.grad(out, (ar, br), g)]
        errors[backend] = {
            "forward": relative_error(got[0].double(), want[0]),
            "backward": max(
                relative_error(x.double(), w) for x, w in zip(got[1:], want[1:], strict=True)
            ),
        }
        del got, out, ar, br
    del want  # float64: 3 tensors of 6.4 GB at the largest shape
    torch.cuda.empty_cache()

    add = cuda_time(lambda: torch.add(a, b))
    copy = copy_seconds(a, 3)
    cumsum = cuda_time(lambda: torch.cumsum(b, dim))
    for backend in ("triton", "torch"):
        ar, br = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
        out = scan(ar, br, dim, backend=backend)
        tol = 1e-4 if dtype == torch.float32 else 3e-2
        times: dict[str, float | None] = {}
        for direction in ("forward", "backward"):
            if not errors[backend][direction] <= tol:
                times[direction] = None
                continue
            if direction == "forward":

                def fn(ar: torch.Tensor = ar, br: torch.Tensor = br, be: str = backend) -> object:
                    with torch.no_grad():
                        return scan(ar, br, dim, backend=be)
            else:

                def fn(out: torch.Tensor = out, ar: torch.Tensor = ar,
                       br: torch.Tensor = br) -> object:  # fmt: skip
                    return torch.autograd.grad(out, (ar, br), g, retain_graph=True)

            times[direction] = cuda_time(fn)
            times[direction + " sync"] = cuda_time(fn, sync=True)
        for direction in ("forward", "backward"):
            t = times[direction]
            scale = 1.0 if direction == "forward" else 5 / 3
            row = {
                "kind": "first_order", "case": name, "op": op, "shape": list(shape), "dim": dim,
                "dtype": str(dtype).removeprefix("torch."), "backend": backend,
                "direction": direction, "ms": None if t is None else t * 1e3,
                "ms_sync": None if t is None else times[direction + " sync"] * 1e3,
                "error": errors[backend][direction], "add_ms": add * scale * 1e3,
                "copy_ms": copy * scale * 1e3, "cumsum_ms": cumsum * 1e3,
                "x_add": None if t is None else t / (add * scale),
                "x_copy": None if t is None else t / (copy * scale),
                "x_cumsum": None if t is None else t / cumsum,
                "copy_fraction": None if t is None else copy * scale / t,
            }  # fmt: skip
            rows.append(row)
            print(
                f"{name:20s} {op:6s} {row['dtype']:9s} {backend:6s} {direction:8s} "
                + ("WRONG" if t is None else f"{t * 1e3:9.3f} ms  x add {row['x_add']:5.2f}  "
                   f"x copy {row['x_copy']:5.2f} ({100 * row['copy_fraction']:5.1f}% of copy "
                   f"bandwidth)  x cumsum {row['x_cumsum']:5.2f}  per call after a sync "
                   f"{row['ms_sync']:9.3f} ms")
                + f"  err {errors[backend][direction]:.1e}",
                flush=True,
            )  # fmt: skip
        del out, ar, br
    torch.cuda.empty_cache()


def selective(batch: int, dim: int, length: int, n: int, rows: list[dict[str, Any]],
              quick: bool) -> None:  # fmt: skip
    gen = torch.Generator(DEVICE).manual_seed(0)

    def rand(*shape: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=DEVICE) * scale + shift

    x = {
        "u": rand(batch, dim, length), "delta": rand(batch, dim, length, scale=0.5, shift=-3.0),
        "A": -torch.exp(rand(dim, n, scale=0.5)), "B": rand(batch, n, length),
        "C": rand(batch, n, length), "D": rand(dim), "z": rand(batch, dim, length),
        "delta_bias": rand(dim, scale=0.1),
    }  # fmt: skip
    weight = rand(batch, dim, length)

    def ours(backend: str) -> Callable[..., torch.Tensor]:
        def fn(**k: torch.Tensor) -> torch.Tensor:
            return ps.selective_scan(**k, delta_softplus=True, backend=backend)  # type: ignore[return-value]

        return fn

    impls = {"triton": ours("triton"), "torch": ours("torch"), "transformers loop": reference_loop}

    def train(fn: Callable[..., torch.Tensor]) -> list[torch.Tensor]:
        leaves = {k: v.detach().clone().requires_grad_() for k, v in x.items()}
        out = fn(**leaves)
        grads = torch.autograd.grad((out * weight).sum(), [leaves["u"], leaves["delta"]])
        return [out.detach(), *grads]

    # float64 reference: the torch backend in float64 on the GPU
    x64 = {k: v.double() for k, v in x.items()}
    leaves = {k: v.clone().requires_grad_() for k, v in x64.items()}
    out64 = ps.selective_scan(**leaves, delta_softplus=True, backend="torch")
    assert isinstance(out64, torch.Tensor)
    want = [out64.detach(), *torch.autograd.grad((out64 * weight.double()).sum(),
                                                  [leaves["u"], leaves["delta"]])]  # fmt: skip
    del x64, leaves, out64
    grid = torch.empty(batch * dim * length * n, device=DEVICE)
    exp_limit = cuda_time(lambda: torch.exp(grid, out=grid))
    for name, fn in impls.items():
        slow = name == "transformers loop"
        if slow and quick:
            continue
        got = train(fn)
        error = max(relative_error(g.double(), w) for g, w in zip(got, want, strict=True))
        del got
        reps = 3 if slow else 15
        forward = cuda_time(lambda fn=fn: fn(**x), reps) if error <= 1e-3 else None
        both = cuda_time(lambda fn=fn: train(fn), reps) if error <= 1e-3 else None
        for direction, t in (("forward", forward), ("forward+backward", both)):
            row = {
                "kind": "selective", "shape": [batch, dim, length, n], "impl": name,
                "direction": direction, "ms": None if t is None else t * 1e3, "error": error,
                "exp_limit_ms": exp_limit * 1e3,
                "x_exp": None if t is None else t / exp_limit,
            }  # fmt: skip
            rows.append(row)
            print(
                f"selective {(batch, dim, length, n)} {name:17s} {direction:16s} "
                + ("WRONG" if t is None else f"{t * 1e3:9.3f} ms  x exp limit {t / exp_limit:6.2f}")
                + f"  err {error:.1e}",
                flush=True,
            )  # fmt: skip
    loop = {r["direction"]: r["ms"] for r in rows if r.get("impl") == "transformers loop"}
    for row in rows:
        ours = row["kind"] == "selective" and row["impl"] != "transformers loop"
        if ours and loop.get(row["direction"]) and row["ms"]:
            row["loop_over_this"] = loop[row["direction"]] / row["ms"]
            print(f"selective {row['impl']} {row['direction']}: the loop takes "
                  f"{row['loop_over_this']:.1f}x its time")  # fmt: skip
    torch.cuda.empty_cache()


def main() -> None:
    if DRY and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("gpu_bench.py --dry: set TRITON_INTERPRET=1")
    if not DRY and not torch.cuda.is_available():
        raise SystemExit("gpu_bench.py: needs a CUDA device (or --dry)")
    quick = "--quick" in sys.argv
    rows: list[dict[str, Any]] = []
    name = "dry run on the CPU" if DRY else torch.cuda.get_device_name()
    print(f"{name}  torch {torch.__version__}", flush=True)
    for name, shape, dim in QUICK_FIRST_ORDER if quick else FIRST_ORDER:
        first_order(name, shape, dim, "linear", torch.float32, rows)
    if not quick:
        long, major = ((2, 5, 70), (2, 70, 5)) if DRY else ((8, 1536, 16384), (8, 4096, 1536))
        first_order("T=16384 time last", long, -1, "linear", torch.bfloat16, rows)
        first_order("T=16384 time last", long, -1, "log", torch.float32, rows)
        first_order("T=4096 time-major", major, 1, "log", torch.float32, rows)
    for shape in SELECTIVE:
        selective(*shape, rows, quick)
    if "--json" in sys.argv:
        with open(sys.argv[sys.argv.index("--json") + 1], "w") as f:
            json.dump(rows, f, indent=1)
    wrong = [r for r in rows if r["ms"] is None]
    if wrong:
        raise SystemExit(f"gpu_bench.py: {len(wrong)} results were wrong")


if __name__ == "__main__":
    main()
