"""Worker settings from the environment (and a `.env` file): LiveKit credentials, engine preset, checkpoint,
slots, agent name and ports. Read once, passed explicitly; secrets never have defaults and are never logged.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field

DEFAULT_AGENT_NAME = "chorus-concierge"


class AgentSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    livekit_url: str = ""
    livekit_api_key: str = ""
    livekit_api_secret: str = Field("", repr=False)
    preset: str = "tiny"
    checkpoint: str | None = None
    slots: int = Field(64, ge=1)
    device: str | None = None
    agent_name: str = DEFAULT_AGENT_NAME
    prometheus_port: int | None = None  # the worker's /metrics (livekit-agents' and Chorus's)
    metrics_port: int | None = None  # the engine's /snapshot for the monitoring page
    http_port: int | None = (
        None  # the worker's health and /worker endpoint (livekit-agents' default if unset)
    )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, *, dotenv: bool = True) -> AgentSettings:
        if env is None:
            if dotenv:
                from dotenv import load_dotenv

                load_dotenv(override=False)
            env = os.environ

        def opt_int(name: str) -> int | None:
            value = (env.get(name) or "").strip()
            return int(value) if value else None

        return cls(
            livekit_url=env.get("LIVEKIT_URL", ""),
            livekit_api_key=env.get("LIVEKIT_API_KEY", ""),
            livekit_api_secret=env.get("LIVEKIT_API_SECRET", ""),
            preset=env.get("CHORUS_PRESET") or "tiny",
            checkpoint=(env.get("CHORUS_CHECKPOINT") or "").strip() or None,
            slots=opt_int("CHORUS_SLOTS") or 64,
            device=(env.get("CHORUS_DEVICE") or "").strip() or None,
            agent_name=env.get("CHORUS_AGENT_NAME") or DEFAULT_AGENT_NAME,
            prometheus_port=opt_int("CHORUS_PROMETHEUS_PORT"),
            metrics_port=opt_int("CHORUS_METRICS_PORT"),
            http_port=opt_int("CHORUS_HTTP_PORT"),
        )
