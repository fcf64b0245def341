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
#   OUT/gpu_bench.txt tools/gpu/gpu_bench.py (and .json): first-order forward and backward
#                     against the copy bandwidth, torch.add and torch.cumsum; the selective
#                     scan against its exp limit and transformers' loop
#   OUT/ssd_check.txt tools/gpu/ssd_check.py: the SSD kernels against the float64 loop and
#                     the torch backend, timed against the HBM limit and transformers
#   OUT/junit.xml     the CUDA leg's cases, one by one
#   OUT/failures.txt  the CUDA leg's failures and skips with their tracebacks, written as
#                     they happen (kept when the leg runs out of time)
#   OUT/bench.json    with GPU_CHECK_BENCH=1: parascan bench --device cuda --json, each
#                     case with the time of torch.add over the same bytes (3 more minutes:
#                     its float64 references run on the CPU)
#
# Each step has a time limit (device 30 s, check 240, speed 150, ssd 80, pytest 300: 800 s
# at worst, more than one 10-minute device call, so pick steps with GPU_CHECK_ONLY to fit
# one; on an H200 "device check pytest" took 372 s); a step that fails or runs out of
# time is recorded and the next one still runs.
# On an H200 with 16 cores the CUDA leg ran all its 4498 cases in 286 s on 14 workers
# (GPU_CHECK_PYTEST_S, default 300, gives it more where the other steps are left out);
# the check needs over a minute there while Triton's kernel cache is cold.
# GPU_CHECK_ONLY="check pytest" runs only the steps named (device, check, speed, ssd,
# pytest; bench with GPU_CHECK_BENCH=1). Exits non-zero when any step failed. Needs
# `pip install -e ".[test,triton]"` (the C kernels are not used on CUDA tensors). The suite's CUDA leg runs on
# max(1, cores - 2) pytest-xdist workers when pytest-xdist is installed.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu-report}
mkdir -p "$out"
status=0
# cuBLAS is deterministic (tests/conftest.py asks torch for deterministic algorithms)
# only with a fixed workspace; torch raises without one.
export CUBLAS_WORKSPACE_CONFIG=${CUBLAS_WORKSPACE_CONFIG:-:4096:8}
export PYTHONUNBUFFERED=1
py=${PYTHON:-$(command -v python3 || command -v python)}

step() {  # step KEY NAME SECONDS FILE COMMAND...: its stdout to FILE, stderr to FILE.stderr
    local key=$1 name=$2 seconds=$3 file=$4
    shift 4
    case " ${GPU_CHECK_ONLY:-$key} " in *" $key "*) ;; *) return 0 ;; esac
    echo "== $name (limit ${seconds} s) -> $file"
    # SIGINT first: pytest then still writes its summary and junit.xml
    timeout -s INT -k 15 "$seconds" "$@" >"$file" 2>"$file.stderr"
    local rc=$?
    tail -n 3 "$file" "$file.stderr"
    if [ "$rc" -ne 0 ]; then
        echo "== $name: FAILED (exit $rc$([ "$rc" -eq 124 ] && echo ', out of time'))"
        status=1
    fi
}

step device "device and copy bandwidth" 30 "$out/device.json" "$py" - <<'EOF'
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
step check "parascan check --device cuda" 240 "$out/check.txt" \
    "$py" -m parascan check --device cuda
step speed "first-order and selective speed" 150 "$out/gpu_bench.txt" \
    "$py" tools/gpu/gpu_bench.py --json "$out/gpu_bench.json"
step ssd "SSD check and speed" 80 "$out/ssd_check.txt" \
    env PYTHONPATH="tests${PYTHONPATH:+:$PYTHONPATH}" "$py" tools/gpu/ssd_check.py
# The compiled kernels, not the interpreter: conftest defaults TRITON_INTERPRET to 1.
workers=()
if "$py" -c "import xdist" 2>/dev/null; then
    workers=(-n "$(( $(nproc) > 3 ? $(nproc) - 2 : 1 ))")
fi
timeouts=()
if "$py" -c "import pytest_timeout" 2>/dev/null; then
    timeouts=(--timeout 120)
fi
step pytest "the suite's CUDA leg" "${GPU_CHECK_PYTEST_S:-300}" "$out/pytest.txt" \
    env TRITON_INTERPRET=0 PARASCAN_TEST_LOG="$out/failures.txt" "$py" -m pytest -v -rfE --tb=short --durations=25 \
    -p no:cacheprovider -k cuda \
    "${workers[@]}" "${timeouts[@]}" --junitxml "$out/junit.xml"
if [ "${GPU_CHECK_BENCH:-0}" != 0 ]; then
    step bench "parascan bench --device cuda" 180 "$out/bench.json" \
        "$py" -m parascan bench --device cuda --json
fi

echo "== written to $out/ ($([ "$status" -eq 0 ] && echo 'all steps passed' || echo 'some steps FAILED'))"
exit "$status"
