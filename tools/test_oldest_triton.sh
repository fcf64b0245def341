#!/usr/bin/env bash
# The Triton backend's tests with the oldest Triton parascan supports (3.2.0), in a
# virtual environment of its own that sees this environment's torch and parascan:
#
#   bash tools/test_oldest_triton.sh [VERSION]     # default: 3.2.0
#
# Runs every test that runs the Triton kernels in Triton's interpreter (pytest -k
# triton), except the compile-for-GPU tests, which use the newest Triton's compiler API
# (the test extra installs the newest). Triton's interpreter before 3.9 needs numpy < 2
# (3.3 and 3.5 fail with numpy 2.4: "only 0-dimensional arrays can be converted").
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-3.2.0}
venv=build/triton-$version
python -m venv --system-site-packages "$venv"
"$venv/bin/python" -m pip install --quiet "triton==$version" "numpy<2"
"$venv/bin/python" -c "import triton; print('triton', triton.__version__, triton.__file__)"
"$venv/bin/python" -m pytest -q -p no:cacheprovider -k "triton and not gpu_compile"
