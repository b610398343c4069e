#!/usr/bin/env bash
# scripts/prepare_gpu_carry.sh -- fill .gpu_carry/ (git-ignored) with the wheels the leased GPU
# machine lacks (Python 3.12, no package index there): pyzmq (the server and client), gguf and
# pyyaml (GGUF import). About 2 MB; tests/gpu/run_all.sh installs them with --no-deps before the
# package. Pass `.gpu_carry` in the device tool's carry list.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .gpu_carry
mkdir -p .gpu_carry
"${PYTHON:-python3}" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  -d .gpu_carry pyzmq gguf pyyaml
ls -l .gpu_carry
