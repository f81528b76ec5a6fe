"""Where bookings live, from the environment: `DATABASE_URL` (PostgreSQL) or a SQLite file under
`CHORUS_DATA_DIR` (default ./data); `CHORUS_DB_SCHEMA` picks a PostgreSQL schema (default public).
Read once, passed explicitly; nothing happens at import time."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

SQLITE_FILE = "hotel.sqlite3"


@dataclass(frozen=True)
class StoreSettings:
    data_dir: Path = Path("data")
    database_url: str | None = None
    pool_size: int = 8
    schema: str = "public"

    def __post_init__(self) -> None:
        object.__setattr__(self, "data_dir", Path(self.data_dir))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> StoreSettings:
        env = os.environ if env is None else env
        url = (env.get("DATABASE_URL") or "").strip() or None
        if url is not None and not url.startswith(("postgresql://", "postgres://")):
            raise ValueError("DATABASE_URL must be a postgresql:// URL (leave it empty for SQLite)")
        pool = int(env.get("CHORUS_DB_POOL_SIZE") or cls.pool_size)
        schema = env.get("CHORUS_DB_SCHEMA") or cls.schema
        return cls(Path(env.get("CHORUS_DATA_DIR") or "data"), url, pool, schema)

    @property
    def sqlite_path(self) -> Path:
        return self.data_dir / SQLITE_FILE

    def describe(self) -> str:
        """For logs: which backend, never the credentials."""
        return "postgresql" if self.database_url else f"sqlite at {self.sqlite_path}"
