"""RoomTranscript (agent/transcript.py): the agent's words go to the room's text stream without ever
holding up the turn that speaks them. A fake room stands in for the rtc SDK's participant here (the real
streams are exercised through a LiveKit server in test_livekit.py); what is checked is the output's own
behaviour: it returns at once, one stream per turn with its final attribute, pieces written while a
write is in flight coalesce, and a stream that stalls costs that turn's words (counted) and nothing
else."""

from __future__ import annotations

import asyncio

from agent.transcript import FINAL, SEGMENT_ID, TOPIC, TRACK_ID, RoomTranscript
from wait_support import await_until


class FakeWriter:
    def __init__(self, room: FakeRoom, attributes: dict[str, str]) -> None:
        self.room, self.attributes = room, attributes
        self.texts: list[str] = []
        self.closed_with: dict[str, str] | None = None

    async def write(self, text: str) -> None:
        await self.room.gate.wait()
        self.texts.append(text)

    async def aclose(self, *, reason: str = "", attributes: dict[str, str] | None = None) -> None:
        self.closed_with = dict(attributes or {})


class FakeRoom:
    def __init__(self) -> None:
        self.writers: list[FakeWriter] = []
        self.gate = asyncio.Event()  # writes wait on it: cleared, a stalled runtime
        self.gate.set()
        self.opens = asyncio.Event()  # stream openings wait on it: cleared, a data channel not yet up
        self.opens.set()
        self.local_participant = self

    def isconnected(self) -> bool:
        return True

    async def stream_text(self, *, topic: str, attributes: dict[str, str]) -> FakeWriter:
        assert topic == TOPIC
        await self.opens.wait()
        w = FakeWriter(self, attributes)
        self.writers.append(w)
        return w


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def test_a_turn_is_one_stream_closed_final_and_capture_never_waits():
    async def run():
        room = FakeRoom()
        out = RoomTranscript(room, "TR_agent")
        room.gate.clear()  # the runtime does not answer: capture still returns at once
        await asyncio.wait_for(out.capture_text(" Hello,"), 0.1)
        await asyncio.wait_for(out.capture_text(" thank you"), 0.1)
        await asyncio.wait_for(out.capture_text(" for calling."), 0.1)
        out.flush()
        room.gate.set()
        await settle()
        await out.aclose()
        return room, out

    room, out = asyncio.run(run())
    assert len(room.writers) == 1
    w = room.writers[0]
    assert "".join(w.texts) == " Hello, thank you for calling."
    assert len(w.texts) <= 2  # what arrived while the first write waited went out as one
    assert (
        w.attributes[FINAL] == "false" and w.attributes[TRACK_ID] == "TR_agent" and w.attributes[SEGMENT_ID]
    )
    assert w.closed_with == {FINAL: "true", TRACK_ID: "TR_agent"}
    assert out.stats["turns"] == 1 and out.stats["failed"] == 0


def test_a_stalled_stream_costs_its_turn_only():
    async def run():
        room = FakeRoom()
        out = RoomTranscript(room, None, wait_s=0.05)
        room.gate.clear()
        await out.capture_text(" lost words")
        out.flush()
        # the write times out: that turn is given up
        await await_until(lambda: out.stats["failed"] == 1, "the turn given up", seen=lambda: out.stats)
        room.gate.set()
        await out.capture_text(" Café Zürich, naïve façade.")
        out.flush()
        await settle()
        await out.aclose()
        return room, out

    room, out = asyncio.run(run())
    assert out.stats["failed"] == 1
    assert [("".join(w.texts), w.closed_with) for w in room.writers][-1] == (
        " Café Zürich, naïve façade.",
        {FINAL: "true"},
    )


def test_turns_waiting_behind_a_stall_are_bounded():
    async def run():
        room = FakeRoom()
        out = RoomTranscript(room, None, wait_s=30.0)
        room.gate.clear()
        for i in range(20):
            await out.capture_text(f" turn {i}.")
            out.flush()
            if i == 0:
                await settle()  # its stream is open; its write waits
        dropped = out.stats["dropped"]
        room.gate.set()
        for _ in range(50):
            await settle()
        await out.aclose()
        return room, out, dropped

    room, out, dropped = asyncio.run(run())
    assert dropped > 0
    texts = ["".join(w.texts) for w in room.writers]
    assert texts[0] == " turn 0." and texts[-1] == " turn 19."  # the first (in flight) and the newest survive
    assert len(texts) + dropped == 20


def test_a_stream_slow_to_open_still_carries_its_turn_and_one_that_never_opens_costs_that_turn():
    """A worker busy with joining rooms can take seconds to set up the agent's data channel, which the first
    stream waits for: the greeting's words wait with it (longer than any write may), and are not lost."""

    async def run():
        room = FakeRoom()
        out = RoomTranscript(room, None, wait_s=0.05, open_wait_s=1.0)
        room.opens.clear()
        await out.capture_text(" Hello, thank you for calling.")
        out.flush()
        await asyncio.sleep(0.3)  # longer than a write may take, shorter than an opening may
        room.opens.set()
        await settle()
        late = [("".join(w.texts), w.closed_with) for w in room.writers]
        room.opens.clear()
        await out.capture_text(" never sent")
        out.flush()
        # the stream never opens: its turn is given up once the opening's wait is over
        await await_until(lambda: out.stats["failed"], "the unopened turn given up", seen=lambda: out.stats)
        failed = out.stats["failed"]
        await out.aclose()
        return late, failed

    late, failed = asyncio.run(run())
    assert late == [(" Hello, thank you for calling.", {FINAL: "true"})]
    assert failed == 1


def test_a_turns_words_go_out_at_most_every_quarter_second_and_its_last_at_once():
    """A token every 80 ms (the model's text channel) is not a write every 80 ms: the first words go at once,
    then what came since at most every WRITE_EVERY_S, and what is left as the turn ends, without waiting."""

    async def run(every: float):
        room = FakeRoom()
        out = RoomTranscript(room, "TR_agent", write_every_s=every)
        loop = asyncio.get_running_loop()
        for i in range(15):
            await out.capture_text(f" w{i}")
            await asyncio.sleep(0.08)
        await out.capture_text(" end.")
        out.flush()
        ended = loop.time()
        while room.writers[0].closed_with is None:
            await asyncio.sleep(0.001)
        closed_after = loop.time() - ended
        await out.aclose()
        return room.writers[0], closed_after

    paced, closed_after = asyncio.run(run(0.25))
    assert "".join(paced.texts) == "".join(f" w{i}" for i in range(15)) + " end."
    assert paced.texts[0] == " w0"  # the first words at once
    assert len(paced.texts) <= 8  # 1.2 s of tokens: the first, then one write a quarter second, then the end
    assert closed_after < 0.1 and paced.closed_with[FINAL] == "true"
    unpaced, _ = asyncio.run(run(0.0))
    assert len(unpaced.texts) >= 15  # a write per token: what the pacing saves
