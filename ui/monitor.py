"""The Chorus monitoring page: `python -m ui` (or `streamlit run ui/monitor.py`).

Polls each worker's engine snapshot (`GET /snapshot`, one worker per GPU) every few seconds in a fragment and
shows whether the tick holds, who is talking, who waits on a tool and what was booked; with several workers,
each one's figures side by side and the fleet's totals; a worker that stops answering is marked and the others
keep showing. Nothing personal: rooms by their labels, phone numbers, names and codes masked, and the agent's
words only as counts unless a worker sends them (then redacted again and cut short); with an access token
set, a visitor without it sees only the refusal.
Knows Streamlit and the pieces of `ui/`; reads the engine only through its HTTP snapshot.
"""

from __future__ import annotations

import hmac
import time

import altair as alt
import pandas as pd
import streamlit as st

from engine.api import EngineSnapshot
from envsettings import SettingsError
from tools.settings import StoreSettings
from tools.store import Store
from ui import fleet
from ui.bookings import latest_bookings, open_bookings
from ui.settings import MonitorSettings, PageAccess, parse_urls

WORKER_COLUMNS = 4  # workers side by side in one row


def main() -> None:
    st.set_page_config(page_title="Chorus monitor", layout="wide")
    _let_in()
    try:
        settings = MonitorSettings.from_env()
        store_settings = StoreSettings.from_env()
    except SettingsError as e:
        st.error(f"The monitor's settings are refused: {e}")
        st.stop()
    urls, refresh_s = _sidebar(settings, store_settings)
    st.title("Chorus")
    st.fragment(run_every=refresh_s)(_live)(urls, settings, store_settings, refresh_s)


def _let_in() -> None:
    """The token check, before anything else (settings and their errors included): without the token, the
    page shows its refusal and nothing more. A token setting that is itself refused lets nobody in."""
    try:
        access = PageAccess.from_env()
    except SettingsError:
        st.error(
            "Refused: the page's access token is misconfigured (CHORUS_MONITOR_TOKEN); nobody is let in."
        )
        st.stop()
    if access.token is not None and not _token_ok(access.token.get_secret_value()):
        st.error("Refused: this page needs its access token. Open it as `/?token=...`.")
        st.stop()


def _token_ok(token: str) -> bool:
    given = st.query_params.get("token", "")
    return hmac.compare_digest(given.encode(), token.encode())


def _sidebar(settings: MonitorSettings, store_settings: StoreSettings) -> tuple[list[str], float]:
    with st.sidebar:
        st.header("Workers")
        text = st.text_area(
            "Snapshot URLs, one a line", value="\n".join(settings.snapshot_urls), key="urls", height=120
        )
        try:
            urls = parse_urls(text)
        except ValueError:
            st.warning("Each line must be an http:// or https:// URL; showing the configured workers.")
            urls = settings.snapshot_urls
        refresh_s = st.number_input(
            "Refresh every (s)", min_value=0.5, max_value=60.0, value=settings.refresh_s, step=0.5
        )
        st.caption(f"Bookings from {store_settings.describe()}.")
    return urls, float(refresh_s)


def _live(
    urls: list[str], settings: MonitorSettings, store_settings: StoreSettings, refresh_s: float
) -> None:
    workers = fleet.fetch_all(urls, settings.timeout_s)
    last_up: dict[str, float] = st.session_state.setdefault("last_up", {})
    for w in workers:
        if w.up:
            last_up[w.url] = w.fetched_at
    _banners(workers, last_up)
    up = [w for w in workers if w.up]
    if len(workers) == 1 and up:
        _headline(up[0].snapshot)
    elif len(workers) > 1:
        _fleet(workers)
    if up:
        _tick_chart(workers, max(w.snapshot.tick_budget_ms for w in up))
        _side_work(workers)
        _sessions(workers, settings.trace_url)
        _tool_log(workers)
    if settings.bookings:
        _bookings(store_settings, settings.bookings)
    st.caption(f"Updated {time.strftime('%H:%M:%S')}, every {refresh_s:g} s.")


def _ago(t: float | None) -> str:
    return "never answered" if t is None else f"last answer {time.time() - t:.0f} s ago"


def _banners(workers: list[fleet.Worker], last_up: dict[str, float]) -> None:
    down = [w for w in workers if not w.up]
    if not workers:
        st.error("No worker to watch: give the snapshot URLs in the sidebar or in CHORUS_MONITOR_URLS.")
    elif len(down) == len(workers):
        lines = [f"- {w.url}: {w.error} ({_ago(last_up.get(w.url))})" for w in down]
        st.error(
            "**The worker cannot be reached.** Retrying.\n" + "\n".join(lines)
            if len(workers) == 1
            else "**No worker can be reached.** Retrying.\n" + "\n".join(lines)
        )
    else:
        for w in down:
            st.warning(
                f"**Worker {w.name} is not answering**: {w.error} ({_ago(last_up.get(w.url))}). "
                "The other workers are shown; its figures are left out of the totals."
            )


def _headline(snap: EngineSnapshot) -> None:
    budget = snap.tick_budget_ms
    cols = st.columns(8)
    cols[0].metric("Live sessions", f"{len(snap.sessions)} / {snap.num_slots}")
    cols[1].metric(
        "Live step p50", fleet.ms(snap.live_ms_p50), help="the live step's median over the last minutes"
    )
    cols[2].metric(
        "Live step p99",
        fleet.ms(snap.live_ms_p99),
        delta=f"{snap.live_ms_p99 - budget:+.0f} ms",
        delta_color="inverse",
        help=f"against the {budget:g} ms budget",
    )
    cols[3].metric("Missed deadlines", snap.missed_deadlines)
    cols[4].metric("Dropped frames", snap.dropped_frames)
    cols[5].metric("Underruns", snap.underruns, help="live ticks with no caller frame (silence fed)")
    cols[6].metric("Device memory", fleet.memory(snap), help=fleet.memory_help(snap))
    cols[7].metric("Gaps heard / late absorbed", _heard(snap), help=HEARD_HELP)
    _about(snap)


HEARD_HELP = (
    "the calls now live: silences a caller heard inside the agent's turns, and the agent's frames that came "
    "late but that the playout's buffer covered without one"
)


def _heard(snap: EngineSnapshot) -> str:
    """The gaps callers heard and the late frames absorbed, over the live sessions' calls."""
    gaps = sum(s.playout_gaps for s in snap.sessions)
    return f"{gaps} / {sum(s.late_absorbed for s in snap.sessions)}"


def _about(snap: EngineSnapshot) -> None:
    phases = " · ".join(f"{fleet.STATES.get(p, p)} {n}" for p, n in sorted(snap.phases.items()))
    st.caption(
        f"{snap.preset} on {snap.device}, {snap.ticks:,} ticks, {snap.tool_calls} tool calls"
        + (f"; {phases}" if phases else "")
    )
    if snap.overloaded:
        st.warning(f"Overloaded: new sessions are refused ({snap.refused_sessions} so far).")
    if snap.redispatches:
        lost = " · ".join(f"{why} {n}" for why, n in sorted(snap.redispatches.items()))
        st.caption(f"New agents for rooms left alone: {lost}")


def _fleet(workers: list[fleet.Worker]) -> None:
    t = fleet.totals(workers)
    st.subheader("Fleet")
    cols = st.columns(6)
    cols[0].metric("Workers answering", f"{t.workers_up} / {t.workers}")
    cols[1].metric("Rooms", t.rooms)
    cols[2].metric("Free slots", t.free_slots)
    cols[3].metric("Worst live step p99", fleet.ms(t.worst_p99_ms))
    cols[4].metric("Missed deadlines", t.missed_deadlines)
    cols[5].metric(
        "Re-dispatched", t.redispatches, help="rooms with a caller and no live agent that got a new one"
    )
    for start in range(0, len(workers), WORKER_COLUMNS):
        row = workers[start : start + WORKER_COLUMNS]
        for col, w in zip(st.columns(WORKER_COLUMNS), row, strict=False):
            with col, st.container(border=True):
                st.markdown(f"**{w.name}**")
                if w.snapshot is None:
                    st.error(f"down: {w.error}")
                    continue
                s = w.snapshot
                st.metric("Live sessions", f"{len(s.sessions)} / {s.num_slots}")
                st.metric("Live step p50 / p99", f"{fleet.ms(s.live_ms_p50)} / {fleet.ms(s.live_ms_p99)}")
                st.metric("Missed deadlines", s.missed_deadlines)
                st.metric("Gaps heard / late absorbed", _heard(s), help=HEARD_HELP)
                st.metric("Dropped frames / underruns", f"{s.dropped_frames} / {s.underruns}")
                st.metric("Device memory", fleet.memory(s), help=fleet.memory_help(s))
                if s.overloaded:
                    st.warning("overloaded: refusing new sessions")


def _tick_chart(workers: list[fleet.Worker], budget_ms: float) -> None:
    st.subheader("Tick time")
    series = fleet.tick_series(workers)
    points = [{"seconds": x, "ms": y, "series": name} for name, pts in series.items() for x, y in pts]
    if not points:
        st.caption("No ticks measured yet.")
        return
    data = pd.DataFrame(points)
    lines = (
        alt.Chart(data)
        .mark_line()
        .encode(
            x=alt.X("seconds:Q", title="seconds ago"),
            y=alt.Y("ms:Q", title="live step (ms)"),
            color=alt.Color("series:N", title=None),
        )
    )
    budget = (
        alt.Chart(pd.DataFrame({"ms": [budget_ms]}))
        .mark_rule(color="red", strokeDash=[6, 4])
        .encode(y="ms:Q")
    )
    st.altair_chart(lines + budget, width="stretch")
    st.caption(f"The live step, per second, over the last minutes; red: the {budget_ms:g} ms budget.")


def _side_work(workers: list[fleet.Worker]) -> None:
    """The tick's ledger: each bucket of side work, predicted against measured on the device, the time the
    live step waited for earlier work, and the late ticks with what ran in the latest."""
    st.subheader("Side work")
    rows, notes = [], []
    for w in workers:
        ledger = w.snapshot.tick_ledger if w.snapshot is not None else None
        if not ledger:
            continue
        for key, b in ledger["pieces"].items():
            kind, bucket = key.split("/", 1)
            row = {"worker": w.name} if len(workers) > 1 else {}
            row |= {"kind": kind, "rows x positions": bucket, "pieces": b["run"]}
            row |= {
                f"{what} ms {q}": b[f"{what}_ms_{q}"]
                for what in ("predicted", "measured")
                for q in ("p50", "p99")
            }
            rows.append(row)
        wait, late = ledger["live_wait_ms"], ledger["missed"]
        ran = ", ".join(f"{p['kind']} {p['rows']}x{p['positions']}" for p in late[-1]["ran"]) if late else ""
        notes.append(
            (f"{w.name}: " if len(workers) > 1 else "")
            + f"the live step waited for earlier work {wait['p50']} ms p50, {wait['p99']} p99, "
            + f"{wait['max']} max; "
            + f"{ledger['late_ticks']} late ticks"
            + (f" (the latest: {late[-1]['why']}; ran {ran or 'no side work'})" if late else "")
        )
    if rows:
        st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")
    else:
        st.caption("No side work measured yet.")
    for note in notes:
        st.caption(note)


def _sessions(workers: list[fleet.Worker], trace_url: str) -> None:
    rows = fleet.session_rows(workers, trace_url)
    st.subheader(f"Sessions ({len(rows)})")
    if rows:
        links = {"trace": st.column_config.LinkColumn("trace", display_text="open trace")}
        st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch", column_config=links)
    else:
        st.caption("No open sessions.")


def _tool_log(workers: list[fleet.Worker]) -> None:
    rows = fleet.tool_log_rows(workers)
    st.subheader("Tool calls")
    if rows:
        st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")
    else:
        st.caption("No finished tool calls yet.")


@st.cache_resource(show_spinner=False)
def _store(database_url: str | None, data_dir: str, schema: str) -> Store | None:
    return open_bookings(StoreSettings(database_url=database_url, data_dir=data_dir, db_schema=schema))


def _bookings(settings: StoreSettings, n: int) -> None:
    st.subheader("Latest bookings")
    if not settings.database_url and not settings.sqlite_path.exists():
        st.caption(f"No bookings database yet ({settings.describe()}).")
        return
    try:
        store = _store(settings.database_url, str(settings.data_dir), settings.schema)
        rows = latest_bookings(store, n) if store is not None else []
    except Exception as e:  # noqa: BLE001 (the database is down or unreadable: the rest of the page still shows)
        st.warning(f"Bookings cannot be read: {type(e).__name__}.")
        return
    if rows:
        st.dataframe(pd.DataFrame(rows), hide_index=True, width="stretch")
    else:
        st.caption("No bookings yet.")


main()
