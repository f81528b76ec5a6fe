"""Acknowledgement clips: the prerecorded "one moment" phrasings that fill a tool pause, at the sink's rate.

Loads prompts/acks/*.wav once per rate (resampled, downmixed) and picks one never twice in a row. Knows WAV
files and resampling; nothing of when a clip plays (agent/audio_out/playout.py decides that).
"""

from __future__ import annotations

import random
import wave
from functools import lru_cache
from pathlib import Path

import numpy as np
from livekit import rtc

from prompts import PROMPTS_DIR

ACKS_DIR = PROMPTS_DIR / "acks"


@lru_cache(maxsize=8)
def _load_clips(directory: str, sample_rate: int) -> tuple[tuple[str, np.ndarray], ...]:
    clips = []
    for path in sorted(Path(directory).glob("*.wav")):
        with wave.open(str(path), "rb") as w:
            if w.getsampwidth() != 2:
                raise ValueError(f"{path.name}: acknowledgement clips must be 16-bit WAV")
            rate, ch = w.getframerate(), w.getnchannels()
            pcm = np.frombuffer(w.readframes(w.getnframes()), dtype=np.int16)
        if ch > 1:
            pcm = pcm.reshape(-1, ch).mean(axis=1).astype(np.int16)
        if rate != sample_rate:
            rs = rtc.AudioResampler(rate, sample_rate, num_channels=1, quality=rtc.AudioResamplerQuality.HIGH)
            frames = rs.push(rtc.AudioFrame(pcm.tobytes(), rate, 1, pcm.size)) + rs.flush()
            pcm = np.concatenate([np.frombuffer(f.data, dtype=np.int16) for f in frames])
        clips.append((path.stem, pcm))
    return tuple(clips)


class AckClips:
    """Prerecorded "one moment" phrasings; `next()` never gives the same one twice in a row."""

    def __init__(self, sample_rate: int, directory: str | Path = ACKS_DIR, seed: int | None = None) -> None:
        self.clips = _load_clips(str(directory), sample_rate)
        if not self.clips:
            raise FileNotFoundError(f"no acknowledgement clips (*.wav) in {directory}")
        self._rng = random.Random(seed)
        self._last = -1

    def named(self, stem: str) -> tuple[str, np.ndarray]:
        """The clip of that file name (without .wav); KeyError if there is none."""
        for clip in self.clips:
            if clip[0] == stem:
                return clip
        raise KeyError(f"no acknowledgement clip {stem!r}")

    def next(self) -> tuple[str, np.ndarray]:
        choices = [i for i in range(len(self.clips)) if i != self._last] or [0]
        self._last = self._rng.choice(choices)
        return self.clips[self._last]
