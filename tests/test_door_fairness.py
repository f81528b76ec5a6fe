"""No room's process can stall the engine's door (engine/door/host.py) or lock other rooms out of it: a
process with the rooms' key that sends requests and never reads the answers, then opens a session, holds up
neither another call's audio and events nor the worker's questions; a session's context is capped (refused
with a sentence the room reads) and tokenised off the door's thread, so a large one that is allowed keeps
nobody waiting; one room's process holding idle connections leaves room for another's `open`. Ticks are
driven at the model's cadence by a thread of the test on the engine's hand-moved clock.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from engine.api import AudioFrame, SessionRejected, TurnEnded
from engine.client.control import EngineControl
from engine.client.remote import RemoteEngine
from engine.door.gate import ROOM_PEER_CAP
from engine.transport.wire import MAX_CONTEXT_CHARS, MAX_CONTEXT_TOKENS, encode
from engine_support import TICK_S, hosted_engine, run_ticks
from testkit.concierge import PROMPT, TOOLS

pytestmark = pytest.mark.serial  # ticks at the model's cadence on the wall clock (tests/conftest.py)

HANG_S = 60.0  # no wait below takes this long unless the door hangs
ANSWER_S = 1.0  # the worker's question and a room's open: answered within this, whoever else is at the door


@pytest.fixture
def hosted():
    with hosted_engine() as pair:
        yield pair


def keyed(host, *lines: bytes) -> socket.socket:
    """A connection of this process with the rooms' key that sends `lines` and reads nothing."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(HANG_S)
    s.connect("\0" + host.address)
    s.sendall(encode({"op": "key", "key": host.keys.room}))
    for line in lines:
        try:
            s.sendall(line)
        except OSError:  # closed by the door for not reading: what it may do
            break
    return s


def answers(s: socket.socket, n: int) -> list[dict]:
    """The next `n` messages on `s` (a blocking socket; fewer if the door closes it)."""
    got = b""
    while got.count(b"\n") < n and (d := s.recv(1 << 16)):
        got += d
    return [json.loads(line) for line in got.splitlines()[:n]]


class Ticker:
    """Ticks at the model's cadence (TICK_S of the wall clock each, the engine's hand-moved clock with them),
    on a thread of its own, until stopped; `ticks` counts them, `at` says when each ended."""

    def __init__(self, engine, first: int) -> None:
        self.engine, self.k, self.ticks = engine, first, 0
        self.at: dict[int, float] = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        due = time.monotonic()
        while not self.stop.is_set():
            self.k = run_ticks(self.engine, self.k, 1)
            self.at[self.k - 1] = time.monotonic()
            self.ticks += 1
            due += TICK_S
            self.stop.wait(max(0.0, due - time.monotonic()))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(HANG_S)


def test_a_room_that_never_reads_stalls_neither_another_call_nor_the_worker(hosted, caplog):
    """Three connections with the rooms' key each send 3 MiB of `hello`s without reading an answer, then an
    `open`, and stay. Meanwhile a call speaks turn after turn (each forced as the last one ends: its events
    cross the door, and its frames wait for them) and the worker asks for the load again and again: the call
    gets its frames at the tick's cadence, each of its words within a second of its tick, and every question
    is answered within a second. The three are closed, and the log says so by their role alone."""
    engine, host = hosted
    caplog.set_level(logging.WARNING, "chorus.engine.host")
    worker = EngineControl(host.address, host.keys.control)
    hello = encode({"op": "hello"})
    flood = hello * ((3 << 20) // 380)  # a hello's answer is some 380 bytes: 3 MiB of answers
    window_s = 4.0

    async def main():
        loop = asyncio.get_running_loop()
        remote = await asyncio.to_thread(RemoteEngine, host.address, key=host.keys.room)
        tok = remote.tokens
        turn = [tok.bos, *tok.encode(" Welcome to the café."), tok.eos]
        call = await asyncio.to_thread(remote.open_session, PROMPT, TOOLS, loop=loop)
        ticker = Ticker(engine, 0)
        frames: list[tuple[float, int, str]] = []  # (when it came, its tick, its text)
        call.force_text(turn)

        async def listen() -> None:
            while True:
                out = await call.outputs.get()
                if isinstance(out, AudioFrame):
                    frames.append((time.monotonic(), out.tick, out.text))
                elif isinstance(out, TurnEnded):
                    call.force_text(turn)

        listening = loop.create_task(listen())
        try:
            while len(frames) < 10:  # the call is live and speaking
                await asyncio.sleep(0.05)
            held: list[socket.socket] = []
            open_line = encode({"op": "open", "prompt": PROMPT, "tools": TOOLS})
            attack = threading.Thread(
                target=lambda: held.extend(keyed(host, flood, open_line) for _ in range(3))
            )
            started, ticks0 = time.monotonic(), ticker.ticks
            attack.start()
            waits = []
            while time.monotonic() - started < window_s:
                t0 = time.monotonic()
                assert (await asyncio.to_thread(worker.status))["op"] == "load"
                waits.append(time.monotonic() - t0)
                await asyncio.sleep(0.1)
            ticked, ended = ticker.ticks - ticks0, time.monotonic()
            call.read_frames()  # what the ring holds now (quiet frames are signalled a few at a time)
            got = sum(1 for t, _, _ in frames if t >= started)
            # a word reaches the room as soon as its tick wrote it (a frame with text wakes the room at once)
            words = [t - ticker.at[k] for t, k, text in frames if text and started <= t <= ended]
            attack.join(HANG_S)
            assert len(engine.pool.sessions) == 1  # the call's alone
            return waits, got, ticked, words, held
        finally:
            listening.cancel()
            ticker.close()
            call.close()

    waits, got, ticked, words, held = asyncio.run(main())
    print(f"worker's waits max {max(waits):.3f} s over {len(waits)}; {got} frames in {ticked} ticks")
    print(f"{len(words)} words in the window, the latest {max(words):.3f} s after its tick")
    print(host.stats)
    for s in held:
        s.close()
    assert max(waits) < ANSWER_S
    assert got >= 0.75 * ticked > 0
    assert len(words) >= 5 and max(words) < ANSWER_S
    assert host.stats["dropped_connections"] == 3
    lines = [r.getMessage() for r in caplog.records if "stopped reading" in r.getMessage()]
    assert lines == ["a room connection stopped reading the door's answers; 1 closed"]
    assert host.alive


def test_a_context_too_long_is_refused_with_a_sentence_and_the_room_reads_it(hosted):
    engine, host = hosted
    remote = RemoteEngine(host.address, key=host.keys.room)
    big = "The guest asked about the spa. " * (4_000_000 // 31)  # 3.8 MiB
    many_tokens = "😀" * 10_000  # under the characters' cap, some 40,000 tokens
    for context, why in ((big, "characters"), (many_tokens, "tokens")):
        s = keyed(host, encode({"op": "open", "prompt": PROMPT, "tools": TOOLS, "context": context}))
        t0 = time.monotonic()
        [reply] = answers(s, 1)
        took = time.monotonic() - t0
        s.close()
        print(reply, f"{took:.3f} s")
        assert reply["op"] == "error" and reply["kind"] == "SessionRejected", reply
        assert reply["message"].startswith("context: ") and why in reply["message"]
    # the room's side refuses it before a byte is sent, with the same sentence
    connections = host.stats["connections"]

    async def room_opens():
        return remote.open_session(PROMPT, TOOLS, context=big)

    with pytest.raises(SessionRejected, match=f"more than the {MAX_CONTEXT_CHARS:,}"):
        asyncio.run(room_opens())
    assert host.stats["connections"] == connections
    assert host.stats["sessions"] == 0 and engine.pool.available == 4 and not engine.pool.sessions


def test_the_door_serves_others_while_a_long_context_is_tokenised(hosted, monkeypatch):
    """A context within the caps whose tokenising takes long (held here until the others were served): the
    worker's question and another room's session are answered meanwhile, and the context's session opens."""
    engine, host = hosted
    worker = EngineControl(host.address, host.keys.control)
    remote = RemoteEngine(host.address, key=host.keys.room)
    context = "Earlier the guest asked for a quiet room. " * 400  # 16,800 characters
    assert len(engine.tokens.encode("\n\n" + context)) < MAX_CONTEXT_TOKENS
    tokenising, release = threading.Event(), threading.Event()
    encode_text = engine.tokens.encode

    def slow(text: str) -> list[int]:
        if len(text) >= len(context):
            tokenising.set()
            release.wait(HANG_S / 4)  # the door's own thread would be held this long
        return encode_text(text)

    monkeypatch.setattr(engine.tokens, "encode", slow)

    async def main():
        loop = asyncio.get_running_loop()
        slow_open = asyncio.create_task(
            asyncio.to_thread(remote.open_session, PROMPT, TOOLS, loop=loop, context=context)
        )
        assert await asyncio.to_thread(tokenising.wait, HANG_S)
        t0 = time.monotonic()
        status = await asyncio.to_thread(worker.status)
        other = await asyncio.to_thread(remote.open_session, PROMPT, TOOLS, loop=loop)
        served = time.monotonic() - t0
        release.set()
        return status, other, served, await slow_open

    status, other, served, carried = asyncio.run(main())
    print(f"the worker and another room served in {served:.3f} s; {host.stats}")
    assert status["op"] == "load" and not other.closed and served < ANSWER_S
    assert not carried.closed and carried.slot != other.slot
    sessions = {s.id: s for s in engine.pool.sessions.values()}
    assert set(sessions) == {carried.id, other.id}
    # the carried call's prompt has its own part (never kept for others); the other's is the agent's alone
    assert not sessions[carried.id].keep_prompt and sessions[other.id].keep_prompt


HOLDER = r"""
import json, socket, sys, time
address, key, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
held, refused = [], 0
for _ in range(n):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect("\0" + address)
    s.sendall((json.dumps({"op": "key", "key": key}) + "\n" + json.dumps({"op": "hello"}) + "\n").encode())
    answer = s.recv(65536)
    if b'"op":"hello"' in answer:
        held.append(s)
    else:
        refused += 1
        s.close()
print(json.dumps({"held": len(held), "refused": refused}), flush=True)
time.sleep(60)
"""


def test_one_rooms_idle_connections_do_not_stop_another_rooms_open(hosted):
    """A room's process holds as many idle connections with the rooms' key as the door lets it (more than the
    door's room connections in all used to be); another room's process still says hello and opens its
    session at once."""
    engine, host = hosted
    n = 3 * ROOM_PEER_CAP
    holder = subprocess.Popen(
        [sys.executable, "-I", "-c", textwrap.dedent(HOLDER), host.address, host.keys.room, str(n)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        counts = json.loads(holder.stdout.readline())

        async def another_room():
            remote = await asyncio.to_thread(RemoteEngine, host.address, key=host.keys.room)
            return await asyncio.to_thread(
                remote.open_session, PROMPT, TOOLS, loop=asyncio.get_running_loop()
            )

        t0 = time.monotonic()
        room = asyncio.run(another_room())
        took = time.monotonic() - t0
    finally:
        holder.kill()
        holder.wait()
    print(counts, f"another room opened in {took:.3f} s", host.stats)
    assert counts == {"held": ROOM_PEER_CAP, "refused": n - ROOM_PEER_CAP}
    assert not room.closed and took < ANSWER_S and len(engine.pool.sessions) == 1
