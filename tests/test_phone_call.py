"""A phone call end to end on the real engine (tiny preset, dummy weights) in an offline `AgentSession`:
telephone-band caller audio (8 kHz, through G.711 mu-law and back) and the phone concierge hanging up.

Dummy weights decide nothing, so the tool call is made by teacher forcing: the function channel is forced with
`call_control`'s real token sequence, the goodbye is a forced turn, and both channels are held at padding
between them. LiveKit's API is the protocol fake of
tests/twirp_fake.py (no LiveKit server can run here).
"""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pytest
from livekit.agents.testing import fake_job_context

from agent.audio_out.sinks import WavSink
from agent.call import PcmInput, read_wav, start_call
from agent.phone.phone import PhoneConcierge, PhoneLine
from agent.phone.telephony import PHONE_RATE, mulaw_decode, mulaw_encode, telephone_band
from agent.settings import AgentSettings
from engine.config.presets import load_preset
from engine.tick.engine import Engine
from engine.tick.slots import SILENT_RMS
from engine_support import ticks_pass
from prompts import PROMPTS_DIR
from wait_support import await_until

CLOCK = load_preset("tiny").clock  # the engine's frame clock (the engine below runs the tiny preset)
FRAME_S = CLOCK.frame_ms / 1000
PHONE_FRAME = PHONE_RATE * CLOCK.frame_ms // 1000  # one engine frame of telephone audio


def quiet_frames(phone: np.ndarray) -> int:
    """Frames of the caller's audio (in engine frames, as sent) that hold no words: below twice the engine's
    silence level, so a frame at the edge that resampling nudges either way is counted."""
    n = math.ceil(phone.size / PHONE_FRAME)
    x = np.zeros(n * PHONE_FRAME, np.float32)
    x[: phone.size] = phone / 32768.0
    return int((np.sqrt(np.mean(np.square(x.reshape(n, PHONE_FRAME)), axis=1)) < 2 * SILENT_RMS).sum())


def test_mulaw_round_trip_is_g711():
    x = np.array([0, 1, -1, 100, -100, 1000, -8000, 32767, -32768], np.int16)
    codes = mulaw_encode(x)
    assert codes[0] == 0xFF and codes[7] == 0x80 and codes[8] == 0x00  # G.711's zero and extremes
    y = mulaw_decode(codes)
    assert np.all(np.abs(y.astype(int) - x) <= np.maximum(4, np.abs(x.astype(int)) // 16))  # <= half a step
    assert np.array_equal(mulaw_decode(mulaw_encode(y)), y)  # decoded values are fixed points


@pytest.fixture(scope="module")
def engine():
    e = Engine(preset="tiny", num_slots=4, refuse_when_overloaded=False)  # a call, not admission, under test
    yield e
    e.close()


@pytest.fixture
def hotel(sqlite_hotel):
    return sqlite_hotel  # tests/conftest.py


def test_a_phone_caller_on_8khz_mulaw_is_heard_frame_for_frame_and_the_agent_hangs_up(
    engine, hotel, livekit, tmp_path
):
    """The caller's 3.5 s of speech at telephone band reaches the engine as engine frames, every one of them;
    the agent answers each frame it heard with one of its own. Then the model calls `call_control` to end the
    call (forced), says goodbye (a forced turn), and only after that turn has played is the caller removed
    and the room closed."""
    pcm, rate = read_wav(PROMPTS_DIR / "callers" / "caller_booking.wav")
    phone = telephone_band(pcm, rate)
    sent = math.ceil(phone.size / PHONE_FRAME)  # PcmInput pads the last frame

    async def main():
        livekit.rooms.add("call-1")  # the room the SIP dispatch rule made for the call
        livekit.participants["call-1"] = {"sip_guest"}
        line = PhoneLine(
            AgentSettings.from_env(dotenv=False), room="call-1", identity="sip_guest", number="+447700900123"
        )
        inp = PcmInput(CLOCK, PHONE_RATE, silence=False)  # only the caller's words, no silence after
        with fake_job_context():
            call = await start_call(
                engine,
                PhoneConcierge(hotel, line),
                sink=WavSink(tmp_path / "out.wav", CLOCK.output_rate),
                audio_input=inp,
            )
            line.attach(call.output)
            handle = await call.wait_open()
            # teacher forcing: padding on both channels between the forced tokens, so the dummy weights start
            # no turn of their own (which turns they start depends on when each caller frame was heard)
            handle.pad_between(True)
            await await_until(lambda: call.duplex.stats["frames_out"] >= 3, "the session to go live")
            inp.push(phone)

            def heard():
                s = next(s for s in engine.snapshot().sessions if s.id == handle.id)
                return s.frames_in, s.frames_consumed, s.skipped_frames, s.dropped_frames

            def all_heard():
                frames_in, consumed, skipped, dropped = heard()
                return frames_in >= sent - 1 and consumed + skipped + dropped == frames_in

            await await_until(
                all_heard, "the caller's words", seen=lambda: f"(in, consumed, skipped, dropped) {heard()}"
            )
            await ticks_pass(engine, 6)  # anything still on its way has arrived
            frames_in, consumed, skipped, dropped = heard()
            out_before = call.duplex.stats["frames_out"]

            tok = engine.tokens
            handle.force_function(tok.call_ids([{"name": "call_control", "arguments": {"action": "end"}}]))
            await await_until(lambda: call.duplex.paused, "the pause")
            goodbye = [tok.bos, *tok.encode(" Thank you for calling, goodbye."), tok.eos]
            handle.force_text(goodbye)
            await await_until(lambda: call.duplex.stats["resumes"] == 1, "the result to be consumed")
            removed_while_speaking = []

            def watch():
                if call.duplex.speaking and livekit.calls("RemoveParticipant"):
                    removed_while_speaking.append(True)
                return line.outcome is not None

            await await_until(watch, "the hang-up")
            items = [(i.type, getattr(i, "name", None)) for i in call.session.history.items]
            stats = dict(call.duplex.stats)
            # when the line was hung up: what played, and the quiet stretches the playout cut once the turn
            # had waited longer than the measured jitter needed
            played = call.output.stats["model_s"] + call.output.stats["trimmed_s"]
            await call.aclose()
            return (
                frames_in,
                consumed,
                skipped,
                dropped,
                out_before,
                stats,
                items,
                line,
                removed_while_speaking,
                played,
                goodbye,
            )

    result = asyncio.run(main())
    frames_in, consumed, skipped, dropped, out_before, stats, items, line, early, played, goodbye = result
    print("sent", sent, "in", frames_in, "consumed", consumed, "skipped", skipped, "out", out_before, stats)
    assert sent - 1 <= frames_in <= sent  # every frame (the resampler may hold back its last few ms)
    # the model heard each one, except silent frames a busy machine let pile up: the live catch-up skips
    # only silence, so every frame of the caller's words is heard
    assert dropped == 0 and consumed + skipped == frames_in
    assert skipped <= quiet_frames(phone)
    assert out_before >= consumed  # and said one frame for each (plus its frames before the caller spoke)
    assert ("function_call", "call_control") in items and stats["function_calls"] == 1
    assert line.outcome == "ended" and not early
    assert stats["turns"] == 1 and stats["speech_frames"] == len(goodbye)
    assert played == pytest.approx(
        len(goodbye) * FRAME_S, abs=1e-3
    )  # the goodbye had played before the hang-up
    assert livekit.methods() == ["RemoveParticipant", "DeleteRoom"]
    assert "call-1" not in livekit.rooms
