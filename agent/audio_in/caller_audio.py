"""Caller audio as the engine hears it: frames of any rate and channel count cut into the
engine's input frames.

Knows rtc audio frames, downmixing and resampling; nothing of sessions or the engine beyond the rate and frame
size it is given (the engine's clock, read by agent/duplex.py).
"""

from __future__ import annotations

import numpy as np
from livekit import rtc


class InputConverter:
    """rtc.AudioFrames of any rate and channel count -> int16 mono chunks of exactly `frame` samples at `rate`
    (the engine's input clock: `input_samples` at `input_rate`)."""

    def __init__(self, rate: int, frame: int) -> None:
        self.rate = rate
        self.frame = frame
        self._rate: int | None = None
        self._resampler: rtc.AudioResampler | None = None
        self._pending = np.zeros(0, np.int16)  # samples at `rate` not yet a whole frame

    def push(self, frame: rtc.AudioFrame) -> list[np.ndarray]:
        n, ch, rate = frame.samples_per_channel, frame.num_channels, frame.sample_rate
        if n <= 0 or ch <= 0 or rate <= 0:
            return []
        pcm = np.frombuffer(frame.data, dtype=np.int16)[: n * ch]
        if ch > 1:
            pcm = pcm.reshape(n, ch).astype(np.int32).sum(axis=1) // ch
            pcm = pcm.astype(np.int16)
        frames: list[rtc.AudioFrame] = []
        if rate != self._rate:
            if self._resampler is not None:
                frames.extend(self._resampler.flush())
            self._rate = rate
            self._resampler = (
                None
                if rate == self.rate
                else rtc.AudioResampler(
                    rate, self.rate, num_channels=1, quality=rtc.AudioResamplerQuality.MEDIUM
                )
            )
        if self._resampler is not None:
            frames.extend(self._resampler.push(rtc.AudioFrame(pcm.tobytes(), rate, 1, n)))
        out = [c for f in frames for c in self._cut(_samples(f))]  # what the resampler held first
        return out if self._resampler is not None else out + self._cut(pcm)  # at the engine's rate already

    def _cut(self, pcm: np.ndarray) -> list[np.ndarray]:
        """`pcm` (at `rate`) after what is pending, as whole frames; the rest waits for the next push."""
        if not self._pending.size and pcm.size == self.frame:
            return [pcm.copy()]  # one whole frame, the usual case: no joining, no cutting
        joined = np.concatenate([self._pending, pcm])
        whole = joined.size // self.frame * self.frame
        self._pending = joined[whole:].copy()
        return [joined[i : i + self.frame].copy() for i in range(0, whole, self.frame)]


def _samples(frame: rtc.AudioFrame) -> np.ndarray:
    return np.frombuffer(frame.data, dtype=np.int16)[: frame.samples_per_channel]
