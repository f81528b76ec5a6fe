"""Who may use the engine's door (engine/door/gate.py, engine/door/host.py): another user's process is closed
before a byte of it is read, whatever it sends (its attacker runs as `nobody`, through `setpriv`, and is
skipped where this suite cannot change user); a process of the engine's own user needs a key, and its key's
role bounds what it may ask; a message nested too deep, or one whose handling fails, is refused and counted
and the door keeps serving; connections without a key are bounded in number and time, so the worker's own
questions and a room's new session get through a crowd of them; a door whose thread stopped makes its engine's
process exit. Rooms refuse a socket at the engine's address that another user holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from engine.api import EngineClosed
from engine.client.control import EngineControl
from engine.client.remote import RemoteEngine
from engine.door.gate import AUTH_S, MAX_PENDING
from engine.door.host import EngineHost
from engine.door.serve import DOOR_STOPPED, run_until_stopped
from engine.transport.wire import MAX_DEPTH, encode
from engine_support import hosted_engine, run_ticks
from testkit.concierge import PROMPT, TOOLS
from wait_support import await_until, wait_until


@pytest.fixture
def hosted():
    with hosted_engine(eager=True) as pair:
        yield pair


def _other_user_python() -> list[str] | None:
    """A command that runs a stdlib-only Python as `nobody`, or None where this process cannot change user."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        return None
    for python in (os.path.realpath(sys.executable), "/usr/bin/python3"):
        cmd = ["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", python, "-I", "-c"]
        ok = subprocess.run([*cmd, "import os; print(os.getuid())"], capture_output=True, text=True)
        if ok.returncode == 0 and ok.stdout.strip() not in ("", "0"):
            return cmd
    return None


OTHER_USER = _other_user_python()
needs_other_user = pytest.mark.skipif(
    OTHER_USER is None, reason="needs root and setpriv to run a process as nobody"
)

# What another user's process tries on the door: every operation, on a connection each, with the worker's
# and the rooms' real keys (passed to it) and with none; and then connections as fast as it can for a while.
# It prints, per try, what came back before the door closed the connection.
ATTACKER = r"""
import json, socket, sys, time
address, room_key, control_key, flood_s = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
def line(d):
    return (json.dumps(d) + "\n").encode()
tries = {
    "hello": [line({"op": "hello"})],
    "open": [line({"op": "open", "prompt": "p", "tools": []})],
    "admit": [line({"op": "admit", "admission": "AJ_x"})],
    "release": [line({"op": "release", "admission": "AJ_worker"})],
    "drain": [line({"op": "drain", "seconds": 0})],
    "load": [line({"op": "load"})],
    "room_key_open": [line({"op": "key", "key": room_key}), line({"op": "open", "prompt": "p", "tools": []})],
    "control_key_drain": [line({"op": "key", "key": control_key}), line({"op": "drain", "seconds": 0})],
    "nested": [b"[" * 10000 + b"\n"],
}
out = {}
for name, lines in tries.items():
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(3)
    s.connect("\0" + address)
    got = b""
    try:
        for l in lines:
            s.sendall(l)
        while True:
            d = s.recv(65536)
            if not d:
                break
            got += d
    except OSError:  # reset: closed with the try unread
        pass
    out[name] = got.decode(errors="replace")
    s.close()
made = 0
t0 = time.monotonic()
while time.monotonic() - t0 < flood_s:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setblocking(False)
    try:
        s.connect("\0" + address)
        made += 1
    except OSError:
        pass
    s.close()
out["flood_connections"] = made
print(json.dumps(out))
"""


@needs_other_user
def test_another_users_process_gets_nothing_from_the_door_and_the_worker_keeps_its_engine(hosted):
    engine, host = hosted
    worker = EngineControl(host.address, host.keys.control)
    assert worker.admit("AJ_worker") == "AJ_worker"

    async def main():
        room = await asyncio.to_thread(
            RemoteEngine(host.address, key=host.keys.room).open_session,
            PROMPT,
            TOOLS,
            loop=asyncio.get_running_loop(),
        )
        drained: list[float] = []
        room._engine.on_drain = drained.append
        attacker = await asyncio.create_subprocess_exec(
            *OTHER_USER,
            ATTACKER,
            host.address,
            host.keys.room,
            host.keys.control,
            "1",
            stdout=asyncio.subprocess.PIPE,
        )
        # the worker's questions while the other user floods the door: each answered
        waits = []
        while attacker.returncode is None:
            t0 = time.monotonic()
            status = await asyncio.to_thread(worker.status)
            waits.append(time.monotonic() - t0)
            assert status["op"] == "load"
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(attacker.wait(), 0.1)
        out = json.loads((await attacker.stdout.read()).decode())
        await asyncio.sleep(0.2)
        return room, drained, out, waits

    room, drained, out, waits = asyncio.run(main())
    flood = out.pop("flood_connections")
    print(out, flood, host.stats, f"worker's waits max {max(waits):.3f} s over {len(waits)}")
    assert out == {name: "" for name in out}  # every connection closed before a byte was answered
    assert host.stats["refused_peers"] >= len(out) + flood
    assert drained == []  # no drain reached the room
    assert host.engine.pool.holds("AJ_worker")  # the worker's admission was not released
    assert (
        engine.pool.available == 4 - 2 and len(engine.pool.sessions) == 1
    )  # the room's, and the admission's
    assert not room.closed and room.stats["refused"] == 0
    assert all(w < 2.0 for w in waits)
    assert host.alive


@needs_other_user
def test_a_room_will_not_give_its_key_to_a_socket_another_user_made_at_the_engines_address():
    name = f"chorus-engine-squat-{os.getpid()}"
    squatter = subprocess.Popen(
        [
            *OTHER_USER,
            textwrap.dedent(
                f"""
                import socket, sys, time
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.bind("\\0{name}")
                s.listen(8)
                print("up", flush=True)
                c, _ = s.accept()
                c.settimeout(5)
                print(repr(c.recv(4096)), flush=True)
                """
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert squatter.stdout.readline().strip() == "up"
        with pytest.raises(EngineClosed, match="another user"):
            RemoteEngine(name, key="the-rooms-key", timeout=2)
        assert squatter.stdout.readline().strip() == "b''"  # nothing was sent to it
    finally:
        squatter.kill()
        squatter.wait()


def _raw(host: EngineHost, *lines: bytes, timeout: float = 5.0) -> bytes:
    """What the door answers to `lines` on one connection of this (the engine's own) user, until it closes
    the connection or `timeout` passes without a word. A line the door closed the connection before (its
    refusal of an earlier one) is not sent: the refusal is what is answered."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect("\0" + host.address)
        for line in lines:
            try:
                s.sendall(line)
            except (BrokenPipeError, ConnectionResetError):
                break
        got = b""
        try:
            while d := s.recv(65536):
                got += d
                if got.count(b"\n") >= len(lines):
                    break
        except (TimeoutError, ConnectionResetError):
            pass
        return got


def _answers(got: bytes) -> list[dict]:
    return [json.loads(line) for line in got.splitlines() if line]


def test_without_the_right_key_the_engines_own_user_gets_nothing_but_a_refusal(hosted):
    engine, host = hosted
    for first in (
        encode({"op": "hello"}),
        encode({"op": "admit", "admission": "AJ_1"}),
        encode({"op": "drain", "seconds": 0}),
        encode({"op": "key", "key": "guessed"}),
        encode({"op": "key", "key": host.keys.room[:-1]}),
        b"\xff\xfe\n",
    ):
        got = _answers(_raw(host, first, encode({"op": "load"})))
        assert [a["op"] for a in got] == ["refused"], (first, got)  # the first line refused, the next unread
    assert host.stats["refused_keys"] == 6 and host.stats["sessions"] == 0
    assert engine.pool.available == 4


def test_each_key_opens_only_its_roles_operations(hosted):
    engine, host = hosted
    room = encode({"op": "key", "key": host.keys.room})
    control = encode({"op": "key", "key": host.keys.control})
    worker_only = [
        encode({"op": "admit", "admission": "AJ_1"}),
        encode({"op": "release", "admission": "AJ_1"}),
        encode({"op": "drain", "seconds": 0}),
        encode({"op": "load"}),
    ]
    got = _answers(_raw(host, room, *worker_only))
    assert [a["op"] for a in got] == ["refused"] * 4
    assert all("may ask for" in a["why"] for a in got)
    got = _answers(_raw(host, control, encode({"op": "open", "prompt": "p", "tools": []})))
    assert [a["op"] for a in got] == ["refused"]
    # and each its own: the worker admits and reads the load; a room says hello
    got = _answers(_raw(host, control, encode({"op": "admit", "admission": "AJ_1"}), encode({"op": "load"})))
    assert [a["op"] for a in got] == ["admitted", "load"]
    assert [a["op"] for a in _answers(_raw(host, room, encode({"op": "hello"})))] == ["hello"]
    assert engine.pool.available == 3 and host.stats["bad_messages"] == 5


def test_the_workers_key_reads_the_engines_figures_and_a_rooms_key_does_not(hosted):
    """What the simulation reports of the engine it started (agent/sim/): its snapshot, the live steps of the
    accounting window, its process's memory and its snapshot port, asked with the worker's key only."""
    engine, host = hosted
    run_ticks(engine, 0, 3)
    worker = EngineControl(host.address, host.keys.control)
    figures = worker.figures()
    assert figures.snapshot.ticks == 3 and figures.snapshot.num_slots == 4
    assert figures.live_ms == [round(ms, 3) for ms in engine.acct.live_ms] and len(figures.live_ms) == 3
    assert figures.rss_bytes > 0 and figures.port is None
    assert "snapshot" not in worker.status()  # the worker's load alone stays small
    with pytest.raises(EngineClosed):
        EngineControl(host.address, host.keys.room).figures()


def test_a_message_nested_too_deep_or_whose_handling_fails_is_refused_and_the_door_keeps_serving(
    hosted, monkeypatch
):
    engine, host = hosted
    worker = EngineControl(host.address, host.keys.control)

    async def main():
        remote = RemoteEngine(host.address, key=host.keys.room)
        room = await asyncio.to_thread(remote.open_session, PROMPT, TOOLS, loop=asyncio.get_running_loop())
        raw = room._sock
        raw.setblocking(True)
        raw.sendall(b"[" * 10000 + b"\n")  # json.loads would recurse past the interpreter's limit
        raw.sendall(b'{"op": "force", "x": ' + b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1) + b"}\n")
        raw.sendall(b"[]" * 40000 + b"\n")  # shallow but too many parts to walk
        raw.setblocking(False)
        await await_until(lambda: room.stats["refused"] >= 3, "the three refusals", seen=lambda: room.stats)

        def broken(*_a, **_k):
            raise RuntimeError("a defect in one operation's handler")

        monkeypatch.setattr("engine.door.host_ops.apply_session_op", broken)
        room.pad_between(True)
        await await_until(lambda: host.stats["errors"] >= 1, "the failed handler", seen=lambda: host.stats)
        await await_until(lambda: room.stats["refused"] >= 4, "its refusal", seen=lambda: room.stats)
        monkeypatch.undo()
        # the door still serves: the worker's question and a new session
        status = await asyncio.to_thread(worker.status)
        again = await asyncio.to_thread(remote.open_session, PROMPT, TOOLS, loop=asyncio.get_running_loop())
        return room, again, status

    room, again, status = asyncio.run(main())
    print(host.stats, room.stats)
    assert status["op"] == "load" and not again.closed and not room.closed
    assert room.stats["refused"] == 4  # each message refused on its own connection
    assert host.stats["bad_messages"] == 4 and host.stats["errors"] == 1
    assert host.alive and len(engine.pool.sessions) == 2


def test_a_crowd_of_connections_without_a_key_is_bounded_and_the_worker_and_rooms_get_through(hosted):
    engine, host = hosted
    worker = EngineControl(host.address, host.keys.control)
    assert worker.status()["op"] == "load"  # the worker's connection, kept open from its first question
    stop = threading.Event()
    crowd: list[socket.socket] = []

    def hold() -> None:  # connections that never show a key, as many as the door takes, for a while
        while not stop.is_set() and len(crowd) < 3000:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.setblocking(False)
            try:
                s.connect("\0" + host.address)
                crowd.append(s)
            except OSError:
                s.close()
                time.sleep(0.001)

    flood = threading.Thread(target=hold)
    flood.start()
    try:
        wait_until(lambda: len(crowd) > MAX_PENDING * 4 or not flood.is_alive(), "the crowd at the door")

        async def main():
            waits = []
            for _ in range(5):
                t0 = time.monotonic()
                assert (await asyncio.to_thread(worker.status))["op"] == "load"
                waits.append(time.monotonic() - t0)
            t0 = time.monotonic()
            remote = await asyncio.to_thread(RemoteEngine, host.address, key=host.keys.room)
            room = await asyncio.to_thread(
                remote.open_session, PROMPT, TOOLS, loop=asyncio.get_running_loop()
            )
            return waits, time.monotonic() - t0, room

        waits, opened_s, room = asyncio.run(main())
        held = sum(1 for c in list(host._conns) if c.role is None)  # a copy: the door changes it
    finally:
        stop.set()
        flood.join()
    print(f"{len(crowd)} connections; worker waits {max(waits):.3f} s; open {opened_s:.3f} s; {host.stats}")
    assert len(crowd) > MAX_PENDING * 4
    assert held <= MAX_PENDING
    assert max(waits) < 2.0 and opened_s < 5.0 and not room.closed
    # every connection without a key is closed within AUTH_S and the door's turn
    deadline = time.monotonic() + AUTH_S + 3
    while time.monotonic() < deadline and any(c.role is None for c in list(host._conns)):
        time.sleep(0.1)
    assert not [c for c in list(host._conns) if c.role is None]
    assert host.stats["refused_keys"] >= len(crowd) - MAX_PENDING
    for s in crowd:
        s.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_door_whose_thread_stopped_makes_its_engines_process_exit(hosted, monkeypatch):
    engine, host = hosted

    def failing(*_a, **_k):
        raise OSError("the selector failed")

    monkeypatch.setattr(host._sel, "select", failing)
    host._wake()
    deadline = time.monotonic() + 5
    while host.alive and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not host.alive
    t0 = time.monotonic()
    assert run_until_stopped(host, threading.Event(), every_s=0.05) == DOOR_STOPPED
    assert time.monotonic() - t0 < 1.0


def test_the_workers_new_agents_reach_the_snapshot_and_metrics_and_only_its_key_may_report_them(hosted):
    """agent/fleet/fleet.py's counts, reported by the worker through the door: in the snapshot (the monitoring
    page) and /metrics; a room may not report them, nor anyone send a malformed count."""
    from prometheus_client.core import CounterMetricFamily

    from engine.observe.metrics import _FiguresCollector
    from engine.observe.snapshot import figures

    engine, host = hosted
    worker = EngineControl(host.address, host.keys.control)
    worker.report_fleet({"agent lost": 2, "never answered": 1})
    room = encode({"op": "key", "key": host.keys.room})
    got = _answers(_raw(host, room, encode({"op": "fleet", "redispatches": {"agent lost": 99}})))
    bad = _answers(
        _raw(
            host,
            encode({"op": "key", "key": host.keys.control}),
            encode({"op": "fleet", "redispatches": [1]}),
        )
    )
    assert [a["op"] for a in got] == ["refused"] and [a["op"] for a in bad] == ["refused"]
    assert engine.snapshot().redispatches == {"agent lost": 2, "never answered": 1}

    class ThisEngine(_FiguresCollector):
        source = staticmethod(lambda: figures(engine))

    family = next(f for f in ThisEngine().collect() if f.name == "chorus_redispatches")
    assert isinstance(family, CounterMetricFamily)
    assert {s.labels["reason"]: s.value for s in family.samples if s.name.endswith("_total")} == {
        "agent lost": 2,
        "never answered": 1,
    }
