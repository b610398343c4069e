#!/usr/bin/env bash
# tests/gpu/run_all.sh -- every check that needs a GPU, in one call of the device tool (a lease
# is 15 minutes of device time, the machine's start included; this script stops itself at 8).
# Everything that needs no GPU is done beforehand on the CPU box: scripts/prepare_gpu_carry.sh
# builds the cp312 wheel (Cython modules + nvcc fatbins) and carry.json into .gpu_carry/, and CI
# runs the compile gates and CMake. Here, on the device, nothing is compiled but what NVRTC
# compiles at run time, and nothing is fetched (PIP_NO_INDEX=1). docs/gpu_check.md has the exact
# device call, its carry list, and what to do with what comes back.
#
# Steps, in this order, each under its own `timeout` (pytest ones also under pytest-timeout per
# test, where installed), each run even when an earlier one failed:
#   install         the carried wheels (paged-run cp312, pyzmq) with --no-deps --no-index into
#                   /tmp/gpu_check_site (on PYTHONPATH; the image's venv is not touched), after
#                   checking carry.json against this tree (a stale carry fails the step). With
#                   only .gpu_carry/prebuilt/ (prepare_gpu_carry.sh --fatbins-only): a Cython-only
#                   build here, no nvcc. On sim: reports the package installed here.
#   probe           driver, CuPy, CUDA runtime, NVRTC, NCCL, device name / arch, and per kernel
#                   source: prebuilt fatbin or NVRTC (tests/gpu/gpu_check_probe.py)
#   twins           the PTX twins, before any long kernel work: tests/gpu/test_ptx_twins.py on
#                   cuda, tests/sim/test_twins.py on sim
#   kernels         tests/kernels with PAGEDRUN_TEST_BACKEND=<device>, one pytest run (xdist,
#                   a file per worker; a hung test ends its worker, not the run), per-file results
#   bench_gemm      benchmarks/kernels/bench_gemm.py: TFLOP/s vs cupy.matmul, GB/s vs copy
#   bench_attention benchmarks/kernels/bench_attention.py
#   engine          the engine on a tiny model, decode graphs on and off, async scheduling, bf16:
#                   tests/gpu/test_cuda_backend.py (tests/engine/test_sim_backend.py on sim)
#   engine_bench    benchmarks/kernels/bench_model.py --layers 8: tokens/s, graphs off / on
#   tp              tests/distributed/gpu_tp_check.py: TP=1 through NCCL vs the plain runner
#
# Output, in --out DIR (default $OUT, else a new temporary folder), exactly two files, rewritten
# after every step so a call cut off at its limit still returns the steps that ended:
#   summary.md        the step table (status, seconds, limit, H100 estimate, result), the
#                     per-file kernel results and the failures; record it in benchmarks/RESULTS.md
#   gpu_check.tar.gz  gpu_check/: summary.md, summary.json, steps.tsv, logs/NN_<step>.log (the
#                     bench tables are their logs), junit/<step>.xml, probe.json, carry.json
# tests/gpu/gpu_check_layout.py checks that layout (CI and tests/gpu/test_gpu_check_layout.py).
#
#   bash tests/gpu/run_all.sh                        # on the device (docs/gpu_check.md)
#   bash tests/gpu/run_all.sh --device sim           # full rehearsal on the CPU harness (1-2
#                                                    # min on 2 cores)
#   bash tests/gpu/run_all.sh --device sim --quick   # CI's rehearsal: the first test of each
#                                                    # file, bench_model at 1 layer (~30 s)
#   --budget S      whole-run seconds (default 480): a step gets min(its limit, what is left);
#                   none starts with under 20 s left (recorded as skipped)
#   --dry-run       every step's command replaced by ${GPU_CHECK_DRY_RUN_CMD:-true} (STEP set),
#                   for the layout test; --step-limit S overrides every step's limit
# The exit status is 1 when any step failed, timed out or was skipped.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONUNBUFFERED=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1

DEVICE=cuda
OUT_DIR="${OUT:-}"
BUDGET=480
MODE=full
DRY_RUN=0
STEP_LIMIT=""
PY="${PYTHON:-python3}"
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --out) OUT_DIR="$2"; shift 2 ;;
    --budget) BUDGET="$2"; shift 2 ;;
    --quick) MODE=quick; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    --step-limit) STEP_LIMIT="$2"; shift 2 ;;
    *) echo "run_all.sh: unknown argument $1 (use --device cuda|sim, --out DIR, --budget S," \
            "--quick, --dry-run, --step-limit S)" >&2; exit 2 ;;
  esac
done
case "$DEVICE" in cuda|sim) ;; *) echo "run_all.sh: --device must be cuda or sim" >&2; exit 2 ;; esac
[ "$DRY_RUN" = 1 ] && MODE="$MODE-dry-run"
[ -z "$OUT_DIR" ] && OUT_DIR="$(mktemp -d -t gpu-check-out.XXXXXX)"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
rm -f "$OUT_DIR/summary.md" "$OUT_DIR/gpu_check.tar.gz"

# The run's files; packed into $OUT_DIR/gpu_check.tar.gz after every step.
WORK_PARENT="$(mktemp -d -t gpu-check.XXXXXX)"
trap 'rm -rf "$WORK_PARENT"' EXIT
WORK="$WORK_PARENT/gpu_check"
mkdir -p "$WORK/logs" "$WORK/junit"
: > "$WORK/steps.tsv"
[ -f .gpu_carry/carry.json ] && cp .gpu_carry/carry.json "$WORK/"
# The carried wheels go here, ahead of the image's venv on the path, which stays as it was.
SITE=/tmp/gpu_check_site
if [ "$DEVICE" = cuda ]; then export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"; fi
# The kernel tests' only backend switch (tests/kernels/paged_kernel_inputs.py).
export PAGEDRUN_TEST_BACKEND="$DEVICE"
# A step is not started with less than this left of the budget: it could not end in time.
MIN_STEP_S=20
DEADLINE=$((SECONDS + BUDGET))
STEP_NO=0
FAILED=()

pack() {  # pack STATE: summary.md + gpu_check.tar.gz in OUT_DIR, each replaced whole
  "$PY" tests/gpu/gpu_check_summary.py "$WORK" --device "$DEVICE" --mode "$MODE" \
    --budget "$BUDGET" --state "$1" || echo "run_all.sh: the summary failed (logs still packed)"
  tar -czf "$OUT_DIR/gpu_check.tar.gz.part" -C "$WORK_PARENT" gpu_check \
    && mv -f "$OUT_DIR/gpu_check.tar.gz.part" "$OUT_DIR/gpu_check.tar.gz"
  if [ -f "$WORK/summary.md" ]; then
    cp "$WORK/summary.md" "$OUT_DIR/summary.md.part" && mv -f "$OUT_DIR/summary.md.part" \
      "$OUT_DIR/summary.md"
  fi
}

run_step() {  # run_step NAME LIMIT_S H100_ESTIMATE_S COMMAND...
  local name="$1" limit="$2" estimate="$3"; shift 3
  STEP_NO=$((STEP_NO + 1))
  local log left=$((DEADLINE - SECONDS)) start=$SECONDS rc status=pass
  log="$WORK/logs/$(printf %02d "$STEP_NO")_$name.log"
  [ -n "$STEP_LIMIT" ] && limit="$STEP_LIMIT"
  if [ "$left" -lt "$MIN_STEP_S" ]; then
    echo "== SKIP $name: ${left} s of the ${BUDGET} s budget left" | tee "$log"
    printf '%s\tskipped\t0\t%s\t%s\t-1\n' "$name" "$limit" "$estimate" >> "$WORK/steps.tsv"
    FAILED+=("$name")
    pack running
    return
  fi
  [ "$limit" -gt "$left" ] && limit="$left"
  echo "== $name (limit ${limit} s, H100 estimate ${estimate} s): $*" | tee "$log"
  if [ "$DRY_RUN" = 1 ]; then
    set -- env STEP="$name" bash -c "${GPU_CHECK_DRY_RUN_CMD:-true}"
  elif declare -F "$1" >/dev/null; then
    # `timeout` runs programs, not shell functions: a function step runs in a child bash that
    # inherits it (export -f below).
    set -- bash -c '"$@"' _ "$@"
  fi
  # timeout signals the whole process group: pytest-xdist's workers end with the step.
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    status=timeout
  elif [ "$rc" -ne 0 ]; then
    status=fail
  fi
  printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - start))" "$limit" \
    "$estimate" "$rc" >> "$WORK/steps.tsv"
  if [ "$status" = pass ]; then
    echo "== PASS $name ($((SECONDS - start)) s)"
  else
    echo "== ${status^^} $name (exit $rc, $((SECONDS - start)) s)"
    FAILED+=("$name")
  fi
  pack running
}

install_step() {
  if [ "$DEVICE" = sim ]; then
    echo "sim: the check runs the paged-run installed here; nothing is installed"
    if [ -f .gpu_carry/carry.json ]; then
      "$PY" tests/gpu/gpu_carry_manifest.py check .gpu_carry/carry.json \
        || echo "(on sim a stale carry is only reported: it matters on the device)"
    fi
    (cd / && "$PY" -c "import pagedrun, pagedrun.pyx.scheduler; print('pagedrun from',
      pagedrun.__file__)")
    return
  fi
  if [ ! -f .gpu_carry/carry.json ]; then
    echo "no .gpu_carry/carry.json: run bash scripts/prepare_gpu_carry.sh on the CPU box and" \
         "name .gpu_carry in the call's carry (docs/gpu_check.md)"
    return 1
  fi
  local stale=0
  "$PY" tests/gpu/gpu_carry_manifest.py check .gpu_carry/carry.json || stale=1
  rm -rf "$SITE"
  local pip=("$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE")
  if compgen -G ".gpu_carry/paged_run-*.whl" >/dev/null; then
    "${pip[@]}" .gpu_carry/*.whl || return 1
  else
    [ -d .gpu_carry/prebuilt ] || { echo "no wheel and no prebuilt/ in .gpu_carry"; return 1; }
    echo "no carried paged-run wheel: the Cython modules are built here (no nvcc), the carried" \
         "fatbins copied in"
    if compgen -G ".gpu_carry/*.whl" >/dev/null; then "${pip[@]}" .gpu_carry/*.whl || return 1; fi
    PAGEDRUN_BUILD_FATBINS=OFF "${pip[@]}" --no-build-isolation \
      --config-settings=build-dir=/tmp/gpu_check_build . || return 1
    mkdir -p "$SITE/pagedrun/cuda/prebuilt"
    cp .gpu_carry/prebuilt/* "$SITE/pagedrun/cuda/prebuilt/"
  fi
  (cd / && "$PY" - <<'PYEOF'
import importlib, pkgutil
import pagedrun, pagedrun.pyx
mods = [m.name for m in pkgutil.iter_modules(pagedrun.pyx.__path__)]
for name in mods:
    importlib.import_module(f"pagedrun.pyx.{name}")
print(f"installed: pagedrun from {pagedrun.__file__}; {len(mods)} Cython modules import")
PYEOF
  ) || return 1
  if [ "$stale" = 1 ]; then
    # The steps still run (the lease is spent either way); this line is the step's result.
    echo "installed, but the carry is STALE (files above): the wheel is not this tree's"
    return 1
  fi
}

pytest_step() {  # pytest_step NAME PER_TEST_TIMEOUT_S PYTEST_ARGS...
  local name="$1" per_test="$2"; shift 2
  local args=(-q -p no:cacheprovider -rfE -o junit_family=xunit1
              "--junitxml=$WORK/junit/$name.xml")
  if "$PY" -c "import pytest_timeout" 2>/dev/null; then
    # thread: a test stuck inside a CUDA call never returns to Python, so a signal cannot end
    # it; this method dumps every stack and ends the process (xdist starts a new worker).
    args+=("--timeout=$per_test" --timeout-method=thread)
  else
    echo "pytest-timeout is not installed: no per-test limit (the step's limit still holds)"
  fi
  if [[ "$MODE" == quick* ]]; then
    args+=(-p gpu_check_quick)
    export PYTHONPATH="$PWD/tests/gpu${PYTHONPATH:+:$PYTHONPATH}"
  fi
  "$PY" -m pytest "${args[@]}" "$@"
}

export PY DEVICE MODE WORK SITE
export -f install_step pytest_step

if [ "$DEVICE" = cuda ]; then
  TWINS=tests/gpu/test_ptx_twins.py
  ENGINE=tests/gpu/test_cuda_backend.py
  # One GPU, 16 cores: four test processes keep it busy without crowding its memory.
  XDIST=(-n 4 --dist loadfile)
else
  TWINS=tests/sim/test_twins.py
  ENGINE=tests/engine/test_sim_backend.py
  XDIST=(-n auto --dist loadfile)
fi
# The quick rehearsal runs 21 tests in the kernels step: workers would cost more than they save.
if [[ "$MODE" == quick* ]] || ! "$PY" -c "import xdist" 2>/dev/null; then XDIST=(); fi
LAYERS=8
[[ "$MODE" == quick* ]] && LAYERS=1

echo "run_all.sh: --device $DEVICE, $MODE, budget $BUDGET s, output in $OUT_DIR"
run_step install 180 10 install_step
run_step probe 60 5 "$PY" tests/gpu/gpu_check_probe.py --device "$DEVICE" \
  --json "$WORK/probe.json"
run_step twins 90 20 pytest_step twins 60 "$TWINS"
run_step kernels 240 90 pytest_step kernels 90 "${XDIST[@]}" tests/kernels
run_step bench_gemm 150 60 "$PY" benchmarks/kernels/bench_gemm.py --device "$DEVICE"
run_step bench_attention 90 30 "$PY" benchmarks/kernels/bench_attention.py --device "$DEVICE"
run_step engine 150 40 pytest_step engine 120 "$ENGINE"
run_step engine_bench 180 90 "$PY" benchmarks/kernels/bench_model.py --device "$DEVICE" \
  --layers "$LAYERS" --graphs both
run_step tp 90 15 "$PY" tests/distributed/gpu_tp_check.py --device "$DEVICE"

pack finished
echo
cat "$OUT_DIR/summary.md"
echo
echo "run_all.sh: $(ls "$OUT_DIR" | tr '\n' ' ')in $OUT_DIR"
if [ "${#FAILED[@]}" -gt 0 ]; then
  echo "run_all.sh ($DEVICE, $MODE): FAILED steps: ${FAILED[*]}"
  exit 1
fi
echo "run_all.sh ($DEVICE, $MODE): all steps passed"
