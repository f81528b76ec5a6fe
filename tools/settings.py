"""Settings read from the environment, and where bookings live.

`EnvSettings` is the base of every settings object (this store's, the agent's): each field names its
environment variable, `from_env()` reads them over a `.env` file in the working directory, and a bad value
is refused with one `SettingsError` line naming the variable, its value and what is allowed.
`StoreSettings`: `DATABASE_URL` (PostgreSQL) or a SQLite file under `CHORUS_DATA_DIR` (default ./data), the
PostgreSQL schema, the pool size and how long a call waits for a free connection. Nothing happens at import.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Self

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    DotEnvSettingsSource,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

SQLITE_FILE = "hotel.sqlite3"
SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")  # a PostgreSQL schema: an unquoted lower-case identifier
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


def _one_line(cls: type[EnvSettings], e: ValidationError) -> str:
    """`NAME=value: must be ...` for the first error: a validator's words, else the field's description."""
    error = e.errors()[0]
    name = str(error["loc"][0]) if error["loc"] else cls.__name__
    field = next((f for n, f in cls.model_fields.items() if name in (n, f.validation_alias)), None)
    reason = str(error.get("ctx", {}).get("error", ""))
    allowed = reason or (field.description if field and field.description else error["msg"])
    value = _PASSWORD.sub(r"\1***@", str(error.get("input", "")))
    return f"{name}={value}: must be {allowed}"


class StoreSettings(EnvSettings):
    data_dir: Path = Field(Path("data"), validation_alias="CHORUS_DATA_DIR", description="a folder")
    database_url: str | None = Field(
        None,
        validation_alias="DATABASE_URL",
        repr=False,  # may hold a password
        description="a postgresql:// URL (empty: SQLite under CHORUS_DATA_DIR)",
    )
    pool_size: int = Field(
        8, ge=1, validation_alias="CHORUS_DB_POOL_SIZE", description="a whole number of at least 1"
    )
    db_schema: str = Field(
        "public",
        pattern=SCHEMA_NAME.pattern,
        validation_alias="CHORUS_DB_SCHEMA",
        description="a lower-case SQL identifier (a-z, 0-9, _; not starting with a digit)",
    )
    wait_s: float = Field(
        5.0,
        gt=0,
        allow_inf_nan=False,
        validation_alias="CHORUS_DB_WAIT_S",
        description="a number of seconds above 0",
    )

    @field_validator("database_url")
    @classmethod
    def _postgres_only(cls, url: str | None) -> str | None:
        if url is not None and not url.startswith(("postgresql://", "postgres://")):
            raise ValueError  # the description says what is allowed
        return url

    @property
    def schema(self) -> str:
        """The PostgreSQL schema the store lives in (`CHORUS_DB_SCHEMA`)."""
        return self.db_schema

    @property
    def sqlite_path(self) -> Path:
        return self.data_dir / SQLITE_FILE

    def describe(self) -> str:
        """For logs: which backend, never the credentials."""
        return "postgresql" if self.database_url else f"sqlite at {self.sqlite_path}"
