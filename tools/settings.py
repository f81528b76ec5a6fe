"""Where bookings live, from the environment: `StoreSettings.from_env()` reads `DATABASE_URL` or a SQLite file
under `CHORUS_DATA_DIR`, the schema, the pool size and the wait for a connection; a bad value is a one-line
`SettingsError`. Knows the store's variables, not the agent's or the page's; nothing happens at import.
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import Field, field_validator

from envsettings import EnvSettings

SQLITE_FILE = "hotel.sqlite3"
SCHEMA_NAME = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")  # a PostgreSQL schema: an unquoted lower-case identifier


class StoreSettings(EnvSettings):
    data_dir: Path = Field(Path("data"), validation_alias="CHORUS_DATA_DIR", description="a folder")
    database_url: str | None = Field(
        None,
        validation_alias="DATABASE_URL",
        repr=False,  # may hold a password
        description="a postgresql:// URL (empty: SQLite under CHORUS_DATA_DIR)",
    )
    pool_size: int = Field(
        8, ge=1, le=1024, validation_alias="CHORUS_DB_POOL_SIZE", description="a whole number from 1 to 1024"
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
        le=600,
        validation_alias="CHORUS_DB_WAIT_S",
        description="a number of seconds above 0, at most 600",
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

    @property
    def setting(self) -> str:
        """The setting that says where the store is, for a message about it: `DATABASE_URL` (never its value:
        it may hold a password) or `CHORUS_DATA_DIR=<folder>`."""
        return "DATABASE_URL" if self.database_url else f"CHORUS_DATA_DIR={self.data_dir}"

    def describe(self) -> str:
        """For logs: which backend, never the credentials."""
        return "postgresql" if self.database_url else f"sqlite at {self.sqlite_path}"
