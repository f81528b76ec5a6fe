"""The simulation's engine, reached as a worker reaches its own: a process of its own
(engine/client/process.py `EngineProcess`, `python -m engine.door.serve`), the rooms' sessions through its
door (`RemoteEngine`), and the run's questions (its load, its figures) with the worker's key
(engine/client/control.py `EngineControl`). Knows the door's clients; nothing of rooms or the report.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from engine.client.control import EngineControl, EngineFigures
from engine.client.process import EngineProcess
from engine.client.remote import RemoteEngine

if TYPE_CHECKING:
    from engine.config.engine_config import EngineConfig
    from engine.config.stage_config import ClockConfig

FREED_S = 5.0  # at the end, how long the slots of the closed calls may take to be given back


class SimEngine:
    """The engine's process, started by `start` (EngineClosed, with why, if it exits or is not ready within
    `timeout`), and the run's clients of its door; `close` ends it."""

    def __init__(self, config: EngineConfig, process: EngineProcess) -> None:
        self.config, self.process = config, process
        self.control = EngineControl(process.address, process.keys.control)
        self.remote: RemoteEngine | None = None

    @classmethod
    def start(cls, config: EngineConfig, timeout: float) -> SimEngine:
        engine = cls(config, EngineProcess(config.model_dump_json(), timeout=timeout).start())
        try:
            engine.remote = RemoteEngine(engine.process.address, key=engine.process.keys.room)
            _ = engine.remote.tokens  # the rooms' tokenizer, loaded before the first room needs it
        except BaseException:
            engine.close()
            raise
        return engine

    @property
    def clock(self) -> ClockConfig:
        assert self.remote is not None
        return self.remote.model_cfg.clock

    async def load(self) -> dict:
        """The engine's load as its worker reads it: "load" (1.0 while it turns callers away), "occupancy",
        "available", "num_slots"."""
        return await asyncio.to_thread(self.control.status)

    async def figures(self) -> EngineFigures:
        """The engine's snapshot, its live steps over the accounting window, its memory and snapshot port."""
        return await asyncio.to_thread(self.control.figures)

    async def occupancy_after(self) -> float:
        """The share of slots still held once the closed calls' slots had time to be given back (at most
        FREED_S: they are freed on the engine's next tick)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + FREED_S
        while (occupancy := float((await self.load())["occupancy"])) > 0 and loop.time() < deadline:
            await asyncio.sleep(0.05)
        return occupancy

    def close(self) -> None:
        self.control.close()
        self.process.stop()
