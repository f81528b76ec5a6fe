"""The engine under the GPU's dtype policy on CPU, against the same engine in fp32; and a closed engine lets
its model go, so the next engine in the process gets the memory."""

import ctypes
import gc
import os
import subprocess
import sys
import weakref
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.api import AudioFrame, EngineClosed
from engine.tick.engine import Engine, EngineConfig
from engine_support import ManualClock, caller_audio, run_ticks
from testkit.soak_sampler import proc_status

# the NeMo-built tiny model: random but structured weights, unlike the dummy weights' near-uniform logits
MODEL = Path(__file__).parent / "fixtures" / "model"
PROMPT = "You are the concierge of a small hotel."
SLOTS, TICKS = 4, 24
SCRIPT = "Good evening, the deluxe room is free on those dates and costs one hundred and twenty euros."
# Both channels are teacher-forced with the same tokens in both engines, so their thinkers see the same inputs
# every frame and their text logits can be compared. Measured (4 sessions x 23 live frames): logits within
# 0.24 of fp32's (their std ~2), greedy choices agree on 0.92 of the frames (this random-weight model has many
# near-ties); the audio is identical, the talker and the codec being fp32 under both policies.
GREEDY_FLOOR = 0.85
LOGIT_ABS = 0.3


def conversation(policy: str) -> tuple[list[list[AudioFrame]], np.ndarray, np.ndarray]:
    """SLOTS sessions for TICKS ticks: each session's frames, whether each row of each live step was live, and
    the thinker's text logits of every row of every live step."""
    # the live step eager (no traced graph), so that the thinker's logits can be read from its Python call
    cfg = EngineConfig(
        preset="tiny", num_slots=SLOTS, start=False, dtype=policy, checkpoint=str(MODEL), cuda_graph=False
    )
    with Engine(cfg, clock=ManualClock()) as e:
        assert e.dtypes.name == policy
        logits: list[np.ndarray] = []
        rows: list[np.ndarray] = []
        live, step = e.runner.live, e.pipeline.thinker.step

        def thinker_step(*args, **kwargs):  # the live form (slack work steps through `step_rows`)
            out = step(*args, **kwargs)
            logits.append(out.text_logits.numpy().copy())
            return out

        def runner_live(plan):
            rows.append(plan.live.copy())
            return live(plan)

        e.pipeline.thinker.step, e.runner.live = thinker_step, runner_live
        script = e.tokens.encode(SCRIPT)
        handles = [e.open_session(PROMPT, []) for _ in range(SLOTS)]
        for i, h in enumerate(handles):
            h.push_audio(caller_audio(i, TICKS * 0.08))
            h.force_text((script * TICKS)[i : i + TICKS])
            h.force_function([e.tokens.pad] * TICKS)
        run_ticks(e, 0, TICKS)
        outs = []
        for h in handles:
            items = []
            while not h.outputs.empty():
                items.append(h.outputs.get_nowait())
            outs.append([o for o in items if isinstance(o, AudioFrame)])
    return outs, np.stack(rows), np.stack(logits)


def test_the_gpu_policy_runs_the_engine_on_cpu_within_tolerance_of_fp32():
    base, live, base_logits = conversation("fp32")
    gpu, gpu_live, gpu_logits = conversation("gpu")
    assert (gpu_live == live).all()  # the same sessions live on the same ticks
    agree = (gpu_logits.argmax(-1) == base_logits.argmax(-1))[live].mean()
    deviation = np.abs(gpu_logits - base_logits)[live].max()
    print(
        f"greedy text tokens agree on {agree:.3f} of {live.sum()} live frames; logits within {deviation:.3f}"
    )
    assert agree >= GREEDY_FLOOR and deviation < LOGIT_ABS
    for a, b in zip(base, gpu, strict=True):
        assert len(a) == len(b) >= TICKS - 2  # live within a tick or two of opening, then a frame every tick
        for x, y in zip(a, b, strict=True):
            assert y.samples.dtype == np.float32 and y.samples.shape == (1764,)
            assert np.isfinite(y.samples).all() and np.abs(y.samples).max() <= 1.0
            assert x.tick == y.tick and x.text == y.text
            np.testing.assert_allclose(y.samples, x.samples, rtol=0, atol=1e-6)


def test_close_releases_the_model_and_is_idempotent():
    e = Engine(EngineConfig(preset="tiny", num_slots=2, start=False), clock=ManualClock())
    h = e.open_session(PROMPT, [])
    h.push_audio(caller_audio(0, 0.4))
    for k in range(3):
        e.run_tick(k, 60.0)
    held = (
        e.pipeline,
        e.runner,
        e.pipeline.thinker.embed_tokens.weight,
        e.pipeline.talker.backbone.k_cache0,
        e.runner.audio,
    )
    refs = [weakref.ref(t) for t in held]
    del held
    e.close()
    gc.collect()
    assert [r() for r in refs] == [None] * len(refs)  # weights, state and the runner's buffers are gone
    e.close()  # idempotent
    with pytest.raises(EngineClosed):
        e.open_session(PROMPT, [])
    assert e.snapshot().ticks == 3  # what was measured stays readable


def test_close_stops_a_running_tick_thread_before_releasing():
    e = Engine(EngineConfig(preset="tiny", num_slots=2))  # the tick thread runs on the wall clock
    e.open_session(PROMPT, [])
    ref = weakref.ref(e.pipeline)
    e.close()
    gc.collect()
    assert ref() is None


def resident_mb() -> float:
    """This process's resident memory after a collection, with the allocator's free pages given back."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return proc_status(os.getpid())[0]


def test_engines_built_and_closed_one_after_another_leave_nothing_behind():
    # TorchScript keeps every traced module's classes and executors in one unit for the process: about 50 MB
    # for this engine, kept after close, until the last traced step is gone and the unit is cleared
    # (engine.tick.runner._Traces). Measured here: 0-2 MB over three engines cleared, 150 MB kept.
    unit = torch.jit._state._python_cu
    for _ in range(2):  # the first builds the process's own lasting state (libraries, pools)
        Engine(EngineConfig(preset="tiny", num_slots=4, start=False), clock=ManualClock()).close()
    assert unit.get_functions() == []
    before = resident_mb()
    for _ in range(3):
        e = Engine(EngineConfig(preset="tiny", num_slots=4, start=False), clock=ManualClock())
        assert unit.get_functions()  # the traced step's classes, while it lives
        e.close()
        assert unit.get_functions() == []
    assert resident_mb() - before < 30


FOREIGN_SCRIPT = """
import torch
from engine.tick.engine import Engine, EngineConfig
from engine.tick.runner import TRACES
from engine_support import ManualClock


class Twice(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2


@torch.jit.script
def thrice(x: torch.Tensor) -> torch.Tensor:
    return x * 3


twice = torch.jit.script(Twice())
Engine(EngineConfig(preset="tiny", num_slots=2, start=False), clock=ManualClock()).close()
assert TRACES.live == 0
names = [f.qualified_name for f in torch.jit._state._python_cu.get_functions()]
assert any(n.endswith("Twice.forward") for n in names), names
again = torch.jit.script(Twice())  # its class, found again in the unit
print(twice(torch.ones(2)).tolist(), thrice(torch.ones(2)).tolist(), again(torch.ones(1)).tolist())
"""


def test_another_librarys_torchscript_in_the_engines_process_is_left_whole(tmp_path):
    # Its own process (the scripted function stays in TorchScript's unit for the life of the process), from a
    # file: TorchScript reads a function's source.
    tests = Path(__file__).parent
    script = tmp_path / "foreign.py"
    script.write_text(FOREIGN_SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tests.parent,
        env={**os.environ, "PYTHONPATH": f"{tests.parent}{os.pathsep}{tests}"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[2.0, 2.0] [3.0, 3.0] [2.0]"
