"""Helpers the engine and kernel tests share: a call of the concierge's tool (its prompt and tool are
testkit/concierge.py), a caller's audio, the engine's clock moved by hand and the ticks driven on
it (and the poll between them), a session's queued outputs, and code run with the kernels compiled. Knows
nothing of LiveKit or the hotel."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from engine.door.host import EngineHost
from engine.tick.engine import Engine, EngineConfig
from wait_support import await_until

REPO = Path(__file__).resolve().parent.parent

# a call of the concierge's tool (what the model is forced to say)
CALL = [{"name": "check_availability", "arguments": {"guests": 2}}]
TICK_S = 0.08  # the clock's move from one hand-driven tick to the next (the model's frame)


def pipeline_with_history(cfg, slots: int, seed: int, steps: int = 3):
    """A prepared pipeline (eval) of `slots` slots after `steps` live steps of seeded caller noise on every
    slot, so that the state a test looks at is not the fresh one."""
    from engine.model.pipeline import Pipeline
    from engine.text.tokens import Tokens

    p = Pipeline(cfg, slots, Tokens(cfg.tokens)).eval()
    p.prepare()
    gen = torch.Generator().manual_seed(seed)
    minus, every = torch.full((slots,), -1), torch.ones(slots, dtype=torch.bool)
    for _ in range(steps):
        p.live_step(0.1 * torch.randn(slots, cfg.clock.input_samples, generator=gen), every, minus, minus)
    return p


def caller_audio(seed: int, seconds: float) -> np.ndarray:
    """A caller's voice at 16 kHz: a tone of the seed's own pitch with a little noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(16000 * seconds)) / 16000
    return (0.3 * np.sin(2 * np.pi * (150 + 40 * seed) * t) + 0.05 * rng.standard_normal(t.size)).astype(
        np.float32
    )


class ManualClock:
    """The engine's clock in the tests that drive ticks by hand: time moves only when the test says so. Ticks
    driven with a deadline far away complete all pending paused work (prompt and result prefill, call tokens,
    replay) within the tick, no step ever looks slow, and the test is deterministic whatever the machine's
    load. Deadlines on the wall clock are measured by `benchmarks.engine_bench serve`, not here."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def engine_on(clock: ManualClock | None = None, **config) -> Engine:
    """An engine at the tiny preset with no tick thread, on `clock` (a fresh ManualClock by default)."""
    return Engine(EngineConfig(preset="tiny", start=False, **config), clock=clock or ManualClock())


@contextlib.contextmanager
def hosted_engine(num_slots: int = 4, *, eager: bool = False) -> Iterator[tuple[Engine, EngineHost]]:
    """An engine at the tiny preset (no tick thread) behind its door, both closed on the way out. `eager`: on
    the CPU its live step is not traced, for tests that drive a few ticks by hand on the test's own thread,
    which tracing (three quarters of building a tiny engine) buys nothing; the traced step is the eager one
    bit for bit (tests/test_runner_trace.py). Not for a tick thread beside the door's: eager, each of the
    step's ops gives the GIL up (engine/tick/runner.py `traced_live_step`)."""
    engine = engine_on(num_slots=num_slots, cuda_graph=not eager or torch.cuda.is_available())
    host = EngineHost(engine).start()
    try:
        yield engine, host
    finally:
        host.close()
        engine.close()


def run_ticks(engine: Engine, start: int, n: int, deadline_s: float = 60.0) -> int:
    """Ticks `start` .. `start + n - 1`, each with its deadline `deadline_s` ahead on the engine's clock (one
    moved by hand: a ManualClock, or a clock with a `now` like it), moved on by TICK_S after each tick;
    returns the next tick."""
    for k in range(start, start + n):
        engine.run_tick(k, engine.clock() + deadline_s)
        engine.clock.now += TICK_S
    return start + n


def poll_between_ticks(engine: Engine) -> None:
    """What the tick's first call does, between two ticks driven by hand: the sessions' requests and tool
    results taken in, and a result whose tokens are ready put to prefill."""
    sch = engine.scheduler
    sch.poll(sch.begin_tick(engine.tick, list(engine.pool.sessions.values())), engine.clock())


async def ticks_pass(engine: Engine, n: int = 4) -> None:
    """Wait for `n` more ticks of an engine running its own tick thread: whatever an earlier tick sent is then
    through the session's queues."""
    start = engine.tick
    await await_until(lambda: engine.tick >= start + n, f"{n} more ticks")


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
