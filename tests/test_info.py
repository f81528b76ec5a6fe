"""`engine info` sizes the real preset from meta tensors; the bench and demo print their JSON last."""

import json
import subprocess
import sys

from engine.config import load_preset
from engine.info import report

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
    assert r["sessions_fit"] * r["state_bytes_per_session"] < (141 - r["workspace_gb"]) * 2**30


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


def test_cli_prints_json_last():
    out = subprocess.run(
        [sys.executable, "-m", "engine", "info", "--preset", "tiny", "--gpu-mem-gb", "80"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"params_total", "params", "state_bytes_per_session"} <= set(last)
    assert last["params_total"] == sum(last["params"].values())


def test_thinker_bench_reports_each_batch_size():
    out = subprocess.run(
        [sys.executable, "-m", "engine.bench", "thinker", "--slots", "1,4", "--steps", "5", "--warmup", "1"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    last = json.loads(out.stdout.strip().splitlines()[-1])
    for b in (1, 4):
        assert 0 < last[f"step_ms_p50_{b}"] <= last[f"step_ms_p99_{b}"]
