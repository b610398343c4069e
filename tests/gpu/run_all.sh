#!/usr/bin/env bash
# tests/gpu/run_all.sh -- every check that needs a GPU, in one script that fits one device lease
# (15 minutes of device time including the machine's start; this script aims under 8), in order:
#   0. install   the package from the carried tree (pip install --no-build-isolation --no-deps .)
#                when `import pagedrun` fails or --install is given; cp312 wheels in .gpu_carry/
#                (scripts/prepare_gpu_carry.sh: pyzmq, gguf) go in first, without dependencies
#   1. build     compile gates (NVRTC + nvcc, sm_80/sm_90, spills, register budgets) and a load
#                of every cuda/*.cu module on the chosen backend (NVRTC through CuPy on cuda)
#   2. kernels   the kernel tests (tests/kernels) on the chosen backend
#   3. twins     the PTX twin check: on cuda, tests/gpu/test_ptx_twins.py (each host twin in
#                cuda/sim/twins.cuh against the real instruction); on sim, tests/sim/test_twins.py
#   4. bench     the benchmark tables (attention, GEMM, the model on random Llama-3-8B layers)
#   5. tp        tensor parallelism at TP=1 through the whole path (NCCL on cuda) against the
#                plain ModelRunner (tests/distributed/gpu_tp_check.py)
#   6. model     the cuda backend end to end on a tiny random model (the default model's 94 MB
#                do not travel; its check runs only where the package is installed)
#
#   bash tests/gpu/run_all.sh                 # on a GPU machine (cupy installed)
#   bash tests/gpu/run_all.sh --device sim    # rehearsal on the CPU harness, no GPU needed
#   bash tests/gpu/run_all.sh --out DIR       # logs + summary.{txt,json} in DIR (default $OUT,
#                                             # else a fresh temporary folder)
#   bash tests/gpu/run_all.sh --budget 480    # whole-run seconds (default 480): a step gets
#                                             # min(its limit, what is left); none starts with
#                                             # under 20 s left (recorded as skipped)
#
# Every step has a time limit (`timeout`) and an H200 estimate in seconds (the "H200 est."
# column: a guess from the work's size and the sim rehearsal, until a lease measures it). Steps
# run even when an earlier one fails (a GPU session is short: get every answer); the exit
# status is non-zero when any step failed, timed out or was skipped. The only backend switch of
# the kernel tests is PAGEDRUN_TEST_BACKEND, set here.
#
# Carry list for the device tool (`run`'s carry): .gpu_carry (optional wheels). The working
# tree travels as it is; step 0 builds the Cython extensions on the device.
set -uo pipefail
cd "$(dirname "$0")/../.."

DEVICE=cuda
OUT_DIR="${OUT:-}"
BUDGET=480
INSTALL=auto
PY="${PYTHON:-python3}"
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --out) OUT_DIR="$2"; shift 2 ;;
    --budget) BUDGET="$2"; shift 2 ;;
    --install) INSTALL=yes; shift ;;
    --no-install) INSTALL=no; shift ;;
    *) echo "run_all.sh: unknown argument $1 (use --device cuda|sim, --out DIR, --budget S," \
            "--install, --no-install)" >&2; exit 2 ;;
  esac
done
case "$DEVICE" in cuda|sim) ;; *) echo "run_all.sh: --device must be cuda or sim" >&2; exit 2 ;; esac
[ -z "$OUT_DIR" ] && OUT_DIR="$(mktemp -d)"
mkdir -p "$OUT_DIR"
RESULTS="$OUT_DIR/steps.tsv"
: > "$RESULTS"
DEADLINE=$((SECONDS + BUDGET))

FAILED=()
step() {  # step NAME LIMIT_S H200_ESTIMATE_S COMMAND...
  local name="$1" limit="$2" estimate="$3"; shift 3
  local left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 20 ]; then
    echo "== SKIP $name: ${left} s of the ${BUDGET} s budget left"
    printf '%s\tskipped\t0\t%s\t%s\n' "$name" "$limit" "$estimate" >> "$RESULTS"
    FAILED+=("$name")
    return
  fi
  [ "$limit" -gt "$left" ] && limit="$left"
  echo "== $name (limit ${limit} s, H200 estimate ${estimate} s): $*"
  local start=$SECONDS
  # `timeout` runs programs, not shell functions: a function step runs in a child bash that
  # inherits it (export -f below).
  if declare -F "$1" >/dev/null; then set -- bash -c '"$@"' _ "$@"; fi
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
  local rc=${PIPESTATUS[0]} status=pass
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    status=timeout
  elif [ "$rc" -ne 0 ]; then
    status=fail
  fi
  printf '%s\t%s\t%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - start))" "$limit" \
    "$estimate" >> "$RESULTS"
  if [ "$status" = pass ]; then
    echo "== PASS $name ($((SECONDS - start)) s)"
  else
    echo "== ${status^^} $name (exit $rc, $((SECONDS - start)) s)"
    FAILED+=("$name")
  fi
}

install_package() {
  if compgen -G ".gpu_carry/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-deps .gpu_carry/*.whl || return 1
  fi
  "$PY" -m pip install -q --no-build-isolation --no-deps .
}

load_modules() {
  "$PY" - "$DEVICE" <<'PYEOF'
import sys
from pathlib import Path

from pagedrun.runtime.kernels.loader import load_module
from pagedrun.runtime.kernels.sim_module import CUDA_DIR

backend = sys.argv[1]
for path in sorted(Path(CUDA_DIR).glob("*.cu")):
    module = load_module(path.name, backend=backend)
    if backend == "sim":
        print(f"{path.name}: {len(module.kernel_names)} kernels")
    else:
        # cupy.RawModule compiles (NVRTC) on first use; compile() forces it now.
        if hasattr(module, "compile"):
            module.compile()
        print(f"{path.name}: compiled")
PYEOF
}

summarize() {
  "$PY" - "$RESULTS" "$OUT_DIR" "$DEVICE" "$BUDGET" <<'PYEOF'
import json
import sys
from pathlib import Path

results, out_dir, device, budget = sys.argv[1], Path(sys.argv[2]), sys.argv[3], int(sys.argv[4])
keys = ("step", "status", "seconds", "limit_s", "h200_estimate_s")
rows = [dict(zip(keys, line.split("\t"))) for line in Path(results).read_text().splitlines()]
for row in rows:
    for key in keys[2:]:
        row[key] = int(row[key])
total = sum(r["seconds"] for r in rows)
lines = [f"run_all.sh --device {device}: {total} s of a {budget} s budget",
         f"{'step':<16} {'status':<8} {'seconds':>7} {'limit':>6} {'H200 est.':>9}"]
lines += [f"{r['step']:<16} {r['status']:<8} {r['seconds']:>7} {r['limit_s']:>6} "
          f"{r['h200_estimate_s']:>9}" for r in rows]
lines.append(f"{'total':<16} {'':<8} {total:>7} {budget:>6} "
             f"{sum(r['h200_estimate_s'] for r in rows):>9}")
text = "\n".join(lines)
print(text)
(out_dir / "summary.txt").write_text(text + "\n")
(out_dir / "summary.json").write_text(json.dumps(
    {"device": device, "budget_s": budget, "total_s": total, "steps": rows}, indent=1) + "\n")
PYEOF
}

export PY DEVICE
export -f install_package load_modules

if [ "$INSTALL" = yes ] || { [ "$INSTALL" = auto ] && ! "$PY" -c "import pagedrun" 2>/dev/null; }; then
  step install 300 90 install_package
fi
if [ "$DEVICE" = cuda ] && ! "$PY" -c "import cupy; cupy.cuda.runtime.getDeviceCount()" 2>/dev/null; then
  echo "run_all.sh: --device cuda needs cupy and a visible GPU (pip install -e '.[cuda13]')" >&2
  exit 2
fi

# nvcc may be absent on a GPU machine that only has the CuPy wheels: the gate reports it as
# skipped there (CI runs the full gate on the build machines).
step compile_gates 180 60 "$PY" scripts/compile_gates.py --allow-missing
step load_modules 180 60 load_modules
step kernels 240 60 env PAGEDRUN_TEST_BACKEND="$DEVICE" \
  "$PY" -m pytest -q -p no:cacheprovider tests/kernels
if [ "$DEVICE" = cuda ]; then
  step twins 120 20 "$PY" -m pytest -q -p no:cacheprovider tests/gpu/test_ptx_twins.py
else
  step twins 120 20 "$PY" -m pytest -q -p no:cacheprovider tests/sim/test_twins.py
fi
step bench_attention 150 30 "$PY" benchmarks/kernels/bench_attention.py --device "$DEVICE"
step tp 120 20 "$PY" tests/distributed/gpu_tp_check.py --device "$DEVICE"
# GEMM TFLOP/s vs cupy.matmul and skinny GB/s vs copy; then the whole model on the kernel
# backend: e2e tokens/s at concurrency 1/32/256, eager and with decode graphs; 8 of
# Llama-3-8B's 32 layers keep the host-side random weights (float32, built matrix by matrix)
# and the device time bounded.
step bench_gemm 180 40 "$PY" benchmarks/kernels/bench_gemm.py --device "$DEVICE"
step bench_model 240 80 "$PY" benchmarks/kernels/bench_model.py --device "$DEVICE" --layers 8
if [ "$DEVICE" = cuda ]; then
  step model_cuda 180 40 "$PY" -m pytest -q -p no:cacheprovider tests/gpu/test_cuda_backend.py
else
  step model_sim 180 40 "$PY" -m pytest -q -p no:cacheprovider tests/engine/test_sim_backend.py
fi

summarize
echo "run_all.sh: logs and summary in $OUT_DIR"
if [ "${#FAILED[@]}" -gt 0 ]; then
  echo "run_all.sh ($DEVICE): FAILED steps: ${FAILED[*]}"
  exit 1
fi
echo "run_all.sh ($DEVICE): all steps passed"
