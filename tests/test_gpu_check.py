"""scripts/gpu_check.sh, the prepared GPU check, run end to end in its CPU smoke form (tiny preset, tiny
sizes): every step runs, writes its JSON, and the summary gathers them, so the script cannot rot between the
sessions that have a GPU. The figures themselves mean nothing here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_gpu_check_script_runs_every_step_in_its_cpu_smoke_form(tmp_path):
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "PRESET": "tiny",
        "DEVICE": "cpu",
        "SLOTS": "1,2",
        "SESSIONS": "2",
        "TOOL_SESSIONS": "1",
        "SECONDS": "2",
        "SWEEP_BUDGET_S": "5",
        "SWEEP_MAX": "4",
    }
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary == json.loads((tmp_path / "summary.json").read_text())
    assert summary["exit"] == {
        "gpu_tests": 0,
        "pipeline": 0,
        "attention": 0,
        "profile": 0,
        "serve": 0,
        "sweep": 0,
    }
    assert summary["gpu_tests"]["failures"] == summary["gpu_tests"]["errors"] == 0
    assert summary["pipeline"]["total_ms_p50_2"] > 0
    assert summary["profile"]["capture_problems"] == [] and summary["profile"]["operators_per_step"] > 100
    assert summary["serve"]["sessions"] == 2 and summary["serve"]["ticks"] > 0
    assert summary["sweep"]["bench"] == "serve-sweep"
    assert (tmp_path / "serve-64.png").stat().st_size > 1000
