"""The Triton kernels compiled for real NVIDIA GPUs, on a machine without one
(run by test_triton_gpu_compile.py in a process of its own, without the interpreter:
``python tools/gpu/first_order_compile.py [--full]`` prints one JSON line per kernel and target).

Triton compiles a kernel for a named target (``triton.compile(ASTSource(...),
target=GPUTarget("cuda", arch, 32))``) to PTX and a cubin with no GPU present, and its
bundled ``ptxas -v`` reports the registers and spills of each entry function. Every
specialization the ``triton`` backend launches (pass mode, dtype, tile, direction,
initial state, one chunk or several) must compile for NVIDIA sm_80 and sm_90 and AMD gfx942 with no
register spills and within the target's shared memory; a failure names the kernel and
the figure. NVIDIA's figures come from ptxas -v (spills: bytes of local memory), AMD's
from the assembly's metadata (spills: VGPRs spilled and scratch bytes, both memory).

The default suite compiles every (mode, dtype, tile, kernel) with ``reverse``, an
initial state and several chunks (the code paths that add loads and index arithmetic),
as contiguous inputs launch it (see UNIT); ``pytest -m slow`` compiles them with packed
sequences too (``--packed``: more live values), and every combination of flags and the
strided specialization (every integer argument an int64, the widest Triton can pick).
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

if os.environ.get("TRITON_INTERPRET") == "1":  # interpreted kernels cannot be compiled
    raise SystemExit("first_order_compile.py: run it without TRITON_INTERPRET=1")

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from parascan.first_order import triton_kernels as kernels

# (mode, pointer dtype, complex): what run launches. The log modes take real inputs.
LINEAR_MODES = (kernels.LINEAR, kernels.LINEAR_BWD)
LOG_MODES = (kernels.LOG, kernels.LOG_BWD)
REAL = ("fp16", "bf16", "fp32", "fp64")
PASSES = [(m, p, False) for m in LINEAR_MODES + LOG_MODES for p in REAL] + [
    (m, p, True) for m in LINEAR_MODES for p in ("fp32", "fp64")
]
SUMMARY_PTRS = ("Mr_ptr", "Mi_ptr", "Fr_ptr", "Fi_ptr", "Rs_ptr", "Cr_ptr", "Ci_ptr")
INT32_PTRS = ("seq_ptr",)  # packed sequences: each step's sequence


TILES = {"time-major": kernels.TIME_MAJOR, "time-contiguous": kernels.TIME_CONTIGUOUS}
# Triton compiles an integer argument equal to 1 as the constant 1: contiguous inputs
# launch each tile with their unit strides (and, time-contiguous, INNER = 1) constant,
# which lets it vectorize the loads. The specs name that specialization "contiguous";
# "strided" compiles every integer as an int64 argument.
UNIT = {
    "time-major": ("sa2", "sb2", "sh2", "se2"),
    "time-contiguous": ("sa1", "sb1", "sh1", "se1", "INNER"),
}
Spec = tuple[str, int, str, bool, str, dict[str, bool]]


def _specializations(full: bool, packed: bool = False) -> list[Spec]:
    """Every specialization (``full``), or each (mode, dtype, tile, kernel) once with
    reverse, an initial state and several chunks, unpacked or ``packed``."""
    both = (False, True) if full else (True,)
    pack = (False, True) if full else (packed,)
    contiguity = ("contiguous", "strided") if full else ("contiguous",)
    flags = {
        "_summaries": [
            {"REVERSE": r, "HAS_INIT": h, "PACKED": p} for r in both for h in both for p in pack
        ],
        "_carries": [{"HAS_INIT": h, "PACKED": p} for h in both for p in pack],
        "_apply": [
            {"REVERSE": r, "HAS_INIT": h, "SINGLE": one, "PACKED": p}
            for r in both
            for h in both
            for one in ((False, True) if full else (False,))
            for p in pack
        ],
    }
    return [
        (name, mode, ptr, is_complex, tile, f)
        for mode, ptr, is_complex in PASSES
        for tile in (f"{t} {c}" for t in TILES for c in contiguity)
        for name, options in flags.items()
        for f in options
    ]


# name -> Triton's target: NVIDIA A100 and H100, AMD MI300 (wave size 64)
TARGETS = {
    "sm_80": GPUTarget("cuda", 80, 32),
    "sm_90": GPUTarget("cuda", 90, 32),
    "gfx942": GPUTarget("hip", "gfx942", 64),
}


def _compile(spec: Spec, arch: str):
    name, mode, ptr, is_complex, tile, flags = spec
    layout, contiguity = tile.split()
    fn = getattr(kernels, name)
    acc = "fp64" if ptr == "fp64" else "fp32"
    params = inspect.signature(fn.fn).parameters
    unit = UNIT[layout] if contiguity == "contiguous" else ()
    constexprs = {
        "MODE": mode,
        "IS_COMPLEX": is_complex,
        "ACC": tl.float64 if acc == "fp64" else tl.float32,
        "BLOCK_C": TILES[layout].channels,
        **({"BLOCK_T": TILES[layout].steps} if "BLOCK_T" in params else {}),
        **{p: 1 for p in unit if p in params},
        **flags,
    }
    signature = {}
    for param in params:
        if param in constexprs:
            signature[param] = "constexpr"
        elif param in INT32_PTRS:
            signature[param] = "*i32"
        elif param.endswith("_ptr"):
            signature[param] = f"*{acc}" if param in SUMMARY_PTRS else f"*{ptr}"
        else:
            signature[param] = "i64"
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=TARGETS[arch])


def _ptxas_report(ptx: str, arch: int, tmp: Path) -> str:
    target = re.search(r"\.target\s+(\w+)", ptx).group(1)  # sm_90a for arch 90
    path = tmp / "kernel.ptx"
    path.write_text(ptx)
    done = subprocess.run(
        [get_ptxas(arch).path, f"-arch={target}", "-v", "-o", str(tmp / "kernel.cubin"), path],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    return done.stderr


def _nvidia_figures(compiled, arch: str, tmp: Path) -> dict:
    report = _ptxas_report(compiled.asm["ptx"], int(arch.removeprefix("sm_")), tmp)
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", report)]
    registers = re.search(r"Used (\d+) registers", report)
    return {
        "binary": "cubin" in compiled.asm,
        "registers": int(registers.group(1)) if registers else None,
        "spilled": sum(spills) if spills else None,
        "report": report,
    }


def _amd_figures(compiled) -> dict:
    # The AMDGPU assembly's own metadata: VGPRs, and what spills to memory (spilled VGPRs
    # and scratch bytes). SGPRs spilled into VGPR lanes never leave the register file
    # (the fp64 log scans do that, a few SGPRs): reported, not counted as spills.
    asm = compiled.asm["amdgcn"]
    vgprs = re.search(r"; NumVgprs: (\d+)", asm)
    vgpr_spills = [int(x) for x in re.findall(r"\.vgpr_spill_count: (\d+)", asm)]
    sgpr_spills = [int(x) for x in re.findall(r"\.sgpr_spill_count: (\d+)", asm)]
    scratch = re.search(r"; ScratchSize: (\d+)", asm)
    return {
        "binary": "hsaco" in compiled.asm,
        "registers": int(vgprs.group(1)) if vgprs else None,
        "spilled": sum(vgpr_spills) + int(scratch.group(1)) if vgpr_spills and scratch else None,
        "sgprs_in_vgpr_lanes": sum(sgpr_spills),
        "report": "\n".join(re.findall(r"^.*(?:Vgprs|Sgprs|Scratch|spill).*$", asm, re.M)),
    }


def describe(spec: Spec, arch: str) -> str:
    name, mode, ptr, is_complex, tile, flags = spec
    return f"{name} MODE={mode} {ptr}{' complex' if is_complex else ''} {tile} {flags} {arch}"


def figures(spec: Spec, arch: str, tmp: Path) -> dict:
    """What the compiled kernel uses: shared memory, registers, spills (bytes on
    NVIDIA; registers plus scratch bytes on AMD), or why it did not compile."""
    try:
        compiled = _compile(spec, arch)
        found = _amd_figures(compiled) if arch == "gfx942" else _nvidia_figures(compiled, arch, tmp)
    except Exception as exc:  # reported, and failed, by the test
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"shared": compiled.metadata.shared, **found}


def _row(job: tuple[Spec, str]) -> dict:
    spec, arch = job
    with tempfile.TemporaryDirectory() as tmp:
        return {"what": describe(spec, arch), "arch": arch, **figures(spec, arch, Path(tmp))}


def main() -> None:
    full, packed = "--full" in sys.argv, "--packed" in sys.argv
    jobs = [(spec, arch) for spec in _specializations(full, packed) for arch in TARGETS]
    # one compiler process per core: each compile takes about 0.2 s of one core
    with ProcessPoolExecutor(os.cpu_count() or 1) as pool:
        for row in pool.map(_row, jobs, chunksize=8):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
