"""What a database failure means for a transaction: retry it, retry it once elsewhere, give up at once, or
a bug. Knows the kinds, not which driver error is which (each backend classifies its own).
"""

from __future__ import annotations


class StoreError(Exception):
    """The database refused something the code should never ask for (a bug, not a caller error)."""


class Conflict(StoreError):
    """A concurrent writer took a unique key or changed a row first; the transaction is retried."""


class Duplicate(StoreError):
    """A unique key the transaction inserts already exists, and not because a concurrent writer took it
    first (a unique violation again on the retry, or on SQLite, whose writers cannot race): the caller is
    told `AlreadyExists` at once, never retried."""


class Transient(StoreError):
    """Locked, deadlocked or not serializable right now; the transaction is retried."""


class Lost(StoreError):
    """The connection broke (the server restarted or ended it, the network failed, or it was cut at the
    call's deadline); the transaction is retried once on another connection."""


class Unavailable(StoreError):
    """The database cannot serve this now (a statement timed out, the call's deadline passed, the server is
    out of resources); the caller is told `Busy` at once."""


class SchemaTooNew(StoreError):
    """The database was migrated by a newer version of this code."""
