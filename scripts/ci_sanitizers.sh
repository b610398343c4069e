#!/usr/bin/env bash
# Sanitizer pass of the CUDA CPU harness (issue 5): runs the kernel tests with the sanitizer
# runtime preloaded into Python. SimModule sees the loaded runtime and builds every kernel
# module with the matching -fsanitize flags (runtime/kernels/sim_module.py), so the tests run
# unchanged:
#   1. ASan + UBSan over tests/sim and tests/kernels minus SANITIZER_SKIP and the statistical
#      sampling tests (below), under a shuffled harness schedule (--sim-schedule-seed random:
#      block and thread order drawn per test afresh, the seed printed for a replay), so a race
#      that index order hides can surface.
#   2. TSan over tests/sim and tests/kernels minus the tests selected away by TSAN_KERNEL_SKIP
#      (a pytest -k expression; default: the statistical sampling tests, which launch large
#      grids many times and take 2+ min alone under TSan; the head_dim-256 attention cases and
#      their fp8-cache twins, ~40 s and ~150 s: the head_dim-64/128 cases run the same kernels'
#      barriers and shared-memory phases, only more of them per block; the K = 4096 tensor-core
#      GEMMs, ~40 s: the other shapes run the same pipeline stages, fewer times over; the
#      bf16 twins of the f16 cases -- the same kernel template with another 16-bit conversion,
#      so the same shared-memory traffic and barriers; and the fp8-cache numerics matrices
#      (TSAN_FP8_MATRIX: head size x GQA group x dtype of the fp8 decode and prefill, the
#      split/window mix and the bit-for-bit encode: 307 of the pass's 977 s in a --durations
#      profile on a busy Zen 3, module builds included that now happen in the next fp8 test):
#      the fp8 kernels stay under TSan through their pipeline-edge,
#      tensor-core, window/block-size and rotary tests, and their barriers and shared memory
#      are the f16/f32 attention kernels'; the ASan pass runs all of those), and SANITIZER_SKIP.
# SANITIZER_SKIP (both passes; tier 1 runs all of them plainly): the benchmark plumbing tests
# (…runs_on_the_harness: the same kernels as the kernel tests, at benchmark sizes), the CMake
# configure/build tests (host tools, no kernel), the harness's build-cache test (it rebuilds
# modules to see the cache keyed by content: host tooling, ~24 s a pass), and the exhaustive
# fp8 decode
# (test_decode_all_256_codes_exactly: every code through a long context, a numerics check;
# 235 s of ASan's 613 s for its f16 case alone; the other fp8 decode tests, its tensor-core
# twin test_decode_tc_all_256_codes_exactly included, keep that kernel under both). The
# statistical sampling tests (draw_distribution) launch large grids many times; ASan skips them
# too (the other sampling tests keep the kernels under it).
# What the passes spend their time on is running the tests: building every kernel module with
# sanitizer flags takes ~70 s of the ~10 min (measured 2026-12-07, the 15 files one by one).
# The two passes run side by side, one single-threaded process each. Each pass's output is
# printed when it ends.
# A sanitizer report aborts the process, so any report fails this script.
#   bash scripts/ci_sanitizers.sh
set -euo pipefail
cd "$(dirname "$0")/.."

# The real interpreter, not a pyenv shim: a preloaded TSan crashes shell-script shims.
PY="$(${PYTHON:-python3} -c 'import sys; print(sys.executable)')"
CXX="${CXX:-g++}"
LIBASAN="$($CXX -print-file-name=libasan.so)"
LIBTSAN="$($CXX -print-file-name=libtsan.so)"
SANITIZER_SKIP="runs_on_the_harness or cmake or test_decode_all_256_codes_exactly or test_builds_are_cached_by_content"
ASAN_KERNEL_SKIP="${ASAN_KERNEL_SKIP:-draw_distribution or $SANITIZER_SKIP}"
TSAN_FP8_MATRIX="test_decode_fp8_matches_numpy or test_prefill_fp8_matches_numpy or test_decode_fp8_split_and_window or test_encode_matches_numpy_bit_for_bit"
TSAN_KERNEL_SKIP="${TSAN_KERNEL_SKIP:-draw_distribution or (attention and 256) or (fp8 and 256) or $TSAN_FP8_MATRIX or (tensor_core_gemm and 4096) or bf16 or $SANITIZER_SKIP}"
KERNEL_TESTS=(tests/sim)
[ -d tests/kernels ] && KERNEL_TESTS+=(tests/kernels)
# OpenBLAS's own thread pool (numpy, uninstrumented) shows up as false races under TSan.
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1

# -s in both runs: a sanitizer report ends the process at once; pytest's capture would
# swallow it. Each pass writes its own log, printed whole when it ends.
logs="$(mktemp -d -t paged-run-sanitizers.XXXXXX)"
trap 'rm -rf "$logs"' EXIT

asan_pass() {
  LD_PRELOAD="$LIBASAN" \
  ASAN_OPTIONS="detect_leaks=0:abort_on_error=1:halt_on_error=1" \
  UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
    "$PY" -m pytest -q -s -p no:cacheprovider "${KERNEL_TESTS[@]}" --sim-schedule-seed random \
      -k "not ($ASAN_KERNEL_SKIP)"
}

tsan_pass() {
  LD_PRELOAD="$LIBTSAN" \
  TSAN_OPTIONS="halt_on_error=1:report_signal_unsafe=0" \
    "$PY" -m pytest -q -s -p no:cacheprovider "${KERNEL_TESTS[@]}" -k "not ($TSAN_KERNEL_SKIP)"
}

start=$(date +%s)
asan_pass > "$logs/asan.log" 2>&1 &
asan_pid=$!
tsan_pass > "$logs/tsan.log" 2>&1 &
tsan_pid=$!
asan_rc=0; tsan_rc=0
wait "$asan_pid" || asan_rc=$?
echo "--- ASan + UBSan: ${KERNEL_TESTS[*]} (without: $ASAN_KERNEL_SKIP; rc $asan_rc, $(( $(date +%s) - start )) s)"
cat "$logs/asan.log"
wait "$tsan_pid" || tsan_rc=$?
echo "--- TSan: ${KERNEL_TESTS[*]} (without: $TSAN_KERNEL_SKIP; rc $tsan_rc, $(( $(date +%s) - start )) s)"
cat "$logs/tsan.log"
if [ "$asan_rc" -ne 0 ] || [ "$tsan_rc" -ne 0 ]; then
  echo "--- sanitizers: FAILED (ASan+UBSan rc $asan_rc, TSan rc $tsan_rc)" >&2
  exit 1
fi
echo "--- sanitizers: clean"
