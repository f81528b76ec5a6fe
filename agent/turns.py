"""The model's turns as the rest of a call sees them: `SPEECH` marks an output frame that belongs to one of
the model's turns, `TurnGate` lets exactly those frames through the framework's audio gate, `cut_short` says
whether a turn that ends was cut short by the caller (a barge-in), and a `CallObserver` (the playout) is told
when a turn starts and ends and when the model pauses for a tool.

Runs on each call's event loop, in the room's process; the duplex session (agent/duplex.py) marks the frames,
judges the turns' ends and calls the observer. Knows livekit's audio frames and the monotonic clock; nothing
of the engine, its tokens or rooms.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from livekit import rtc

SPEECH = "chorus.speech"  # AudioFrame.userdata key: the frame belongs to one of the model's turns
BARGE_IN_WINDOW_S = 0.6  # a turn that ends this soon after caller speech was cut short by the caller
_SENTENCE_END = (".", "!", "?")


class CallObserver:
    """What the playout side hears about a session besides its audio (all calls on the session's loop)."""

    def on_turn_started(self) -> None: ...

    def on_turn_ended(self, barge_in: bool) -> None: ...

    def on_tool_pause(self, after_speech: bool) -> None:
        """The model paused for a tool; `after_speech`: it cut its own turn short, whose audio is still on
        its way to the output."""

    def on_tool_resume(self) -> None: ...

    def report_playout(self, report: Callable[..., None]) -> None:
        """The engine session is open: tell it what the playout costs through `report` (queued seconds,
        gaps, gap seconds, start delay, when the last turn began to play; `SessionHandle.report_playout`)."""


class TurnGate:
    """The adapter's audio gate, driven by the model's own turns instead of loudness: a frame is speech
    exactly when it lies between the text channel's start-of-turn and end-of-turn tokens."""

    def update(self, frame: rtc.AudioFrame) -> bool:
        return bool(frame.userdata.get(SPEECH, False))

    def deactivate(self) -> None:
        pass


def cut_short(voiced_at: float, said: str) -> bool:
    """Whether a turn that ends now, having said `said`, was cut short by a caller last heard speaking at
    `voiced_at` (monotonic seconds): the caller spoke just now and the sentence is left unfinished."""
    return time.monotonic() - voiced_at < BARGE_IN_WINDOW_S and not said.rstrip().endswith(_SENTENCE_END)
