"""The soak's PNG (benchmarks/soak.py): memory per process, calls live against slots in use, each call's
longest unasked silence, the frame-to-ear time per window, with the faults marked where they fell."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from agent.forcing import REPLY_EVERY_S
from testkit.soak_calls import CallRecord
from testkit.soak_report import SILENCE_BOUND_S
from testkit.soak_sampler import ROOM, Recorder


def plot(report: dict, rec: Recorder, records: list[CallRecord], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = np.asarray([s["t"] for s in rec.samples]) / 60
    fig, ax = plt.subplots(4, 1, figsize=(11, 13), sharex=True)
    names = sorted({n for s in rec.samples for n in s["procs"]})
    first_room = True
    for n in names:
        pts = [(s["t"] / 60, s["procs"][n]["rss_mb"]) for s in rec.samples if n in s["procs"]]
        if n.startswith(ROOM):  # one a call: drawn alike, named once
            ax[0].plot(
                *zip(*pts, strict=True), color="0.6", lw=0.6, label="a room's process" if first_room else None
            )
            first_room = False
        else:
            ax[0].plot(*zip(*pts, strict=True), label=n, lw=1)
    ax[0].set_ylabel("resident MiB")
    ax[0].legend(fontsize=6, ncol=4)
    ax[1].step(t, [s["live"] for s in rec.samples], where="post", label="calls live")
    ax[1].step(t, [s["slots"] for s in rec.samples], where="post", label="slots in use")
    ax[1].step(t, [s["leaked"] for s in rec.samples], where="post", label="slots kept after a hang-up")
    ax[1].set_ylabel("calls / slots")
    ax[1].legend(fontsize=7)
    ended = [r for r in records if r.answered_at is not None and r.left_at is not None]
    ax[2].scatter(
        [(r.left_at - rec.t0) / 60 for r in ended],
        [r.longest_unasked(REPLY_EVERY_S) for r in ended],
        s=8,
        label="a call's longest unasked silence (at its hang-up)",
    )
    ax[2].axhline(SILENCE_BOUND_S, color="r", lw=0.8, ls="--", label="bound")
    ax[2].set_ylabel("s")
    ax[2].legend(fontsize=7)
    mid = [(w["from_s"] / 60, w["m2e_ms"]) for w in report["windows"] if w["m2e_ms"].get("n")]
    if mid:
        ax[3].plot([m[0] for m in mid], [m[1]["p50"] for m in mid], "o-", label="frame to ear p50")
        ax[3].plot([m[0] for m in mid], [m[1]["p99"] for m in mid], "o-", label="frame to ear p99")
    ax[3].set_ylabel("ms")
    ax[3].set_xlabel("minutes")
    ax[3].legend(fontsize=7)
    for f in rec.faults:
        for a in ax:
            a.axvline(f["at_s"] / 60, color="k", lw=0.6, ls=":")
        ax[0].annotate(f["kind"], (f["at_s"] / 60, ax[0].get_ylim()[1]), fontsize=6, rotation=90, va="top")
    fig.suptitle(
        f"soak: {report['calls']} calls, {report['minutes']:g} min, seed {report['seed']}"
        + (f", planted {report['plant']}" if report["plant"] else "")
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
