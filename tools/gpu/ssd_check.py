"""The SSD scan's ``triton`` backend on a real GPU: ``python tools/gpu/ssd_check.py``
on a machine with CUDA (not collected by pytest: it needs a GPU, and the CPU suite
proves the kernels in Triton's interpreter and compiles them for sm_80/sm_90).

1. Validation: ``ps.ssd_scan(backend="triton")``, with each forward algorithm
   (``PARASCAN_SSD_TRITON_FORWARD``: "sequential", "chunked"), against the float64 loop
   (oracles.ssd_loop, on the CPU) on small shapes, and against the ``torch`` backend
   on the model shapes below: out, final and the gradients of every input, plain and
   packed (cu_seqlens with an empty sequence and boundaries next to the checkpoints).
2. Timing (CUDA events, the median of repetitions after a warm-up) of the forward
   and the forward + backward of both backends (triton with each forward algorithm:
   the faster is the one to make ``PARASCAN_SSD_TRITON_FORWARD``'s default), next to the HBM
   limit measured in the same run: the time a device-to-device copy takes to move
   the bytes the forward must move at least (read x, dt, B, C, z; write out), and 3.5x that for the
   forward + backward (the backward reads them again with grad_out and writes the
   gradients: about 2.5x the forward's bytes).

Exits non-zero when a comparison fails. ``--quick`` runs the validation only.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import torch

import parascan as ps
from parascan.cli.timing import event_median as cuda_time

sys.path.insert(0, str(Path(__file__).parents[1]))

from oracles import ssd_loop

# (batch, L, heads, headdim, groups, N): issue 18's model shape (24 heads of 64, state
# 64) at 512 and 4096 tokens, and a Mamba-2 2.7B layer (80 heads of 64, state 128)
# (shape, cu_seqlens) checked against the float64 loop
LOOP_CASES = [
    ((2, 130, 3, 5, 1, 4), None),
    ((1, 200, 4, 20, 2, 16), [0, 0, 63, 64, 65, 128, 200]),
]
DEVICE = "cuda"  # the smoke test in the CPU suite sets "cpu" (the interpreter)
SHAPES = [(1, 512, 24, 64, 1, 64), (1, 4096, 24, 64, 1, 64), (2, 2048, 80, 64, 1, 128)]


def problem(
    batch: int, length: int, heads: int, headdim: int, groups: int, n: int, *,
    dtype: torch.dtype = torch.float32, seed: int = 0,
) -> dict[str, torch.Tensor]:  # fmt: skip
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=DEVICE, dtype=dtype)

    return {
        "x": rand(batch, length, heads, headdim),
        "dt": rand(batch, length, heads) * 0.5 - 1.0,
        "A": -torch.rand(heads, generator=gen).to(device=DEVICE, dtype=dtype) * 4 - 0.1,
        "B": rand(batch, length, groups, n),
        "C": rand(batch, length, groups, n),
        "D": rand(heads),
        "z": rand(batch, length, heads, headdim),
        "dt_bias": rand(heads) * 0.1,
        "initial": rand(batch, heads, headdim, n) * 0.1,
    }


def run(
    p: dict[str, torch.Tensor], backend: str, cu: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    q = dict(p)
    if cu is not None:  # one initial state per packed sequence
        q["initial"] = q["initial"][:1].expand(cu.numel() - 1, -1, -1, -1).contiguous()
    out, final = ps.ssd_scan(
        q["x"], q["dt"], q["A"], q["B"], q["C"], D=q["D"], z=q["z"], dt_bias=q["dt_bias"],
        dt_softplus=True, initial=q["initial"], return_final=True, cu_seqlens=cu,
        backend=backend,
    )  # fmt: skip
    return out, final


def gradients(
    p: dict[str, torch.Tensor], backend: str, cu: torch.Tensor | None = None, seed: int = 1
) -> list[torch.Tensor]:
    leaves = {k: v.detach().clone().requires_grad_() for k, v in p.items()}
    out, final = run(leaves, backend, cu)
    gen = torch.Generator().manual_seed(seed)
    g_out = torch.randn(out.shape, generator=gen).to(out)
    g_final = torch.randn(final.shape, generator=gen).to(final)
    grads = torch.autograd.grad(
        (out * g_out).sum() + (final * g_final).sum(), list(leaves.values())
    )
    return [out.detach(), final.detach(), *grads]


NAMES = ["out", "final", "x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial"]


def compare(got: list[torch.Tensor], want: list[torch.Tensor], what: str, rtol: float) -> bool:
    ok = True
    for name, g, w in zip(NAMES, got, want, strict=True):
        w = w.to(device=g.device, dtype=torch.float64)
        err = (g.double() - w).abs().max().item() if w.numel() else 0.0
        scale = max(1.0, w.abs().max().item()) if w.numel() else 1.0
        good = math.isfinite(err) and err <= rtol * scale
        ok &= good
        verdict = "ok" if good else "FAIL"
        print(f"  {what:40s} {name:8s} max error {err:.2e} (scale {scale:.1e}) {verdict}")
    return ok


def validate() -> bool:
    ok = True
    for algorithm in ("sequential", "chunked"):  # the triton forward's two algorithms
        os.environ["PARASCAN_SSD_TRITON_FORWARD"] = algorithm
        print(f"triton, forward {algorithm}:")
        ok &= _validate()
    os.environ.pop("PARASCAN_SSD_TRITON_FORWARD")  # the default again
    return ok


def _validate() -> bool:
    ok = True
    # against the float64 loop on the CPU, small shapes
    for shape, cu in LOOP_CASES:
        p = problem(*shape)
        cu_t = None if cu is None else torch.tensor(cu, device=DEVICE)
        got = gradients(p, "triton", cu_t)
        wide = {k: v.detach().cpu().double().requires_grad_() for k, v in p.items()}
        initial = (
            wide["initial"] if cu is None else wide["initial"][:1].expand(len(cu) - 1, -1, -1, -1)
        )
        out, final = ssd_loop(
            wide["x"], wide["dt"], wide["A"], wide["B"], wide["C"], D=wide["D"], z=wide["z"],
            dt_bias=wide["dt_bias"], dt_softplus=True, initial=initial, cu_seqlens=cu,
        )  # fmt: skip
        gen = torch.Generator().manual_seed(1)
        g_out = torch.randn(out.shape, generator=gen).double()
        g_final = torch.randn(final.shape, generator=gen).double()
        loss = (out * g_out).sum() + (final * g_final).sum()
        want = [out, final, *torch.autograd.grad(loss, list(wide.values()))]
        ok &= compare(got, want, f"loop {shape} cu={cu}", 1e-3)
    # against the torch backend on the model shapes
    for shape in SHAPES[:2]:
        p = problem(*shape)
        ok &= compare(gradients(p, "triton"), gradients(p, "torch"), f"torch {shape}", 2e-3)
        length = shape[1]
        cu = torch.tensor(sorted([0, 64, 64, length // 2 + 1, length]), device=DEVICE)
        ok &= compare(
            gradients(p, "triton", cu), gradients(p, "torch", cu), f"torch {shape} packed", 2e-3
        )
    return ok


def hbm_seconds(nbytes: int) -> float:
    """The time a device-to-device copy takes to move ``nbytes`` (read + write), measured."""
    src = torch.empty(max(nbytes // 8, 1 << 20), dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    t = cuda_time(lambda: dst.copy_(src))
    return t * nbytes / (2 * src.numel() * 4)


def benchmark() -> None:
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}")
    for shape in SHAPES:
        batch, length, heads, headdim, groups, n = shape
        p = problem(*shape)
        leaves = {k: v.detach().clone().requires_grad_() for k, v in p.items()}
        io = 4 * batch * length * (3 * heads * headdim + heads + 2 * groups * n)
        limit = hbm_seconds(io)
        for backend, algorithm in (("triton", "sequential"), ("triton", "chunked"), ("torch", "")):
            os.environ["PARASCAN_SSD_TRITON_FORWARD"] = algorithm or "sequential"
            forward = cuda_time(lambda b=backend, q=p: run(q, b))

            def step(b: str = backend, q: dict[str, torch.Tensor] = leaves) -> None:
                out, final = run(q, b)
                (out.sum() + final.sum()).backward()

            both = cuda_time(step, reps=10)
            print(
                f"{shape} {backend:6s} {algorithm:10s} forward {forward * 1e3:8.3f} ms "
                f"({forward / limit:6.1f}x the HBM limit {limit * 1e6:.1f} us)  "
                f"forward+backward {both * 1e3:8.3f} ms "
                f"({both / (3.5 * limit):6.1f}x its limit)"
            )
        os.environ.pop("PARASCAN_SSD_TRITON_FORWARD")  # the default forward from here
        transformers_row(p)


def transformers_row(p: dict[str, torch.Tensor]) -> None:
    """transformers' torch fallback for Mamba-2's scan (``mamba2_chunk_scan``, chunk 128,
    Mamba2Config's default) against the triton backend's default forward on the same
    arguments (D, dt_bias, softplus; no z or initial state, which it does not take
    alike)."""
    from parascan.cli.bench_ssd import _TRANSFORMERS_CHUNK, _transformers_scan

    hf = _transformers_scan()
    if hf is None:
        print("  transformers' mamba2_chunk_scan: not in this transformers")
        return
    keys = ("x", "dt", "A", "B", "C", "D", "dt_bias")
    leaves = {k: p[k].detach().clone().requires_grad_() for k in keys}

    def ours(q: dict[str, torch.Tensor]) -> torch.Tensor:
        out = ps.ssd_scan(q["x"], q["dt"], q["A"], q["B"], q["C"], D=q["D"],
                          dt_bias=q["dt_bias"], dt_softplus=True, backend="triton")  # fmt: skip
        assert isinstance(out, torch.Tensor)
        return out

    def theirs(q: dict[str, torch.Tensor]) -> torch.Tensor:
        out = hf(q["x"], q["dt"], q["A"], q["B"], q["C"], chunk_size=_TRANSFORMERS_CHUNK,
                 D=q["D"], dt_bias=q["dt_bias"], dt_softplus=True)  # fmt: skip
        return out[0] if isinstance(out, tuple) else out

    with torch.no_grad():
        want, got = ours(p).double(), theirs(p).double()
    err = ((got - want).abs().max() / want.abs().max().clamp(min=1)).item()
    times = {}
    for name, fn in (("triton", ours), ("transformers", theirs)):
        forward = cuda_time(lambda fn=fn: fn(p))
        both = cuda_time(lambda fn=fn: fn(leaves).sum().backward(), reps=10)
        times[name] = (forward, both)
    (f0, b0), (f1, b1) = times["triton"], times["transformers"]
    print(
        f"  vs transformers' mamba2_chunk_scan (difference {err:.1e}): forward {f1 * 1e3:.3f} ms "
        f"= {f1 / f0:.1f}x triton's {f0 * 1e3:.3f} ms; forward+backward {b1 * 1e3:.3f} ms = "
        f"{b1 / b0:.1f}x triton's {b0 * 1e3:.3f} ms"
    )


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("ssd_check.py: needs a CUDA device")
    ok = validate()
    if "--quick" not in sys.argv:
        benchmark()
    if not ok:
        raise SystemExit("ssd_check.py: a comparison FAILED")
    print("all comparisons passed")


if __name__ == "__main__":
    main()
