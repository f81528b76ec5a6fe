"""Summarise a long `python -m agent simulate` run: its resident-memory series, whether it stays flat after
warm-up, and the run's figures; writes a JSON record and a plot beside each other.

    .venv/bin/python scripts/soak_report.py out/soak/metrics.json benchmarks/soak-64-rooms-1h

Flat means every sample after the warm-up lies within +-5% of the warm-up's end. Last stdout line: JSON.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from agent.sim.report import TICK_FIGURES

KEEP = (
    "rooms",
    "tool_rooms",
    "seconds",
    "preset",
    "device",
    "slots",
    "ended",
    "join_s",
    "rooms_live",
    "rooms_refused",
    "room_errors",
    *TICK_FIGURES,
    "scripted_calls",
    "function_calls",
    "tool_results",
    "resumes",
    "bookings_made",
    "tool_call_ms_p50",
    "resume_ms_p50",
    "frames_pushed",
    "frames_in",
    "input_errors",
)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("metrics", help="metrics.json of the run")
    p.add_argument("out", help="output path without extension: OUT.json and OUT.png are written")
    p.add_argument("--warmup-s", type=float, default=600.0, help="seconds of warm-up left out (default 600)")
    args = p.parse_args()
    m = json.loads(Path(args.metrics).read_text())
    rss = m["rss_mb"]  # [[seconds into the talk, MiB], ...]
    after = [mb for t, mb in rss if t >= args.warmup_s]
    base = after[0] if after else None
    spread = (max(abs(mb - base) for mb in after) / base * 100) if after else None
    record = {
        "summary": {k: m["summary"][k] for k in KEEP if k in m["summary"]},
        "warmup_s": args.warmup_s,
        "rss_after_warmup_mb": {
            "first": base,
            "min": min(after, default=None),
            "max": max(after, default=None),
        },
        "rss_max_deviation_pct": round(spread, 2) if spread is not None else None,
        "rss_flat_within_5pct": spread is not None and spread <= 5.0,
        "rss_mb": rss,
    }
    heap = [[t, mb] for t, mb in m.get("heap_mb", []) if mb is not None]  # the C heap in use, when sampled
    if heap:
        h_after = [mb for t, mb in heap if t >= args.warmup_s]
        h_base = h_after[0] if h_after else None
        h_spread = (max(abs(mb - h_base) for mb in h_after) / h_base * 100) if h_after else None
        record["heap_after_warmup_mb"] = {
            "first": h_base,
            "min": min(h_after, default=None),
            "max": max(h_after, default=None),
        }
        record["heap_max_deviation_pct"] = round(h_spread, 2) if h_spread is not None else None
        record["heap_flat_within_5pct"] = h_spread is not None and h_spread <= 5.0
        record["heap_mb"] = heap
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 3.5))
        ax.plot([t / 60 for t, _ in rss], [mb for _, mb in rss], marker=".", lw=1, label="resident")
        if heap:
            ax.plot(
                [t / 60 for t, _ in heap], [mb for _, mb in heap], marker=".", lw=1, label="C heap in use"
            )
        if base is not None:
            ax.axhspan(base * 0.95, base * 1.05, color="green", alpha=0.1, label="+-5% of the warm-up's end")
            ax.axvline(args.warmup_s / 60, color="grey", ls=":", label="end of warm-up")
        s = m["summary"]
        ax.set_title(f"{s['rooms']} rooms ({s['tool_rooms']} with tools), {s['preset']}: resident memory")
        ax.set_xlabel("minutes into the talk")
        ax.set_ylabel("MiB")
        ax.legend(loc="lower right")
        fig.tight_layout()
        fig.savefig(out.with_suffix(".png"), dpi=110)
    except ImportError:
        print("matplotlib is not installed: no plot")
    print(json.dumps({k: v for k, v in record.items() if k not in ("rss_mb", "heap_mb")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
