"""The native resampler the agent's captures go through (agent/audio_in/native/resample.c, built into the
library of agent/audio_in/audio_pump.py): 22,050 Hz (the engine's output) to 48,000 Hz (the track's), against
the exact band-limited signal it should make (sines at known times), frame sizes, streaming in pieces against
one piece, images of the input's spectrum, and silence."""

from __future__ import annotations

import ctypes
import shutil

import numpy as np
import pytest

from agent.audio_in import audio_pump

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")

FIN, FOUT = 22_050, 48_000
L, TAPS = 320, 32  # FOUT / FIN in lowest terms is 320 / 147; resample.c's taps a phase
DELAY_S = (L * TAPS - 1) / 2 / (L * FIN)  # the filter's delay (linear phase: half its length)


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    lib = ctypes.CDLL(str(audio_pump.build(directory=tmp_path_factory.mktemp("native"))))
    vp, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.rs_new.restype, lib.rs_new.argtypes = vp, [ctypes.c_int, ctypes.c_int]
    lib.rs_out_len.restype, lib.rs_out_len.argtypes = i64, [vp, i64]
    lib.rs_run.restype, lib.rs_run.argtypes = i64, [vp, vp, i64, vp]
    lib.rs_free.restype, lib.rs_free.argtypes = None, [vp]
    return lib


class Resampler:
    def __init__(self, lib, fin: int = FIN, fout: int = FOUT) -> None:
        self.lib, self.r = lib, lib.rs_new(fin, fout)
        assert self.r

    def __call__(self, x: np.ndarray) -> np.ndarray:
        x = np.ascontiguousarray(x, np.int16)
        out = np.zeros(self.lib.rs_out_len(self.r, x.size), np.int16)
        assert self.lib.rs_run(self.r, x.ctypes.data, x.size, out.ctypes.data) == out.size
        return out

    def close(self) -> None:
        self.lib.rs_free(self.r)


def sines(t: np.ndarray, parts: tuple[tuple[float, float, float], ...]) -> np.ndarray:
    """Sum of amplitude * sin(2 pi f t + phase) at times t (seconds)."""
    return sum(a * np.sin(2 * np.pi * f * t + ph) for a, f, ph in parts)


def db(x: float) -> float:
    return 20 * np.log10(x)


SPEECH = ((6000, 220.0, 0.0), (3000, 1375.0, 1.0), (2000, 3100.0, 2.0), (1000, 6950.0, 0.5))


def test_speech_band_content_comes_out_as_the_exact_band_limited_signal(lib):
    """Below 8 kHz (the band the model's codec fills at 22.05 kHz), each output sample is the input's
    band-limited signal at its own time, to within int16 rounding: error at least 70 dB under the signal."""
    rs = Resampler(lib)
    x = sines(np.arange(FIN) / FIN, SPEECH)
    y = rs(np.round(x)).astype(float)
    rs.close()
    assert y.size == FOUT
    ref = sines(np.arange(y.size) / FOUT - DELAY_S, SPEECH)
    body = slice(500, -500)  # away from the filter's start-up and the end it has not reached
    err = db(np.std(y[body] - ref[body]) / np.std(ref[body]))
    assert err < -70, err


@pytest.mark.parametrize("f", [1000.0, 5000.0, 8000.0])
def test_the_inputs_spectral_images_are_removed(lib, f):
    """Upsampling a tone at f leaves images at FIN - f, FIN + f, ...: each one below the output's Nyquist
    frequency at least 80 dB under the tone."""
    rs = Resampler(lib)
    y = rs(np.round(sines(np.arange(FIN) / FIN, ((12000, f, 0.0),)))).astype(float)
    rs.close()
    spectrum = np.abs(np.fft.rfft(y * np.hanning(y.size)))
    freq = np.fft.rfftfreq(y.size, 1 / FOUT)
    tone = spectrum[np.abs(freq - f) < 30].max()
    for image in (im for im in (FIN - f, FIN + f) if im < FOUT / 2):
        assert db(spectrum[np.abs(freq - image) < 30].max() / tone) < -80, image


def test_an_80_ms_frame_becomes_one_of_the_tracks_and_pieces_of_any_length_stream_as_one(lib):
    rng = np.random.default_rng(7)
    x = np.round(sines(np.arange(FIN * 2) / FIN, SPEECH)).astype(np.int16)
    x[FIN // 2 : FIN] = 0  # silence between turns, and speech after it
    whole = Resampler(lib)
    one = whole(x)
    whole.close()
    framed = Resampler(lib)
    frames = [framed(x[i : i + 1764]) for i in range(0, x.size, 1764)]
    framed.close()
    assert {f.size for f in frames[:-1]} == {3840}  # 80 ms in, 80 ms out, every frame
    pieces = Resampler(lib)
    cuts = np.sort(rng.choice(np.arange(1, x.size), 200, replace=False))
    streamed = np.concatenate([pieces(p) for p in np.split(x, cuts)])
    pieces.close()
    assert np.array_equal(np.concatenate(frames), one)
    assert np.array_equal(streamed, one)


def test_silence_is_silence_and_the_filters_tail_still_follows_speech(lib):
    rs = Resampler(lib)
    assert not rs(np.zeros(FIN, np.int16)).any()
    rs(np.full(1764, 8000, np.int16))
    tail = rs(np.zeros(1764, np.int16))  # a loud frame's last samples ring on into the next
    assert tail[:10].any() and not tail[100:].any()
    assert not rs(np.zeros(1764, np.int16)).any()
    rs.close()


def test_a_constant_passes_unchanged_and_peaks_past_full_scale_are_clipped_not_wrapped(lib):
    rs = Resampler(lib)
    out = rs(np.full(FIN, 1234, np.int16))
    assert np.all(out[100:] == 1234)
    rs.close()
    # a tone at a quarter of the input rate, 45 degrees off its samples: every input sample is at full scale,
    # and the band-limited signal between them peaks at sqrt(2) times that
    quarter = ((32767 * np.sqrt(2), FIN / 4, np.pi / 4),)
    rs = Resampler(lib)
    y = rs(np.clip(np.round(sines(np.arange(FIN) / FIN, quarter)), -32768, 32767)).astype(int)
    rs.close()
    ref = sines(np.arange(y.size) / FOUT - DELAY_S, quarter)
    body = slice(500, -500)
    assert np.all(y[body][ref[body] > 34000] == 32767)
    assert np.all(y[body][ref[body] < -34000] == -32768)


def test_other_ratios_and_refused_ones(lib):
    down = Resampler(lib, 48_000, 16_000)  # a ratio the other way: 3 to 1
    y = down(np.round(sines(np.arange(48_000) / 48_000, ((8000, 1000.0, 0.0),))).astype(np.int16))
    down.close()
    assert y.size == 16_000
    ref = sines(np.arange(y.size) / 16_000 - (32 - 1) / 2 / 48_000, ((8000, 1000.0, 0.0),))
    assert db(np.std(y[200:-200] - ref[200:-200]) / np.std(ref[200:-200])) < -70
    assert not lib.rs_new(0, 48_000)
    assert not lib.rs_new(48_000, 44_101)  # 44101 / 48000 needs 44,101 phases: refused
