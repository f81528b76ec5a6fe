"""One web caller in a process of its own, for a caller whose network drops: benchmarks/soak.py stops this
process (SIGSTOP) for a few seconds and lets it go on (SIGCONT), which to the server and the agent is a
network loss and to the caller's own rtc SDK a connection that went quiet, so it resumes or reconnects as
LiveKit's clients do after a drop. The callers that share one process cannot lose their network one at a time.

    python -m testkit.lone_caller SPEC.json OUT.json

SPEC: `{"url", "key", "secret", "room", "agent_name", "identity", "metadata", "until"}` (`until`: when to hang
up, a time.monotonic() value, which every process of the machine shares). OUT: when the agent's voice was
heard (`audible`, time.monotonic() of each frame that is not silence), the agents heard, the caller's own
connection events with their times, and the words. Written at the end, and on SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import signal
import sys
import time
from pathlib import Path

import numpy as np

from testkit.callers import SPEECH_PEAK, Caller, caller_pcm
from testkit.server import Server


def said_by(caller: Caller) -> dict[str, str]:
    """Each agent's words as the caller received them, its turns joined."""
    out: dict[str, list[str]] = {}
    for sender, text, _ in caller.heard.transcripts:
        out.setdefault(sender, []).append(text)
    return {k: " ".join(v) for k, v in out.items()}


def audible_times(caller: Caller) -> list[float]:
    """The arrival times of the frames that are not silence (the agent speaking), in order."""
    h = caller.heard
    return [t for f, t in zip(h.frames, h.times, strict=True) if np.abs(f).max(initial=0) > SPEECH_PEAK]


async def run(spec: dict, out: Path) -> None:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    caller = Caller(
        Server(spec["url"], spec["key"], spec["secret"]),
        spec["room"],
        spec["agent_name"],
        identity=spec["identity"],
        metadata=spec.get("metadata", ""),
    )
    events: list[tuple[str, float]] = []
    await caller.join()
    for state in ("reconnecting", "reconnected", "disconnected"):
        caller.room.on(state, lambda *_, s=state: events.append((s, time.monotonic())))
    talk = asyncio.ensure_future(
        caller.speak(caller_pcm(), seconds=max(0.0, spec["until"] - time.monotonic()))
    )
    try:
        while time.monotonic() < spec["until"] and not stop.is_set():
            await asyncio.sleep(0.1)
    finally:
        talk.cancel()
        await asyncio.gather(talk, return_exceptions=True)
        left_at = time.monotonic()
        await caller.leave()
        out.write_text(
            json.dumps(
                {
                    "audible": audible_times(caller),
                    "agents": sorted(caller.heard.agents),
                    "first_agent": caller.heard.agent_identity,
                    "speech_at": caller.heard.speech_at,
                    "agent_left_at": caller.heard.left_at,
                    "said": said_by(caller),
                    "turns_at": caller.heard.turns_at,
                    "connection": events,
                    "words": len(caller.heard.transcripts),
                    "left_at": left_at,
                }
            )
        )


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    asyncio.run(run(spec, Path(sys.argv[2])))


if __name__ == "__main__":
    main()
