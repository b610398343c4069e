#!/usr/bin/env bash
# Sanitizer pass of the CUDA CPU harness (issue 5): runs the kernel tests with the sanitizer
# runtime preloaded into Python. SimModule sees the loaded runtime and builds every kernel
# module with the matching -fsanitize flags (runtime/kernels/sim_module.py), so the tests run
# unchanged:
#   1. ASan + UBSan over tests/sim and tests/kernels (measured 1-3 min on 2 cores), under a
#      shuffled harness schedule (--sim-schedule-seed random: block and thread order drawn per test
#      afresh, the seed printed for a replay), so a race that index order hides can surface.
#   2. TSan over tests/sim and tests/kernels minus the tests selected away by TSAN_KERNEL_SKIP
#      (a pytest -k expression; default: the statistical sampling tests, which launch large
#      grids many times and take 2+ min alone under TSan, and the head_dim-256 attention cases,
#      ~40 s under TSan, which the ASan pass still runs). Measured 3-4 min on 2 cores.
# A sanitizer report aborts the process, so any report fails this script.
#   bash scripts/ci_sanitizers.sh
set -euo pipefail
cd "$(dirname "$0")/.."

# The real interpreter, not a pyenv shim: a preloaded TSan crashes shell-script shims.
PY="$(${PYTHON:-python3} -c 'import sys; print(sys.executable)')"
CXX="${CXX:-g++}"
LIBASAN="$($CXX -print-file-name=libasan.so)"
LIBTSAN="$($CXX -print-file-name=libtsan.so)"
TSAN_KERNEL_SKIP="${TSAN_KERNEL_SKIP:-draw_distribution or (attention and 256)}"
KERNEL_TESTS=(tests/sim)
[ -d tests/kernels ] && KERNEL_TESTS+=(tests/kernels)
# OpenBLAS's own thread pool (numpy, uninstrumented) shows up as false races under TSan.
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1

# -s in both runs: a sanitizer report ends the process at once; pytest's capture would
# swallow it.
echo "--- ASan + UBSan: ${KERNEL_TESTS[*]}"
LD_PRELOAD="$LIBASAN" \
ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1" \
UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
  "$PY" -m pytest -q -s -p no:cacheprovider "${KERNEL_TESTS[@]}" --sim-schedule-seed random

echo "--- TSan: ${KERNEL_TESTS[*]} (without: $TSAN_KERNEL_SKIP)"
LD_PRELOAD="$LIBTSAN" \
TSAN_OPTIONS="halt_on_error=1:report_signal_unsafe=0" \
  "$PY" -m pytest -q -s -p no:cacheprovider "${KERNEL_TESTS[@]}" -k "not ($TSAN_KERNEL_SKIP)"
echo "--- sanitizers: clean"
