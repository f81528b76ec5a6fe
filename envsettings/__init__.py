"""The base of every Chorus settings object (the tools' store, the agent worker, the monitoring page).

Each field of a subclass names its environment variable; `from_env()` reads them over a `.env` file in the
working directory, and a bad value is refused with one `SettingsError` line naming the variable, its value and
what is allowed. Knows pydantic-settings and `.env`; knows no variable of its own. Nothing happens at import.
"""

from __future__ import annotations

import re
import sys
from typing import Any, Self

from pydantic import Field, ValidationError
from pydantic_settings import (
    BaseSettings,
    DotEnvSettingsSource,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

__all__ = ["EnvSettings", "SettingsError"]

_PASSWORD = re.compile(r"(://[^:/@\s]*:)[^@\s]*@")  # scheme://user:PASSWORD@host


class SettingsError(ValueError):
    """A setting's value is refused; the message is one line: `NAME=value: must be <what is allowed>`."""


class EnvSettings(BaseSettings):
    """Constructed in code, holds exactly the values given (defaults for the rest); `from_env()` reads each
    field's variable from the environment, then from `.env` in the working directory. Empty means unset."""

    model_config = SettingsConfigDict(
        env_file=".env",
        dotenv_filtering="only_existing",  # `.env` holds every Chorus variable; each class takes its own
        env_ignore_empty=True,
        case_sensitive=True,
        extra="forbid",
        populate_by_name=True,
        frozen=True,
        allow_inf_nan=False,  # every number is finite: `inf` is no timeout, NaN no number
    )

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        **_: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings,)  # construction never reads the environment; from_env does

    @classmethod
    def from_env(cls, *, dotenv: bool = True) -> Self:
        """The settings from the environment (which wins) and `.env`; SettingsError on the first bad value."""
        values = DotEnvSettingsSource(cls)() if dotenv else {}
        values.update(EnvSettingsSource(cls)())
        values = {name: value.strip() for name, value in values.items() if value.strip()}
        try:
            return cls(**values)
        except ValidationError as e:
            raise SettingsError(_one_line(cls, e)) from None

    @classmethod
    def for_command(cls, command: str) -> Self | None:
        """The settings from the environment for a command line tool; None, with the refused value said on
        stderr as `command: NAME=value: must be ...`, when one is bad (the command then exits 2)."""
        try:
            return cls.from_env()
        except SettingsError as e:
            print(f"{command}: {e}", file=sys.stderr)
            return None


def whole(default: int, low: int, high: int, name: str) -> Any:
    """A setting that is a whole number from `low` to `high`, read from the variable `name`."""
    return Field(
        default, ge=low, le=high, validation_alias=name, description=f"a whole number from {low} to {high}"
    )


def _one_line(cls: type[EnvSettings], e: ValidationError) -> str:
    """`NAME=value: must be ...` for the first error: a validator's words, else the field's description."""
    error = e.errors()[0]
    name = str(error["loc"][0]) if error["loc"] else cls.__name__
    field = next((f for n, f in cls.model_fields.items() if name in (n, f.validation_alias)), None)
    reason = str(error.get("ctx", {}).get("error", ""))
    allowed = reason or (field.description if field and field.description else error["msg"])
    value = _PASSWORD.sub(r"\1***@", str(error.get("input", "")))
    return f"{name}={value}: must be {allowed}"
