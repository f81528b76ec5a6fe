"""The engine facade and its tick thread: one model, many sessions, one frame per 80 ms tick.

`Engine(config)` builds (or loads) the model once and starts the tick thread; `open_session` hands out slots.
The tick thread never awaits and never blocks on a session: outputs go back to each session's own event
loop with `call_soon_threadsafe` (or to a sink called on the tick thread). Knows slots, time and the model;
knows nothing of LiveKit, rooms or hotels.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import json
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

from engine.api import (
    EngineClosed,
    EngineOverloaded,
    Output,
    SessionFailed,
    SessionRejected,
    ToolResultConsumed,
)
from engine.dtype_policy import DtypePolicy, DtypePolicyName, dtype_policy
from engine.echo import Echo, TimedInbox
from engine.graph import pow2_at_least
from engine.info import check_memory
from engine.malloc import tune_malloc
from engine.metrics import (
    LAST_WORDS,
    Accounting,
    EngineSnapshot,
    SessionSnapshot,
    SnapshotServer,
    ToolCallSnapshot,
    history,
    pct,
    resident_bytes,
)
from engine.model.pipeline import Pipeline
from engine.model.weights import model_config
from engine.presets import PRESETS, load_preset
from engine.privacy import last_words, mask_numbers, private_values
from engine.runner import Runner
from engine.scheduler import Limits, Scheduler
from engine.slots import SAID_PIECES, FrameInbox, Phase, Session, SlotPool
from engine.tokens import MAX_TOOLS, Tokens
from engine.windows import talker_window, with_windows

log = logging.getLogger("chorus.engine")

GC_EVERY_S = 60.0  # the tick thread runs a full garbage collection this often, in a tick's slack
GC_FORCE_AFTER = 3  # ...and without slack after this many periods (a pass can outlast a tick)

OVERLOAD_WINDOW = 100  # ticks (8 s) of history behind the headroom decision
OVERLOAD_MIN_TICKS = 10  # no decision before this many ticks were measured
ADMISSION_TTL_S = 30.0  # how long an admitted caller's slot is held for the session to open
OVERLOAD_MISSES = 5  # missed deadlines in the window that mean overload


class EngineConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)  # an engine's settings never change under it

    preset: str = "tiny"
    num_slots: int = Field(64, ge=1, le=4096)
    checkpoint: str | None = None
    tokenizer: str | None = None  # the thinker's tokenizer.json (or its folder); default: the preset's
    speaker: str | None = None  # the speaker latent `audio_prompt_latents.<Name>`; default: the preset's
    device: str | None = None  # default: cuda when available, else cpu
    # each stage's dtypes: "auto" is "gpu" (bf16 where parity allows; "capacity" in capacity mode) on CUDA and
    # "fp32" elsewhere
    dtype: DtypePolicyName | DtypePolicy = "auto"
    threads: int = Field(1, ge=1)  # intra-op threads on CPU: one leaves the other core to the event loops
    # the live step as one graph: captured on CUDA (engine/graph.py), traced on the CPU (engine/runner.py)
    cuda_graph: bool = True
    # context windows (positions) of the talker's KV rings and the thinker's attention; None: the release's.
    # `capacity_mode` shortens the talker's to CAPACITY_TALKER_WINDOW (engine/windows.py) unless set.
    talker_window: int | None = Field(None, ge=2)
    thinker_window: int | None = Field(None, ge=1)
    capacity_mode: bool = False
    tick_ms: float = Field(80.0, gt=0)
    safety_margin_ms: float = Field(6.0, ge=0)  # slack work stops this long before the deadline
    # paused work (tool calls, prefills, catch-up) may use this much of every tick even when the live step
    # left less slack: progress on a slow machine, at the price of counted overruns
    reserve_ms: float = Field(10.0, ge=0)
    switch_interval_ms: float = Field(1.0, gt=0)  # the process's GIL switch interval once the tick runs
    admission_s: float = Field(2.0, gt=0)  # a new session is live within this (prompt prefill + held audio)
    result_s: float = Field(1.0, gt=0)  # tool results are prefilled within this of arriving
    replay_s: float = Field(2.0, gt=0)  # ...and the session is live again within this after that
    # refuse new sessions while the live step's recent p95 is above this share of the tick, or deadlines are
    # being missed; accept again once it is below the second share and misses have (nearly) stopped
    overload_ratio: float = Field(0.9, gt=0)
    # False: admit up to the slots whatever the headroom (overload is still measured and shown). For a worker
    # that is the only one of its agent name, where a slow answer beats none, and for tests of other behaviour
    # on a shared machine.
    refuse_when_overloaded: bool = True
    recover_ratio: float = Field(0.75, gt=0)
    max_call_tokens: int = Field(512, ge=8)
    max_result_chars: int = Field(16_000, ge=100)  # a longer tool result is cut, with a note to the model
    tool_timeout_s: float = Field(15.0, gt=0)
    prefill_chunk: int = Field(64, ge=1)
    prompt_cache_size: int = Field(8, ge=0)  # prefilled system prompts kept for new sessions to start from
    max_prompt_prefills: int = Field(
        4, ge=1
    )  # distinct new prompts admitted at once (each costs its prefill)
    max_backlog_s: float = Field(30.0, gt=0)  # caller audio held per session while paused
    cadence_locked_tools: bool = False  # baseline: one tool token per tick, results one token per tick
    # measurement only (engine/echo.py): every live slot's output is its own input frame, resampled; never for
    # callers
    echo: bool = False
    metrics_port: int | None = None  # serve /snapshot and /metrics on 127.0.0.1 (0: any free port)
    metrics_host: str = "127.0.0.1"
    start: bool = True  # start the tick thread at once

    def model_post_init(self, __context) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"preset: unknown preset {self.preset!r}; choose one of {sorted(PRESETS)}")
        if self.checkpoint is not None and not Path(self.checkpoint).exists():
            raise FileNotFoundError(f"checkpoint: {self.checkpoint!r} does not exist")


class SessionHandle:
    """What a conversation holds: push caller audio, read outputs, answer function calls, close."""

    def __init__(self, engine: Engine, session: Session, outputs) -> None:
        self._engine = engine
        self._s = session
        self.id = session.id
        self.outputs = outputs  # asyncio.Queue (with a loop), queue.Queue (without), or None (with a sink)
        self._private_lock = threading.Lock()

    @property
    def phase(self) -> str:
        return self._s.phase.value

    @property
    def closed(self) -> bool:
        return self._s.closed

    @property
    def frames_in(self) -> int:
        """Caller frames this session received (also after it closed)."""
        return self._s.inbox.frames_in

    def push_audio(self, pcm16k: np.ndarray) -> None:
        """Caller audio at 16 kHz mono, int16 or float in [-1, 1], any length; cut into 1280-sample frames."""
        if self._s.closed:
            raise EngineClosed(f"session {self.id} is closed")
        self._s.inbox.push(pcm16k)

    def submit_tool_result(self, call_id: str, output: str, is_error: bool = False) -> None:
        """The result of a FunctionCall; results for unknown or already answered calls are ignored. The personal
        values of the call's arguments and of its result (when that is a JSON object) are kept private from now
        on: names, contacts, codes (`privacy.private_values`)."""
        if self._s.closed:
            return
        call = self._s.pending.get(call_id)
        if call is not None:
            self.keep_private(*private_values(call.arguments), *private_values(_json_object(output)))
        # every character is prefilled on the tick: a longer result is cut, and the model reads a note saying so
        output, cap = str(output), self._engine.config.max_result_chars
        if len(output) > cap:
            output = f"{output[:cap]} [the result was cut: {len(output)} characters, the first {cap} kept]"
        self._s.incoming.put(
            {
                "call_id": call_id,
                "name": call.name if call else "",
                "output": output,
                "is_error": bool(is_error),
            }
        )

    def keep_private(self, *terms: str) -> None:
        """Words this conversation must never show in clear: a guest's name (each of its words too), a contact,
        a code. The snapshot's `last_words` replace them with "[name]" from now on (engine/privacy.py). Callable
        from any thread; the terms live as long as the session."""
        fresh = tuple(t.strip()[:200] for t in terms if isinstance(t, str) and t.strip())
        with self._private_lock:
            self._s.private = tuple(dict.fromkeys(self._s.private + fresh))

    def force_text(self, tokens: list[int] | str) -> None:
        """Teacher forcing: the text channel emits these tokens (one per position) instead of its own."""
        self._s.force_text.extend(self._ids(tokens))

    def force_function(self, tokens: list[int] | str) -> None:
        """Teacher forcing of the function channel (e.g. a complete tool call from `Tokens.call_ids`)."""
        self._s.force_func.extend(self._ids(tokens))

    def _ids(self, tokens: list[int] | str) -> list[int]:
        ids = self._engine.tokens.encode(tokens) if isinstance(tokens, str) else [int(t) for t in tokens]
        bad = [t for t in ids if not 0 <= t < self._engine.vocab_size]
        if bad:
            raise ValueError(f"tokens: ids outside 0..{self._engine.vocab_size - 1}: {bad[:5]}")
        return ids

    def close(self) -> None:
        """Free the slot; a late tool result or audio is discarded. Idempotent."""
        self._engine.pool.close(self._s)


class Engine:
    def __init__(
        self, config: EngineConfig | None = None, *, clock: Callable[[], float] = time.monotonic, **overrides
    ) -> None:
        """`clock` is the engine's notion of now (seconds); tests drive ticks by hand against their own."""
        self.config = cfg = config or EngineConfig(**overrides)
        self.clock = clock
        tune_malloc()  # before the model and its first tick allocate
        release = model_config(load_preset(cfg.preset), cfg.checkpoint, cfg.tokenizer, cfg.speaker)
        self.model_cfg = with_windows(
            release, talker_window(release, cfg.talker_window, cfg.capacity_mode), cfg.thinker_window
        )
        self.device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cpu":
            torch.set_num_threads(cfg.threads)
        self.tokens = Tokens(self.model_cfg.tokens)
        self.vocab_size = self.model_cfg.thinker.vocab_size
        self.dtypes = dtype_policy(cfg.dtype, self.device.type, cfg.capacity_mode)
        if cfg.checkpoint:
            check_memory(self.model_cfg, self.dtypes, cfg.num_slots, self.device)
        t0 = time.monotonic()
        with torch.device(self.device):
            self.pipeline = Pipeline(self.model_cfg, cfg.num_slots, self.tokens, self.dtypes)
        if cfg.checkpoint:
            from engine.model.weights import load_checkpoint

            load_checkpoint(self.pipeline, cfg.checkpoint)
        self.pipeline.eval().requires_grad_(False)  # inference only
        self.pipeline.prepare()
        log.info("model %s ready on %s in %.1f s (%d slots, dtypes %s)", cfg.preset, self.device,
                 time.monotonic() - t0, cfg.num_slots, self.dtypes)  # fmt: skip
        self.pool = SlotPool(cfg.num_slots)
        limits = Limits(
            max_call_tokens=cfg.max_call_tokens,
            tool_timeout_s=cfg.tool_timeout_s,
            prefill_chunk=cfg.prefill_chunk,
            result_chunk=1 if cfg.cadence_locked_tools else cfg.prefill_chunk,
            max_chunk=self.model_cfg.thinker.attention_window,
            admission_ticks=max(1, round(cfg.admission_s * 1000 / cfg.tick_ms)),
            replay_ticks=max(1, round(cfg.replay_s * 1000 / cfg.tick_ms)),
            result_ticks=max(1, round(cfg.result_s * 1000 / cfg.tick_ms)),
        )
        frame_clock = self.model_cfg.clock
        # tool results are tokenised off the tick thread
        self._encoder = ThreadPoolExecutor(max_workers=1, thread_name_prefix="chorus-tokens")
        self.scheduler = Scheduler(
            cfg.num_slots, self.tokens, frame_clock.input_samples, limits, clock, encode_pool=self._encoder
        )
        self.runner = Runner(self.pipeline, self.device, cfg.prompt_cache_size, capture=cfg.cuda_graph)
        self.acct = Accounting()
        self._max_backlog = max(1, int(cfg.max_backlog_s * 1000 / frame_clock.frame_ms))
        self._overloaded = False
        self.refused = 0  # sessions refused for lack of headroom
        self._stop = threading.Event()
        self._closed = False  # the model released (by close)
        self._thread: threading.Thread | None = None
        self._gc_at = time.monotonic()  # the tick thread's last full collection
        self.gc_ms = 5.0  # what one is expected to cost (learned)
        self.gc_runs = 0
        self.tick = 0
        self.failure: BaseException | None = None
        self._echo = Echo(self.model_cfg.clock, self.tokens) if cfg.echo else None
        if cfg.echo:
            also = "; the checkpoint's model runs, but the agent only echoes" if cfg.checkpoint else ""
            log.warning("echo mode: every caller hears their own audio back (measurement only)%s", also)
        self._warm_up()
        gc.collect()
        gc.freeze()  # the model lives until close: keep it out of the collector's full passes (close drops it)
        atexit.register(gc.unfreeze)  # ...but let the interpreter's own cleanup see them at exit
        self.server = (
            SnapshotServer(self.snapshot, cfg.metrics_host, cfg.metrics_port)
            if cfg.metrics_port is not None
            else None
        )
        if cfg.start:
            self.start()

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
        admission: object | None = None,
    ) -> SessionHandle:
        """A slot for a new conversation, or EngineFull. With an `admission` from `admit` the slot it reserved
        is taken and headroom is not judged again. Outputs arrive on `loop` (an asyncio.Queue in
        `handle.outputs`), or through `sink` (called on the tick thread: keep it cheap), or in a queue.Queue.
        `label` and `caller` (the caller's kind) are the agent's words for the conversation: the snapshot shows
        them (at most 80 characters each; a number in the label by its last four digits), the engine neither
        reads nor logs them."""
        self._check_up()
        if admission is None:
            self._check_headroom()
        tools = tools or []
        if len(tools) > MAX_TOOLS:
            raise SessionRejected(f"tools: the model accepts at most {MAX_TOOLS} tools, got {len(tools)}")
        names = [t.get("name") for t in tools]
        if any(not isinstance(n, str) or not n for n in names) or len(set(names)) != len(names):
            raise SessionRejected("tools: every tool needs a distinct, non-empty name")
        try:
            prompt_ids = self.tokens.prompt_ids(prompt, tools)
        except ValueError as e:
            raise SessionRejected(str(e)) from None
        key = hash(tuple(prompt_ids))
        prefilling = self._prompts_prefilling()
        if admission is None and key not in prefilling and len(prefilling) >= self.config.max_prompt_prefills:
            self.refused += 1
            raise EngineOverloaded(
                f"{len(prefilling)} other system prompts are being prefilled (the most at once is "
                f"{self.config.max_prompt_prefills}); retry shortly, or share one prompt across sessions"
            )
        if sink is not None:
            outputs, deliver = None, sink
        elif loop is not None:
            outputs = asyncio.Queue()

            def deliver(items: list[Output], _q=outputs, _loop=loop) -> None:
                if not _loop.is_closed():
                    _loop.call_soon_threadsafe(_put_all, _q, items)
        else:
            outputs = queue.Queue()

            def deliver(items: list[Output], _q=outputs) -> None:
                for item in items:
                    _q.put(item)

        frame = self.model_cfg.clock.input_samples
        inbox = partial(TimedInbox, clock=self.clock) if self._echo is not None else FrameInbox

        def make(session_id: str, slot: int) -> Session:
            return Session(
                session_id, slot, frozenset(names), inbox(frame, self._max_backlog), self._accounted(deliver),
                prefill_ids=prompt_ids, prompt_key=key, label=mask_numbers(str(label))[:80],
                caller=str(caller)[:80],
            )  # fmt: skip

        session = self.pool.open(make, admission)
        log.info("session %s opened on slot %d (%d prompt tokens, %d tools)", session.id, session.slot,
                 len(prompt_ids), len(tools))  # fmt: skip
        return SessionHandle(self, session, outputs)

    def admit(self, ttl_s: float = ADMISSION_TTL_S) -> object:
        """Admission of a caller the worker is about to accept: the engine is up and has headroom, and a slot
        is reserved for `ttl_s` seconds (EngineClosed, EngineOverloaded or EngineFull otherwise). The session
        opened with it (`open_session(admission=...)`) gets that slot: the decision is made once, before the
        caller is taken on, so no accepted caller is refused afterwards. `release` gives an unused one back."""
        self._check_up()
        self._check_headroom()
        return self.pool.reserve(ttl_s)

    def release(self, admission: object) -> None:
        self.pool.release(admission)

    def _check_up(self) -> None:
        if self._stop.is_set():
            raise EngineClosed("the engine is shut down")
        if self.failure is not None:
            raise EngineClosed(f"the engine's tick thread stopped: {self.failure!r}")

    def _check_headroom(self) -> None:
        if self.overloaded and self.config.refuse_when_overloaded:
            self.refused += 1
            raise EngineOverloaded(
                f"no headroom: the live step's recent p95 is {self._recent_p95():.0f} ms of the "
                f"{self.config.tick_ms:g} ms tick, {sum(self.acct.recent_missed)} of the last "
                f"{len(self.acct.recent_missed)} ticks late; route the caller to another worker or retry later"
            )

    def _accounted(self, deliver: Callable[[list[Output]], None]) -> Callable[[list[Output]], None]:
        def wrapped(items: list[Output]) -> None:
            for item in items:
                if isinstance(item, ToolResultConsumed):
                    self.acct.record_resume(item.resume_ms)
            deliver(items)

        return wrapped

    @property
    def occupancy(self) -> float:
        return self.pool.occupancy

    def _prompts_prefilling(self) -> set[int]:
        """Distinct system prompts not yet cached that open sessions are waiting for (read across threads:
        a snapshot, good enough for admission)."""
        cached = self.scheduler.cached_prompts
        return {
            s.prompt_key
            for s in list(self.pool.sessions.values())
            if s.phase is Phase.PROMPT and not s.closed and s.prompt_key not in cached
        }

    @property
    def load(self) -> float:
        """What the worker reports to LiveKit: the share of slots in use, or 1.0 (full) while overloaded or
        after the tick thread stopped."""
        full = self.failure is not None or (self.overloaded and self.config.refuse_when_overloaded)
        return 1.0 if full else self.occupancy

    def _recent_p95(self) -> float:
        recent = list(self.acct.live_ms)[-OVERLOAD_WINDOW:]
        return float(np.percentile(recent, 95)) if recent else 0.0

    @property
    def overloaded(self) -> bool:
        """Headroom, measured over the last OVERLOAD_WINDOW ticks: the live step's p95 against the tick, and the
        deadlines missed, with hysteresis. (The p95 rather than the max-like p99 of 100 ticks: one collector
        pause must not turn callers away; sustained lateness shows in the missed deadlines.)"""
        if len(self.acct.live_ms) < OVERLOAD_MIN_TICKS:
            return self._overloaded
        cfg = self.config
        p95, missed = self._recent_p95(), sum(self.acct.recent_missed)
        if self._overloaded:
            self._overloaded = p95 > cfg.recover_ratio * cfg.tick_ms or missed > OVERLOAD_MISSES // 2
        else:
            self._overloaded = p95 > cfg.overload_ratio * cfg.tick_ms or missed >= OVERLOAD_MISSES
        return self._overloaded

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

    def _collect_garbage(self, next_start: float) -> None:
        """A full collection about once a minute, in a tick's slack when it fits. The objects of a turn or a
        tool call live for seconds, long enough to reach the collector's oldest generation, whose own passes
        are rare (`agent.call.quiet_gc`), so their reference cycles would otherwise never be freed. The model
        and other long-lived objects are frozen, so a pass walks only what came since; still, on a busy CPU it
        can outlast a tick, and one that finds no room for GC_FORCE_AFTER of its periods runs anyway: bounded
        memory is worth one late tick."""
        now = time.monotonic()
        since = now - self._gc_at
        if since < GC_EVERY_S:
            return
        room = next_start - self.clock()
        if room < 1.5 * self.gc_ms / 1000 + 0.002 and since < GC_FORCE_AFTER * GC_EVERY_S:
            return
        t = time.perf_counter()
        gc.collect()
        ms = (time.perf_counter() - t) * 1e3
        self.gc_ms = max(ms, 0.7 * self.gc_ms + 0.3 * ms)  # what the next one is expected to cost
        self.gc_runs += 1
        self._gc_at = time.monotonic()
        log.debug("full collection in %.1f ms (%.1f ms of room)", ms, room * 1e3)

    def _loop(self) -> None:
        tick_s = self.config.tick_ms / 1000
        t0 = self.clock()
        k = 0
        while not self._stop.is_set():
            start = t0 + k * tick_s
            now = self.clock()
            if now < start:
                self._stop.wait(start - now)
                continue
            if now - start > tick_s:  # more than a whole tick behind: re-anchor instead of bursting
                self.acct.record_slip(int((now - start) / tick_s))
                t0 = now - k * tick_s
                start = now
            self.run_tick(k, start + tick_s)
            k += 1
            self._collect_garbage(t0 + k * tick_s)

    def run_tick(self, k: int, deadline: float) -> None:
        """One tick: the live step, then paused work (tool calls, prefills, catch-up) until `deadline` minus
        the safety margin or for `reserve_ms`, whichever is later, then whatever is owed this tick whatever the
        time: the progress guarantee. Work past the deadline is counted (`overruns`)."""
        clock, sch = self.clock, self.scheduler
        t_start = clock()
        self.tick = k
        # schedule: this tick's sessions, the results that came in, the live batch
        reset, sessions, freed = self.pool.begin_tick()
        for s in freed:
            self.acct.closed_dropped += s.inbox.dropped
            self.acct.closed_skipped += s.inbox.skipped
        sch.begin_tick(k, sessions, freed)
        sch.poll(t_start)
        plan = sch.plan_live(reset)
        # execute and update: one batched live step for every live slot, its frames out to their sessions
        result = self.runner.live(plan)
        if self._echo is not None:
            self._echo.apply(plan, result, sessions, t_start)
        sch.apply_live(plan, result)
        t_live = clock()
        if self._echo is not None:
            self._echo.sent(t_live)
        # paused work (tool-call tokens, prefills, catch-up): what fits before the deadline, then what is owed
        until = max(deadline - self.config.safety_margin_ms / 1000, t_live + self.config.reserve_ms / 1000)
        cadence = self.config.cadence_locked_tools
        skip: frozenset[str] = frozenset()
        served: frozenset[str] = frozenset()
        while not self._stop.is_set():
            now = clock()
            sch.poll(now)
            budget_ms = (until - now) * 1e3
            work = sch.next_tool_work(budget_ms, skip, served) if budget_ms > 0 else None
            if work is None:
                work = sch.owed_work()
                if work is None:
                    break
                self.acct.owed[work.kind] = self.acct.owed.get(work.kind, 0) + 1
            served = served | {work.kind}
            if cadence and work.kind in ("call", "result"):
                skip = skip | {work.kind}
            t = clock()
            res = self.runner.tool(work)
            done = sch.apply_tool(work, res, (clock() - t) * 1e3)
            for slot, key in done.saves:
                sch.forget_prompts(self.runner.save_prompt(slot, key))
            for call_ms, ticks in done.calls:
                self.acct.record_call(call_ms, ticks)
        t_end = clock()
        self.acct.record_tick(
            (t_live - t_start) * 1e3, (t_end - t_start) * 1e3, t_live > deadline, t_end > deadline
        )

    def _warm_up(self) -> None:
        """Run the live step and each bucket of tool-call steps once on the scratch rows (capturing their graphs
        on CUDA) so that the cost model starts from measurements, capture the other slack buckets' graphs on
        CUDA; then fresh state."""
        p, S = self.pipeline, self.config.num_slots
        idle = torch.zeros(S, dtype=torch.bool, device=self.device)
        minus = torch.full((S,), -1, dtype=torch.long, device=self.device)
        with torch.inference_mode():
            for _ in range(2):
                p.live_step(
                    torch.zeros(S, self.model_cfg.clock.input_samples, device=self.device), idle, minus, minus
                )
            b = 1
            while b <= pow2_at_least(S):
                step = self.runner.slack[("call", b, 1)]  # padding rows only: no slot's state changes
                step()
                t = time.monotonic()
                step()
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                self.scheduler.costs.observe("call", b, 1, (time.monotonic() - t) * 1e3)
                b *= 2
            if self.runner.step.captured:  # every other slack bucket captured now, not in a tick
                t = time.monotonic()
                n = self.runner.prepare_slack(self.scheduler.limits.max_chunk)
                log.info("captured %d slack-work graphs in %.1f s", n, time.monotonic() - t)
        p.prepare()

    # -- observation and shutdown -----------------------------------------------------------------------

    def snapshot(self) -> EngineSnapshot:
        """The engine's state for the monitoring page and the benchmarks. Everything here is computed now, on
        the caller's thread, from counters and references the tick thread keeps (no per-tick copies, no lock
        the tick waits on held). No transcript leaves in clear: each session's `last_words` are redacted
        (engine/privacy.py) before they are cut to LAST_WORDS characters."""
        now = time.monotonic()
        sessions = list(self.pool.sessions.values())
        phases: dict[str, int] = {}
        rows = []
        for s in sessions:
            phases[s.phase.value] = phases.get(s.phase.value, 0) + 1
            calling = list(s.call_names) if s.phase in (Phase.TOOL_CALL, Phase.WAITING, Phase.PREFILL) else []
            rows.append(SessionSnapshot(
                id=s.id, slot=s.slot, phase=s.phase.value, age_s=round(now - s.opened_at, 1),
                frames_in=s.inbox.frames_in, frames_consumed=s.frames_consumed, frames_replayed=s.frames_replayed,
                underruns=s.underruns, dropped_frames=s.inbox.dropped, tool_calls=s.tool_calls,
                tool_errors=s.tool_errors, backlog_frames=len(s.inbox), skipped_frames=s.inbox.skipped,
                label=s.label, caller=s.caller, speaking=s.speaking, calling=calling,
                last_words=last_words(list(s.said), s.private, LAST_WORDS,
                                      truncated=len(s.said) == SAID_PIECES, going=s.speaking),
            ))  # fmt: skip
        a = self.acct
        tick_ms = list(a.tick_ms)
        per = max(1, round(1000 / self.config.tick_ms))  # live steps per history point (about a second)
        hist_max, hist_p50 = history(list(a.live_ms), per)
        used, total = _memory(self.device)
        log_rows = [ToolCallSnapshot(session=c.session, label=c.label, names=list(c.names), ok=c.ok, at=c.at,
                                     call_ms=round(c.call_ms, 1), tool_ms=round(c.tool_ms, 1),
                                     resume_ms=round(c.resume_ms, 1))
                    for c in list(self.scheduler.call_log)]  # fmt: skip
        return EngineSnapshot(
            preset=self.config.preset, device=str(self.device), num_slots=self.config.num_slots,
            occupancy=self.occupancy, ticks=a.ticks, tick_ms_p50=pct(a.live_ms, 50), tick_ms_p99=pct(a.live_ms, 99),
            tick_ms_max=round(max(a.live_ms), 3) if a.live_ms else 0.0,
            missed_deadlines=a.missed_deadlines, overruns=a.overruns, slipped_ticks=a.slipped_ticks,
            overloaded=self.overloaded, refused_sessions=self.refused,
            dropped_frames=a.closed_dropped + sum(s.inbox.dropped for s in sessions),
            skipped_frames=a.closed_skipped + sum(s.inbox.skipped for s in sessions),
            underruns=self.scheduler.underruns, tool_calls=a.tool_calls, tool_call_ms_p50=pct(a.tool_call_ms, 50),
            tool_call_ticks_p50=pct(a.tool_call_ticks, 50), resume_ms_p50=pct(a.resume_ms, 50), phases=phases,
            sessions=rows, recent_tick_ms=[round(x, 2) for x in tick_ms[-200:]], at=time.time(),
            tick_budget_ms=self.config.tick_ms, history_step_s=per * self.config.tick_ms / 1000,
            history_max_ms=hist_max, history_p50_ms=hist_p50, memory_bytes=used, memory_total_bytes=total,
            tool_log=log_rows, echo=self._echo.snapshot() if self._echo is not None else None,
        )  # fmt: skip

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
        self.pipeline = self.runner = None  # the only references: no cycle holds them, so they die here
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _memory(device: torch.device) -> tuple[int, int]:
    """(in use, total) bytes: CUDA memory allocated on the device and its size; on CPU the process's resident
    memory and the machine's."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device), torch.cuda.get_device_properties(device).total_memory
    resident = resident_bytes()  # 0 without /proc (macOS): unknown
    return (resident, os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")) if resident else (0, 0)


def _json_object(text: object) -> dict:
    """`text` parsed as a JSON object, or {} (a result may be any text)."""
    try:
        value = json.loads(text) if isinstance(text, str | bytes) and len(text) < 1_000_000 else None
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _put_all(q: asyncio.Queue, items: list[Output]) -> None:
    for item in items:
        q.put_nowait(item)
