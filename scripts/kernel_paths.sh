#!/usr/bin/env bash
# The numeric tests whose bounds depend on the CPU's kernels, run once per kernel path this CPU can take: ATen's
# default, AVX2 and AVX-512 kernels, and oneDNN held to AVX2 (as on CPUs without bf16 instructions). Each run
# prints the figures the bounds in tests/test_perception.py and tests/test_pipeline.py were set from.
# Usage: scripts/kernel_paths.sh   (after `make venv`)
set -uo pipefail
cd "$(dirname "$0")/.."
TESTS=(tests/test_perception.py::test_mel_columns_match_nemo
       "tests/test_pipeline.py::test_the_gpu_policy_on_cpu_stays_within_tolerance_of_fp32")
status=0
for path in "" ATEN_CPU_CAPABILITY=default ATEN_CPU_CAPABILITY=avx2 ATEN_CPU_CAPABILITY=avx512 ONEDNN_MAX_CPU_ISA=AVX2; do
    echo "== kernel path: ${path:-as the CPU chooses}"
    env $path .venv/bin/python -m pytest -q -s -p no:cacheprovider "${TESTS[@]}" 2>&1 \
        | grep -E "^mel |gpu vs fp32|passed|failed" || status=1
done
exit $status
