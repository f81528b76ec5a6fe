"""`engine info` sizes the real preset from meta tensors; the engine's bench prints its JSON last."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.config.dtype_policy import dtype_policy
from engine.config.presets import load_preset
from engine.model.pipeline import Pipeline
from engine.sizing.info import report
from engine.text.tokens import Tokens

PUBLISHED = {"llm": 7.714e9, "embed_tokens": 0.587e9, "lm_head": 0.587e9, "function_head": 0.587e9}


def test_full_preset_counts_match_the_published_ones():
    r = report(load_preset("nemotron-voicechat-11b"), gpu_mem_gb=141)
    thinker = r["params_detail"]["thinker"]
    for part, published in PUBLISHED.items():
        assert abs(thinker[part] - published) / published < 0.005, (part, thinker[part])
    # per session: 16 KiB of bf16 KV per position over the 4 attention layers, fp32 SSM state
    kv = 8192 * 16 * 1024
    ssm = 27 * 128 * 80 * 128 * 4
    assert r["state_bytes_detail"]["thinker"] >= kv + ssm
    # 141 GB: 10**9 bytes each
    assert r["sessions_fit"] * r["state_bytes_per_session"] < 141e9 - r["workspace_gb"] * 2**30


def test_voice_stages_and_total_match_the_published_counts():
    r = report(load_preset("nemotron-voicechat-11b"), gpu_mem_gb=141)
    d = r["params_detail"]
    checks = {
        "perception": (sum(d["perception"].values()), 0.614e9),
        "talker backbone": (d["talker"]["backbone"], 0.595e9),
        "MoG head": (d["talker"]["mog_head"], 0.159e9),
        "char encoder": (d["talker"]["embed_subword"], 0.023e9),
        "codec decoder + prvq": (d["codec"]["decoder"] + d["codec"]["prvq"], 0.108e9),
    }
    for name, (ours, published) in checks.items():
        assert abs(ours - published) / published < 0.01, (name, ours)
    # the release's 11.095 B includes the codec encoder and the RNNT branch, which inference never loads
    assert abs(r["params_total"] - 11.095e9) / 11.095e9 < 0.01


# ids: a bare "gpu" would read as the marker of the GPU-only tests
@pytest.mark.parametrize("policy", ["fp32", "gpu"], ids=["fp32-policy", "gpu-policy"])
def test_state_bytes_are_what_the_built_pipeline_allocates(policy):
    """At the tiny preset, the state `engine info` predicts for n slots (n per-session shares plus the fixed
    scratch row) is the bytes of the state buffers a built pipeline holds, at 1 and 5 slots; and every buffer
    that grows with the slot count is one of them, so nothing a slot costs escapes the count."""
    cfg = load_preset("tiny")
    r = report(cfg, gpu_mem_gb=80, dtypes=policy)
    per, fixed = r["state_bytes_per_session"], r["state_bytes_fixed"]
    assert per == sum(r["state_bytes_detail"].values()) > 0
    built = {n: Pipeline(cfg, n, Tokens(cfg.tokens), dtype_policy(policy)) for n in (1, 5)}
    for n, p in built.items():
        state = p.slot_state()
        assert sum(t.nbytes for ts in state.values() for t in ts.values()) == per * n + fixed, n
    one, five = ({name: b.nbytes for name, b in p.named_buffers()} for p in built.values())
    declared = {id(t) for ts in built[5].slot_state().values() for t in ts.values()}
    grown = {name for name in five if five[name] != one[name]}
    state_names = {name for name, b in built[5].named_buffers() if id(b) in declared}
    assert grown == state_names
    assert sum(five.values()) - sum(one.values()) == 4 * per


def test_full_preset_state_follows_the_dtype_policy():
    """Perception's caches (slot-first, one K and V ring per layer) count in full (K and V rings of 70
    frames in 24 layers, ~14.6 MB a session in fp32), and halve under the GPU policy's bf16."""
    cfg = load_preset("nemotron-voicechat-11b")
    fp32, gpu = report(cfg, gpu_mem_gb=141, dtypes="fp32"), report(cfg, gpu_mem_gb=141, dtypes="gpu")
    rings = 2 * 24 * 70 * 1024  # K and V, 8 heads x 128
    assert 4 * rings < fp32["state_bytes_detail"]["perception"] < 1.1 * 4 * rings
    assert 2 * rings < gpu["state_bytes_detail"]["perception"] < 1.1 * 2 * rings
    kv = 4 * 8192 * 8 * 128 * 2  # the thinker's 4 attention layers, K and V, per byte of dtype
    ssm = 27 * 128 * 80 * 128 * 4  # always fp32
    thinker = {name: r["state_bytes_detail"]["thinker"] for name, r in (("fp32", fp32), ("gpu", gpu))}
    assert thinker["fp32"] >= 4 * kv + ssm > thinker["gpu"] >= 2 * kv + ssm
    assert set(fp32["weight_bytes"]) == {"float32", "int64"} and "bfloat16" in gpu["weight_bytes"]
    assert sum(gpu["weight_bytes"].values()) < 0.6 * sum(fp32["weight_bytes"].values())
    assert gpu["sessions_fit"] > fp32["sessions_fit"]


def test_cli_prints_json_last():
    out = subprocess.run(
        [sys.executable, "-m", "engine", "info", "--preset", "tiny", "--gpu-mem-gb", "80"],
        capture_output=True,
        text=True,
        check=True,
    )
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"params_total", "params", "state_bytes_per_session"} <= set(last)
    assert last["params_total"] == sum(last["params"].values())


def test_thinker_bench_reports_each_batch_size():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.engine_bench",
            "thinker",
            "--slots",
            "1,4",
            "--steps",
            "5",
            "--warmup",
            "1",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    last = json.loads(out.stdout.strip().splitlines()[-1])
    for b in (1, 4):
        assert 0 < last[f"step_ms_p50_{b}"] <= last[f"step_ms_p99_{b}"]


def test_kv_layout_benchmark_agrees_with_engine_info():
    """`benchmarks/kv_layout.py` (rings against paged KV): its ring figures are `engine info`'s, paging never
    fits fewer sessions than rings, and a call old enough to fill every window gains nothing from it."""
    out = subprocess.run(
        [sys.executable, "benchmarks/kv_layout.py", "--minutes", "3", "30"],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parent.parent,
    )
    last = json.loads(out.stdout.strip().splitlines()[-1])
    full = load_preset("nemotron-voicechat-11b")
    ring = report(full, 141.0)["sessions_fit"]  # 141 GB = 131.3 GiB
    assert last["settings"]["release"]["sessions_ring"] == ring == 49
    for setting in last["settings"].values():
        three, thirty = setting["paged"]
        # a full window gains nothing from paging (its block rounding may even cost a session)
        ring = setting["sessions_ring"]
        assert three["sessions"] > ring >= thirty["sessions"] >= ring - 1
