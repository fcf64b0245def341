"""The selective scan's Triton kernels compiled for real NVIDIA GPUs on a machine
without one (run by test_selective_triton.py in a process of its own, without the
interpreter): ``python tools/gpu/selective_compile.py [--full]`` prints one JSON
line per (kernel, configuration, target).

Each kernel is specialized exactly as the ``triton`` backend launches it for a
realistic problem (batch 2, dim 2048, L 4096, N 16; the arguments come from
``forward_launch`` / ``backward_launch`` on meta tensors, and Triton's own
specialization of each argument: integers equal to 1 become constants, multiples of
16 and tensors are marked 16-divisible), compiled to PTX and a cubin for sm_80 and
sm_90 (``triton.compile(..., target=GPUTarget("cuda", arch, 32))``), and its
registers and spills read from the bundled ``ptxas -v``.

Default: both kernels in float32 with every option (D, z, delta_bias, softplus, an
initial state) and a variable B and C, on both targets. ``--full``: also float64,
invariant B and C, and no option.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":  # interpreted kernels cannot be compiled
    raise SystemExit("selective_compile.py: run it without TRITON_INTERPRET=1")

import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from parascan.selective import triton as backend
from parascan.selective import triton_kernels as kernels

TARGETS = {"sm_80": GPUTarget("cuda", 80, 32), "sm_90": GPUTarget("cuda", 90, 32)}
BATCH, DIM, LENGTH, STATES = 2, 2048, 4096, 16

# (kernel, dtype, variable B and C, every option)
Spec = tuple[str, str, bool, bool]


def _specs(full: bool) -> list[Spec]:
    if not full:
        return [(k, "float32", True, True) for k in ("forward", "backward")]
    return [
        (k, d, variable, options)
        for k in ("forward", "backward")
        for d in ("float32", "float64")
        for variable in (True, False)
        for options in (True, False)
    ]


def launch(spec: Spec) -> backend.Launch:
    """The launch the backend makes for ``spec``, on meta tensors."""
    kernel, dtype_name, variable, options = spec
    meta = dict(dtype=getattr(torch, dtype_name), device="meta")
    u = torch.empty(BATCH, DIM, LENGTH, **meta)  # type: ignore[arg-type]
    A = torch.empty(DIM, STATES, **meta)  # type: ignore[arg-type]
    BC = torch.empty(BATCH, 1, STATES, LENGTH, **meta) if variable else A  # type: ignore[arg-type]
    vector = torch.empty(DIM, **meta) if options else None  # type: ignore[arg-type]
    z = u if options else None
    state = torch.empty(BATCH, DIM, STATES, **meta)  # type: ignore[arg-type]
    if kernel == "forward":
        found, *_ = backend.forward_launch(
            u, u, A, BC, BC, vector, z, vector, state if options else None, options
        )
        return found
    n_chunks = -(-LENGTH // backend.plan(DIM, STATES, DIM, DIM, u.dtype, True).chunk)
    checkpoints = torch.empty(BATCH, DIM, n_chunks, STATES, **meta)  # type: ignore[arg-type]
    found, *_ = backend.backward_launch(
        u, u, A, BC, BC, vector, z, vector, options, checkpoints, u, state
    )
    return found


def _compile(spec: Spec, arch: str):  # type: ignore[no-untyped-def]
    found = launch(spec)
    fn = kernels.forward_kernel if spec[0] == "forward" else kernels.backward_kernel
    names = list(fn.arg_names)
    signature: dict[str, str] = {}
    constexprs: dict[str, object] = dict(found.constexprs)
    attrs = {}
    for i, value in enumerate(found.args):
        kind, attr = native_specialize_impl(BaseBackend, value, False, True, True)
        if kind == "constexpr":
            constexprs[names[i]] = attr
        elif attr == "D":
            attrs[(i,)] = BaseBackend.parse_attr(attr)
        signature[names[i]] = kind
    for name in names[len(found.args) :]:
        signature[name] = "constexpr"
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=TARGETS[arch], options=found.options())


def _ptxas(ptx: str, arch: int, tmp: Path) -> str:
    target = re.search(r"\.target\s+(\w+)", ptx).group(1)  # type: ignore[union-attr]
    path = tmp / "kernel.ptx"
    path.write_text(ptx)
    done = subprocess.run(
        [get_ptxas(arch).path, f"-arch={target}", "-v", "-o", str(tmp / "k.cubin"), path],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return done.stderr


def describe(spec: Spec, arch: str) -> str:
    kernel, dtype, variable, options = spec
    c = launch(spec).constexprs
    tile = f"{c['BLOCK_D']}x{c['BLOCK_N']}x{c['BLOCK_T']}"
    return (
        f"{kernel} {dtype} {'variable' if variable else 'invariant'} B/C "
        f"{'all options' if options else 'no options'} tile {tile} {arch}"
    )


def _row(job: tuple[Spec, str]) -> dict[str, object]:
    spec, arch = job
    row: dict[str, object] = {"what": describe(spec, arch), "arch": arch}
    try:
        compiled = _compile(spec, arch)
        with tempfile.TemporaryDirectory() as tmp:
            report = _ptxas(compiled.asm["ptx"], int(arch.removeprefix("sm_")), Path(tmp))
    except Exception as exc:  # reported, and failed, by the test
        return {**row, "error": f"{type(exc).__name__}: {exc}"}
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    registers = re.search(r"Used (\d+) registers", report)
    return {
        **row,
        "binary": "cubin" in compiled.asm,
        "registers": int(registers.group(1)) if registers else None,
        "spilled": sum(spills) if spills else None,
        "shared": compiled.metadata.shared,
        "warps": launch(spec).warps,
        "report": report,
    }


def main() -> None:
    full = "--full" in sys.argv
    jobs = [(spec, arch) for spec in _specs(full) for arch in TARGETS]
    with ProcessPoolExecutor(os.cpu_count() or 1) as pool:
        for row in pool.map(_row, jobs):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
