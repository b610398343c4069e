#!/usr/bin/env bash
# Sanitizer pass of the CUDA CPU harness (issue 5): runs the kernel tests with the sanitizer
# runtime preloaded into Python. SimModule sees the loaded runtime and builds every kernel
# module with the matching -fsanitize flags (runtime/kernels/sim_module.py), so the tests run
# unchanged:
#   1. ASan + UBSan: tests/sim and tests/kernels (about 4x slower than plain).
#   2. TSan, on small shapes only (25-60x slower): tests/sim, and the kernel tests selected by
#      TSAN_KERNEL_TESTS (a pytest -k expression; default: none of tests/kernels).
# A sanitizer report aborts the process, so any report fails this script.
#   bash scripts/ci_sanitizers.sh
set -euo pipefail
cd "$(dirname "$0")/.."

# The real interpreter, not a pyenv shim: a preloaded TSan crashes shell-script shims.
PY="$(${PYTHON:-python3} -c 'import sys; print(sys.executable)')"
CXX="${CXX:-g++}"
LIBASAN="$($CXX -print-file-name=libasan.so)"
LIBTSAN="$($CXX -print-file-name=libtsan.so)"
KERNEL_TESTS=(tests/sim)
[ -d tests/kernels ] && KERNEL_TESTS+=(tests/kernels)

echo "--- ASan + UBSan: ${KERNEL_TESTS[*]}"
LD_PRELOAD="$LIBASAN" \
ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1" \
UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
  "$PY" -m pytest -q -p no:cacheprovider "${KERNEL_TESTS[@]}"

echo "--- TSan (small shapes): tests/sim${TSAN_KERNEL_TESTS:+ + tests/kernels -k $TSAN_KERNEL_TESTS}"
LD_PRELOAD="$LIBTSAN" \
TSAN_OPTIONS="halt_on_error=1:report_signal_unsafe=0" \
  "$PY" -m pytest -q -p no:cacheprovider tests/sim
if [ -n "${TSAN_KERNEL_TESTS:-}" ] && [ -d tests/kernels ]; then
  LD_PRELOAD="$LIBTSAN" \
  TSAN_OPTIONS="halt_on_error=1:report_signal_unsafe=0" \
    "$PY" -m pytest -q -p no:cacheprovider tests/kernels -k "$TSAN_KERNEL_TESTS"
fi
echo "--- sanitizers: clean"
