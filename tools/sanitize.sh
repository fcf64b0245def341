#!/usr/bin/env bash
# The C kernels built with AddressSanitizer and UBSan, under the differential fuzzer
# (tests/native/fuzz_kernels.py) against the float64 loops.
#
#   bash tools/sanitize.sh [SECONDS [SEED]]     # default: 240 s, a new seed (printed)
#
# Exits non-zero on any mismatch, any sanitizer report (out-of-bounds or
# use-after-free access, undefined behaviour: every check aborts at its first
# finding), or if the sanitized library was not the one the fuzzer loaded.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-240}
seed=${2:-}
out=build/sanitize
mkdir -p "$out"
lib="$PWD/$out/_kernels_sanitized.so"

# The flags of setup.py (minus -O3), plus the sanitizers; every .c file of the package
# is a kernel source.
export out
flags=(-std=c11 -O2 -g -fno-omit-frame-pointer -fsanitize=address,undefined
       -fno-sanitize-recover=all -ffp-contract=off -fno-trapping-math -fopenmp
       -fvisibility=hidden -Wno-psabi -fPIC -Isrc/parascan/_native)
mapfile -t sources < <(find src/parascan -name '*.c' | sort)
rm -f "$out"/*.o
# One compiler per source, as many at once as cores (each path is an argument, never code).
printf '%s\0' "${sources[@]}" | xargs -0 -P "$(nproc)" -n 1 \
    bash -c 'src=${!#}; gcc "${@:1:$#-1}" -c "$src" -o "$out/${src//\//_}.o"' bash \
    "${flags[@]}"
gcc -fsanitize=address,undefined -fopenmp -shared "$out"/*.o -o "$lib" -lm
echo "sanitize: built $lib from ${#sources[@]} sources"

rm -f "$out"/report.*
status=0
# The ASan runtime must come first in the process; libstdc++ beside it so that its
# interceptors find the C++ runtime torch uses. Python and torch leak by design at
# exit: leak detection is off; every report goes to $out/report.<pid>.
PARASCAN_KERNEL_LIBRARY="$lib" \
LD_PRELOAD="$(gcc -print-file-name=libasan.so) $(gcc -print-file-name=libstdc++.so)" \
ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:log_path=$PWD/$out/report" \
UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1:log_path=$PWD/$out/report" \
    python tests/native/fuzz_kernels.py --seconds "$seconds" ${seed:+--seed "$seed"} || status=$?
if compgen -G "$out/report.*" > /dev/null; then
    echo "sanitize: sanitizer reports:"
    cat "$out"/report.*
    status=1
fi
echo "sanitize: exit $status"
exit "$status"
