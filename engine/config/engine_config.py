"""The engine's settings: one typed, frozen object, validated once (the agent maps its own settings onto it in
`AgentSettings.engine_config`). The tick period is not among them: it is the model's frame (`ClockConfig`).
Knows values and their bounds; knows nothing of the model or of sessions.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.config.dtype_policy import DtypePolicy, DtypePolicyName
from engine.config.presets import PRESETS


class WarmPrompt(BaseModel):
    """A system prompt and its tools, prefilled when the engine starts (`EngineConfig.warm_prompts`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt: str
    tools: list[dict] = []


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
    # the live step as one graph: captured on CUDA (engine/tick/graph.py), traced on the CPU
    # (engine/tick/runner.py)
    cuda_graph: bool = True
    # context windows (positions) of the talker's KV rings and the thinker's attention; None: the release's.
    # `capacity_mode` shortens the talker's to CAPACITY_TALKER_WINDOW (engine/config/windows.py) unless set.
    talker_window: int | None = Field(None, ge=2)
    thinker_window: int | None = Field(None, ge=1)
    capacity_mode: bool = False
    safety_margin_ms: float = Field(6.0, ge=0)  # slack work stops this long before the deadline
    # paused work (tool calls, prefills, catch-up) may use this much of every tick even when the live step
    # left less slack: progress on a slow machine, at the price of counted overruns
    reserve_ms: float = Field(10.0, ge=0)
    switch_interval_ms: float = Field(1.0, gt=0)  # the process's GIL switch interval once the tick runs
    # the live step's real-time priority (SCHED_FIFO, 1-99): no busy thread on the host (a room's event
    # loop, its audio runtime, whose media threads libwebrtc puts at SCHED_FIFO 49) can hold it off the core
    # when its tick is due; 0, or a process the kernel refuses one, runs it at normal priority
    # (engine/process/priority.py)
    tick_priority: int = Field(50, ge=0, le=99)
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
    # prefilled at start, into a slot of their own, and kept in the prompt cache: an agent's prompts, so that
    # its first calls and every call carried on after a break (a new engine's) start from their state
    warm_prompts: list[WarmPrompt] = []
    # the worker's OTEL_* settings by variable name (envsettings/traces.py `TraceSettings.variables`), read
    # once by the worker over its environment and .env; empty: the engine's spans are off
    traces: dict[str, str] = {}
    max_prompt_prefills: int = Field(
        4, ge=1
    )  # distinct new prompts admitted at once (each costs its prefill)
    max_backlog_s: float = Field(30.0, gt=0)  # caller audio held per session while paused
    cadence_locked_tools: bool = False  # baseline: one tool token per tick, results one token per tick
    # baseline for benchmarks: the buffers as they were before they followed the measured jitter (a frame of
    # reserve in every caller's inbox, the tick's phase left where it fell, the room's playout a fixed frame
    # of start delay and no trimming); never for callers
    fixed_buffers: bool = False
    # measurement only (engine/tick/echo.py): every live slot's output is its own input frame, resampled;
    # never for callers
    echo: bool = False
    metrics_port: int | None = None  # serve /snapshot and /metrics on 127.0.0.1 (0: any free port)
    # the agent's words in the snapshot: "off" (counts only: turns, words) or "redacted" (the end of its
    # current or last turn, personal data replaced as redaction/ can, which misses some: monitoring.md)
    show_words: Literal["off", "redacted"] = "off"
    metrics_host: str = "127.0.0.1"
    start: bool = True  # start the tick thread at once

    def model_post_init(self, __context) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"preset: unknown preset {self.preset!r}; choose one of {sorted(PRESETS)}")
        if self.checkpoint is not None and not Path(self.checkpoint).exists():
            raise FileNotFoundError(f"checkpoint: {self.checkpoint!r} does not exist")
