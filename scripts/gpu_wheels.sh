#!/usr/bin/env bash
# Wheels for scripts/gpu_check.sh on a GPU machine without network: the packages Chorus needs beyond a stock
# CUDA PyTorch image (torch, triton, numpy present), for CPython 3.12 on Linux x86_64, into DIR (default .whl).
#   scripts/gpu_wheels.sh [DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
PY=${PYTHON:-python3}
mkdir -p "$DIR"
# versions as the suite ran them (constraints.txt), without their own dependencies beyond this list
PACKAGES=(pydantic pydantic-core pydantic-settings python-dotenv typing-inspection annotated-types
  typing-extensions safetensors tokenizers pytest pluggy iniconfig packaging)
pins=()
for p in "${PACKAGES[@]}"; do
  pin=$(grep -i -E "^${p//-/[-_]}==" constraints.txt || true)
  pins+=("${pin:-$p}")
done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d "$DIR" "${pins[@]}"
ls "$DIR"
