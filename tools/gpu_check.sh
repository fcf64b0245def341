#!/usr/bin/env bash
# The GPU check, for a machine with an NVIDIA GPU (CUDA): one command that proves and
# measures parascan there, writing what it found to one folder.
#
#   bash tools/gpu_check.sh [OUT]          # default OUT: gpu-report
#
#   OUT/device.json   the GPU, the versions, and the device's copy bandwidth measured
#                     in this run (the bandwidth limit the benchmark's ratios stand for)
#   OUT/check.txt     parascan check --device cuda: every backend against float64
#   OUT/pytest.txt    the test suite's CUDA leg: every test case run on CUDA tensors
#                     (conftest's `target` fixture adds one per CUDA backend, the
#                     compiled Triton kernels among them)
#   OUT/bench.json    parascan bench --device cuda --json: each case with the time of
#                     torch.add over the same bytes, measured beside it
#
# Each step has a time limit, so that the whole command ends within 10 minutes on one
# GPU; a step that fails or runs out of time is recorded and the next one still runs.
# Exits non-zero when any step failed. Needs `pip install -e ".[test,triton]"`.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-report}
mkdir -p "$out"
status=0

step() {  # step NAME SECONDS FILE COMMAND...: its stdout to FILE, stderr to FILE.stderr
    local name=$1 seconds=$2 file=$3
    shift 3
    echo "== $name (limit ${seconds} s) -> $file"
    timeout "$seconds" "$@" >"$file" 2>"$file.stderr"
    local rc=$?
    tail -n 3 "$file" "$file.stderr"
    if [ "$rc" -ne 0 ]; then
        echo "== $name: FAILED (exit $rc$([ "$rc" -eq 124 ] && echo ', out of time'))"
        status=1
    fi
}

step "device and copy bandwidth" 60 "$out/device.json" python - <<'EOF'
import json, platform
import torch
import parascan
from parascan.cli.timing import elapsed

if not torch.cuda.is_available():
    raise SystemExit("gpu_check.sh: torch sees no CUDA device")
x = torch.empty(2**28, dtype=torch.float32, device="cuda")  # 1 GiB
y = torch.empty_like(x)
y.copy_(x)
seconds = min(elapsed(lambda: y.copy_(x), 10, "cuda") for _ in range(5))
try:
    import triton
    triton_version = triton.__version__
except ImportError:
    triton_version = None
props = torch.cuda.get_device_properties(0)
print(json.dumps({
    "device": torch.cuda.get_device_name(0),
    "capability": list(torch.cuda.get_device_capability(0)),
    "memory_gib": round(props.total_memory / 2**30, 1),
    "copy_bandwidth_gb_s": round(2 * x.nbytes / seconds / 1e9, 1),
    "torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton_version,
    "parascan": parascan.__version__, "backends": parascan.backends("cuda"),
    "python": platform.python_version(),
}, indent=2))
EOF
step "parascan check --device cuda" 120 "$out/check.txt" \
    python -m parascan check --device cuda
# The compiled kernels, not the interpreter: conftest defaults TRITON_INTERPRET to 1.
step "the suite's CUDA leg" 300 "$out/pytest.txt" \
    env TRITON_INTERPRET=0 python -m pytest -q -p no:cacheprovider -k cuda
step "parascan bench --device cuda" 180 "$out/bench.json" \
    python -m parascan bench --device cuda --json

echo "== written to $out/ ($([ "$status" -eq 0 ] && echo 'all steps passed' || echo 'some steps FAILED'))"
exit "$status"
