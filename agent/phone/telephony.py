"""What a telephone line does to a caller's voice: 8 kHz, coded with G.711 mu-law. LiveKit's SIP bridge
decodes real calls; this reproduces the line for the simulation's phone callers and for tests.
"""

from __future__ import annotations

import numpy as np
from livekit import rtc

PHONE_RATE = 8_000


def mulaw_encode(pcm: np.ndarray) -> np.ndarray:
    """G.711 mu-law bytes of int16 samples, as ITU-T G.711 specifies."""
    x = pcm.astype(np.int32)
    sign = np.where(x < 0, 0x80, 0)
    mag = np.minimum(np.abs(x), 32635) + 0x84
    exponent = np.floor(np.log2(mag)).astype(np.int32) - 7
    mantissa = (mag >> (exponent + 3)) & 0x0F
    return (~(sign | (exponent << 4) | mantissa) & 0xFF).astype(np.uint8)


def mulaw_decode(code: np.ndarray) -> np.ndarray:
    """int16 samples of G.711 mu-law bytes."""
    u = ~code.astype(np.int32) & 0xFF
    sign, exponent, mantissa = u & 0x80, (u >> 4) & 0x07, u & 0x0F
    mag = (((mantissa << 3) + 0x84) << exponent) - 0x84
    return np.where(sign != 0, -mag, mag).astype(np.int16)


def telephone_band(pcm: np.ndarray, rate: int) -> np.ndarray:
    """int16 mono speech at `rate` as a phone line carries it: int16 at 8 kHz, mu-law coded and decoded."""
    rs = rtc.AudioResampler(rate, PHONE_RATE, num_channels=1, quality=rtc.AudioResamplerQuality.HIGH)
    frames = [*rs.push(rtc.AudioFrame(pcm.astype(np.int16).tobytes(), rate, 1, pcm.size)), *rs.flush()]
    narrow = np.concatenate([np.frombuffer(f.data, np.int16) for f in frames])
    return mulaw_decode(mulaw_encode(narrow))
