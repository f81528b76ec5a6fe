"""The monitoring page's side work (ui/monitor.py `_side_work`): the tick's ledger from a real engine's
snapshot, each bucket predicted against measured, and the time the live step waited for earlier work."""

from __future__ import annotations

from test_monitor import Worker, page, store_env, table  # noqa: F401 (store_env: the page's fixture)


def test_the_page_shows_each_bucket_of_side_work_and_the_live_steps_wait(store_env, monkeypatch):  # noqa: F811
    w = Worker(slots=2, sessions=1)  # its prompt prefilled in the slack: prompt pieces in the ledger
    try:
        ledger = w.engine.snapshot().tick_ledger
        assert ledger["pieces"]
        at = page(monkeypatch, w.url)
        rows = table(at, {"kind", "rows x positions", "predicted ms p99", "measured ms p50"})
        assert {f"{r['kind']}/{r['rows x positions']}": r["pieces"] for r in rows} == {
            key: b["run"] for key, b in ledger["pieces"].items()
        }
        for r in rows:
            b = ledger["pieces"][f"{r['kind']}/{r['rows x positions']}"]
            assert (
                r["measured ms p50"] == b["measured_ms_p50"]
                and r["predicted ms p99"] == b["predicted_ms_p99"]
            )
        captions = [c.value for c in at.caption]
        assert any(
            c.startswith("the live step waited for earlier work") and "0 late ticks" in c for c in captions
        )
    finally:
        w.close()
