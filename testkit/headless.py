"""Sessions on a running worker's engine with no room behind them: the baseline a room's cost is measured
against. Each session reaches the engine as a room's process does (its socket and shared memory,
engine/client/remote.py), opens with the concierge's prompt and tools, hears a caller's recording looped in
real time, and is teacher-forced as the rooms' script forces theirs (agent/forcing.py: padding between
scripted turns, the greeting, a reply every REPLY_EVERY_S), so the engine does the work it does for as many
rooms, while nothing of LiveKit runs. All of it on one event loop in a thread of this process.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
import time
from pathlib import Path

import numpy as np

from agent.call import read_wav
from agent.forcing import GREETING, REPLIES, REPLY_EVERY_S, Forcing
from engine.api import AudioFrame
from engine.client.remote import RemoteEngine
from prompts import PROMPTS_DIR, load_prompt
from tools.schemas import tool_specs

LIVE_WAIT_S = 60.0  # every session live by then, or the baseline is refused


def engine_address(engine_pid: int) -> tuple[str, str]:
    """The address a worker gave its engine's process and its rooms' key to it (its CHORUS_ENGINE_SOCKET
    and CHORUS_ENGINE_KEY): what a room's process of that worker reaches the engine with."""
    from engine.transport.wire import ADDRESS_ENV, KEY_ENV

    env = Path(f"/proc/{engine_pid}/environ").read_bytes().split(b"\0")

    def value(name: str) -> str:
        key = name.encode() + b"="
        return next(v[len(key) :].decode() for v in env if v.startswith(key))

    return value(ADDRESS_ENV), value(KEY_ENV)


class HeadlessSessions:
    """`n` sessions on the engine at `address` (its address and the rooms' key, `engine_address`) while the
    `with` block runs (live when it is entered)."""

    def __init__(self, address: tuple[str, str], n: int) -> None:
        (self.address, self.key), self.n = address, n
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="headless", daemon=True)
        self._stop = asyncio.Event()
        self._task: asyncio.Future | None = None
        self.frames_out = 0

    def __enter__(self) -> HeadlessSessions:
        self._thread.start()
        live = asyncio.run_coroutine_threadsafe(self._open(), self._loop).result(LIVE_WAIT_S + 10)
        self._task = asyncio.run_coroutine_threadsafe(self._run(live), self._loop)
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        if self._task is not None:
            self._task.result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    async def _open(self) -> list:
        engine = RemoteEngine(self.address, key=self.key)
        prompt = load_prompt("concierge", hotel_name="The Grand Hotel", today=dt.date.today().strftime("%A"))
        handles = [
            engine.open_session(prompt, tool_specs(), label=f"headless-{i}", caller="web")
            for i in range(self.n)
        ]
        self._scripts = [Forcing(h, engine.tokens, None) for h in handles]  # padding between its turns
        self._clock = engine.model_cfg.clock
        deadline = time.monotonic() + LIVE_WAIT_S
        for h in handles:  # live: its first frame out
            while not any(isinstance(o, AudioFrame) for o in self._take(h)):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the headless sessions were not live within {LIVE_WAIT_S:g} s")
                await asyncio.sleep(0.02)
        return handles

    def _take(self, h) -> list:
        out = []
        while not h.outputs.empty():
            out.append(h.outputs.get_nowait())
        self.frames_out += sum(isinstance(o, AudioFrame) for o in out)
        return out

    async def _run(self, handles: list) -> None:
        pcm, rate = read_wav(PROMPTS_DIR / "callers" / "caller_booking.wav")
        if rate != self._clock.input_rate:
            raise ValueError(
                f"the caller's recording is {rate} Hz, the engine hears {self._clock.input_rate}"
            )
        frame = self._clock.input_samples
        frames = np.resize(pcm, (pcm.size // frame + 1) * frame).reshape(-1, frame)
        loop = self._loop
        t0 = loop.time()
        tick_s = self._clock.frame_ms / 1000
        # the greetings, then the replies, spread over the reply period as rooms joining apart spread theirs
        due = [t0 + i * REPLY_EVERY_S / len(handles) for i in range(len(handles))]
        said = [0] * len(handles)
        k = 0
        try:
            while not self._stop.is_set():
                now = loop.time()
                for i, h in enumerate(handles):  # caller i is i frames into the recording
                    h.push_audio(frames[(k + i) % len(frames)])
                    self._take(h)
                    if now >= due[i]:
                        self._scripts[i].say(REPLIES[(said[i] - 1) % len(REPLIES)] if said[i] else GREETING)
                        said[i] += 1
                        due[i] = now + REPLY_EVERY_S
                k += 1
                await asyncio.sleep(max(0.0, t0 + k * tick_s - loop.time()))
        finally:
            for h in handles:
                h.close()
