"""The schema's versioned migrations: the SQL files in `migrations/`, written once for both dialects with
their column types as `{date}`, `{timestamp}` and `{bigint}`, rendered per dialect and applied in order.
Knows the files and the `schema_migrations` table; not how a backend connects, locks or retries.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from importlib import resources
from typing import Any

from .errors import SchemaTooNew, StoreError

# What the migrations' type placeholders are in each dialect. SQLite keeps dates and moments as ISO-8601 text
# (times in UTC) and every integer in up to 64 bits.
DIALECT_TYPES = {
    "sqlite": {"date": "TEXT", "timestamp": "TEXT", "bigint": "INTEGER"},
    "postgres": {"date": "DATE", "timestamp": "TIMESTAMPTZ", "bigint": "BIGINT"},
}
_PLACEHOLDER = re.compile(r"\{(\w+)\}")


def render(sql: str, dialect: str) -> str:
    """A migration's SQL with its type placeholders replaced by `dialect`'s types."""
    types = DIALECT_TYPES[dialect]

    def typed(m: re.Match[str]) -> str:
        if m.group(1) not in types:
            raise StoreError(f"no {dialect} type for the placeholder {m.group(0)}")
        return types[m.group(1)]

    return _PLACEHOLDER.sub(typed, sql)


def migrations(dialect: str) -> list[tuple[int, str, str]]:
    """(version, name, sql) for every `NNNN_name.sql` file, in version order, rendered for `dialect`."""
    found = []
    for entry in resources.files(__package__).joinpath("migrations").iterdir():
        stem, dot, suffix = entry.name.partition(".")
        if dot and suffix == "sql":
            version, _, name = stem.partition("_")
            found.append((int(version), name, render(entry.read_text(encoding="utf-8"), dialect)))
    found.sort()
    if [v for v, _, _ in found] != list(range(1, len(found) + 1)):
        raise StoreError(f"migration versions are not 1..n: {[v for v, _, _ in found]}")
    return found


def statements(sql: str) -> list[str]:
    """Split a migration file on semicolons that end a line (our files hold no procedural code)."""
    lines = [line for line in sql.splitlines() if not line.lstrip().startswith("--")]
    return [part.strip() for part in "\n".join(lines).split(";\n") if part.strip().rstrip(";").strip()]


LATEST_VERSION = len(migrations("sqlite"))


def apply_migrations(run: Callable[..., Any], dialect: str, where: str, mark: str, now: Any) -> None:
    """Bring a store's schema to the newest version this code knows, inside the caller's transaction (which
    holds whatever lock keeps two migrators apart). `run(statement, params=())` executes one statement and
    returns its rows; `mark` is the driver's parameter mark, `now` the time recorded per migration. A schema
    newer than this code is SchemaTooNew (`where` names the database in the message)."""
    run(
        "CREATE TABLE IF NOT EXISTS schema_migrations "
        f"(version INTEGER PRIMARY KEY, name TEXT NOT NULL, applied_at {DIALECT_TYPES[dialect]['timestamp']} "
        "NOT NULL)"
    )
    applied = {row[0] for row in run("SELECT version FROM schema_migrations")}
    known = migrations(dialect)
    if applied and max(applied) > len(known):
        raise SchemaTooNew(f"{where} has schema version {max(applied)}; this code knows up to {len(known)}")
    for version, name, text in known:
        if version in applied:
            continue
        for statement in statements(text):
            run(statement)
        run(
            f"INSERT INTO schema_migrations (version, name, applied_at) VALUES ({mark}, {mark}, {mark})",
            (version, name, now),
        )
