"""A burst's times (leaving the caller; pushed into the engine's inbox, its tick's start, its output frame
handed out; arriving back at the caller) and the parts between them: the engine's echo log matched to each
caller's record, burst by burst. Knows the algorithmic constants from the code that sets them; knows nothing
of how the callers or the worker were run.
"""

from __future__ import annotations

from agent.call import room_label
from benchmarks.latency.caller import LENGTHS_S, Caller, burst_name

WITHIN_S = 1.5  # a burst's echo is looked for this long after it (its name repeats every 2 s)


def constants() -> dict:
    """The algorithmic parts, from the code that sets them."""
    from agent.audio_out.playout_buffer import BUFFER_FRAMES, START_DELAY_FRAMES
    from agent.audio_out.playout_timing import MAX_START_DELAY_FRAMES, MIN_START_DELAY_S
    from engine.config.presets import load_preset
    from engine.model.codec_ops import cached_columns
    from engine.tick.echo import MARK

    cfg = load_preset("tiny")  # the 11B preset has the same clock, perception geometry and codec head
    big = load_preset("nemotron-voicechat-11b")
    assert (big.clock, big.codec.n_fft, big.codec.hop_length) == (
        cfg.clock,
        cfg.codec.n_fft,
        cfg.codec.hop_length,
    )
    clock, per, codec = big.clock, big.perception, big.codec
    codec_delay = cached_columns(codec.n_fft, codec.hop_length) // 2 * codec.hop_length  # Codec.output_delay
    return {
        "frame_ms": clock.frame_ms,
        "input_rate": clock.input_rate,
        "input_samples": clock.input_samples,
        "output_rate": clock.output_rate,
        "output_samples": clock.output_samples,
        "tick_ms": clock.frame_ms,  # the tick is the model's frame
        # the encoder runs (chunk_mel - 1) mel columns behind the audio (engine/model/perception.py)
        "perception_lag_ms": (per.chunk_mel - 1) * per.hop_length * 1000 / clock.input_rate,
        "codec_delay_ms": codec_delay * 1000 / clock.output_rate,
        "playout_buffer_ms": BUFFER_FRAMES * clock.frame_ms,
        # a call's first turns; then as the measured jitter needs, within these bounds (ArrivalJitter)
        "playout_start_delay_ms": START_DELAY_FRAMES * clock.frame_ms,
        "playout_start_delay_range_ms": [MIN_START_DELAY_S * 1000, MAX_START_DELAY_FRAMES * clock.frame_ms],
        "mark": MARK,
    }


def engine_onsets(frames: list[dict], label: str, rate: int, mark: float) -> list[dict]:
    """The engine's marked frames of one room as bursts: the first frame of each run of consecutive ticks (a
    burst can straddle two frames), with the burst's name from the whole run."""
    shown = room_label(label)  # the worker shows a room by its label, a pseudonym of its name
    mine = sorted((r for r in frames if r["label"] == shown), key=lambda r: r["tick"])
    runs: list[list[dict]] = []
    for r in mine:
        if runs and r["tick"] == runs[-1][-1]["tick"] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return [
        {**run[0], "name": burst_name(sum(r["loud"] for r in run), max(r["peak"] for r in run), rate, mark)}
        for run in runs
    ]


def match(caller: Caller, frames: list[dict], k: dict) -> tuple[list[dict], dict]:
    """Per burst: its onset's four times and the parts between them (ms); bursts with a missing time left out.
    A burst is matched to the first engine frame and then the first echo of its own name (LENGTHS_S) after it,
    within WITHIN_S."""
    left = caller.leave_times()
    eng = engine_onsets(frames, caller.room, k["input_rate"], k["mark"])
    heard, names = caller.heard_onsets(k["mark"])
    used_e, used_h = set(), set()
    rows = []
    fin = k["input_samples"] / k["input_rate"]
    for i, t_send in enumerate(left):
        name = i % len(LENGTHS_S)
        e = next(
            (
                j
                for j, r in enumerate(eng)
                if j not in used_e
                and r["name"] == name
                and r["pushed"] is not None
                and t_send < r["pushed"] < t_send + WITHIN_S
            ),
            None,
        )
        if e is None:
            continue
        used_e.add(e)
        e = eng[e]
        h = next(
            (
                j
                for j, t in enumerate(heard)
                if j not in used_h and names[j] == name and e["sent"] < t < e["sent"] + WITHIN_S
            ),
            None,
        )
        if h is None:
            continue
        used_h.add(h)
        ear = heard[h]
        pos = e["onset"] / k["input_rate"]  # the onset's place in its frame (also in the output frame)
        rows.append(
            {
                "framing_in": (fin - pos) * 1e3,
                "transport_in": (e["pushed"] - t_send - (fin - pos)) * 1e3,
                "inbox_wait": (e["tick_start"] - e["pushed"]) * 1e3,
                "live_step": (e["sent"] - e["tick_start"]) * 1e3,
                "framing_out": pos * 1e3,
                "after_engine": (ear - e["sent"] - pos) * 1e3,
                "a": (e["tick_start"] - t_send) * 1e3,
                "b": (ear - e["sent"]) * 1e3,
                "round_trip": (ear - t_send) * 1e3,
                "onset": e["onset"],
                "backlog": e["backlog"],
                "left_at": round(float(t_send), 4),
                "sent_at": e["sent"],  # the output frame handed out (benchmarks/latency/hops.py)
            }
        )
    seen = {"sent": len(left), "in_engine": len(eng), "heard": len(heard), "engine_matched": len(used_e)}
    return rows, seen
