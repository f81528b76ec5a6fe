"""testkit/watchdog.py: a run whose progress stops fails, with every thread's stack in its output, a minute
(`stall_s`) on, instead of hanging; one that progresses is left alone. The clock is the test's, so no test
waits the minute; the process-ending paths run in a child process of their own."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

import benchmarks.soak as soak
from benchmarks.soak import _progress
from testkit.soak_calls import CallPlan, CallRecord, CallRunner
from testkit.watchdog import STALLED, Watchdog, thread_stacks

ROOT = Path(__file__).resolve().parents[1]


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def watchdog(progress, clock: Clock, stalls: list[str], out: io.StringIO) -> Watchdog:
    return Watchdog(
        progress, 60.0, what="no call", on_stall=stalls.append, exit_status=None, out=out, clock=clock
    )


def test_a_run_that_progresses_is_left_alone_however_long_it_runs():
    clock, stalls, out = Clock(), [], io.StringIO()
    calls = {"answered": 0, "frames": 0}
    dog = watchdog(lambda: (calls["answered"], calls["frames"]), clock, stalls, out)
    for n in range(500):  # over five hours, still for up to 59 s at a time
        if n % 6 == 0:
            calls["frames"] += 1
        clock.t += 9.9
        assert dog.check(), n
    assert stalls == [] and out.getvalue() == "" and dog.report is None


def stuck_caller(lock: threading.Lock, ready: threading.Event) -> None:
    ready.set()
    lock.acquire()  # held by the test: waits, as the soak's caller waited on the router's lock


def test_a_stalled_run_fails_with_every_threads_stack_once_still_for_the_threshold():
    clock, stalls, out = Clock(), [], io.StringIO()
    lock, ready = threading.Lock(), threading.Event()
    lock.acquire()
    caller = threading.Thread(target=stuck_caller, args=(lock, ready), name="caller 7", daemon=True)
    caller.start()
    ready.wait(10)
    try:
        frames = [3]
        dog = watchdog(lambda: (1, frames[0]), clock, stalls, out)
        assert dog.check()
        clock.t += 30
        frames[0] += 1  # progress: stillness is timed from here
        assert dog.check()
        clock.t += 59.9
        assert dog.check() and stalls == []
        clock.t += 0.2
        assert not dog.check()
        assert len(stalls) == 1 and out.getvalue() == stalls[0] + "\n" == dog.report + "\n"
        report = stalls[0]
        assert report.startswith("watchdog: no call progressed for 60 s (last seen: (1, 4))")
        assert "Thread caller 7" in report and "in stuck_caller" in report and "lock.acquire()" in report
        assert "Thread MainThread" in report and "in test_a_stalled_run_fails" in report
        clock.t += 100
        assert not dog.check() and len(stalls) == 1  # reported once
    finally:
        lock.release()
        caller.join(5)


def test_a_progress_that_cannot_be_read_counts_as_nothing_new():
    clock, stalls, out = Clock(), [], io.StringIO()
    reads = iter([(1,), RuntimeError("dictionary changed size during iteration"), (2,)])

    def progress():
        got = next(reads, (2,))
        if isinstance(got, Exception):
            raise got
        return got

    dog = watchdog(progress, clock, stalls, out)
    assert dog.check()
    clock.t += 59
    assert dog.check()  # the failed read: not progress, not a failure
    clock.t += 1
    assert dog.check() and stalls == []  # (2,): progress
    clock.t += 61
    assert not dog.check() and len(stalls) == 1


def test_thresholds_must_be_above_zero():
    with pytest.raises(ValueError, match="stall_s and every_s"):
        Watchdog(lambda: 0, 0.0)


def test_thread_stacks_names_each_thread():
    got = thread_stacks()
    assert "Thread MainThread" in got and "in test_thread_stacks_names_each_thread" in got


def run_child(body: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(body)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_run_whose_main_thread_waits_on_itself_is_ended_with_its_stacks_and_its_on_stall_run():
    # the soak's hang: the main thread waiting for good on a lock it holds, beyond any exception or SIGTERM
    run = run_child(
        """
        import threading
        from testkit.watchdog import Watchdog

        def speak(lock):
            with lock:
                with lock:
                    pass

        Watchdog(lambda: 0, 0.5, what="no call", every_s=0.05,
                 on_stall=lambda report: print("workers stopped", flush=True)).start(backstop=False)
        speak(threading.Lock())
        """
    )
    assert run.returncode == STALLED, run.stderr
    assert run.stdout == "workers stopped\n"
    assert "watchdog: no call progressed for" in run.stderr
    assert "Thread MainThread" in run.stderr and "in speak" in run.stderr and "Thread watchdog" in run.stderr


def test_a_run_that_keeps_the_watchdogs_thread_from_running_is_ended_by_the_backstop():
    # a thread holding the interpreter's lock for good (as a native library's can): no Python thread runs
    run = run_child(
        """
        import sys
        from testkit.watchdog import Watchdog

        def hold_the_interpreter():
            while True:
                pass

        Watchdog(lambda: 0, 0.5, every_s=0.05).start()
        sys.setswitchinterval(1000.0)
        hold_the_interpreter()
        """
    )
    assert run.returncode == 1, run.stderr
    assert "Timeout" in run.stderr and "in hold_the_interpreter" in run.stderr
    assert "watchdog: " not in run.stderr  # its thread never took another look


def test_the_soaks_progress_moves_with_its_calls_and_once_they_ended_with_its_samples():
    runner = CallRunner.__new__(CallRunner)
    runner.records, runner.callers = [], {}
    rec = SimpleNamespace(samples=[])
    seen = [_progress(runner, rec)]
    call = CallRecord(CallPlan(0, 0.0, 30.0, "web"))
    runner.records.append(call)  # started
    caller = SimpleNamespace(heard=SimpleNamespace(times=[]))
    runner.callers[0] = caller
    seen.append(_progress(runner, rec))
    caller.heard.times.append(1.0)  # a frame heard
    seen.append(_progress(runner, rec))
    call.answered_at = 1.0
    seen.append(_progress(runner, rec))
    rec.samples.append({})  # sampled mid-call: not the calls' progress
    assert _progress(runner, rec) == seen[-1]
    del runner.callers[0]
    call.left_at = 30.0  # ended: from here on, the samples of the slots being let go count
    seen.append(_progress(runner, rec))
    rec.samples.append({})
    seen.append(_progress(runner, rec))
    assert len(set(seen)) == len(seen) == 6, seen


def test_a_stalled_soak_kills_its_workers_keeps_the_stacks_and_says_why_on_its_last_line(
    tmp_path, monkeypatch, capsys
):
    worker = subprocess.Popen(["sleep", "600"], start_new_session=True)  # a worker: a process group
    log = tmp_path / "w.log"
    log.write_text("registered worker\n")
    fleet = SimpleNamespace(every=[SimpleNamespace(proc=worker, log=log)])
    torn_down = []
    monkeypatch.setattr(soak, "agent_sip", lambda server, *args, **kw: torn_down.append(args))
    args = SimpleNamespace(out=tmp_path / "out")
    args.out.mkdir()
    report = "watchdog: no call progressed for 60 s (last seen: ((4, 3, 1, 77), 0)); every thread's stack:\nX"
    try:
        soak._stalled(report, args, fleet, server=None, name="chorus-soak-x")
        assert worker.wait(10) == -9  # SIGKILLed
    finally:
        if worker.poll() is None:
            worker.kill()
    assert (args.out / "stacks.txt").read_text() == report + "\n"
    assert (args.out / "worker-1.log").read_text() == "registered worker\n"
    assert torn_down == [("teardown", "--name", "chorus-soak-x")]
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    why = "watchdog: no call progressed for 60 s (last seen: ((4, 3, 1, 77), 0))"
    assert last == {"ok": False, "stalled": why, "checks": {"progress": {"ok": False, "detail": why}}}


def test_a_stalled_fleet_benchmark_kills_its_workers_and_says_why_on_its_last_line(capsys):
    """benchmarks/fleet_faults.py's watchdog, armed while its calls are on, counts the frames its callers
    hear (testkit/callers.py `frames_heard`, which every caller's reception adds to)."""
    import benchmarks.fleet_faults as fleet_faults
    from testkit import callers

    before = callers.frames_heard()
    callers._heard[0] += 3  # as three frames received by the callers' reception would
    assert callers.frames_heard() == before + 3
    worker = subprocess.Popen(["sleep", "600"], start_new_session=True)
    report = "watchdog: no caller's audio progressed for 60 s (last seen: 1234); every thread's stack:\nX"
    try:
        fleet_faults._stalled(report, [SimpleNamespace(proc=worker)])
        assert worker.wait(10) == -9  # SIGKILLed
    finally:
        if worker.poll() is None:
            worker.kill()
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    why = "watchdog: no caller's audio progressed for 60 s (last seen: 1234)"
    assert last == {"ok": False, "stalled": why}
