"""The engine facade and its tick thread: one model, many sessions, one frame per 80 ms tick.

`Engine(config)` builds (or loads) the model once and starts the tick thread; `open_session` hands out slots.
The tick thread never awaits and never blocks on a session: outputs go back to each session's own event
loop with `call_soon_threadsafe` (or to a sink called on the tick thread). Knows slots, time and the model;
knows nothing of LiveKit, rooms or hotels.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from engine.api import EngineClosed, EngineSnapshot, Output, SessionFailed, SessionRejected
from engine.config.engine_config import EngineConfig
from engine.observe import snapshot
from engine.observe.ledger_metrics import publish_ledger
from engine.observe.metrics import Accounting, SnapshotServer, publish
from engine.process.collector import Collector, freeze_long_lived
from engine.process.malloc import tune_malloc
from engine.process.priority import TickPriority
from engine.tick import build
from engine.tick.echo import Echo
from engine.tick.handle import SessionHandle, delivery
from engine.tick.headroom import Headroom
from engine.tick.opening import accounted, prompts_prefilling, requested_prompt
from engine.tick.pacing import frames_in, run_ticks
from engine.tick.phase import STEP_S, TickPhase
from engine.tick.plan import TickObserver
from engine.tick.runner import Runner
from engine.tick.scheduler import Scheduler
from engine.tick.session import Session
from engine.tick.slots import FrameInbox, SlotPool
from engine.tick.ticker import Ticker
from engine.tick.warm import warm_prompts
from engine.transport.wire import trace_error
from redaction import mask_numbers, warm_redaction

__all__ = ["ADMISSION_TTL_S", "Engine", "EngineConfig", "SessionHandle"]

ADMISSION_TTL_S = 90.0  # how long an admitted caller's slot is held for the session to open: a phone call
# opens it once answered, and agent/phone/phone.py waits up to 60 s while the phone rings

log = logging.getLogger("chorus.engine")


class Engine:
    def __init__(
        self, config: EngineConfig | None = None, *, clock: Callable[[], float] = time.monotonic, **overrides
    ) -> None:
        """`clock` is the engine's notion of now (seconds); tests drive ticks by hand against their own."""
        self.config = cfg = config or EngineConfig(**overrides)
        self.clock = clock
        tune_malloc()  # before the model and its first tick allocate
        if cfg.show_words == "redacted":  # what redaction reads on first use: now, not on a request
            warm_redaction()
        model = build.build_model(cfg, clock)
        self.model_cfg, self.device, self.dtypes = model.cfg, model.device, model.dtypes
        self.tokens, self.pipeline = model.tokens, model.pipeline
        self.vocab_size = self.model_cfg.thinker.vocab_size
        frame_clock = self.model_cfg.clock
        self.tick_ms = float(frame_clock.frame_ms)  # the tick is the model's frame
        self.pool = SlotPool(cfg.num_slots, clock)
        # tool results are tokenised off the tick thread
        self._encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chorus-tokens")
        self.runner = Runner(self.pipeline, self.device, cfg.prompt_cache_size, capture=cfg.cuda_graph)
        self.scheduler = Scheduler(
            cfg.num_slots,
            self.tokens,
            frame_clock.input_samples,
            build.limits(cfg, self.model_cfg),
            clock,
            encode_pool=self._encoder,
            prompts=self.runner.prompts,  # the runner's: it saves and loads, the scheduler asks what is in
        )
        self.acct = Accounting()
        self._max_backlog = max(1, int(cfg.max_backlog_s * 1000 / frame_clock.frame_ms))
        self.headroom = Headroom(
            *(self.acct, self.tick_ms, cfg.overload_ratio, cfg.recover_ratio),
            slips=lambda: sum(self.scheduler.slipped),
        )
        # ticks start soon after the frames they take arrive (the fixed-buffer baseline leaves them where they
        # fell)
        self.phase = TickPhase(self.tick_ms / 1000, step_s=0.0 if cfg.fixed_buffers else STEP_S)
        self._early = not cfg.fixed_buffers  # a tick starts within its margin once its frames are all in
        self._heard: list[Session] = []
        self._stop = threading.Event()
        self._closed = False  # the model released (by close)
        self._thread: threading.Thread | None = None
        self.collector = Collector(clock)  # full collections in the tick's slack
        self.tick = 0  # the tick running or last run, for other threads (the tick itself passes its own)
        self.failure: BaseException | None = None
        self.redispatches: dict[str, int] = {}  # the worker's new agents for lost ones (agent/fleet/fleet.py)
        self.priority = TickPriority(cfg.tick_priority)  # the tick thread's (engine/process/priority.py)
        self.echo = Echo(self.model_cfg.clock, self.tokens) if cfg.echo else None
        # what watches every tick (engine/tick/plan.py TickObserver): echo mode, else nothing
        self.observers: list[TickObserver] = [self.echo] if self.echo is not None else []
        if cfg.echo:
            also = "; the checkpoint's model runs, but the agent only echoes" if cfg.checkpoint else ""
            log.warning("echo mode: every caller hears their own audio back (measurement only)%s", also)
        self.ticker = Ticker(
            *(self.pool, self.scheduler, self.runner, self.acct, cfg, clock, self._stop),
            *(self.phase, self.priority, self.observers),
        )
        build.warm_up(model, self.runner, self.scheduler, clock)
        freeze_long_lived(again=True)  # the model lives until close (close drops it)
        publish(lambda: snapshot.figures(self))  # what /metrics reads at a scrape
        publish_ledger(lambda: snapshot.ledger_report(self))  # ...and the tick's ledger
        self.server = (
            SnapshotServer(self.snapshot, cfg.metrics_host, cfg.metrics_port)
            if cfg.metrics_port is not None
            else None
        )
        if cfg.start:
            self.start()
            # prefilled by the tick before the engine is handed out: a worker registers once they are kept
            warm_prompts(self, cfg.warm_prompts)

    # -- sessions ---------------------------------------------------------------------------------------

    def open_session(
        self,
        prompt: str,
        tools: list[dict] | None = None,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        sink: Callable[[list[Output]], None] | None = None,
        label: str = "",
        caller: str = "",
        admission: str | None = None,
        source: Callable[[FrameInbox], None] | None = None,
        pending: Callable[[], bool] | None = None,
        playout: np.ndarray | None = None,
        context: str = "",
        trace: str = "",
    ) -> SessionHandle:
        """A slot for a new conversation, or EngineFull. `context` is the call's own part of the prompt (the
        earlier turns of a call carried on after a break), after the tool block: the system prompt and tools
        before it are prefilled once for every call of the same agent, and their state kept. With an
        `admission` (a job `admit` reserved a slot for) that slot is taken and headroom is not judged again.
        Outputs arrive on `loop` (an asyncio.Queue in `handle.outputs`), or through `sink` (called on the tick
        thread: keep it cheap), or in a queue.Queue. `label` and `caller` (the caller's kind) are the agent's
        words for the conversation: the snapshot shows them (at most 80 characters each; a number in the label
        by its last four digits), the engine neither reads nor logs them. `source` feeds the session's inbox
        besides `push_audio`, on the tick thread once a tick: a room in another process writes its caller
        frames to shared memory (engine/door/host.py), and its playout figures to `playout` (a view of that
        memory); `pending` says whether it holds a frame the tick has not taken (a tick starts early once
        every frame is in). `trace` is the call's W3C traceparent (SessionRejected if it is not one): the
        snapshot shows its trace id, and the engine's spans of the session are its children."""
        if (why := trace_error(trace)) is not None:
            raise SessionRejected(why)
        self._check_up()
        admitted = admission is not None and self.pool.holds(admission)
        if not admitted:
            self._check_headroom()
        names, prompt_ids, prefix_len = requested_prompt(self.tokens, prompt, tools, context)
        key, prefix_key = hash(tuple(prompt_ids)), hash(tuple(prompt_ids[:prefix_len]))
        cached = self.scheduler.cached_prompts
        making = prefix_key if prefix_key not in cached and key not in cached else key
        prefilling = prompts_prefilling(self.pool.sessions, self.scheduler.cached_prompts)
        if (
            not admitted
            and making not in cached
            and making not in prefilling
            and len(prefilling) >= self.config.max_prompt_prefills
        ):
            raise self.headroom.refuse(
                f"{len(prefilling)} other system prompts are being prefilled (the most at once is "
                f"{self.config.max_prompt_prefills}); retry shortly, or share one prompt across sessions"
            )
        outputs, deliver = delivery(loop, sink)
        frame = self.model_cfg.clock.input_samples

        def make(session_id: str, slot: int) -> Session:
            box = FrameInbox(frame, self._max_backlog, clock=self.clock)
            box.source, box.pending = source, pending
            return Session(
                session_id,
                slot,
                frozenset(names),
                box,
                accounted(self.acct, deliver),
                prefill_ids=prompt_ids,
                prompt_key=key,
                prefix_key=prefix_key,
                prefix_len=prefix_len,
                keep_prompt=not context,
                label=mask_numbers(str(label))[:80],
                caller=str(caller)[:80],
                opened_at=self.clock(),
                playout=playout,
                trace=trace,
            )

        session = self.pool.open(make, admission)
        log.info(
            "session %s opened on slot %d (%d prompt tokens, %d its own, %d tools)",
            *(session.id, session.slot, len(prompt_ids), len(prompt_ids) - prefix_len - 1, len(names)),
        )
        return SessionHandle(self, session, outputs)

    def admit(self, job: str, ttl_s: float = ADMISSION_TTL_S) -> str:
        """Admission of a caller the worker is about to accept: the engine is up and has headroom, and a slot
        is reserved for `job` for `ttl_s` seconds (EngineClosed, EngineOverloaded or EngineFull otherwise);
        the job's name. The session opened with it (`open_session(admission=job)`) gets that slot: the
        decision is made once, before the caller is taken on, so no accepted caller is refused afterwards.
        `release` gives an unused one back."""
        self._check_up()
        self._check_headroom()
        return self.pool.reserve(job, ttl_s)

    def release(self, admission: str) -> None:
        """Give back the slot reserved for the job `admission` (it ended before it opened a session)."""
        self.pool.release(admission)

    def _check_up(self) -> None:
        if self._stop.is_set():
            raise EngineClosed("the engine is shut down")
        if self.failure is not None:
            raise EngineClosed(f"the engine's tick thread stopped: {self.failure!r}")

    def _check_headroom(self) -> None:
        if self.config.refuse_when_overloaded:
            self.headroom.check()

    @property
    def occupancy(self) -> float:
        return self.pool.occupancy

    @property
    def load(self) -> float:
        """What the worker reports to LiveKit: the share of slots in use, or 1.0 (full) while overloaded or
        after the tick thread stopped."""
        full = self.failure is not None or (self.overloaded and self.config.refuse_when_overloaded)
        return 1.0 if full else self.occupancy

    @property
    def overloaded(self) -> bool:
        """No headroom for another caller (engine/tick/headroom.py): measured and shown whether or not the
        engine refuses callers for it (`refuse_when_overloaded`)."""
        return self.headroom.overloaded

    # -- the tick ---------------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the tick thread. The process's GIL switch interval drops to `switch_interval_ms`: the tick
        thread gives the GIL up at every tensor op, and with the default 5 ms it waited that long behind the
        rooms' event loops to get it back, many times a tick."""
        if self._thread is None:
            if sys.getswitchinterval() > self.config.switch_interval_ms / 1000:
                sys.setswitchinterval(self.config.switch_interval_ms / 1000)
            self._thread = threading.Thread(target=self._run, name="chorus-tick", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        if self.device.type == "cpu":
            torch.set_num_threads(self.config.threads)  # OpenMP settings are per thread: set them here too
        self.priority.start()
        try:
            with torch.inference_mode():
                self._loop()
        except BaseException as e:  # the tick thread must not die silently
            self.failure = e
            log.exception("tick thread stopped")
            self._fail_all(f"the engine stopped: {type(e).__name__}: {e}")

    def _fail_all(self, message: str) -> None:
        """Tell every open session the engine is gone (the worker reports itself full from now on)."""
        for s in list(self.pool.sessions.values()):
            if not s.closed:
                s.deliver([SessionFailed(self.tick, message)])

    def _loop(self) -> None:
        """Tick until the engine stops, each tick when it is due (engine/tick/pacing.py)."""
        run_ticks(
            self.run_tick,
            lambda: frames_in(self._heard),
            self._stop,
            self.clock,
            self.tick_ms / 1000,
            self.phase,
            self._early,
            self.acct,
            self.collector,
        )

    def run_tick(self, k: int, deadline: float, due: float | None = None) -> None:
        """One tick (engine/tick/ticker.py): the live step, then paused work (tool calls, prefills, catch-up)
        where its device time fits before `deadline` minus the safety margin or within `reserve_ms`,
        whichever is later, what is owed this tick first; a tick whose live step left no slack runs what is
        owed whole (the progress guarantee); then the fence. Work past the deadline is counted (`overruns`)
        and accounted (`ticker.ledger`). `due`: when the
        tick was due to start (it may start earlier, its frames all in; default: when it starts), which the
        frames' leads are measured against (engine/tick/phase.py)."""
        self.tick = k
        self._heard = self.ticker.run(k, deadline, due)  # whose frames the next tick may start early for

    # -- observation and shutdown -----------------------------------------------------------------------

    def snapshot(self) -> EngineSnapshot:
        """The engine's state for the monitoring page and the benchmarks (engine/observe/snapshot.py): from
        any thread, never waited on by the tick; no transcript in clear."""
        return snapshot.build(self)

    def close(self) -> None:
        """Stop the tick thread, the tokeniser pool and the metrics server, then release the model: the
        pipeline and the runner's buffers become unreachable (on CUDA the allocator's cache is emptied too),
        so the next engine in this process gets their memory. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._encoder.shutdown(wait=False, cancel_futures=True)
        if self.server is not None:
            self.server.close()
            self.server = None
        if self._closed:
            return
        if self._thread is not None and self._thread.is_alive():  # never pull tensors from a running step
            log.warning("tick thread still in a step 5 s after close: the model's memory stays allocated")
            return
        self._closed = True
        # the only references (the ticker's too: it keeps its ledger): no cycle holds them, so they die here
        self.pipeline = self.runner = self.ticker.runner = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
