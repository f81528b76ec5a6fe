"""scripts/gpu_check.sh, the prepared GPU check, run end to end in its CPU smoke form (tiny preset, tiny
sizes, the CUDA tests of one file): every step runs, writes its JSON, and the summary gathers them, so the
script cannot rot between the sessions that have a GPU. The figures themselves mean nothing here. Every file
whose CUDA tests the check runs has some: pytest collects them, all the files in one process."""

from __future__ import annotations

import json
import os
import re
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
        "SWEEP_SECONDS": "1",
        "SWEEP_MAX": "4",
        # one file's CUDA tests (skipped on the CPU) for the step's loop; the files' list is checked below
        "GPU_TESTS": "tests/test_ring_write.py",
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
    assert summary["gpu_tests"]["tests"] >= 1
    assert summary["pipeline"]["total_ms_p50_2"] > 0
    assert summary["profile"]["capture_problems"] == [] and summary["profile"]["operators_per_step"] > 100
    assert summary["serve"]["sessions"] == 2 and summary["serve"]["ticks"] > 0
    assert summary["sweep"]["bench"] == "serve-sweep" and summary["sweep"]["sweep_seconds"] == 1
    assert (tmp_path / "serve-64.png").stat().st_size > 1000


def test_every_file_whose_cuda_tests_the_gpu_check_runs_has_some():
    """A file the check names that has no CUDA test ends its pytest with 'nothing collected', which fails the
    check's first step on a GPU: pytest collects at least one test marked `gpu` from each file it names."""
    code = [line for line in (ROOT / "scripts" / "gpu_check.sh").read_text().splitlines() if line[:1] != "#"]
    files = sorted(set(re.findall(r"tests/test_\w+\.py", "\n".join(code))))
    assert len(files) >= 8 and all((ROOT / f).is_file() for f in files), files
    collect = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu", "-p", "no:cacheprovider"]
    done = subprocess.run(
        collect + files,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    collected = {line.split("::")[0] for line in done.stdout.splitlines() if "::" in line}
    assert collected == set(files), sorted(set(files) - collected)
