"""The text channel as text: a character the tokenizer splits over several byte tokens reaches the session's
frames, the caller's transcript and the snapshot whole, decoded one token at a time as the engine does it.

Through the engine's own tokenizer (the tiny preset's byte-level BPE, which splits every character outside
ASCII into byte tokens, as the release's does), then through the engine itself with teacher-forced turns."""

from __future__ import annotations

import random

import pytest

from engine.api import AudioFrame, TurnEnded, TurnStarted
from engine.config.stage_config import TokenConfig
from engine.text.tokens import TextStream, Tokens
from engine.tick.engine import Engine, EngineConfig
from engine_support import ManualClock, drain, run_ticks
from testkit.concierge import PROMPT, TOOLS

TOK = Tokens(TokenConfig())
PHRASES = ["Booked for José García", " the café", "Müller", "東京", "Ελλάδα", " 😀 see you", "naïve façade"]


def one_at_a_time(ids: list[int], stream: TextStream | None = None) -> list[str]:
    stream = stream or TextStream()
    return [TOK.text(stream, i) for i in ids]


@pytest.mark.parametrize("text", PHRASES)
def test_a_split_character_comes_out_whole_with_its_last_token(text):
    ids = TOK.encode(text)
    assert any("\ufffd" in TOK.decode([i]) for i in ids)  # a character split over byte tokens
    pieces = one_at_a_time(ids)
    print(text, ids, pieces)
    assert "".join(pieces) == TOK.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_tokens_in_any_order_decode_as_the_tokenizer_decodes_them_all():
    """Random runs of the vocabulary's text tokens, valid UTF-8 or not: the pieces, plus the one U+FFFD an
    unfinished last character stands for, are what the tokenizer makes of the whole run."""
    rng = random.Random(29)
    text_ids = [i for i in range(TOK.vocab_size) if TOK.text(TextStream(), i) or "\ufffd" in TOK.decode([i])]
    for _ in range(2000):
        ids = [rng.choice(text_ids) for _ in range(rng.randint(1, 12))]
        stream = TextStream()
        out = "".join(one_at_a_time(ids, stream))
        assert out + ("\ufffd" if stream.held else "") == TOK.decode(ids), ids


def test_bytes_that_are_no_character_are_not_held_back():
    """A lone lead byte gives one U+FFFD as soon as the next token shows no character continues it, and a run
    of continuation bytes comes out at once, one U+FFFD each: nothing waits for bytes that cannot come."""
    lead, cont = TOK.encode("é")[0], TOK.encode("é")[1]  # 0xC3 0xA9
    a = TOK.encode("a")[0]
    assert one_at_a_time([lead, a]) == ["", "\ufffda"]
    assert one_at_a_time([lead, lead, cont]) == ["", "\ufffd", "é"]
    assert one_at_a_time([cont] * 6) == ["\ufffd"] * 6
    assert one_at_a_time(TOK.encode("😀")) == ["", "", "", "😀"]  # 4 byte tokens: 3 held, then whole


def test_control_tokens_inside_a_character_leave_it_whole_and_a_turns_end_drops_it():
    lead, cont = TOK.encode("é")
    b = TOK.encode("b")[0]
    assert "".join(one_at_a_time([lead, TOK.pad, TOK.pad, cont])) == "é"
    # the turn ended mid-character: no half of it shows, and the next turn starts clean
    assert one_at_a_time([TOK.encode("a")[0], lead, TOK.eos, TOK.bos, b]) == ["a", "", "", "", "b"]


# -- through the engine -------------------------------------------------------------------------------------


def turns(outputs: list) -> list[str]:
    """The text of each turn in `outputs`, as a caller's transcript has it (frames' text inside a turn)."""
    said, going = [], False
    for o in outputs:
        if isinstance(o, TurnStarted):
            said.append("")
            going = True
        elif isinstance(o, AudioFrame) and going:
            said[-1] += o.text
        if isinstance(o, TurnEnded):
            going = False
    return said


@pytest.fixture(scope="module")
def engine():
    # the snapshot's words on (off by default: counts only), to see them whole
    config = EngineConfig(preset="tiny", num_slots=1, start=False, show_words="redacted")
    e = Engine(config, clock=ManualClock())
    yield e
    e.close()


def test_a_sessions_frames_and_snapshot_carry_whole_words(engine):
    h = engine.open_session(PROMPT, TOOLS)
    try:
        run_ticks(engine, engine.tick + 1, 2)  # the prompt prefilled: live
        long = " ".join(PHRASES)
        booked = "Booked for José García at the café"
        forced = [TOK.bos, *TOK.encode(long), TOK.eos, TOK.pad, TOK.bos, *TOK.encode(booked), TOK.eos]
        h.force_text(forced + [TOK.pad] * 4)
        run_ticks(engine, engine.tick + 1, len(forced) + 4)
        outputs = drain(h)
        texts = [o.text for o in outputs if isinstance(o, AudioFrame)]
        print(turns(outputs))
        assert turns(outputs) == [long, booked]
        assert not any("\ufffd" in t for t in texts)
        (row,) = engine.snapshot().sessions
        print(row.last_words)
        assert row.last_words == "Booked for [name] [name] at the café"  # names redacted whole, no fragment
    finally:
        h.close()
        run_ticks(engine, engine.tick + 1, 1)


def test_a_character_left_unfinished_is_dropped_and_the_slots_next_session_starts_clean(engine):
    lead = TOK.encode("é")[0]
    first = engine.open_session(PROMPT, TOOLS)
    run_ticks(engine, engine.tick + 1, 2)
    first.force_text([TOK.bos, *TOK.encode(" caf"), lead, TOK.eos, TOK.bos, *TOK.encode(" ok"), lead])
    run_ticks(engine, engine.tick + 1, 9)
    assert turns(drain(first)) == [" caf", " ok"]
    first.close()  # mid-character, on the slot the next session gets
    run_ticks(engine, engine.tick + 1, 1)
    second = engine.open_session(PROMPT, TOOLS)
    try:
        run_ticks(engine, engine.tick + 1, 2)
        assert second.slot == first.slot
        words = " Müller"
        second.force_text([TOK.bos, *TOK.encode(words), TOK.eos, TOK.pad])
        run_ticks(engine, engine.tick + 1, len(TOK.encode(words)) + 3)
        assert turns(drain(second)) == [words]
    finally:
        second.close()
        run_ticks(engine, engine.tick + 1, 1)
