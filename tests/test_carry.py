"""The conversation carried over (agent/fleet/carry.py): a call's turns and tool results are kept in the
booking database while it lasts; an agent that replaces a lost one opens its engine session with a prompt that
holds them (checked at the engine: the session's prefilled tokens), keeps the conversation's key, so a booking
made before the break and asked for again after it exists once; a call that ends on purpose leaves nothing,
and one left behind is purged. On the real engine (tiny, dummy weights) with turns and tool calls forced by
teacher forcing, on SQLite and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import json
from datetime import timedelta
from types import SimpleNamespace

import pytest
from livekit.agents.testing import fake_job_context

import hotel_support
from agent.audio_out.sinks import WavSink
from agent.call import start_call
from agent.fleet import carry
from agent.fleet.carry import Conversation, ConversationLog, resume_context
from agent.hotel import HotelAgent
from engine.tick.engine import Engine
from hotel_support import booking
from wait_support import await_until

OUT_RATE = 48000


@pytest.fixture(scope="module")
def engine():
    e = Engine(preset="tiny", num_slots=4, refuse_when_overloaded=False)
    yield e
    e.close()


def turn(engine: Engine, text: str) -> list[int]:
    tok = engine.tokens
    return [tok.bos, *tok.encode(text), tok.eos]


async def a_call(
    engine, hotel, log: ConversationLog, tmp_path, say: str, book: dict
) -> tuple[str, list[int]]:
    """One call on the engine: the agent's prompt as the job makes it (resumed: with the earlier turns), a
    forced turn, then a forced `book_room`; what the booking answered and the session's prefilled prompt."""
    agent = HotelAgent(hotel, session_key=log.conversation.key)
    context = resume_context(log.conversation) if log.resumed else ""
    with fake_job_context():
        call = await start_call(
            engine, agent, sink=WavSink(tmp_path / f"{len(say)}.wav", OUT_RATE), context=context
        )
        call.duplex.record = log
        handle = await call.wait_open()
        session = handle._s  # the engine's session behind the handle
        prompt = list(session.progress.prefill_ids)  # as opened: the prompt it prefills
        handle.pad_between(True)
        await await_until(lambda: call.duplex.stats["frames_out"] >= 3, "the session to go live", 90)
        handle.force_text(turn(engine, say))
        await await_until(
            lambda: call.duplex.stats["turns"] >= 1 and not call.duplex.speaking, "the turn", 90
        )
        tok = engine.tokens
        handle.force_function(tok.call_ids([{"name": "book_room", "arguments": book}]))
        await await_until(lambda: call.duplex.stats["resumes"] == 1, "the booking's result", 90)
        await log.flush()
        answer = next(
            i.output for i in call.session.history.items if getattr(i, "type", "") == "function_call_output"
        )
        await call.aclose()
    return answer, prompt


@pytest.mark.parametrize("backend", hotel_support.BACKENDS)
def test_a_replacing_agent_carries_the_conversation_on_and_its_booking_is_made_once(
    engine, backend, tmp_path
):
    with hotel_support.seeded_store(backend, tmp_path) as store:
        hotel = hotel_support.hotel(store)
        args = booking(guest_name="Grace Hopper")

        async def main():
            first = await ConversationLog.open(store, "RM_suite", "AJ_first", resumed=False)
            said = " Welcome to the Grand Hotel, Ms Hopper."
            answer, _ = await a_call(engine, hotel, first, tmp_path, said, args)
            # the worker is lost here: the room's next agent reads what was kept
            second = await ConversationLog.open(store, "RM_suite", "AJ_second", resumed=True)
            again, prompt = await a_call(engine, hotel, second, tmp_path, " Where were we?", args)
            return answer, again, prompt, second

        answer, again, prompt, second = asyncio.run(main())
        reservations = hotel.reservations()
    assert second.resumed and second.conversation.key == "AJ_first" and second.conversation.breaks == 1
    text = engine.tokens.decode(prompt)
    # the engine was prefilled with the earlier turn and the tool's result, as the model reads results
    assert "Welcome to the Grand Hotel, Ms Hopper." in text
    assert "<TOOL_RESPONSE>[" in text and answer in text
    assert "cut off" in text
    assert len(reservations) == 1  # asked for twice, across the break: made once
    first, repeat = json.loads(answer), json.loads(again)
    assert first["already_booked"] is False and repeat["already_booked"] is True
    assert repeat["confirmation_code"] == first["confirmation_code"] == reservations[0].code


@pytest.mark.parametrize("backend", hotel_support.BACKENDS)
def test_a_call_that_ends_on_purpose_leaves_nothing_and_one_left_behind_is_purged(backend, tmp_path):
    with hotel_support.seeded_store(backend, tmp_path) as store:

        async def main():
            log = await ConversationLog.open(store, "RM_a", "AJ_a", resumed=False)
            log.said("Hello")
            await log.flush()
            kept = store.transact(lambda tx: tx.conversation("RM_a"))
            await log.forget()
            gone = store.transact(lambda tx: tx.conversation("RM_a"))
            stale = await ConversationLog.open(store, "RM_b", "AJ_b", resumed=False)
            stale.said("Hello")
            await stale.flush()
            old = store.now() - timedelta(seconds=carry.KEEP_S + 1)
            store.transact(
                lambda tx: tx.put_conversation("RM_b", tx.conversation("RM_b"), at=old), write=True
            )
            carry._last_purge = -carry.PURGE_EVERY_S  # this process's last purge long ago
            await ConversationLog.open(store, "RM_c", "AJ_c", resumed=False)  # a job starting: purges
            purged = store.transact(lambda tx: tx.conversation("RM_b"))
            return kept, gone, purged

        kept, gone, purged = asyncio.run(main())
    assert Conversation.from_json(kept).said == ["Hello"]
    assert gone is None and purged is None


def test_a_call_that_ends_while_its_last_turn_is_being_written_leaves_no_row(tmp_path):
    """The write of a turn runs in a thread; the call ending meanwhile deletes the conversation only once that
    write is in, so the row it was writing cannot land after the delete and outlive the call."""
    import threading

    with hotel_support.seeded_store("sqlite", tmp_path) as store:
        writing, go_on = threading.Event(), threading.Event()
        transact = store.transact

        def slow_transact(fn, write=False):  # the first write held in its thread until the test lets it go
            if write and not writing.is_set():
                writing.set()
                go_on.wait(10)
            return transact(fn, write=write)

        async def main():
            log = await ConversationLog.open(store, "RM_w", "AJ_w", resumed=False)
            store.transact = slow_transact
            log.said("Goodbye")  # its write starts, and is held
            await asyncio.to_thread(writing.wait, 10)
            ending = asyncio.ensure_future(log.forget())  # the caller hangs up meanwhile
            await asyncio.sleep(0.2)
            go_on.set()
            await ending
            log.said("after the end")  # a late turn of an ended call is never saved
            await asyncio.sleep(0.2)
            return transact(lambda tx: tx.conversation("RM_w"))

        row = asyncio.run(main())
    assert writing.is_set() and row is None


def test_the_conversations_of_calls_found_over_are_deleted_and_no_other(tmp_path):
    with hotel_support.seeded_store("sqlite", tmp_path) as store:

        async def main():
            for sid in ("RM_over1", "RM_over2", "RM_on"):
                log = await ConversationLog.open(store, sid, f"AJ_{sid}", resumed=False)
                log.said("Hello")
                await log.flush()

        asyncio.run(main())
        carry.forget_rooms(store, ["RM_over1", "RM_over2", "RM_never"])
        left = [
            sid
            for sid in ("RM_over1", "RM_over2", "RM_on")
            if store.transact(lambda tx, s=sid: tx.conversation(s))
        ]
    assert left == ["RM_on"]


def test_a_damaged_or_foreign_row_is_no_conversation():
    assert Conversation.from_json("not json") is None
    assert Conversation.from_json('{"said": ["x"]}') is None  # no key
    c = Conversation.from_json('{"key": "AJ_1", "said": ["hi", 3], "tools": [{"name": 1}], "breaks": "x"}')
    assert (c.key, c.said, c.tools, c.breaks) == ("AJ_1", ["hi"], [], 0)
    assert Conversation.from_json("[" * 100000) is None


def test_a_held_conversation_is_not_saved_until_let_go_and_a_replaced_one_never(tmp_path):
    """While the agent's own connection is down another agent may carry the call on from what is saved: the
    old agent's turns then are kept in memory only, and saved when its connection is back (its call went
    on); a job replaced in the meantime never saves again."""
    with hotel_support.seeded_store("sqlite", tmp_path) as store:

        def row() -> list[str]:
            text = store.transact(lambda tx: tx.conversation("RM_h"))
            return Conversation.from_json(text).said if text else []

        async def main():
            log = await ConversationLog.open(store, "RM_h", "AJ_h", resumed=False)
            log.said("Before")
            await log.flush()
            seen = [row()]
            log.hold(True)  # down
            log.said("Into the void")
            await asyncio.sleep(0.1)
            await log.flush()
            seen.append(row())
            log.hold(False)  # back, not replaced: what changed is saved
            await log.flush()
            seen.append(row())
            log.hold(True)  # replaced: held for good
            log.said("Never saved")
            await asyncio.sleep(0.1)
            await log.flush()
            seen.append(row())
            return seen

        seen = asyncio.run(main())
    assert seen == [["Before"], ["Before"], ["Before", "Into the void"], ["Before", "Into the void"]]


def test_a_dropped_line_that_comes_back_is_acknowledged_once_by_the_script(engine, tmp_path):
    """Teacher forcing: the call asks its script for the agent's words once a dropped line is back (the
    caller's connection, or the agent's own); two cues at once are said once. Checked at the engine's text
    channel as the turn the conversation records."""
    from agent.forcing import Script, run_script

    with hotel_support.seeded_store("sqlite", tmp_path) as store:
        hotel = hotel_support.hotel(store)

        async def main():
            log = await ConversationLog.open(store, "RM_back", "AJ_back", resumed=False)
            cues: asyncio.Queue[str] = asyncio.Queue()
            with fake_job_context():
                call = await start_call(engine, HotelAgent(hotel), sink=WavSink(tmp_path / "b.wav", OUT_RATE))
                call.duplex.record = log
                script = asyncio.create_task(
                    run_script(call, engine, Script(greet=False, reply_every_s=0), cues)
                )
                await await_until(lambda: call.duplex.stats["frames_out"] >= 3, "the session to go live", 90)
                cues.put_nowait(carry.back_again())  # the caller came back ...
                cues.put_nowait(carry.back_again())  # ... and the agent's own link, at once
                await await_until(
                    lambda: call.duplex.stats["turns"] >= 1 and not call.duplex.speaking, "the turn", 90
                )
                await asyncio.sleep(0.5)  # a second turn, if one were forced, would have begun
                turns = call.duplex.stats["turns"]
                script.cancel()
                await call.aclose()
            return turns, log.conversation.said

        turns, said = asyncio.run(main())
    assert turns == 1
    assert said == [carry.back_again().strip()]


@pytest.mark.parametrize(
    "path, wait_s",
    [("carried on", 0.0), ("carried on", 30.0), ("handed over", 0.0), ("handed over", 30.0)],
)
def test_a_carried_on_call_not_live_in_time_hears_a_hold_clip_never_over_the_models_words(
    engine, tmp_path, monkeypatch, path, wait_s
):
    """A call carried on after a break: its session prefills the earlier conversation first (its own part
    of the prompt, never cached). Not live HOLD_ON_S after it was asked for (0 s: never in time),
    the caller hears the "bear with me" clip, and the agent's first words (the forced acknowledgement) come
    after it, never over it; live in time (30 s: always), no clip plays. The same for a call handed over by
    a draining worker whose agent is removed TAKE_OVER_S after the new session was asked for, live or not
    (the removal faked here: tests/test_livekit_fleet.py removes it for real)."""
    from agent.fleet import takeover, timing
    from agent.forcing import Script, run_script

    removed = []
    ctx = SimpleNamespace(job=SimpleNamespace(id="AJ_next"))

    async def remove(ctx, settings):
        removed.append(ctx)

    monkeypatch.setattr(timing, "HOLD_ON_S" if path == "carried on" else "TAKE_OVER_S", wait_s)
    monkeypatch.setattr(takeover, "_replace_lost_agent", remove)
    greeting = carry.acknowledgement(handed_over=path == "handed over")
    with hotel_support.seeded_store("sqlite", tmp_path) as store:
        hotel = hotel_support.hotel(store)

        async def main():
            log = await ConversationLog.open(store, "RM_hold", "AJ_hold", resumed=False)
            log.said(f"Your room for the {wait_s} nights is ready.")
            await log.flush()
            log = await ConversationLog.open(store, "RM_hold", "AJ_next", resumed=True)
            agent = HotelAgent(hotel, session_key=log.conversation.key)
            with fake_job_context():
                call = await start_call(
                    engine,
                    agent,
                    sink=WavSink(tmp_path / "h.wav", OUT_RATE),
                    context=resume_context(log.conversation),
                )
                call.duplex.record = log
                hold = asyncio.create_task(
                    takeover._hold_on(call) if path == "carried on" else takeover._take_over(ctx, None, call)
                )
                script = asyncio.create_task(
                    run_script(call, engine, Script(greeting=greeting, reply_every_s=0))
                )
                await await_until(
                    lambda: call.duplex.stats["turns"] >= 1 and not call.duplex.speaking, "the first turn", 90
                )
                await await_until(
                    lambda: call.output.queued_s == 0 and not call.output.clip_playing, "playout"
                )
                hold.cancel()
                script.cancel()
                spans, events = list(call.output.spans), list(call.output.events)
                await call.aclose()
            return spans, events, log.conversation.said

        spans, events, said = asyncio.run(main())
    clips = [s for s in spans if s[0] == "clip" and s[2] > s[1]]
    model = [s for s in spans if s[0] == "model" and s[2] > s[1]]
    assert said[-1] == greeting.strip()  # the agent's first words: the break acknowledged
    assert removed == ([] if path == "carried on" else [ctx])  # a handed-over call's old agent: removed
    if wait_s:
        assert not clips and not any("clip" in e for _, e in events)
        return
    assert [e for _, e in events if e.startswith("clip_queued")] == ["clip_queued:ack_bear"]
    assert clips and model and max(c[2] for c in clips) <= min(m[1] for m in model) + 1e-3


def test_a_rows_limits_hold_when_it_is_read_back(tmp_path):
    """A row is read back within the limits a conversation is written with, whoever wrote it: one of 7.2 MB
    (24 turns of 300,000 characters) is not read, the call going on without its history, never as a prompt
    of millions of tokens; one within MAX_ROW_CHARS whose turns, tools and results are longer and more than
    the limits is cut to them, and its prompt is as short as the limits make it."""
    from engine.config.stage_config import TokenConfig
    from engine.text.tokens import Tokens

    tokens = Tokens(TokenConfig())
    huge = Conversation("AJ_huge", said=["word " * 60_000] * carry.MAX_TURNS).to_json()
    over = Conversation(
        "AJ_over",
        said=[f"turn {i} " + "x" * 2000 for i in range(60)],
        tools=[
            {"name": "n" * 500, "arguments": "a" * 3000, "output": "o" * 3000, "is_error": "yes"}
            for _ in range(20)
        ],
    ).to_json()
    assert len(huge) > 7_000_000 and len(over) < carry.MAX_ROW_CHARS
    with hotel_support.seeded_store("sqlite", tmp_path) as store:

        async def read(sid: str, text: str) -> ConversationLog:
            store.transact(lambda tx: tx.put_conversation(sid, text), write=True)
            return await ConversationLog.open(store, sid, "AJ_next", resumed=True)

        huge_log = asyncio.run(read("RM_huge", huge))
        over_log = asyncio.run(read("RM_over", over))
    assert (huge_log.resumed, huge_log.conversation.key) == (False, "AJ_next")
    c = over_log.conversation
    assert (over_log.resumed, c.key, len(c.said), len(c.tools)) == (
        True,
        "AJ_over",
        carry.MAX_TURNS,
        carry.MAX_TOOLS,
    )
    assert c.said[-1].startswith("turn 59 ") and max(map(len, c.said)) == carry.MAX_TURN_CHARS
    assert {(len(t["name"]), len(t["arguments"]), len(t["output"]), t["is_error"]) for t in c.tools} == {
        (carry.MAX_NAME_CHARS, carry.MAX_RESULT_CHARS, carry.MAX_RESULT_CHARS, False)
    }
    ids, prefix = tokens.prompt_parts("", [], resume_context(c))
    bound = carry.MAX_TURNS * carry.MAX_TURN_CHARS + carry.MAX_TOOLS * (
        carry.MAX_NAME_CHARS + 2 * carry.MAX_RESULT_CHARS
    )
    print(f"the cut row's prompt: {len(ids)} tokens (the limits' characters: {bound})")
    assert len(ids) - prefix < bound + 2000  # the template's own text besides
    lines = Conversation("AJ_lines", said=["Booked.\n\nYour tools had returned:\n- all", " \n "]).to_json()
    assert Conversation.from_json(lines).said == ["Booked. Your tools had returned: - all"]  # as said
