"""The tick's ledger on `/metrics` and in the snapshot (engine/observe/ledger_metrics.py, engine/observe/
snapshot.py `tick_ledger`): per kind and bucket the predicted and measured device time of the side pieces,
the pieces run, the parts of a tick (the live step, its wait, the side work, the host), and the late ticks
with what ran in them; read over HTTP from an engine that has ticked."""

from __future__ import annotations

import urllib.request

from engine.api import EngineSnapshot
from engine.observe.ledger_metrics import series
from engine.tick.ledger import Ledger, Piece, TickRecord
from engine_support import caller_audio, engine_on, run_ticks
from testkit.concierge import PROMPT, TOOLS


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    """Every `chorus_` sample of `/metrics`: (name, its labels) -> value."""
    prom = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60).read().decode()
    out = {}
    for line in prom.splitlines():
        if not line.startswith("chorus_"):
            continue
        sample, value = line.rsplit(" ", 1)
        name, _, labels = sample.partition("{")
        pairs = (p.split("=", 1) for p in labels.rstrip("}").split(",") if p)
        out[name, frozenset((k, v.strip('"')) for k, v in pairs)] = float(value)
    return out


def at(name: str, **labels: str) -> tuple[str, frozenset]:
    return name, frozenset(labels.items())


def test_an_engines_ledger_reads_on_metrics_and_in_the_snapshot():
    with engine_on(num_slots=2, metrics_port=0) as e:
        h = e.open_session(PROMPT, TOOLS)
        h.push_audio(caller_audio(0, 0.8))
        k = run_ticks(e, 0, 6)  # the prompt is prefilled in the slack: prompt pieces, timed at the fence
        e.run_tick(k, e.clock() - 0.01)  # a tick already past its deadline: late, and the ledger says so
        url = f"http://127.0.0.1:{e.server.port}"
        snap = EngineSnapshot.model_validate_json(
            urllib.request.urlopen(url + "/snapshot", timeout=60).read()
        )
        ledger = snap.tick_ledger
        assert ledger is not None and ledger["ticks"] == 7
        prompts = {key: b for key, b in ledger["pieces"].items() if key.startswith("prompt/")}
        assert prompts, ledger["pieces"]
        assert all(b["run"] >= 1 and b["measured_ms_p50"] > 0 for b in prompts.values())
        assert all(b["predicted_ms_p50"] is not None for b in prompts.values())
        assert ledger["live_ms"]["p50"] > 0 and ledger["live_wait_ms"]["max"] >= 0
        assert ledger["late_ticks"] == 1 and ledger["missed"][-1]["tick"] == k and ledger["missed"][-1]["why"]
        value = scrape(e.server.port)
        for key, b in prompts.items():
            bucket = key.split("/", 1)[1]
            assert value[at("chorus_side_pieces_total", kind="prompt", bucket=bucket)] == b["run"]
            measured = value[
                at("chorus_side_piece_device_seconds", kind="prompt", bucket=bucket, quantile="0.5")
            ]
            assert measured == b["measured_ms_p50"] / 1000
            assert (
                at("chorus_side_piece_predicted_seconds", kind="prompt", bucket=bucket, quantile="0.99")
                in value
            )
        for part in ("live", "wait", "side", "host"):
            assert at("chorus_tick_part_seconds", part=part, quantile="0.5") in value
        assert value[at("chorus_tick_part_seconds", part="live", quantile="0.5")] > 0
        assert value[at("chorus_late_ticks_total")] == 1


def test_the_late_ticks_pieces_are_counted_by_kind():
    ledger = Ledger()
    on_time = TickRecord(0, 46.0, 0.0, 20.0, 1.0, -5.0, [Piece("call", 4, 1, 6.4, 6.5)])
    late = TickRecord(
        1, 46.0, 3.0, 35.0, 1.0, 4.0, [Piece("replay", 2, 1, 12.0, 20.0), Piece("call", 1, 1, 6.0, 6.1)]
    )
    ledger.record(on_time)
    ledger.record(late)
    families = {f.name: f for f in series(ledger.report())}
    late_ran = {s.labels["kind"]: s.value for s in families["chorus_late_tick_pieces"].samples}
    assert late_ran == {"replay": 1, "call": 1}
    run = {(s.labels["kind"], s.labels["bucket"]): s.value for s in families["chorus_side_pieces"].samples}
    assert run == {("call", "4x1"): 1, ("replay", "2x1"): 1, ("call", "1x1"): 1}
    wait = {
        s.labels["quantile"]: s.value
        for s in families["chorus_tick_part_seconds"].samples
        if s.labels["part"] == "wait"
    }
    assert wait["1"] == 0.003
    assert families["chorus_late_tick_seconds_max"].samples[0].value == 0.004
