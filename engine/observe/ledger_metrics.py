"""The tick's ledger (engine/tick/ledger.py) as Prometheus series: per kind and bucket of side work the
predicted and measured device time, the pieces run, the ticks that ended late and what ran in them, and the
parts of a tick (the live step, the time it waited for earlier work, the side work, the host's).

Read at a scrape, on the metrics thread, from the ledger's `report` (the same dict the snapshot's
`tick_ledger` holds): nothing is added to the tick. Knows the report's shape; nothing of the tick.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from prometheus_client import REGISTRY
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

QUANTILES = (("0.5", "p50"), ("0.99", "p99"))
PARTS = {"live": "live_ms", "wait": "live_wait_ms", "side": "side_ms", "host": "host_ms"}


def series(report: dict) -> list:
    """The metric families of one ledger report."""
    predicted = GaugeMetricFamily(
        "chorus_side_piece_predicted_seconds",
        "A side piece's device time as predicted when it started, over the bucket's latest pieces",
        labels=["kind", "bucket", "quantile"],
    )
    measured = GaugeMetricFamily(
        "chorus_side_piece_device_seconds",
        "A side piece's device time as measured at the tick's fence, over the bucket's latest pieces",
        labels=["kind", "bucket", "quantile"],
    )
    run = CounterMetricFamily(
        "chorus_side_pieces",
        "Side pieces run, by kind and bucket (rows x positions)",
        labels=["kind", "bucket"],
    )
    for key, b in report["pieces"].items():
        kind, bucket = key.split("/", 1)
        run.add_metric([kind, bucket], b["run"])
        for q, name in QUANTILES:
            if b[f"predicted_ms_{name}"] is not None:
                predicted.add_metric([kind, bucket, q], b[f"predicted_ms_{name}"] / 1000)
            if b[f"measured_ms_{name}"] is not None:
                measured.add_metric([kind, bucket, q], b[f"measured_ms_{name}"] / 1000)
    parts = GaugeMetricFamily(
        "chorus_tick_part_seconds",
        "A tick's parts over the latest ticks: the live step on the device, the time it waited for earlier "
        "work, the side work on the device, the host's work",
        labels=["part", "quantile"],
    )
    for part, field in PARTS.items():
        figures = report[field]
        for q, name in (*QUANTILES, ("1", "max")):
            if figures[name] is not None:
                parts.add_metric([part, q], figures[name] / 1000)
    late = CounterMetricFamily(
        "chorus_late_ticks", "Ticks whose work ended past their deadline, as the ledger counts them"
    )
    late.add_metric([], report["late_ticks"])
    late_ran = CounterMetricFamily(
        "chorus_late_tick_pieces", "Side pieces that ran in ticks that ended late, by kind", labels=["kind"]
    )
    for kind, n in sorted(report["late_ran"].items()):
        late_ran.add_metric([kind], n)
    late_max = GaugeMetricFamily("chorus_late_tick_seconds_max", "The most a tick ended past its deadline")
    late_max.add_metric([], report["late_ms_max"] / 1000)
    return [predicted, measured, run, parts, late, late_ran, late_max]


class _LedgerCollector:
    source: Callable[[], dict | None] | None = None  # the process's engine's ledger report (the newest)

    def collect(self):
        source = type(self).source
        report = source() if source is not None else None
        if report is not None:
            yield from series(report)


_lock = threading.Lock()
_registered: list[_LedgerCollector] = []  # registered once per process


def publish_ledger(source: Callable[[], dict | None]) -> None:
    """`/metrics` reads the ledger's series from `source` at a scrape (the process's newest engine)."""
    with _lock:
        if not _registered:
            _registered.append(_LedgerCollector())
            REGISTRY.register(_registered[0])
        _LedgerCollector.source = source
