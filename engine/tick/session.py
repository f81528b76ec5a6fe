"""One conversation's state on the engine's side: its phase, and one part for each owner that writes it.

Who writes what (docs/engine.md, "Who writes a session"): the tick thread alone writes every part; the
agent's threads reach them only through `requests`, which the tick drains (`take_requests`), and write
nothing else but `private` (under the handle's lock) and the room's `playout`. Knows the phases and the text
channel's decoder; knows nothing of the model, the pool or time.
"""

from __future__ import annotations

import queue
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np

from engine.api import ForceTokens, Output, SubmitResult
from engine.session_phase import SAID_PIECES, Phase
from engine.text.tokens import ParsedCall, TextStream
from engine.transport.link import PLAYOUT_FIELDS


@dataclass(frozen=True)
class Hold:
    """What the padding between forced turns is (`PadBetween` as the engine takes it): the padding token on
    both channels, or -1 for the model's own tokens."""

    token: int


PAUSED = (Phase.TOOL_CALL, Phase.WAITING, Phase.PREFILL, Phase.REPLAY)
HEARD_PHASES = (Phase.LIVE, Phase.REPLAY)  # the live step takes a caller frame of these each tick
MOVES_KEPT = 16  # a session's last moves between phases kept for the engine's spans (engine/observe/spans.py)

# the only moves between phases (`Session.enter` refuses any other)
MOVES: dict[Phase, frozenset[Phase]] = {
    Phase.PROMPT: frozenset({Phase.REPLAY}),  # prefilled, or its prompt's state loaded from the cache
    Phase.LIVE: frozenset({Phase.TOOL_CALL}),  # the function channel started a call
    Phase.TOOL_CALL: frozenset({Phase.WAITING, Phase.PREFILL}),  # the call went out (or was refused)
    Phase.WAITING: frozenset({Phase.PREFILL}),  # the results are in and tokenised
    Phase.PREFILL: frozenset({Phase.REPLAY}),  # the results are prefilled
    Phase.REPLAY: frozenset({Phase.LIVE}),  # the held audio is caught up
}


@dataclass(slots=True)
class Progress:
    """The scheduler's: how far a PROMPT or PREFILL phase got and the bounds, in ticks, its work is held to.
    `prefill_ids` and the bounds are set on entering a phase (`Session.enter`)."""

    prefill_ids: list[int] = field(default_factory=list)  # what a PROMPT or PREFILL phase still prefills
    prefill_pos: int = 0  # ...and how far it got
    live_by: int | None = None  # live by this tick (set when first planned and on entering REPLAY)
    prefill_by: int = 0  # tool results prefilled by this tick
    owed: int = 0  # prompt or result positions due this tick
    tick: int = -1  # the last tick its paused work advanced

    @property
    def left(self) -> int:
        """Positions a PROMPT or PREFILL phase has still to prefill."""
        return len(self.prefill_ids) - self.prefill_pos

    def upcoming(self, n: int) -> list[int]:
        """The next `n` ids to prefill."""
        return self.prefill_ids[self.prefill_pos : self.prefill_pos + n]


@dataclass(slots=True)
class Feed:
    """The scheduler's: the caller's frames into the live step and the slack's catch-up, and their counts."""

    frames_consumed: int = 0
    frames_replayed: int = 0
    underruns: int = 0
    fed_tick: int = -2  # the last tick that took a caller frame of this session
    missed_tick: int = -2  # a tick that found no frame right after one that did (a late frame, or the end)
    reserve: int = 0  # caller frames left in the inbox after the last live tick took its own
    spare_ticks: int = 0  # live ticks in a row that found a frame to spare in the inbox (Limits.spare_ticks)
    hold_ticks: int = 0  # how many of those shed a frame now (0: Limits.spare_ticks; late arrivals double it)
    late_tick: int = -(10**9)  # the tick of the last late arrival
    catch_up: bool = False  # a live session whose reserve the slack hears in a quiet step this tick
    caught_up: int = 0  # reserve frames heard that way


@dataclass(slots=True)
class Turn:
    """The scheduler's (`apply_live`): the agent's turns and the text channel's words."""

    speaking: bool = False
    turns: int = 0  # the agent's turns so far
    started_at: float = float("nan")  # when the tick that started the last turn began (engine's clock)
    # the text channel between tokens (the bytes of a character not yet whole)
    text: TextStream = field(default_factory=TextStream)
    # the text pieces of the current (or last) turn: appended with no copy, joined and redacted (redaction/)
    # only when a snapshot is taken
    said: deque[str] = field(default_factory=lambda: deque(maxlen=SAID_PIECES))


@dataclass(slots=True)
class Call:
    """The tool calls' (engine/tick/toolcalls.py): the call in progress and the session's call counts."""

    tokens: list[int] = field(default_factory=list)
    pending: dict[str, ParsedCall] = field(default_factory=dict)  # call id -> the function call sent out
    names: tuple[str, ...] = ()  # the tools of the call in progress (or the last one)
    failed: bool = False  # ...and whether any of its results was an error
    results: dict[str, dict] = field(default_factory=dict)
    response: Future | None = None  # the results' tokens, being encoded off the tick thread
    wait_deadline: float = 0.0
    t_start: float = 0.0
    ms: float = 0.0  # start of call -> function calls emitted
    t_last_result: float = 0.0
    count: int = 0  # tool calls started
    errors: int = 0


@dataclass(slots=True)
class Forcing:
    """Teacher forcing, filled from the agent's requests and taken by the scheduler's steps: tokens that
    replace the model's own, one per position per channel, and what each channel emits in a live step between
    them (-1: the model's own; the padding keeps dummy weights silent however late the next forced tokens)."""

    text: deque[int] = field(default_factory=deque)
    func: deque[int] = field(default_factory=deque)
    hold_text: int = -1
    hold_func: int = -1


class Session:
    """Engine-side state of one conversation. Set when it opens and never written after: `id`, `slot`,
    `tools`, `inbox`, `deliver`, `label`, `caller`, `prompt_key`, `prefix_key`, `prefix_len`, `keep_prompt`,
    `opened_at`, `requests`, `playout` (the array; the room writes its figures), `trace`. `phase` changes only
    through `enter`.

    A prompt's first `prefix_len` positions (the system prompt and tools, `prefix_key`) are shared with every
    session of the same agent, whatever follows them (the earlier turns of a call carried on after a break):
    the prompt's prefill stops there, so their state can be kept and loaded on its own. A prompt that is the
    prefix and its end alone (`keep_prompt`) is kept whole as well."""

    __slots__ = (
        "id", "slot", "tools", "inbox", "deliver", "label", "caller", "prompt_key", "prefix_key",
        "prefix_len", "keep_prompt", "opened_at", "requests", "playout", "private", "closed", "progress",
        "feed", "turn", "call", "forcing", "_phase", "since", "trace", "moves",
    )  # fmt: skip

    def __init__(
        self,
        id: str,
        slot: int,
        tools: frozenset[str],
        inbox,
        deliver: Callable[[list[Output]], None],
        *,
        phase: Phase = Phase.PROMPT,
        label: str = "",
        caller: str = "",
        prefill_ids: list[int] | None = None,
        prompt_key: int = 0,
        prefix_key: int = 0,
        prefix_len: int = 0,
        keep_prompt: bool = True,
        opened_at: float = 0.0,
        playout: np.ndarray | None = None,
        trace: str = "",
    ) -> None:
        self.id, self.slot, self.tools, self.inbox, self.deliver = id, slot, tools, inbox, deliver
        # what the agent calls this conversation and its caller ("web", "phone"), numbers cut to their last
        # four digits: shown by the snapshot, never interpreted or logged by the engine
        self.label, self.caller = label, caller
        self.trace = trace  # the call's W3C traceparent ("" when none): the snapshot shows its trace id
        self.prompt_key = prompt_key  # sessions with the same prompt share one prefill
        self.prefix_key, self.prefix_len = prefix_key, prefix_len  # ...and with the same prefix, its prefill
        self.keep_prompt = keep_prompt  # the whole prompt's state is kept for others (not a call's own)
        self.opened_at = opened_at  # on the engine's clock
        # the agent's side: (what, value) pairs put by the handle from any thread, drained by the tick
        self.requests: queue.SimpleQueue[SubmitResult | ForceTokens | Hold] = queue.SimpleQueue()
        # the room's playout (engine/transport/link.py PLAYOUT_FIELDS), written by the room alone: its shared
        # memory for a room in another process, else through the handle
        self.playout = np.zeros(len(PLAYOUT_FIELDS)) if playout is None else playout
        # what the snapshot must never show in clear (guests' names, codes, contacts): written by the handle
        # under its lock, replaced whole, so it holds from the moment `keep_private` returns
        self.private: tuple[str, ...] = ()
        self.closed = False  # the pool's, under its lock
        self.progress = Progress(list(prefill_ids or []))
        self.feed = Feed()
        self.turn = Turn()
        self.call = Call()
        self.forcing = Forcing()
        self._phase = phase
        self.since = -1  # the tick the session entered its phase (-1: the phase it opened in)
        # its last moves between phases, (phase, tick) each: the engine's spans read them off the tick thread
        self.moves: deque[tuple[Phase, int]] = deque(maxlen=MOVES_KEPT)

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def prefill_key(self) -> int:
        """The prompt state this PROMPT session's prefill is making now: its prefix's, then its own."""
        return self.prefix_key if self.progress.prefill_pos < self.prefix_len else self.prompt_key

    @property
    def prefill_stop(self) -> int:
        """Positions to prefill before the next state worth keeping: the prefix's end in a PROMPT phase, else
        the end of what is prefilled."""
        p = self.progress
        if self._phase is Phase.PROMPT and p.prefill_pos < self.prefix_len:
            return self.prefix_len - p.prefill_pos
        return p.left

    def enter(self, phase: Phase, tick: int, *, ids: list[int] | None = None, by: int | None = None) -> None:
        """The one way between phases (on the tick thread): refuses a move `MOVES` does not list and records
        the tick it happened. Entering PREFILL starts the prefill of `ids`, due by tick `by`; entering REPLAY
        ends a prefill, and `by` (when given) is the tick the session is live by."""
        if phase not in MOVES[self._phase]:
            raise ValueError(f"session {self.id}: no move from {self._phase.value} to {phase.value}")
        p = self.progress
        if phase is Phase.PREFILL:
            p.prefill_ids, p.prefill_pos, p.prefill_by = list(ids or ()), 0, tick if by is None else by
        elif phase is Phase.REPLAY:
            p.prefill_ids, p.prefill_pos = [], 0
            if by is not None:
                p.live_by = by
        self._phase, self.since = phase, tick
        self.moves.append((phase, tick))

    def take_requests(self, result: Callable[[Session, dict], None]) -> None:
        """Apply what the agent's side asked for since the last call (the tick thread): forced tokens and
        padding go to `forcing`, tool results to `result`."""
        while not self.requests.empty():
            match self.requests.get_nowait():
                case SubmitResult() as r:
                    result(self, {"call_id": r.call_id, "output": r.output, "is_error": r.is_error})
                case ForceTokens("text", ids):
                    self.forcing.text.extend(ids)
                case ForceTokens(_, ids):
                    self.forcing.func.extend(ids)
                case Hold(token):
                    self.forcing.hold_text = self.forcing.hold_func = token
