"""The soak's samples (benchmarks/soak.py), taken as the run goes: every process's resident memory, threads
and open files (the workers' trees, the LiveKit server, Redis, the generator), the workers' snapshots (slots
in use against the calls live, mouth to ear, missed deadlines) and the database's rows. Knows nothing of the
checks made of them at the end (testkit/soak_report.py).
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from pathlib import Path

from agent.forcing import REPLY_EVERY_S
from engine.tick.warm import WARM_LABEL
from testkit.machine import cmdline, tree
from testkit.soak_calls import CallRecord, read_only
from testkit.worker import Worker

LEAVE_GRACE_S = (
    10.0  # a hung-up call's slot is let go within this (the agent ends the call, the engine frees it)
)
# a handover (a drain) holds two sessions for one call, the draining agent's and the new one's, until the new
# one is live and the old one leaves: a few seconds, bounded here
HANDOVER_OVERLAP_S = 30.0
ROOM = "room "  # a room's own process (one call's, CHORUS_ROOM_PROCESSES=true): "room w1", "room w1.2", ...


def proc_status(pid: int) -> tuple[float, int] | None:
    """(resident MiB, threads) of `pid`, None once it is gone."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    f = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    if "VmRSS" not in f:  # exited, not yet reaped
        return None
    return int(f["VmRSS"].split()[0]) / 1024, int(f["Threads"])


def _parent(pid: int) -> int | None:
    try:  # /proc/<pid>/stat: "pid (comm) state ppid ...", comm may hold spaces and parentheses
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def _pidfile(name: str) -> int | None:
    """The server's or Redis's pid, from scripts/livekit.sh's folder (beside the server's log)."""
    log = os.environ.get("CHORUS_TEST_LIVEKIT_LOG")
    with contextlib.suppress(OSError, ValueError, TypeError):
        return int(Path(log).with_name(name).read_text())
    return None


class Recorder:
    """The run's samples (`sample`, every few seconds), its faults as they are played, its progress line."""

    def __init__(self, store_dir: Path, tmp: Path) -> None:
        self.db = store_dir / "hotel.sqlite3"
        self.t0 = 0.0
        self.samples: list[dict] = []
        self.faults: list[dict] = []
        self.names: dict[int, str] = {}  # pid -> the name its series goes by
        self._workers = 0
        self._unknown: dict[str, float] = {}  # a session's label no call has, since when
        self._doubled: dict[str, float] = {}  # a live call's label held by two sessions or more, since when
        self.final: dict | None = None

    def _name(self, pid: int, role: str, worker: int | None = None) -> str:
        if pid not in self.names:
            if role == "worker":
                self._workers += 1
                self.names[pid] = f"worker {self._workers}"
            elif worker is not None:
                base = f"{role} {self.names.get(worker, 'worker ?').split()[-1]}"  # a second one: base.2
                n = sum(v == base or v.startswith(base + ".") for v in self.names.values())
                self.names[pid] = base + (f".{n + 1}" if n else "")
            else:
                self.names[pid] = role
        return self.names[pid]

    def _processes(self, workers: list[Worker]) -> dict[str, dict]:
        pids: list[tuple[int, str]] = []
        for w in workers:
            if w.proc is None or w.proc.poll() is not None:
                continue
            self._name(w.proc.pid, "worker")
            for p in tree(w.proc.pid):
                cmd = cmdline(p)
                role = (
                    "worker"
                    if p == w.proc.pid
                    else "engine"
                    if "engine.door.serve" in cmd
                    else "snapshot server"
                    if "snapshot_serve" in cmd
                    else "resource tracker"  # multiprocessing's, the rooms' processes' shared memory
                    if "resource_tracker" in cmd
                    else "forkserver"  # forks the rooms' processes (which share its command line)
                    if "forkserver" in cmd and _parent(p) == w.proc.pid
                    else "room"  # a room's own process (CHORUS_ROOM_PROCESSES=true)
                )
                pids.append((p, self._name(p, role, w.proc.pid)))
        for role, pid in (("server", _pidfile("server.pid")), ("redis", _pidfile("redis.pid"))):
            if pid:
                pids.append((pid, self._name(pid, role)))
        pids.append((os.getpid(), self._name(os.getpid(), "generator")))
        out = {}
        for pid, name in pids:
            st = proc_status(pid)
            if st is not None:
                out[name] = {"rss_mb": round(st[0], 1), "threads": st[1], "fds": _fds(pid)}
        return out

    def _rows(self) -> dict[str, int]:
        with read_only(self.db) as db:
            (confirmed,), (cancelled,) = (
                db.execute("SELECT count(*) FROM reservations WHERE status = ?", (s,)).fetchone()
                for s in ("confirmed", "cancelled")
            )
            (conversations,) = db.execute("SELECT count(*) FROM conversations").fetchone()
        return {"confirmed": confirmed, "cancelled": cancelled, "conversations": conversations}

    def sample(self, workers: list[Worker], rooms: dict[str, float | None], now: float) -> None:
        engines, sessions, m2e = {}, [], []
        for w in workers:
            if w.proc is None or w.proc.poll() is not None:
                continue
            try:
                snap = w.snapshot()
            except (OSError, ValueError):
                continue
            engines[w.proc.pid] = {"missed": snap["missed_deadlines"], "ticks": snap["ticks"]}
            for s in snap["sessions"]:
                if s["label"] == WARM_LABEL:  # the engine's own, prefilling its agents' prompts at its start
                    continue
                sessions.append(s["label"])
                if s["phase"] == "live" and s.get("heard_ms") is not None:
                    m2e.append(s["heard_ms"] + s.get("playout_ms", 0.0))
        leaked, excess = [], 0
        held = Counter(sessions)
        for label in set(self._unknown) - set(sessions):  # gone: held again later, it is timed afresh
            del self._unknown[label]
        for label in set(self._doubled) - {k for k, n in held.items() if n > 1}:
            del self._doubled[label]
        for label, n in held.items():
            if label in rooms and rooms[label] is None:  # a live call: one slot, two while handed over
                doubled_s = now - self._doubled.setdefault(label, now) if n > 1 else 0.0
                excess += max(0, n - (2 if doubled_s <= HANDOVER_OVERLAP_S else 1))
                continue
            left = rooms[label] if label in rooms else self._unknown.setdefault(label, now)
            if now - left > LEAVE_GRACE_S:  # its call ended (or no call has it) past the grace
                leaked.append(label)
                excess += n
        self.samples.append(
            {
                "t": round(now - self.t0, 1),
                "live": sum(v is None for v in rooms.values()),
                "slots": len(sessions),
                "rooms_held": len(set(sessions)),
                "leaked": len(leaked),
                "excess": excess,  # sessions no live call accounts for (a handover's second aside)
                "engines": engines,
                "m2e_ms": m2e,
                "procs": self._processes(workers),
                "rows": self._rows(),
            }
        )

    def settled(self) -> bool:
        s = self.samples[-1]
        return s["slots"] == 0 and s["rows"]["conversations"] == 0

    def progress(self, records: list[CallRecord]) -> str:
        s = self.samples[-1] if self.samples else None
        ended = [r for r in records if r.left_at is not None and r.answered_at is not None]
        silence = max((r.longest_unasked(REPLY_EVERY_S) for r in ended), default=0.0)
        procs = s["procs"] if s else {}
        rooms = [v["rss_mb"] for k, v in procs.items() if k.startswith(ROOM)]
        mem = " ".join(f"{k} {v['rss_mb']:.0f}" for k, v in procs.items() if not k.startswith(ROOM))
        if rooms:
            mem += f" rooms {len(rooms)} x {min(rooms):.0f}-{max(rooms):.0f}"
        return (
            f"calls {len(records)} ({sum(r.left_at is None for r in records)} live), answered "
            f"{sum(r.answered_at is not None for r in records)}, "
            f"resumed {sum(len(r.agents) > 1 for r in records)}, "
            f"slots {s['slots'] if s else 0}, leaked {s['leaked'] if s else 0}, longest unasked silence "
            f"{silence:.1f} s, faults {len(self.faults)}; MiB: {mem}"
        )
