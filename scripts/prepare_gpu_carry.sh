#!/usr/bin/env bash
# scripts/prepare_gpu_carry.sh -- builds, on the CPU box, everything the leased GPU machine needs
# and cannot build or fetch itself, into .gpu_carry/ (git-ignored; the device call's `carry`
# names it; docs/gpu_check.md has the call). tests/gpu/run_all.sh installs it there with
# --no-deps and no index, so the device spends no time on Cython, nvcc or CMake:
#   paged_run-0.1.0-cp312-cp312-linux_x86_64.whl
#              the package for the device's python3 (3.12, /opt/torch/.venv): the Cython
#              modules compiled against 3.12 and the kernel fatbins (cubins sm_80 + sm_90a, PTX
#              compute_90) built by this box's nvcc, as CMakeLists.txt builds them
#   pyzmq-*-cp312-*.whl
#              the only dependency the check imports that the device image lacks (step tp's
#              communicator); gguf, starlette, uvicorn are never imported by the check
#   carry.json commit, nvcc, Python, wheel hashes and a sha256 per package input
#              (tests/gpu/gpu_carry_manifest.py): the device's install step and --check refuse a
#              carry that is not the tree's
#
# Python 3.12: this box's python3 is 3.11, but the machine image's pyenv also holds a 3.12 with
# its headers (seen 2026-12: /root/.pyenv/versions/3.12.1). A venv of it, build/py312-venv
# (ignored), holds the build requirements (scikit-build-core, Cython; numpy for the import check
# of the built modules). `pyenv install` and `uv python` cannot help where none is present: both
# download CPython from hosts this box cannot reach, and Debian 12 packages only 3.11.
# Fallback without a 3.12 (--fatbins-only): the fatbins alone, built by this python3's wheel
# build, in .gpu_carry/prebuilt/; run_all.sh's install step then builds only the Cython modules
# on the device (its cython, cmake, ninja; PAGEDRUN_BUILD_FATBINS=OFF, no nvcc) and copies the
# fatbins into the installed package.
#
#   bash scripts/prepare_gpu_carry.sh                 # ~7.5 min the first time on 2 cores (nvcc
#                                                     # over every kernel), then incremental
#   bash scripts/prepare_gpu_carry.sh --fatbins-only  # the fallback above
#   bash scripts/prepare_gpu_carry.sh --check         # exit 1 when .gpu_carry is not this tree's
set -euo pipefail
cd "$(dirname "$0")/.."
CARRY=.gpu_carry
VENV="$PWD/build/py312-venv"
# What travels with one device call, working tree and carry together (the device tool's limit).
MAX_TRAVEL_BYTES=$((64 * 1024 * 1024))
PYZMQ_SPEC="pyzmq>=25"
MODE=wheel
for arg in "$@"; do
  case "$arg" in
    --fatbins-only) MODE=fatbins ;;
    --check) exec "${PYTHON:-python3}" tests/gpu/gpu_carry_manifest.py check "$CARRY/carry.json" ;;
    *) echo "prepare_gpu_carry.sh: unknown argument $arg (--fatbins-only, --check)" >&2; exit 2 ;;
  esac
done
say() { echo "prepare_gpu_carry.sh: $*"; }
die() { echo "prepare_gpu_carry.sh: $*" >&2; exit 1; }
command -v nvcc >/dev/null || die "nvcc not found: the fatbins are built here, not on the device"

# A CPython 3.12 with Python.h: $PYTHON312, python3.12 on PATH (a pyenv shim answers only when
# 3.12 is selected, so it may fail here and the next candidate is tried), pyenv's versions.
find_python312() {
  local cand
  for cand in "${PYTHON312:-}" python3.12 "$(pyenv root 2>/dev/null || echo /nonexistent)"/versions/3.12*/bin/python3.12 \
              /usr/bin/python3.12; do
    [ -n "$cand" ] || continue
    if "$cand" - 2>/dev/null <<'PYEOF'
import os, sys, sysconfig
assert sys.version_info[:2] == (3, 12) and sys.implementation.name == "cpython"
assert os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
PYEOF
    then
      "$cand" -c 'import sys; print(sys.executable)'
      return 0
    fi
  done
  return 1
}

STAGE="$(mktemp -d -t gpu-carry.XXXXXX)"
trap 'rm -rf "$STAGE"' EXIT
NOTES=()

if [ "$MODE" = wheel ]; then
  PY312="$(find_python312)" || die "no CPython 3.12 with headers here (set PYTHON312=...), or run
  with --fatbins-only: the device then builds the Cython modules itself (docs/gpu_check.md)"
  say "Python 3.12: $PY312"
  if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c \
      'import sys, scikit_build_core, Cython, numpy; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    rm -rf "$VENV"
    "$PY312" -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
      "scikit-build-core>=0.11" "cython>=3.0" "numpy>=1.26"
  fi
  BUILD_PY="$VENV/bin/python"
else
  BUILD_PY="${PYTHON:-python3}"
fi

# The wheel, built as `pip install .` builds it (scikit-build-core: CMake, Cython, nvcc for the
# fatbins; pyproject's build-dir build/<wheel tag> keeps the next build incremental). The
# fallback's wheel gets its own build folder so it never touches the editable install's.
say "building the wheel with $("$BUILD_PY" -c 'import sys; print(sys.version.split()[0])') and $(command -v nvcc)"
BUILD_DIR_ARGS=()
[ "$MODE" = fatbins ] && BUILD_DIR_ARGS=(--config-settings=build-dir='build/gpu-carry-{wheel_tag}')
start=$SECONDS
PAGEDRUN_BUILD_FATBINS=ON "$BUILD_PY" -m pip wheel -q --disable-pip-version-check \
  --no-build-isolation --no-deps "${BUILD_DIR_ARGS[@]}" -w "$STAGE/wheel" .
say "wheel built in $((SECONDS - start)) s"
WHEEL="$(ls "$STAGE"/wheel/paged_run-*.whl)"

# Every kernel source has its fatbin in the wheel (CMake only warns when nvcc fails to appear).
"$BUILD_PY" - "$WHEEL" <<'PYEOF'
import sys, zipfile
from pathlib import Path
names = set(zipfile.ZipFile(sys.argv[1]).namelist())
missing = [p.stem for p in Path("cuda").glob("*.cu")
           if f"pagedrun/cuda/prebuilt/{p.stem}.fatbin" not in names]
if missing:
    sys.exit(f"prepare_gpu_carry.sh: no fatbin in the wheel for {missing}")
PYEOF

mkdir -p "$STAGE/carry"
"${PYTHON:-python3}" -m pip download -q --disable-pip-version-check --no-deps \
  --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$STAGE/carry" "$PYZMQ_SPEC"
if [ "$MODE" = wheel ]; then
  cp "$WHEEL" "$STAGE/carry/"
  # The built modules import under 3.12, and every kernel loads from its fatbin on sm_80 and
  # sm_90 (no NVRTC fallback there): checked here, where it costs no device time.
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-index --no-deps \
    --target "$STAGE/site" "$STAGE"/carry/*.whl
  (cd / && PYTHONPATH="$STAGE/site" "$VENV/bin/python" - <<'PYEOF'
import importlib, pkgutil
import pagedrun.pyx, zmq
from pagedrun.runtime.kernels.prebuilt import CUDA_DIR, select_module_source
mods = [m.name for m in pkgutil.iter_modules(pagedrun.pyx.__path__)]
for name in mods:
    importlib.import_module(f"pagedrun.pyx.{name}")
bad = [(cu.name, arch, why) for cu in sorted(CUDA_DIR.glob("*.cu")) for arch in (80, 90)
       for kind, why in [select_module_source(cu.name, arch)] if kind != "prebuilt"]
if bad:
    raise SystemExit(f"prepare_gpu_carry.sh: not served by a fatbin: {bad}")
print(f"prepare_gpu_carry.sh: checked under 3.12: {len(mods)} Cython modules import, "
      f"{len(list(CUDA_DIR.glob('*.cu')))} kernels load prebuilt on sm_80 and sm_90; "
      f"pyzmq {zmq.__version__}")
PYEOF
  )
  NOTES+=(--note "mode=wheel" --note "python=$("$PY312" -c 'import sys; print(sys.version.split()[0])')")
else
  mkdir -p "$STAGE/carry/prebuilt"
  (cd "$STAGE/carry/prebuilt" && "$BUILD_PY" -c "
import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
for n in z.namelist():
    if n.startswith('pagedrun/cuda/prebuilt/'):
        open(n.rsplit('/', 1)[1], 'wb').write(z.read(n))
" "$WHEEL")
  NOTES+=(--note "mode=fatbins-only (the device builds the Cython modules)")
fi
NOTES+=(--note "nvcc=$(nvcc --version | sed -n 's/.*release \([0-9.]*\), V\([0-9.]*\).*/\2/p')")
NOTES+=(--note "fatbins=cubins sm_80 sm_90a, PTX compute_90")

rm -rf "$CARRY"
mkdir -p "$CARRY"
cp -r "$STAGE"/carry/. "$CARRY"/
WHEEL_ARGS=()
for w in "$CARRY"/*.whl; do WHEEL_ARGS+=(--wheel "$w"); done
"${PYTHON:-python3}" tests/gpu/gpu_carry_manifest.py write "$CARRY/carry.json" \
  "${WHEEL_ARGS[@]}" "${NOTES[@]}"

# What the call sends: tracked files, untracked ones git does not ignore, and the carry.
carry_bytes=$(du -sb "$CARRY" | cut -f1)
tree_bytes=$( { git ls-files -z; git ls-files -z --others --exclude-standard; } \
  | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')
total=$((carry_bytes + tree_bytes))
ls -l "$CARRY"
say "carry $((carry_bytes / 1024)) KiB + working tree $((tree_bytes / 1024)) KiB =" \
    "$((total / 1024 / 1024)) MiB of the $((MAX_TRAVEL_BYTES / 1024 / 1024)) MiB a call may send"
[ "$total" -le "$MAX_TRAVEL_BYTES" ] || die "too large to travel with one call"
say "ready: the device call's carry is [\"$CARRY\"] (docs/gpu_check.md)"
