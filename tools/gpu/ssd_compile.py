"""The SSD scan's Triton kernels compiled for real NVIDIA GPUs on a machine without
one (run by test_ssd_triton.py in a process of its own, without the interpreter):
``python tools/gpu/ssd_compile.py [--full]`` prints one JSON line per (kernel,
configuration, target).

Each kernel is specialized exactly as the ``triton`` backend launches it for the
Mamba-2 shape of issue 18 at L 4096 (batch 2, 24 heads of 64, 1 group, N 64; the
arguments come from ``forward_launch`` / ``backward_launch`` on meta tensors, and
Triton's own specialization of each argument), compiled to PTX and a cubin for sm_80
and sm_90, and its registers and spills read from the bundled ``ptxas -v``, as
selective_compile.py does for the selective scan (whose helpers this reuses).

Default: the three kernels (the sequential forward, the dual form's forward, the
backward) in float32 with every option (D, z, an initial state), not packed, on both
targets. ``--full``: also float64, packed (not the dual form's), and no option.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":  # interpreted kernels cannot be compiled
    raise SystemExit("ssd_compile.py: run it without TRITON_INTERPRET=1")

import torch

sys.path.insert(0, str(Path(__file__).parent))

import triton
from selective_compile import TARGETS, _ptxas
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend
from triton.compiler import ASTSource

from parascan.selective.triton import Launch
from parascan.ssd import triton as backend
from parascan.ssd import triton_kernels as kernels

BATCH, LENGTH, HEADS, HEADDIM, GROUPS, STATES = 2, 4096, 24, 64, 1, 64

# (kernel, dtype, packed, every option)
Spec = tuple[str, str, bool, bool]


def _specs(full: bool) -> list[Spec]:
    if not full:
        return [(k, "float32", False, True) for k in ("forward", "chunked", "backward")]
    return [
        (k, d, packed, options)
        for k in ("forward", "backward")
        for d in ("float32", "float64")
        for packed in (False, True)
        for options in (True, False)
    ] + [
        ("chunked", d, False, options) for d in ("float32", "float64") for options in (True, False)
    ]


def launch(spec: Spec) -> Launch:
    """The launch the backend makes for ``spec``, on meta tensors."""
    kernel, dtype_name, packed, options = spec
    meta = dict(dtype=getattr(torch, dtype_name), device="meta")
    batch = 1 if packed else BATCH
    x = torch.empty(batch, LENGTH, HEADS, HEADDIM, **meta)  # type: ignore[arg-type]
    dt = torch.empty(batch, LENGTH, HEADS, **meta)  # type: ignore[arg-type]
    A = torch.empty(HEADS, **meta)  # type: ignore[arg-type]
    BC = torch.empty(batch, LENGTH, GROUPS, STATES, **meta)  # type: ignore[arg-type]
    D = torch.empty(HEADS, HEADDIM, **meta) if options else None  # type: ignore[arg-type]
    z = x if options else None
    cu = torch.empty(5, dtype=torch.int64, device="meta") if packed else None
    states = 4 if packed else BATCH
    state = torch.empty(states, HEADS, HEADDIM, STATES, **meta)  # type: ignore[arg-type]
    initial = state if options else None
    if kernel in ("forward", "chunked"):
        algorithm = "chunked" if kernel == "chunked" else "sequential"
        found, *_ = backend.forward_launch(x, dt, A, BC, BC, D, z, initial, cu, algorithm)
        return found
    n_chunks = -(-LENGTH // backend.plan(HEADDIM, STATES, x.dtype, True).chunk)
    checkpoints = torch.empty(batch, n_chunks, HEADS, HEADDIM, STATES, **meta)  # type: ignore[arg-type]
    found, *_ = backend.backward_launch(x, dt, A, BC, BC, D, z, initial, cu, checkpoints, x, state)
    return found


def _compile(spec: Spec, arch: str):  # type: ignore[no-untyped-def]
    found = launch(spec)
    fn = {
        "forward": kernels.forward_kernel,
        "chunked": kernels.chunked_forward_kernel,
        "backward": kernels.backward_kernel,
    }[spec[0]]
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


def describe(spec: Spec, arch: str) -> str:
    kernel, dtype, packed, options = spec
    c = launch(spec).constexprs
    return (
        f"ssd {kernel} {dtype} {'packed' if packed else 'batched'} "
        f"{'all options' if options else 'no options'} tile {c['BLOCK_P']}x{c['BLOCK_N']}"
        f"{'x' + str(c['BLOCK_T']) if 'BLOCK_T' in c else ''} {arch}"
    )


def _row(job: tuple[Spec, str]) -> dict[str, object]:
    import re

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
