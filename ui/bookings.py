"""The latest bookings from the tools' database, masked for the monitoring page. Read-only use of the store;
knows nothing of Streamlit."""

from __future__ import annotations

from tools.settings import StoreSettings
from tools.store import Store, open_store
from ui.privacy import mask_code, mask_contact, mask_name


def open_bookings(settings: StoreSettings) -> Store | None:
    """The store the settings point at, or None for a SQLite file that does not exist yet (the page never
    creates one)."""
    if not settings.database_url and not settings.sqlite_path.exists():
        return None
    return open_store(settings)


def latest_bookings(store: Store, n: int) -> list[dict]:
    """The `n` bookings made last, newest first: guest, contact and code masked."""
    found = store.transact(lambda tx: tx.latest_reservations(n))
    return [
        {
            "made": r.created_at.strftime("%Y-%m-%d %H:%M"),
            "code": mask_code(r.code),
            "guest": mask_name(r.guest_name),
            "contact": mask_contact(r.contact),
            "room type": r.room_type,
            "check-in": r.check_in.isoformat(),
            "nights": r.nights,
            "guests": r.guests,
            "total": f"{r.total_cents / 100:,.2f}",
            "status": r.status,
        }
        for r in found
    ]
