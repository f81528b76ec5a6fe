"""The machine a benchmark runs on, read from /proc: a process and its descendants, their command lines and
CPU time, the machine's busy time, and other Chorus workers sharing its CPUs. Knows nothing of LiveKit or of
what the processes are for.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def tree(pid: int) -> list[int]:
    """`pid` and its descendants."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            tasks = []
        for t in tasks:  # a child belongs to the thread that started it
            with contextlib.suppress(OSError):
                todo += [int(k) for k in Path(f"/proc/{p}/task/{t}/children").read_text().split()]
    return out


def thread_stats(pid: int) -> Iterator[tuple[int, int, str, list[str]]]:
    """(pid, tid, thread name, the fields of its /proc stat after the name) for every thread of `pid`'s tree;
    threads gone meanwhile are left out. Field i here is stat's field i + 3 (proc(5)): 11 and 12 user and
    system ticks, 37 the real-time priority, 38 the scheduling policy."""
    for p in tree(pid):
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tids:
            try:
                stat = Path(f"/proc/{p}/task/{t}/stat").read_text()
            except OSError:
                continue
            yield (
                p,
                int(t),
                stat[stat.index("(") + 1 : stat.rindex(")")],
                stat[stat.rindex(")") + 2 :].split(),
            )


def cmdline(pid: int) -> str:
    """A process's command line, its arguments joined by spaces ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def cpu_seconds(pids: list[int]) -> dict[int, float]:
    """CPU seconds so far of each process (user + system); those gone are left out."""
    out = {}
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[p] = (int(fields[11]) + int(fields[12])) / TICKS_PER_S
    return out


def cpu_times() -> tuple[int, int]:
    """The machine's busy time (all but idle and iowait) and its total, in clock ticks so far."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return sum(v) - v[3] - v[4], sum(v)


def other_workers(mine: int) -> int:
    """Other `python -m agent start` processes on this machine (someone else's worker sharing the CPUs)."""
    n = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == mine:
            continue
        with contextlib.suppress(OSError):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            n += b"agent" in cmd and b"start" in cmd and b"-m" in cmd
    return n
