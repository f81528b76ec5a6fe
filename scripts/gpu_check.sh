#!/usr/bin/env bash
# Chorus's prepared GPU check: one run, about 8 minutes on one H100/H200, dummy weights at the release shape.
#
#   scripts/gpu_check.sh [OUT_DIR]          (default out/gpu_check)
#
# Runs, each step bounded in time and recorded even when it fails:
#   1. the CUDA tests (kernels, the dense dispatch path, the captured live and slack steps vs eager): pytest -m gpu
#   2. benchmarks.engine_bench pipeline at 1, 64 and 256 slots (per stage, and the step as one CUDA graph)
#   3. the talker's decode attention, reference against the kernel, at several filled lengths
#   4. one live step under the profiler: kernel launches, GPU-busy vs wall, peak memory vs its prediction
#   5. benchmarks.engine_bench serve: 64 sessions, 16 calling tools, 60 s, with the tick plot
#   6. a bounded sweep: the most sessions with zero missed deadlines
# and writes OUT_DIR/<step>.json, OUT_DIR/<step>.log, OUT_DIR/serve-64.png and OUT_DIR/summary.json (also the
# last line printed).
#
# Needs a CUDA PyTorch with triton (a stock image). Python packages it lacks (pydantic, ...) are installed
# from WHEELS (a folder of wheels, default .whl) into a private folder, with no network;
# `scripts/gpu_wheels.sh` fills that folder on a machine with PyPI.
# Settings (environment): PRESET (nemotron-voicechat-11b), SLOTS (1,64,256), SESSIONS (64), TOOL_SESSIONS (16),
# SECONDS (60), SWEEP_BUDGET_S (120), SWEEP_SECONDS (10: each size's run), SWEEP_MAX (512), DEVICE (cuda), CAPACITY (1:
# capacity mode), GPU_TESTS (the test files whose CUDA tests run: every file below that has them). A CPU smoke run
# of the same script (tests/test_gpu_check.py runs a smaller one, its CUDA tests from one file):
# PRESET=tiny DEVICE=cpu SLOTS=1,4 SESSIONS=4 TOOL_SESSIONS=1 SECONDS=3 SWEEP_BUDGET_S=10 SWEEP_MAX=8.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT_DIR=${1:-out/gpu_check}
PRESET=${PRESET:-nemotron-voicechat-11b}
SLOTS=${SLOTS:-1,64,256}
SESSIONS=${SESSIONS:-64}
TOOL_SESSIONS=${TOOL_SESSIONS:-16}
SECONDS_=${SECONDS:-60}
SWEEP_BUDGET_S=${SWEEP_BUDGET_S:-120}
SWEEP_SECONDS=${SWEEP_SECONDS:-10}
SWEEP_MAX=${SWEEP_MAX:-512}
DEVICE=${DEVICE:-cuda}
# capacity mode (a 1,000-position talker window, its KV in bf16) by default: at the release's windows 64 sessions of the 11B
# preset do not fit one H200 (`engine info`); CAPACITY=0 runs the release's windows
CAPACITY=${CAPACITY:-1}
WIN=()
[ "$CAPACITY" = 1 ] && WIN=(--capacity)
WHEELS=${WHEELS:-.whl}
PY=${PYTHON:-python3}
mkdir -p "$OUT_DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
[ "$DEVICE" = cpu ] && export TRITON_INTERPRET=1

# what the image lacks, from the wheels given (no network)
if ! "$PY" -c "import pydantic, pydantic_settings, safetensors, tokenizers, numpy" 2>/dev/null; then
  if compgen -G "$WHEELS/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/chorus-site \
      "$WHEELS"/*.whl || { echo "gpu_check: installing the wheels in $WHEELS failed" >&2; exit 2; }
    export PYTHONPATH="$PYTHONPATH:/tmp/chorus-site"
  fi
  "$PY" -c "import pydantic, pydantic_settings, safetensors, tokenizers, numpy" || {
    echo "gpu_check: Python packages are missing; put their wheels in $WHEELS (see the script's header)" >&2
    exit 2
  }
fi
"$PY" - <<EOF || exit 2
import torch
if "$DEVICE".startswith("cuda") and not torch.cuda.is_available():
    raise SystemExit("gpu_check: no CUDA device (DEVICE=cpu runs the smoke version)")
print("torch", torch.__version__, "on", torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")
EOF

declare -A RC
step() {  # step NAME TIMEOUT_S command...: its output to NAME.log, its last line (JSON) to NAME.json
  local name=$1 limit=$2
  shift 2
  echo "== $name (at most ${limit} s): $*"
  local t0=$SECONDS
  timeout --signal=INT --kill-after=20 "$limit" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
  RC[$name]=${PIPESTATUS[0]}
  tail -n 1 "$OUT_DIR/$name.log" | "$PY" -c 'import json,sys; json.loads(sys.stdin.read())' 2>/dev/null \
    && tail -n 1 "$OUT_DIR/$name.log" >"$OUT_DIR/$name.json" || echo '{}' >"$OUT_DIR/$name.json"
  echo "== $name: exit ${RC[$name]} in $((SECONDS - t0)) s"
}

TESTS=(tests/test_kernels.py tests/test_graph.py tests/test_slack_graphs.py)
for t in tests/test_decode_attention.py tests/test_ring_write.py tests/test_rms_norm_kernel.py tests/test_qk_norm_rope.py \
  tests/test_fused_kernels.py; do
  [ -f "$t" ] && TESTS+=("$t")
done
[ -n "${GPU_TESTS:-}" ] && read -ra TESTS <<<"$GPU_TESTS"
# one pytest per file: the Triton interpreter, which the kernel files turn on for their CPU tests, is per process
step gpu_tests 150 bash -c 'rc=0; for t in "${@:3}"; do
  "$1" -m pytest -q -m gpu -p no:cacheprovider "$t" --junitxml="$2/gpu_tests-$(basename "$t" .py).xml" || rc=1
done; exit $rc' _ "$PY" "$OUT_DIR" "${TESTS[@]}"
step pipeline 150 "$PY" -m benchmarks.engine_bench pipeline --preset "$PRESET" --device "$DEVICE" --slots "$SLOTS" \
  --steps 30 --warmup 5 "${WIN[@]}"
step attention 60 "$PY" benchmarks/decode_attention.py --device "$DEVICE" --dtype bf16
step profile 60 "$PY" -m benchmarks.profile_step --preset "$PRESET" --device "$DEVICE" --slots "$SESSIONS" "${WIN[@]}"
step serve 150 "$PY" -m benchmarks.engine_bench serve --preset "$PRESET" --device "$DEVICE" --sessions "$SESSIONS" \
  --tool-sessions "$TOOL_SESSIONS" --seconds "$SECONDS_" --baseline-seconds 0 --plot "$OUT_DIR/serve-64.png" "${WIN[@]}"
step sweep $((SWEEP_BUDGET_S + 90)) "$PY" -m benchmarks.engine_bench serve --sweep --preset "$PRESET" --device "$DEVICE" \
  --sessions "$SESSIONS" --sweep-seconds "$SWEEP_SECONDS" --sweep-max "$SWEEP_MAX" --sweep-budget-s "$SWEEP_BUDGET_S" \
  --baseline-seconds 0 "${WIN[@]}"

"$PY" - "$OUT_DIR" gpu_tests="${RC[gpu_tests]}" pipeline="${RC[pipeline]}" attention="${RC[attention]}" \
  profile="${RC[profile]}" \
  serve="${RC[serve]}" sweep="${RC[sweep]}" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rcs = dict(a.split("=") for a in sys.argv[2:])
summary = {"check": "gpu_check", "exit": {k: int(v) for k, v in rcs.items()}}
for name in rcs:
    summary[name] = json.loads((out / f"{name}.json").read_text() or "{}")
junits = sorted(out.glob("gpu_tests-*.xml"))
if junits:  # pytest's own count of the CUDA tests, over the files
    import xml.etree.ElementTree as ET
    counts = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
    for junit in junits:
        suite = ET.parse(junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        for k in counts:
            counts[k] += int(suite.get(k, 0))
    summary["gpu_tests"] = counts
summary.get("serve", {}).pop("tick_series_ms", None)
(out / "summary.json").write_text(json.dumps(summary, indent=1))
print(json.dumps(summary))
EOF
