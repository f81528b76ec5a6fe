"""The engine's snapshot: `EngineSnapshot` (engine/api.py) built from what the tick thread keeps.

Computed on the caller's thread from counters and references the tick thread keeps (no per-tick copies, no
lock the tick waits on held); what rooms wrote to their shared memory is checked here, as it is read
(engine/transport/link.py `check_playout`). No transcript leaves by default: a session shows how many turns
the agent took and how many words its current or last one holds; only with `EngineConfig.show_words`
"redacted" do its `last_words` carry the turn's end, redacted (redaction/) before it is cut to LAST_WORDS
characters. Knows sessions' public counters and the accounting; knows nothing of the model.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from engine.api import LAST_WORDS, EngineSnapshot, SessionSnapshot, ToolCallSnapshot
from engine.observe.metrics import Figures, history, pct, resident_bytes
from engine.session_phase import SAID_PIECES, Phase
from engine.transport.link import PLAYED_AT
from engine.transport.wire import trace_id
from redaction import last_words

if TYPE_CHECKING:
    from engine.config.engine_config import EngineConfig
    from engine.observe.metrics import Accounting
    from engine.process.priority import TickPriority


class Session(Protocol):
    """What a row reads of a session (engine/tick/session.py `Session`): its counters and its turn's words."""

    id: str
    slot: int
    phase: Phase
    opened_at: float
    label: str
    caller: str
    trace: str  # the call's W3C traceparent, "" when none
    private: Any  # the values its words are redacted of
    playout: Any  # the room's playout figures in its shared memory
    inbox: Any  # frames_in, dropped, skipped, and its length: the frames waiting
    feed: Any  # frames_consumed, frames_replayed, underruns, reserve
    turn: Any  # said, started_at, speaking, turns
    call: Any  # count, errors, names


class Scheduler(Protocol):
    """What the snapshot reads of the scheduler (engine/tick/scheduler.py)."""

    underruns: int
    call_log: Iterable[Any]  # the last tool calls: session, label, names, ok, at, call_ms, tool_ms, resume_ms


class SlotPool(Protocol):
    sessions: dict[str, Session]


class Headroom(Protocol):
    refused: int


class TickPhase(Protocol):
    shift_s: float


class Echo(Protocol):
    def snapshot(self) -> Any: ...


class Ledger(Protocol):
    """The tick's ledger (engine/tick/ledger.py): its report is safe to build off the tick thread."""

    def report(self, missed_shown: int = 20) -> dict: ...


class Ticker(Protocol):
    ledger: Ledger


class Observed(Protocol):
    """What the snapshot and `/metrics` read of the engine (engine/tick/engine.py `Engine`): the tick's parts
    as the Protocols above, so that nothing here imports the tick."""

    config: EngineConfig
    acct: Accounting
    scheduler: Scheduler
    pool: SlotPool
    clock: Callable[[], float]
    tick_ms: float
    device: torch.device
    headroom: Headroom
    phase: TickPhase
    priority: TickPriority
    echo: Echo | None
    redispatches: dict[str, int]
    ticker: Ticker

    @property
    def occupancy(self) -> float: ...

    @property
    def overloaded(self) -> bool: ...


HISTORY_POINTS = 200  # whole ticks in `recent_tick_ms`
CALLING = (Phase.TOOL_CALL, Phase.WAITING, Phase.PREFILL)


def session_row(
    s: Session,
    now: float,
    playout: list[float],
    show_words: str = "off",
    heard_ms: float = math.nan,
    tick_s: float = 0.08,
) -> SessionSnapshot:
    """`playout`: the room's figures as checked (engine/observe/metrics.py `SharedReads`); a rejected one
    (NaN) shows as 0, or None where the snapshot has a None."""
    turn, feed, call = s.turn, s.feed, s.call
    pieces = list(turn.said)
    played_at = playout[PLAYED_AT]
    queued_s, gaps, gap_s, delay_s, _, absorbed, rx_jitter_s, rx_concealed_s = (
        x if x == x else 0.0 for x in playout
    )
    turn_ms = (played_at - turn.started_at) * 1000
    return SessionSnapshot(
        id=s.id,
        slot=s.slot,
        phase=s.phase.value,
        age_s=round(now - s.opened_at, 1),
        frames_in=s.inbox.frames_in,
        frames_consumed=feed.frames_consumed,
        frames_replayed=feed.frames_replayed,
        underruns=feed.underruns,
        dropped_frames=s.inbox.dropped,
        tool_calls=call.count,
        tool_errors=call.errors,
        backlog_frames=len(s.inbox),
        skipped_frames=s.inbox.skipped,
        underrun_s=round(feed.underruns * tick_s, 2),
        reserve_frames=feed.reserve,
        heard_ms=round(heard_ms, 1) if math.isfinite(heard_ms) else None,
        playout_ms=round(queued_s * 1e3, 1),
        start_delay_ms=round(delay_s * 1e3, 1),
        playout_gaps=int(gaps),
        playout_gap_s=round(gap_s, 3),
        late_absorbed=int(absorbed),
        rx_jitter_ms=round(rx_jitter_s * 1e3, 1),
        rx_concealed_s=round(rx_concealed_s, 3),
        turn_start_ms=round(turn_ms, 1) if math.isfinite(turn_ms) and 0 <= turn_ms < 10_000 else None,
        label=s.label,
        caller=s.caller,
        trace_id=trace_id(s.trace),
        speaking=turn.speaking,
        calling=list(call.names) if s.phase in CALLING else [],
        turns=turn.turns,
        turn_words=len("".join(pieces).split()),
        last_words=last_words(
            pieces, s.private, LAST_WORDS, truncated=len(pieces) == SAID_PIECES, going=turn.speaking
        )
        if show_words == "redacted"
        else "",
    )


def build(engine: Observed) -> EngineSnapshot:
    cfg, a, sch = engine.config, engine.acct, engine.scheduler
    sessions = list(engine.pool.sessions.values())
    now = engine.clock()
    heard = a.heard_ms
    playouts = a.shared.read([s.id for s in sessions], [s.playout for s in sessions], now).tolist()
    rows = [
        session_row(
            s,
            now,
            playout,
            cfg.show_words,
            float(heard[s.slot]) if s.slot < heard.size else math.nan,
            engine.tick_ms / 1000,
        )
        for s, playout in zip(sessions, playouts, strict=True)
    ]
    phases: dict[str, int] = {}
    for row in rows:
        phases[row.phase] = phases.get(row.phase, 0) + 1
    per = max(1, round(1000 / engine.tick_ms))  # live steps per history point (about a second)
    hist_max, hist_p50 = history(list(a.live_ms), per)
    used, total = memory(engine.device)
    tool_log = [
        ToolCallSnapshot(
            session=c.session,
            label=c.label,
            names=list(c.names),
            ok=c.ok,
            at=c.at,
            call_ms=round(c.call_ms, 1),
            tool_ms=round(c.tool_ms, 1),
            resume_ms=round(c.resume_ms, 1),
        )
        for c in list(sch.call_log)
    ]
    return EngineSnapshot(
        preset=cfg.preset,
        device=str(engine.device),
        num_slots=cfg.num_slots,
        occupancy=engine.occupancy,
        ticks=a.ticks,
        live_ms_p50=pct(a.live_ms, 50),
        live_ms_p99=pct(a.live_ms, 99),
        live_ms_max=round(max(a.live_ms), 3) if a.live_ms else 0.0,
        missed_deadlines=a.missed_deadlines,
        overruns=a.overruns,
        slipped_ticks=a.slipped_ticks,
        overloaded=engine.overloaded,
        refused_sessions=engine.headroom.refused,
        dropped_frames=a.closed_dropped + sum(s.inbox.dropped for s in sessions),
        skipped_frames=a.closed_skipped + sum(s.inbox.skipped for s in sessions),
        underruns=sch.underruns,
        tool_calls=a.tool_calls,
        tool_call_ms_p50=pct(a.tool_call_ms, 50),
        tool_call_ticks_p50=pct(a.tool_call_ticks, 50),
        resume_ms_p50=pct(a.resume_ms, 50),
        phases=phases,
        sessions=rows,
        recent_tick_ms=[round(x, 2) for x in list(a.tick_ms)[-HISTORY_POINTS:]],
        show_words=cfg.show_words,
        at=time.time(),  # wall-clock time for the page, not the engine's clock
        tick_budget_ms=engine.tick_ms,
        tick_shift_ms=round(engine.phase.shift_s * 1000, 1),
        early_ticks=a.early_ticks,
        tick_early_ms=round(1000 * a.early_s / a.early_ticks, 2) if a.early_ticks else 0.0,
        tick_realtime=engine.priority.realtime,
        history_step_s=per * engine.tick_ms / 1000,
        history_max_ms=hist_max,
        history_p50_ms=hist_p50,
        memory_bytes=used,
        memory_total_bytes=total,
        tool_log=tool_log,
        echo=engine.echo.snapshot() if engine.echo is not None else None,
        shared_memory_rejected=a.shared.rejected + a.rejected_times,
        redispatches=dict(engine.redispatches),
        tick_ledger=ledger_report(engine),
    )


LEDGER_MISSED_SHOWN = 5  # the latest late ticks the snapshot shows, with what ran in each


def ledger_report(engine: Observed) -> dict:
    """The tick's ledger as the snapshot's `tick_ledger` and `/metrics` read it (off the tick thread)."""
    return engine.ticker.ledger.report(missed_shown=LEDGER_MISSED_SHOWN)


def figures(engine: Observed) -> Figures:
    """What `/metrics` reads at a scrape (engine/observe/metrics.py), from the same counters as the
    snapshot."""
    a, sch = engine.acct, engine.scheduler
    sessions = list(engine.pool.sessions.values())
    playout = a.shared.read([s.id for s in sessions], [s.playout for s in sessions], engine.clock())
    return Figures(
        a.heard_counts.copy(),
        a.heard_sum_ms,
        sch.underruns,
        engine.tick_ms / 1000,
        a.closed_dropped + sum(s.inbox.dropped for s in sessions),
        [s.slot for s in sessions],
        [s.feed.reserve for s in sessions],
        playout,
        a.shared.rejected + a.rejected_times,
        dict(engine.redispatches),
    )


def memory(device: torch.device) -> tuple[int, int]:
    """(in use, total) bytes: CUDA memory allocated on the device and its size; on CPU the process's resident
    memory and the machine's."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device), torch.cuda.get_device_properties(device).total_memory
    resident = resident_bytes()  # 0 without /proc (macOS): unknown
    return (resident, os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")) if resident else (0, 0)
