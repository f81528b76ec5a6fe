"""Rooms in other processes (engine/door/host.py, engine/client/remote.py): a session reached over the
engine's socket and shared memory hears and says exactly what the same session in the engine's own process
does; a room's process killed mid-call frees its slot and costs the others nothing; bad data on the channel is
refused, counted and reaches no other session; an engine that fails or goes away ends every room's session
with one SessionFailed, and nothing waits on it. Ticks are driven by hand (engine_support's ManualClock and
run_ticks).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from engine.api import AudioFrame, EngineClosed, EngineFull, SessionFailed, TurnEnded, TurnStarted
from engine.client.control import EngineControl
from engine.client.remote import RemoteEngine
from engine.transport.link import IN_W
from engine.transport.wire import encode
from engine_support import REPO, caller_audio, hosted_engine, run_ticks
from testkit.concierge import PROMPT, TOOLS

FRAME = 1280


@pytest.fixture
def hosted():
    with hosted_engine(eager=True) as pair:
        yield pair


async def settle(seconds: float = 0.05) -> None:
    """Let the host's thread and this loop's readers pass on what the last tick wrote."""
    await asyncio.sleep(seconds)


def taken(queue) -> list:
    out = []
    while not queue.empty():
        out.append(queue.get_nowait())
    return out


async def ticks(engine, k: int, n: int, *feeds) -> int:
    """n ticks; before each, every (handle, audio) in `feeds` gets its next caller frame."""
    for _ in range(n):
        for handle, audio in feeds:
            i = k % (audio.size // FRAME)
            handle.push_audio(audio[i * FRAME : (i + 1) * FRAME])
        await settle(0.005)
        k = run_ticks(engine, k, 1)
        await settle(0.005)
    await settle()
    return k


async def prompt_cached(engine) -> int:
    """A few ticks of a session that leaves PROMPT's state cached, so that two sessions opened next start
    from it at the same tick (one that waits for another's prefill catches up a tick later). The next tick."""
    warm = engine.open_session(PROMPT, TOOLS)
    k = await ticks(engine, 0, 4, (warm, caller_audio(5, 1.0)))
    warm.close()
    return k


async def open_remote(remote: RemoteEngine, **kw):
    return await asyncio.to_thread(remote.open_session, PROMPT, TOOLS, loop=asyncio.get_running_loop(), **kw)


def test_a_remote_session_hears_and_says_what_a_local_one_does(hosted):
    engine, host = hosted

    async def main():
        remote = RemoteEngine(host.address, key=host.keys.room)
        assert (remote.config.preset, remote.model_cfg.clock) == ("tiny", engine.model_cfg.clock)
        k = await prompt_cached(engine)
        far = await open_remote(remote)
        near = engine.open_session(PROMPT, TOOLS)  # rows are independent: same input, same output
        audio = caller_audio(3, 2.0)
        k = await ticks(engine, k, 12, (far, audio), (near, audio))
        turn = [remote.tokens.bos, *remote.tokens.encode(" Welcome to the café."), remote.tokens.eos]
        far.force_text(turn)
        near.force_text(turn)
        await settle()
        await ticks(engine, k, 24, (far, audio), (near, audio))
        # the room's playout figures reach the engine's snapshot through the shared memory, nothing sent
        far.report_playout(0.2, 3, 0.1, 0.04)
        far.report_receive(0.05, 0.25)
        row = {s.id: s for s in engine.snapshot().sessions}[far.id]
        assert (row.playout_ms, row.playout_gaps, row.playout_gap_s, row.start_delay_ms) == (200, 3, 0.1, 40)
        assert (row.rx_jitter_ms, row.rx_concealed_s) == (50, 0.25)
        return taken(far.outputs), taken(near.outputs), far

    got, want, far = asyncio.run(main())
    print(len(got), "outputs;", far.stats, host.stats)
    assert [type(o) for o in got] == [type(o) for o in want]  # events in the tick's order, among the frames
    assert [o.tick for o in got] == [o.tick for o in want]
    frames = [(a, b) for a, b in zip(got, want, strict=True) if isinstance(a, AudioFrame)]
    assert len(frames) >= 30
    assert all(np.array_equal(a.samples, b.samples) for a, b in frames)  # bit for bit
    assert "".join(a.text for a, _ in frames) == "".join(b.text for _, b in frames)
    assert "Welcome to the café." in "".join(a.text for a, _ in frames)
    kinds = [type(o) for o in got]
    assert kinds.index(TurnStarted) < kinds.index(TurnEnded)
    assert far.stats["frames_lost"] == 0 and host.stats["bad_messages"] == 0


def test_padding_between_forced_tokens_is_forcing_the_pad_on_every_tick(hosted):
    """Teacher forcing's `pad_between` (sent once over the socket) steps exactly as forcing the padding token
    on both channels on every tick does, and a turn forced after it starts on the next tick."""
    engine, host = hosted
    n = 20

    async def main():
        remote = RemoteEngine(host.address, key=host.keys.room)
        tok = remote.tokens
        k = await prompt_cached(engine)
        far = await open_remote(remote)
        near = engine.open_session(PROMPT, TOOLS)
        audio = caller_audio(5, 2.0)
        k = await ticks(engine, k, 12, (far, audio), (near, audio))  # both live
        far.pad_between(True)
        near.force_text([tok.pad] * n)
        near.force_function([tok.pad] * n)
        await settle()
        k = await ticks(engine, k, n, (far, audio), (near, audio))
        far.read_frames()  # the padding's silence is read in batches: what the ring holds, now
        padded = taken(far.outputs), taken(near.outputs)
        far.force_text([tok.bos, *tok.encode(" Hello."), tok.eos])
        await settle()
        await ticks(engine, k, 1, (far, audio))
        return padded, taken(far.outputs)

    (got, want), after = asyncio.run(main())
    tail = [o for o in got if isinstance(o, AudioFrame)][-12:]
    assert len(tail) == 12
    assert [type(o) for o in got][-12:] == [type(o) for o in want][-12:]
    assert all(
        np.array_equal(a.samples, b.samples) and a.text == b.text == ""
        for a, b in zip(tail, [o for o in want if isinstance(o, AudioFrame)][-12:], strict=True)
    )
    assert not any(isinstance(o, TurnStarted) for o in got[-12:])
    assert any(isinstance(o, TurnStarted) for o in after), after  # the forced turn, on the very next tick


def test_the_engines_refusal_reaches_the_room_as_its_own_error(hosted):
    engine, host = hosted

    async def main():
        remote = RemoteEngine(host.address, key=host.keys.room)
        handles = [await open_remote(remote) for _ in range(4)]
        with pytest.raises(EngineFull):
            await open_remote(remote)
        return handles

    handles = asyncio.run(main())
    assert len({h.slot for h in handles}) == 4


ROOM_PROCESS = """
import asyncio, sys, time
import numpy as np
from engine.client.remote import RemoteEngine
async def main():
    remote = RemoteEngine(sys.argv[1], key=sys.argv[2])
    loop = asyncio.get_running_loop()
    h = await asyncio.to_thread(remote.open_session, "You are the concierge.", [], loop=loop)
    print(h.slot, flush=True)
    while True:
        h.push_audio(np.zeros(1280, np.int16))
        await asyncio.sleep(0.02)
asyncio.run(main())
"""


def test_a_room_process_killed_mid_call_frees_its_slot_and_the_others_keep_every_tick(hosted):
    engine, host = hosted
    room = subprocess.Popen(
        [sys.executable, "-c", ROOM_PROCESS, host.address, host.keys.room],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:

        async def main():
            remote = RemoteEngine(host.address, key=host.keys.room)
            other = await open_remote(remote)
            slot = int(await asyncio.to_thread(room.stdout.readline))
            audio = caller_audio(1, 1.0)
            k = await ticks(engine, 0, 6, (other, audio))
            assert len(engine.pool.sessions) == 2
            before = len([o for o in taken(other.outputs) if isinstance(o, AudioFrame)])
            room.send_signal(signal.SIGKILL)
            room.wait(10)
            deadline = (
                time.monotonic() + 2.0
            )  # the host sees the connection end; the next tick frees the slot
            while len(engine.pool.sessions) > 1 and time.monotonic() < deadline:
                k = await ticks(engine, k, 1, (other, audio))
            freed = len(engine.pool.sessions) == 1 and engine.pool.available == 3
            start = k
            k = await ticks(engine, k, 10, (other, audio))
            after = [o for o in taken(other.outputs) if isinstance(o, AudioFrame)]
            return slot, freed, before, after, start, k

        slot, freed, before, after, start, end = asyncio.run(main())
    finally:
        if room.poll() is None:
            room.kill()
    assert freed, "the killed room's slot was not freed within 2 s"
    assert before >= 5
    # the other room got a frame on every tick after the kill too
    assert [f.tick for f in after][-(end - start) :] == list(range(start, end))


def test_bad_data_on_the_channel_is_refused_counted_and_reaches_no_other_session(hosted):
    engine, host = hosted

    async def main():
        remote = RemoteEngine(host.address, key=host.keys.room)
        good = await open_remote(remote)
        bad = await open_remote(remote)
        audio = caller_audio(2, 1.0)
        k = await ticks(engine, 0, 4, (good, audio), (bad, audio))
        raw = bad._sock
        raw.setblocking(True)
        for line in (
            b"not json at all",
            b"[1, 2, 3]",
            json.dumps({"op": "force", "session": good.id, "channel": "text", "ids": [5, 6]}).encode(),
            json.dumps({"op": "result", "session": good.id, "call_id": "x", "output": "hi"}).encode(),
            json.dumps({"op": "force", "session": bad.id, "channel": "text", "ids": ["a"]}).encode(),
            json.dumps({"op": "teleport", "session": bad.id}).encode(),
            b"\xff\xfe garbage \x00",
        ):
            raw.sendall(line + b"\n")
        raw.setblocking(False)
        # a counter that goes backwards, and one that jumps far ahead: the room's own ring only
        bad._link.set(IN_W, 10**12)
        k = await ticks(engine, k, 2, (good, audio))
        bad._link.set(IN_W, 3)
        k = await ticks(engine, k, 2, (good, audio))
        return good, bad

    good, bad = asyncio.run(main())
    print(host.stats, good.stats, bad.stats)
    assert host.stats["bad_messages"] == 7
    assert host.stats["bad_counters"] == 1 and host.stats["lost_frames"] > 0
    assert bad.stats["refused"] == 7  # each refusal answered on the connection that sent it
    assert good.stats["refused"] == 0
    good_session = engine.pool.sessions
    assert all(not s.forcing.text and s.requests.empty() for s in good_session.values())
    assert len(good_session) == 2  # neither session was closed by the garbage


def test_a_message_longer_than_the_limit_closes_only_its_own_session(hosted, monkeypatch):
    engine, host = hosted
    monkeypatch.setattr("engine.door.host.MAX_LINE", 1 << 16)

    async def main():
        remote = RemoteEngine(host.address, key=host.keys.room)
        good = await open_remote(remote)
        bad = await open_remote(remote)
        raw = bad._sock
        raw.setblocking(True)
        with pytest.raises(OSError):  # the host closes the connection partway through
            for _ in range(64):
                raw.sendall(b"x" * (1 << 14))
        k = await ticks(engine, 0, 3, (good, caller_audio(0, 1.0)))
        return good, bad, k

    good, bad, _ = asyncio.run(main())
    assert host.stats["bad_messages"] >= 1
    assert list(engine.pool.sessions.values())[0].id == good.id and len(engine.pool.sessions) == 1
    assert any(isinstance(o, SessionFailed) for o in taken(bad.outputs))
    assert not any(isinstance(o, SessionFailed) for o in taken(good.outputs))


def test_a_failing_tick_ends_every_rooms_session_with_one_failure(hosted):
    engine, host = hosted

    async def main():
        remote = RemoteEngine(host.address, key=host.keys.room)
        rooms = [await open_remote(remote) for _ in range(2)]
        await ticks(engine, 0, 3)
        engine._fail_all("the engine stopped: RuntimeError: planted")  # what the tick thread does as it dies
        await settle(0.2)
        return rooms

    rooms = asyncio.run(main())
    for room in rooms:
        failures = [o for o in taken(room.outputs) if isinstance(o, SessionFailed)]
        assert [f.message for f in failures] == ["the engine stopped: RuntimeError: planted"]


def test_an_engine_that_goes_away_ends_the_rooms_sessions_and_nothing_waits(hosted):
    engine, host = hosted

    async def main():
        remote = RemoteEngine(host.address, key=host.keys.room)
        room = await open_remote(remote)
        await ticks(engine, 0, 2)
        host.close()  # the engine's side of every connection closes, as when its process dies
        t0 = time.monotonic()
        while not room.closed and time.monotonic() - t0 < 5:
            await settle(0.02)
        with pytest.raises(EngineClosed):
            await open_remote(remote)
        return room

    room = asyncio.run(main())
    assert room.closed
    failures = [o for o in taken(room.outputs) if isinstance(o, SessionFailed)]
    assert len(failures) == 1
    with pytest.raises(EngineClosed):
        room.push_audio(np.zeros(FRAME, np.int16))


def test_no_engine_is_a_clear_error_at_once():
    t0 = time.monotonic()
    with pytest.raises(EngineClosed, match="not reachable"):
        RemoteEngine("chorus-engine-nobody-here", key="k")
    assert time.monotonic() - t0 < 5


def test_an_engine_that_never_answers_is_given_up_after_the_timeout():
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = f"chorus-engine-mute-{os.getpid()}"
    listener.bind("\0" + name)
    listener.listen(1)
    try:
        with pytest.raises(EngineClosed, match="did not answer"):
            RemoteEngine(name, key="k", timeout=0.5)
    finally:
        listener.close()


def test_the_worker_reserves_a_slot_per_job_and_a_job_that_ends_before_its_call_gives_it_back():
    with hosted_engine(num_slots=2, eager=True) as (engine, host):
        worker = EngineControl(host.address, host.keys.control)  # the worker's end: admission and load
        assert worker.admit("AJ_1") == "AJ_1" and worker.admit("AJ_2") == "AJ_2"
        assert worker.status()["available"] == 0 and worker.load == 0.0  # reserved, not yet in use
        with pytest.raises(EngineFull):
            worker.admit("AJ_3")
        worker.release("AJ_1")
        assert worker.status()["available"] == 1

        async def main():  # the other job's session takes the slot reserved for it
            return await open_remote(RemoteEngine(host.address, key=host.keys.room), admission="AJ_2")

        handle = asyncio.run(main())
        assert handle.slot in (0, 1) and not host.engine.pool.holds("AJ_2")


def test_the_wire_format_is_one_json_object_a_line():
    line = encode({"op": "hello", "text": "café\nnext"})
    assert line.count(b"\n") == 1 and json.loads(line) == {"op": "hello", "text": "café\nnext"}


def test_the_room_side_imports_no_torch():
    code = textwrap.dedent(
        """
        import sys
        import engine.client.remote, engine.text.tokens
        print("torch" in sys.modules)
        """
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_engines_process_killed_ends_every_rooms_session_and_the_worker_reports_itself_full():
    """The engine in its own process (`python -m engine.door.serve`, as the worker starts it), killed
    mid-call: the room's session ends with one failure, and the load the worker reports is full."""
    from engine.client.process import EngineProcess
    from engine.config.engine_config import EngineConfig

    process = EngineProcess(EngineConfig(preset="tiny", num_slots=2).model_dump_json(), timeout=180).start()
    try:
        worker = EngineControl(process.address, process.keys.control)
        assert worker.load == 0.0

        async def main():
            room = await open_remote(RemoteEngine(process.address, key=process.keys.room))
            t0 = time.monotonic()
            while time.monotonic() - t0 < 60 and not any(
                isinstance(o, AudioFrame) for o in taken(room.outputs)
            ):
                room.push_audio(np.zeros(FRAME, np.int16))
                await settle(0.08)  # the engine ticks on its own clock: the prompt's prefill, then frames
            heard = room.stats["frames_out"]
            process.proc.kill()
            t0 = time.monotonic()
            while not room.closed and time.monotonic() - t0 < 5:
                await settle(0.02)
            return room, heard

        room, heard = asyncio.run(main())
        assert heard > 0 and room.closed
        assert len([o for o in taken(room.outputs) if isinstance(o, SessionFailed)]) == 1
        assert worker.load == 1.0  # what LiveKit is told: this worker takes no room
        with pytest.raises(EngineClosed):
            worker.admit("AJ_late")
    finally:
        process.stop()


def test_the_engines_process_ends_with_the_worker():
    """The worker holds the engine's standard input: when it ends, however it ends, so does the engine."""
    from engine.client.process import EngineProcess
    from engine.config.engine_config import EngineConfig

    process = EngineProcess(EngineConfig(preset="tiny", num_slots=1).model_dump_json(), timeout=180).start()
    try:
        process.proc.stdin.close()  # what the kernel does to the pipe when the worker's process dies
        assert process.proc.wait(30) == 0
    finally:
        process.stop()


def test_the_silence_between_turns_wakes_the_room_once_per_batch_and_a_turn_at_once():
    """The tick's side of a session (engine/door/host_conn.py RoomConn): every frame goes into the ring, but
    the eventfd that wakes the room's loop is written for each frame of a turn (and one with text, and the
    first) and only once per QUIET_WAKE frames of the silence between turns."""
    from engine.door.host_conn import QUIET_WAKE, RoomConn
    from engine.transport.link import OUT_W, Layout, SessionLink

    link = SessionLink.create(Layout(in_samples=FRAME, out_samples=1764))
    efd = os.eventfd(0, os.EFD_NONBLOCK)
    posted = []
    conn = RoomConn(socket.socket(socket.AF_UNIX), {}, lambda c, m: posted.append(m))
    conn.link, conn.efd = link, efd
    silence = np.zeros(1764, np.float32)

    def wakes() -> int:
        try:
            return os.eventfd_read(efd)
        except BlockingIOError:
            return 0

    try:
        conn.deliver([AudioFrame(0, silence, "")])
        assert wakes() == 1  # the session's first frame: the room learns it is live
        for k in range(1, 2 * QUIET_WAKE):
            conn.deliver([AudioFrame(k, silence, "")])
        assert wakes() == 1 and link.get(OUT_W) == 2 * QUIET_WAKE  # all written, one wake for the batch
        conn.deliver([TurnStarted(40), AudioFrame(40, silence, "")])
        assert wakes() == 1  # a turn's first frame at once (after the frames still unread)
        for k in range(41, 45):
            conn.deliver([AudioFrame(k, silence, "")])
            assert wakes() == 1  # and every frame of the turn
        conn.deliver([AudioFrame(45, silence, "Hello"), TurnEnded(45)])
        assert wakes() == 1 and len(posted) == 2
        conn.deliver([AudioFrame(46, silence, "")])
        assert wakes() == 0  # silence again
        conn.deliver([AudioFrame(47, silence, ", hm")])
        assert wakes() == 1  # a frame with text is read at once
    finally:
        os.close(efd)
        conn.sock.close()
        link.close()
