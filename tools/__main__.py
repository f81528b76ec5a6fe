"""Hotel admin: `python -m tools seed | bookings | audit`.
The database comes from the environment (and `.env`): `DATABASE_URL`, or a SQLite file under `CHORUS_DATA_DIR`
(default ./data); a bad setting is one line on stderr and exit status 2. Knows the commands, not the rules.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from datetime import date

from .audit import audit
from .hotel import Hotel
from .rules import money
from .seed import seed
from .settings import StoreSettings
from .store import open_store


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_seed = sub.add_parser(
        "seed", help="create or update the hotel: room types, rates, inventory, policies, FAQ"
    )
    p_seed.add_argument("--today", type=date.fromisoformat, help="first night of inventory (default: today)")
    p_list = sub.add_parser("bookings", help="list reservations")
    p_list.add_argument("--status", choices=["confirmed", "cancelled"])
    p_list.add_argument("--json", action="store_true", help="one JSON object per line")
    sub.add_parser("audit", help="check that inventory counts match the reservations (exit 1 if not)")
    args = parser.parse_args(argv)

    settings = StoreSettings.for_command(args.command)
    if settings is None:
        return 2
    with open_store(settings) as store:
        if args.command == "seed":
            added = seed(store, args.today or _default_today())
            name = store.transact(lambda tx: tx.hotel()).name
            print(f"seeded {name} ({settings.describe()}): {added} inventory nights added")
            return 0
        if args.command == "bookings":
            rows = Hotel(store).reservations(status=args.status)
            for r in rows:
                if args.json:
                    record = asdict(r)
                    record.pop("idempotency_key")
                    print(json.dumps(record, default=str))
                else:
                    print(
                        f"{r.code}  {r.status:<9}  {r.check_in} -> {r.check_out}  {r.room_type:<16} "
                        f"{r.guests}p  {money(r.total_cents):>10}  {r.guest_name}"
                    )
            if not args.json:
                print(f"{len(rows)} reservation{'s' if len(rows) != 1 else ''}", file=sys.stderr)
            return 0
        if args.command == "audit":
            problems = audit(store)
            for problem in problems:
                print(problem)
            print("consistent" if not problems else f"{len(problems)} problems", file=sys.stderr)
            return 1 if problems else 0
    return 2


def _default_today() -> date:
    """Today where the seeded hotel is (before the first seed the database has no time zone)."""
    from datetime import datetime
    from zoneinfo import ZoneInfo

    from .seed import DEFAULT_HOTEL

    return datetime.now(ZoneInfo(DEFAULT_HOTEL.policy.timezone)).date()


if __name__ == "__main__":
    raise SystemExit(main())
