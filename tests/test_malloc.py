"""The engine sets glibc's allocator for the tick itself (engine/process/malloc.py), however it is started: a
large block freed is kept in the heap for the next tick instead of being unmapped. Checked in a fresh
interpreter without the Makefile's MALLOC_* variables, by the process's resident memory around a freed 64 MiB
block."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

PROBE = r"""
import json, numpy as np
def resident():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
def freed_kept():
    a = np.ones(64 << 20, np.uint8)  # every page touched
    held = resident()
    del a
    return held - resident()  # what freeing gave back to the system
before = freed_kept()
from engine.process.malloc import tune_malloc
ok = tune_malloc()
after = freed_kept()
print(json.dumps({"ok": ok, "returned_before": before, "returned_after": after}))
"""


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_a_large_block_freed_stays_in_the_heap_once_the_engine_tuned_malloc():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["ok"]
    assert got["returned_before"] > 48 << 20, got  # glibc's default: mapped for the block, unmapped at free
    assert got["returned_after"] < 8 << 20, got  # tuned: the block stays in the heap, reused next time


def test_the_engine_tunes_malloc_when_it_starts(monkeypatch):
    import engine.tick.engine as engine_module

    calls = []
    monkeypatch.setattr(engine_module, "tune_malloc", lambda: calls.append(1) or True)
    engine_module.Engine(preset="tiny", num_slots=1, start=False).close()
    assert calls == [1]
