"""A finished call's counters, for the line the room's job logs when the call ends: its session's frames,
turns and barge-ins, what played, what the engine's rings lost, the caller's audio taken in natively, the text
channel's counts, the caller's lost connections and a phone caller's keypad presses. Knows the counters of
the call's parts; no words, no digits, no numbers of the caller's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agent.fleet.presence import CallerPresence
    from agent.phone.phone import PhoneLine


def call_figures(call, line: PhoneLine | None = None, presence: CallerPresence | None = None) -> str:
    """A finished call's counters for the log: frames, turns, barge-ins, what played, what the engine's rings
    lost, a phone caller's keypad presses (no words, no digits, no numbers of the caller's)."""
    d = call.duplex.stats if call.duplex is not None else {}
    p = call.output.stats
    ring = getattr(call.handle, "stats", {}) if call.handle is not None else {}
    keys = ("frames_pushed", "frames_out", "speech_frames", "turns", "barge_ins", "function_calls")
    parts = [f"{k} {d[k]}" for k in keys if k in d]
    names = {"ring_full": "ring_full", "frames_lost": "ring_lost", "refused": "refused"}
    parts += [f"{name} {ring[k]}" for k, name in names.items() if k in ring]
    native = call.model.caller_audio
    if native is not None:  # the caller's audio went to the ring natively (agent/audio_in/audio_pump.py)
        n = native.stats()
        parts += [f"native_in {int(n['frames'])}", f"native_ring_full {int(n['ring_full'])}"]
        parts += [f"native_held {int(n['held'])}", f"native_bad {int(n['bad'])}"]
        parts.append(f"native_aligned_ms {1000 * n['aligned'] / native.rate:.0f}")
    parts += [f"{k} {p[k]:.1f}" if isinstance(p[k], float) else f"{k} {p[k]}" for k in sorted(p)]
    stalls = getattr(call.output.sink, "stalls", None)
    if stalls is not None:
        parts.append(f"capture_stalls {stalls}")
    if call.transcript is not None:
        parts += [f"text_{k} {v}" for k, v in call.transcript.stats.items()]
    if presence is not None:
        parts += [f"caller_lost {presence.lost}", f"caller_rejoins {presence.rejoins}"]
    if line is not None:
        parts.append(f"dtmf {line.dtmf}")
    return ", ".join(parts)
