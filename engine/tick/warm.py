"""Prompts prefilled when the engine starts (`EngineConfig.warm_prompts`): each in a session of its own,
closed once its prompt's state is kept in the prompt cache; the engine waits for them before it is handed
out, so a worker registers with LiveKit warm. The agent's first calls and any call carried on after a break
(whose prompt is the agent's and, after it, the call's own part) then start from that state instead of
prefilling several thousand positions while their caller waits.

Knows the engine's `open_session` and the sessions' phases; nothing of the agent."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from engine.api import EngineError
from engine.tick.session import Phase

if TYPE_CHECKING:
    from engine.config.engine_config import EngineConfig, WarmPrompt
    from engine.tick.handle import SessionHandle
    from engine.tick.scheduler import Scheduler


class Warmed(Protocol):
    """What the warm-up uses of the engine (engine/tick/engine.py `Engine`)."""

    config: EngineConfig
    scheduler: Scheduler

    def open_session(
        self,
        prompt: str,
        tools: list[dict] | None = None,
        *,
        sink: Callable[[list[Any]], None] | None = None,
        label: str = "",
        caller: str = "",
    ) -> SessionHandle: ...


log = logging.getLogger("chorus.engine.warm")

WARM_LABEL = "warm-up"  # the sessions' label on the monitoring page
POLL_S = 0.05
GIVE_UP_S = 120.0  # a warm-up session still prefilling after this is closed anyway


def warm_prompts(engine: Warmed, prompts: list[WarmPrompt]) -> None:
    """Open a session for each of `prompts` (at most one slot fewer than the engine has: a caller always
    finds one) and return once each has been prefilled and closed (its state kept), at most GIVE_UP_S."""
    handles = []
    for w in prompts[: max(0, engine.config.num_slots - 1)]:
        try:
            h = engine.open_session(w.prompt, w.tools, sink=_drop, label=WARM_LABEL, caller="engine")
            handles.append(h)
        except EngineError as e:
            log.warning("a prompt was not prefilled at start: %s", e)
    if not handles:
        return
    started = time.monotonic()
    while handles and time.monotonic() - started < GIVE_UP_S:
        for h in [h for h in handles if h.closed or h.phase != Phase.PROMPT.value]:
            h.close()
            handles.remove(h)
        time.sleep(POLL_S)
    for h in handles:
        h.close()
    kept = len(engine.scheduler.cached_prompts)
    log.info("start-up prompts prefilled in %.1f s (%d prompt states kept)", time.monotonic() - started, kept)


def _drop(_items: list) -> None:
    pass
