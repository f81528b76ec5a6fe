"""Helpers the engine and kernel tests share: a concierge prompt with one tool, a session's queued outputs,
and code run with the kernels compiled."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

# a prompt and one tool, and a call of it (what the model is forced to say)
TOOLS = [
    {
        "name": "check_availability",
        "description": "Rooms free on given dates.",
        "parameters": {
            "type": "object",
            "properties": {"guests": {"type": "integer", "description": "Guests"}},
        },
    },
]
PROMPT = "You are the concierge of a small hotel."
CALL = [{"name": "check_availability", "arguments": {"guests": 2}}]


def drain(handle) -> list:
    """Everything a session handle (opened without a loop: a queue.Queue) has received so far, in order."""
    out = []
    while not handle.outputs.empty():
        out.append(handle.outputs.get_nowait())
    return out


def run_compiled(script: str) -> str:
    """`script` in a fresh interpreter without TRITON_INTERPRET (Triton compiles for the device, or the
    kernels fall back to their references where there is none); its stdout. A non-zero exit fails the test."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout
