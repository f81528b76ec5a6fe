"""One tick, executed: the live step, then the paused work that fits the slack, then what is owed.

`Ticker.run` is the body of every tick (`Engine.run_tick` on the tick thread; the scripted device's
simulation, benchmarks/scripted_serve.py, drives the same code over a device double). It asks the scheduler
for the plan and the work, hands them to the runner and gives the runner's results back. Knows the slot pool,
the scheduler, the runner and the accounting; knows nothing of sessions' rooms or of the model's internals.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from engine.config.engine_config import EngineConfig
from engine.observe.metrics import Accounting
from engine.process.priority import TickPriority
from engine.tick.buckets import work_buckets
from engine.tick.ledger import Ledger, Piece, TickRecord
from engine.tick.phase import TickPhase
from engine.tick.plan import Tick, TickObserver, ToolWork
from engine.tick.scheduler import Scheduler
from engine.tick.session import Session
from engine.tick.slack_work import cut_work, fit_work
from engine.tick.slots import SlotPool


class Ticker:
    def __init__(
        self,
        pool: SlotPool,
        scheduler: Scheduler,
        runner,
        acct: Accounting,
        config: EngineConfig,
        clock: Callable[[], float],
        stop: threading.Event,
        phase: TickPhase,
        priority: TickPriority,
        observers: list[TickObserver],
    ) -> None:
        self.pool, self.scheduler, self.runner, self.acct = pool, scheduler, runner, acct
        self.config, self.clock, self.stop = config, clock, stop
        self.phase, self.priority, self.observers = phase, priority, observers
        self.ledger = Ledger()  # every tick's device time (engine/tick/ledger.py)
        self.starved = 0  # ticks in a row in which owed work was found and none of it fitted

    def run(self, k: int, deadline: float, due: float | None = None) -> list[Session]:
        """Tick `k` (see `Engine.run_tick`); returns the sessions it heard from."""
        clock, sch, runner = self.clock, self.scheduler, self.runner
        t_start = clock()
        # schedule: this tick's sessions, the results that came in, the live batch
        reset, sessions, freed = self.pool.begin_tick()
        for s in freed:
            self.acct.closed_dropped += s.inbox.dropped
            self.acct.closed_skipped += s.inbox.skipped
        tick = sch.begin_tick(k, sessions, freed, t_start)
        sch.poll(tick, t_start)
        plan = sch.plan_live(tick, reset)
        heard = plan.live if plan.quiet is None else plan.live & ~plan.quiet
        if plan.late:
            self.phase.missed()
        self.phase.observe((t_start if due is None else due) - plan.arrived[heard])
        # execute and update: one batched live step for every live slot, its frames out to their sessions
        t_call = clock()
        result = runner.live(plan)
        # what the live step's read back took beyond its device time: earlier work it waited for
        live_ms = runner.live_device_ms
        wait_ms = max(0.0, (clock() - t_call) * 1e3 - live_ms)
        for observer in self.observers:
            observer.live(tick, plan, result)
        sch.apply_live(tick, plan, result)
        t_live = clock()
        self.acct.record_heard(plan, heard, t_live)
        for observer in self.observers:
            observer.sent(t_live)
        margin = self.config.safety_margin_ms / 1000
        until = max(deadline - margin, t_live + self.config.reserve_ms / 1000)
        # a live step that takes the whole tick leaves no slack on this machine, however the tick started:
        # what is owed then runs whole (a tick that started late for other reasons catches up instead)
        no_slack = t_live - t_start >= deadline - (t_start if due is None else due) - margin
        pieces = self._slack(tick, until, no_slack)
        # the fence: the device finishes this tick's side work now, so the next live step never waits for it
        for piece, (_, ms) in zip(pieces, runner.fence(), strict=True):
            piece.device_ms = ms
            sch.costs.observe(piece.kind, piece.rows, piece.positions, ms, stale=piece.forced)
        self.priority.restore()
        t_end = clock()
        self.acct.record_tick(
            (t_live - t_start) * 1e3, (t_end - t_start) * 1e3, t_live > deadline, t_end > deadline
        )
        side_ms = sum(p.device_ms for p in pieces)
        late_ms = (t_end - deadline) * 1e3
        rec = TickRecord(
            *(k, live_ms, wait_ms, side_ms, max(0.0, (t_end - t_start) * 1e3 - live_ms - wait_ms - side_ms)),
            *(late_ms, pieces),
        )
        if late_ms > 0:
            rec.why = why_late(rec, (t_live - deadline) * 1e3)
        self.ledger.record(rec)
        return sessions

    def _slack(self, tick: Tick, until: float, late: bool) -> list[Piece]:
        """Paused work (tool-call tokens, prefills, catch-up) until `until`. A piece starts only where its
        predicted device time (a high percentile of its buckets' measured times) fits after what is already
        queued on the device: first what is owed this tick (the positions the bounds need, then call
        tokens), cut to fit; then the most urgent work that fits. What fits nowhere waits for the next tick
        (where the bounds cannot hold in the slack, admission refuses sessions: `Headroom`), unless the tick
        is `late` already (its live step left no slack: a machine too slow for its tick), where what is owed
        runs whole, as progress, and is counted; and once owed work has fitted nowhere for STARVED_TICKS
        ticks in a row, a small piece of it (one row, at most FORCED_POSITIONS) runs anyway, counted the
        same way, and its measurement brings down every prediction of its kind that it shows to be stale:
        predictions that stay above the slack (buckets timed during a burst of load, then never run again
        to be measured anew) would otherwise hold a session's progress for good. Returns the bucket steps
        launched, in order."""
        clock, sch, runner = self.clock, self.scheduler, self.runner
        cadence = self.config.cadence_locked_tools
        skip: frozenset[str] = frozenset()
        served: frozenset[str] = frozenset()
        pieces: list[Piece] = []
        queued_ms = 0.0  # predicted device time launched and not yet read back
        owing = True  # owed work is looked for until a piece of it fits nowhere
        found_owed = owed_ran = forced = False
        while not self.stop.is_set():
            now = clock()
            sch.poll(tick, now)
            budget_ms = (until - now) * 1e3 - queued_ms
            work, owed, probe = None, False, False
            if owing and (due := sch.owed_work(tick)) is not None:
                found_owed = True
                work = fit_work(sch.costs, due, budget_ms)
                if work is None and late:
                    work = due
                    self.acct.owed[work.kind] = self.acct.owed.get(work.kind, 0) + 1
                elif work is None and self.starved >= STARVED_TICKS and not forced:
                    work, forced = cut_work(due, 1, min(work_positions(due), FORCED_POSITIONS)), True
                    self.acct.owed[work.kind] = self.acct.owed.get(work.kind, 0) + 1
                    probe = True
                owing, owed = work is not None, work is not None
                owed_ran = owed_ran or owed
            if work is None:
                work = sch.next_tool_work(tick, budget_ms, skip, served) if budget_ms > 0 else None
                if work is None:
                    break
            self.priority.relax()  # paused work takes turns with the rooms
            served = served | {work.kind}
            if cadence and work.kind in ("call", "result"):
                skip = skip | {work.kind}
            # the buckets it runs, each with its prediction now (the fence reads their device times)
            steps = [
                Piece(*key, sch.costs.bucket(*key), owed=owed, forced=probe)
                for key in work_buckets(work.kind, len(work.sessions), work_positions(work))
            ]
            pieces += steps
            res = runner.tool(work)
            # a read back (a call step's tokens; every piece on a CPU) has waited for all that was queued
            predicted = sum(p.predicted_ms for p in steps)
            queued_ms = queued_ms + predicted if runner.asynchronous and res.func is None else 0.0
            done = sch.apply_tool(tick, work, res)
            for slot, key in done.saves:
                runner.save_prompt(slot, key)
            for call_ms, ticks in done.calls:
                self.acct.record_call(call_ms, ticks)
        self.starved = self.starved + 1 if found_owed and not owed_ran else 0
        return pieces


# owed work that fitted nowhere this many ticks in a row runs one piece anyway (`Ticker._slack`): a few
# ticks, so a stale prediction costs a session a fraction of its bound (the result's, 12 ticks, is the
# shortest), not all of it
STARVED_TICKS = 2
FORCED_POSITIONS = 16  # of such a piece: one row's, few enough to cost little on any device


def work_positions(work: ToolWork) -> int:
    return work.positions


def why_late(rec: TickRecord, live_late_ms: float) -> str:
    """What made a tick end past its deadline, as the ledger shows it."""
    if live_late_ms > 0:
        return f"the live step's frames went out {live_late_ms:.1f} ms late (waited {rec.wait_ms:.1f} ms)"
    over = [p for p in rec.pieces if p.device_ms > p.predicted_ms]
    if any(p.owed for p in rec.pieces) and not over:
        return "owed work ran past the slack"
    if over:
        extra = sum(p.device_ms - p.predicted_ms for p in over)
        return f"{len(over)} pieces took {extra:.1f} ms more than predicted"
    return f"host work ({rec.host_ms:.1f} ms)"
