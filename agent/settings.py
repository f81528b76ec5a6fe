"""Worker settings from the environment (and `.env` in the working directory): the LiveKit server, its
credentials and how long its API may take, engine preset, checkpoint, slots, device, agent name and ports.
Read once with `AgentSettings.from_env()`, passed explicitly; a bad value is a one-line `SettingsError`
(envsettings). Secrets have no defaults and are never logged.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import AliasChoices, BeforeValidator, Field, ValidationInfo, field_validator

from envsettings import EnvSettings, whole

if TYPE_CHECKING:
    from engine.config.engine_config import EngineConfig

__all__ = ["DEFAULT_AGENT_NAME", "AgentSettings", "e164"]

DEFAULT_AGENT_NAME = "chorus-concierge"
E164 = "a phone number in E.164 form: + and 7 to 15 digits, e.g. +14155550100"
_E164 = re.compile(r"\+[1-9][0-9]{6,14}")


def e164(number: str) -> str:
    """`number` in E.164 form (spaces, dots, dashes and brackets dropped); ValueError naming the form if it
    is not one. The number itself is never put in the message: it is personal data."""
    compact = re.sub(r"[\s.()-]", "", number)
    if not _E164.fullmatch(compact):
        raise ValueError(E164)
    return compact


def _not_zero_from_text(value: object) -> object:
    # Code may ask for port 0 (any free port, as the tests do); from the environment a port is 1 to 65535.
    if isinstance(value, str) and value.strip().lstrip("+-0") == "":
        raise ValueError
    return value


Port = Annotated[int, BeforeValidator(_not_zero_from_text), Field(ge=0, le=65535)]
PORT = "a port number, 1 to 65535"
MAX_SLOTS = 4096  # the engine's bound too (EngineConfig.num_slots); its memory may hold fewer
MAX_WINDOW = 1 << 20  # positions of context: far beyond any release's (8,192)
DAY_S = 86400.0  # the longest timeout: a start or a drain that takes longer is stuck
SERVER_URL = "a ws://, wss://, http:// or https:// URL with a host, e.g. wss://hotel.livekit.cloud"


def _server_url(url: str) -> bool:
    """Whether `url` can reach a LiveKit server: its scheme, a host, and a port if any."""
    try:
        parts = urlsplit(url)
        _ = parts.port  # a port that is not one raises
    except ValueError:  # e.g. an unclosed IPv6 bracket
        return False
    return parts.scheme in ("ws", "wss", "http", "https") and bool(parts.hostname) and url.isprintable()


class AgentSettings(EnvSettings):
    livekit_url: str = Field("", validation_alias="LIVEKIT_URL", description=SERVER_URL)
    livekit_api_key: str = Field("", validation_alias="LIVEKIT_API_KEY")
    livekit_api_secret: str = Field("", validation_alias="LIVEKIT_API_SECRET", repr=False)
    # the LiveKit server's API (agent/lkapi.py): how long one try of a call may take. A call that changes
    # nothing or can be repeated safely (list, update, delete) is tried twice; the others once
    livekit_api_timeout_s: float = Field(
        10.0,
        gt=0,
        le=600,
        validation_alias="CHORUS_LIVEKIT_API_TIMEOUT_S",
        description="a number of seconds above 0, at most 600",
    )
    # how long a phone rings before the call is given up (`sip call`, a transfer to the front desk); those
    # calls may take this plus CHORUS_LIVEKIT_API_TIMEOUT_S
    sip_ring_timeout_s: float = Field(
        30.0,
        gt=0,
        le=600,
        validation_alias="CHORUS_SIP_RING_TIMEOUT_S",
        description="a number of seconds above 0, at most 600",
    )
    # the LiveKit cluster's Redis (LiveKit's own `redis.address`: host:port, or a redis:// URL): where the
    # workers mark the rooms they serve and claim a room's new agent (agent/fleet/fleet.py). Unset: no watch,
    # and a room whose agent died stays without one
    redis_url: str = Field("", validation_alias="CHORUS_REDIS_URL", repr=False)
    # ... and who the workers are to it (LiveKit's `redis.username` and `redis.password`: an ACL user, or only
    # the password of `requirepass`); a redis:// URL's own credentials count where these are unset
    redis_username: str = Field("", validation_alias="CHORUS_REDIS_USERNAME")
    redis_password: str = Field("", validation_alias="CHORUS_REDIS_PASSWORD", repr=False)
    # a call's conversation (the agent's turns, its tool calls and results) is kept in the booking database
    # only while the call lasts, for an agent that replaces a lost one (agent/fleet/carry.py); true: after it
    # too
    keep_conversations: bool = Field(
        False, validation_alias="CHORUS_KEEP_CONVERSATIONS", description="true or false"
    )
    preset: str = Field("tiny", validation_alias="CHORUS_PRESET")
    checkpoint: str | None = Field(
        None, validation_alias="CHORUS_CHECKPOINT", description="an existing file or folder"
    )
    tokenizer: str | None = Field(
        None, validation_alias="CHORUS_TOKENIZER", description="an existing tokenizer.json or its folder"
    )
    speaker: str | None = Field(None, validation_alias="CHORUS_SPEAKER")  # a speaker latent of the checkpoint
    slots: int = whole(64, 1, MAX_SLOTS, "CHORUS_SLOTS")  # the engine's own bound (EngineConfig.num_slots)
    # cpu, cuda, cuda:1 ... (unset: cuda when there is one)
    device: str | None = Field(None, validation_alias="CHORUS_DEVICE")
    # LiveKit's own variable wins over Chorus's
    agent_name: str = Field(
        DEFAULT_AGENT_NAME, validation_alias=AliasChoices("LIVEKIT_AGENT_NAME", "CHORUS_AGENT_NAME")
    )
    # the worker's /metrics (livekit-agents' and Chorus's)
    prometheus_port: Port | None = Field(None, validation_alias="CHORUS_PROMETHEUS_PORT", description=PORT)
    # the engine's /snapshot for the monitoring page
    metrics_port: Port | None = Field(None, validation_alias="CHORUS_METRICS_PORT", description=PORT)
    # the agent's words on the snapshot (and so on the monitoring page): off, only counts (turns, words);
    # redacted, the end of its turn with personal data replaced, which misses some (docs/monitoring.md)
    show_words: Literal["off", "redacted"] = Field(
        "off", validation_alias="CHORUS_SHOW_WORDS", description="off or redacted"
    )
    # the worker's health and /worker endpoint (livekit-agents' default if unset)
    http_port: Port | None = Field(None, validation_alias="CHORUS_HTTP_PORT", description=PORT)
    # how long a job runner may take to start (unset: sized from the weights, see agent/worker.py)
    startup_timeout_s: float | None = Field(
        None,
        gt=0,
        le=DAY_S,
        validation_alias="CHORUS_STARTUP_TIMEOUT_S",
        description="a number of seconds above 0, at most 86400",
    )

    # context windows (engine/config/windows.py); empty: the release's. Capacity mode: a short talker window
    talker_window: int | None = Field(
        None,
        ge=2,
        le=MAX_WINDOW,
        validation_alias="CHORUS_TALKER_WINDOW",
        description=f"a whole number of positions from 2 to {MAX_WINDOW}",
    )
    thinker_window: int | None = Field(
        None,
        ge=1,
        le=MAX_WINDOW,
        validation_alias="CHORUS_THINKER_WINDOW",
        description=f"a whole number of positions from 1 to {MAX_WINDOW}",
    )
    capacity_mode: bool = Field(False, validation_alias="CHORUS_CAPACITY_MODE", description="true or false")
    # false: admit callers up to the slots even while the engine has no headroom (it is still measured and
    # shown); for a worker that is the only one of its agent name, where a slow answer beats none
    refuse_when_overloaded: bool = Field(
        True, validation_alias="CHORUS_REFUSE_WHEN_OVERLOADED", description="true or false"
    )
    # LiveKit's server offers a room only to workers whose reported load is under its `agents.target_load`
    # (default 0.7: a worker's share is target_load - load), and livekit-agents' production threshold is 0.7
    # too: the worker reports the share of slots in use scaled to this, so its last free slot is still offered
    load_target: float = Field(
        0.7,
        gt=0,
        le=1,
        validation_alias="CHORUS_LOAD_TARGET",
        description="the LiveKit server's agents.target_load, above 0 and at most 1",
    )
    # SIGTERM: no new jobs; calls in progress go on, and one still going near the end is closed with a goodbye
    drain_timeout_s: float = Field(
        600.0,
        gt=0,
        le=DAY_S,
        validation_alias="CHORUS_DRAIN_TIMEOUT_S",
        description="a number of seconds above 0, at most 86400",
    )
    # dummy weights decide nothing: script each room's agent by teacher forcing (agent/forcing.py); never for
    # a real checkpoint
    teacher_forcing: bool = Field(
        False, validation_alias="CHORUS_TEACHER_FORCING", description="true or false"
    )
    # a measurement tool, never for callers (engine/tick/echo.py, benchmarks/livekit_latency.py): each caller
    # hears their own audio back through the whole path, the engine's tick included; the model runs unheard
    echo: bool = Field(False, validation_alias="CHORUS_ECHO", description="true or false")
    # a benchmark's baseline, never for callers (EngineConfig.fixed_buffers): the buffers as they were before
    # they followed the measured jitter
    fixed_buffers: bool = Field(False, validation_alias="CHORUS_FIXED_BUFFERS", description="true or false")
    # the engine and its tick always run in a process of their own (engine/door/serve.py); each room's call
    # runs in a process of its own (livekit-agents' process executor), which takes the rtc runtime's memory
    # for the call with it when the call ends; false: the rooms are threads of the worker's process (one rtc
    # runtime for all, about a fifth fewer cores per room), whose runtime keeps about 0.65 MB of every call it
    # served
    room_processes: bool = Field(True, validation_alias="CHORUS_ROOM_PROCESSES", description="true or false")
    # with room processes: how many wait, started, for their callers (at most the slots; more are started as
    # callers come, as many at once as the host has cores, up to four); each holds about 110 MB
    warm_rooms: int = whole(4, 0, 1024, "CHORUS_WARM_ROOMS")
    # the caller's audio from the rtc runtime straight into the engine's ring, no Python on its way, and the
    # agent's captures to its track made and answered natively (agent/audio_in/audio_pump.py, built with the
    # host's C compiler on first use); false: through livekit-agents' room input and the SDK's capture, as
    # without one
    native_audio: bool = Field(True, validation_alias="CHORUS_NATIVE_AUDIO", description="true or false")
    # the engine's live step at this real-time priority (SCHED_FIFO; 0: normal priority); refused without
    # CAP_SYS_NICE or RLIMIT_RTPRIO, and then said once in the log
    tick_priority: int = whole(50, 0, 99, "CHORUS_TICK_PRIORITY")
    # how many of a worker process's rooms join at once (connect, then start the call; 0: no limit): callers
    # who arrive together wait their turn rather than stall the calls already live (agent/joins.py)
    joins_at_once: int = whole(2, 0, 1024, "CHORUS_JOINS_AT_ONCE")
    # how much lower than the worker's a room process's CPU priority is (nice): the tick comes first
    room_nice: int = whole(5, 0, 19, "CHORUS_ROOM_NICE")
    # phone calls (agent/phone/phone.py): where a caller is transferred, and the rooms the SIP dispatch rule
    # makes
    front_desk_number: str | None = Field(None, validation_alias="CHORUS_FRONT_DESK_NUMBER", description=E164)
    sip_room_prefix: str = Field(
        "call-",
        pattern=r"^[A-Za-z0-9_-]{1,32}$",
        validation_alias="CHORUS_SIP_ROOM_PREFIX",
        description="1 to 32 letters, digits, - or _",
    )

    def engine_config(self, **overrides: Any) -> EngineConfig:
        """The engine these settings describe, the one mapping from them to `EngineConfig` (the worker's and
        the simulation's); `overrides` are `EngineConfig` fields given another way
        (the simulation's flags)."""
        from engine.config.engine_config import EngineConfig

        fields = {
            "preset": self.preset,
            "num_slots": self.slots,
            "checkpoint": self.checkpoint,
            "tokenizer": self.tokenizer,
            "speaker": self.speaker,
            "talker_window": self.talker_window,
            "thinker_window": self.thinker_window,
            "capacity_mode": self.capacity_mode,
            "refuse_when_overloaded": self.refuse_when_overloaded,
            "echo": self.echo,
            "fixed_buffers": self.fixed_buffers,
            "device": self.device,
            "metrics_port": self.metrics_port,
            "show_words": self.show_words,
            "tick_priority": self.tick_priority,
        }
        return EngineConfig(**(fields | {k: v for k, v in overrides.items() if v is not None}))

    def missing_livekit(self) -> list[str]:
        """The LiveKit connection settings that are not set (their variables' names)."""
        given = {
            "LIVEKIT_URL": self.livekit_url,
            "LIVEKIT_API_KEY": self.livekit_api_key,
            "LIVEKIT_API_SECRET": self.livekit_api_secret,
        }
        return [name for name, value in given.items() if not value]

    @field_validator("livekit_url")
    @classmethod
    def _livekit_server_url(cls, url: str) -> str:
        if url and not _server_url(url):
            raise ValueError  # the description says what is allowed
        return url

    @field_validator("front_desk_number")
    @classmethod
    def _front_desk_e164(cls, number: str | None) -> str | None:
        return None if number is None or not number.strip() else e164(number)

    @field_validator("teacher_forcing")
    @classmethod
    def _forcing_needs_dummy_weights(cls, forcing: bool, info: ValidationInfo) -> bool:
        if forcing and info.data.get("checkpoint"):
            raise ValueError("false with CHORUS_CHECKPOINT set (teacher forcing is for dummy weights)")
        return forcing

    @field_validator("preset")
    @classmethod
    def _known_preset(cls, preset: str) -> str:
        from engine.config.presets import (
            PRESETS,  # the presets' names only; the engine itself is not imported
        )

        if preset not in PRESETS:
            raise ValueError(f"one of {', '.join(sorted(PRESETS))}")
        return preset

    @field_validator("checkpoint", "tokenizer")
    @classmethod
    def _existing_checkpoint(cls, checkpoint: str | None) -> str | None:
        if checkpoint is not None and not Path(checkpoint).exists():
            raise ValueError  # the description says what is allowed
        return checkpoint
