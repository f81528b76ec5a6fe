"""A real browser calls Chorus: headless Debian Chromium opens tests/browser/caller.html (npm
`livekit-client`, its UMD build), joins a room of the LiveKit server of scripts/livekit.sh with a token that
dispatches the worker's agent by name, publishes a fake microphone that plays a caller WAV, and plays the
agent's audio. Real WebRTC from a real browser: the page's signalling goes to ws://127.0.0.1, its media over
the namespace's veth pair.

The page measures the agent's track with a WebAudio AnalyserNode and collects the `lk.transcription` text
stream (room.registerTextStreamHandler); the test reads both back over DevTools (window.caller). The worker
runs with CHORUS_TEACHER_FORCING=true (dummy weights decide nothing), so the agent's greeting is forced: its
transcription says " Hello, thank you for calling the Grand Hotel...", which is what the test looks for.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import threading
import time
import urllib.parse
import urllib.request
import uuid
import wave
from pathlib import Path

import numpy as np
import pytest

from chromium_support import Browser, chromium_path
from livekit_support import POLL_S, require_livekit
from testkit.callers import caller_pcm
from testkit.server import ROOT, token
from testkit.worker import Worker, sessions_by_label
from wait_support import wait_until

pytestmark = pytest.mark.livekit

PAGE_DIR = ROOT / "tests" / "browser"
UMD = PAGE_DIR / "node_modules" / "livekit-client" / "dist" / "livekit-client.umd.js"
RATE = 48_000  # the fake microphone's file
FRAMES_PER_S = 12.5  # the engine's 80 ms frames
HEARD_RMS = 1e-3  # the agent's audio over the call (full scale 1.0): above digital silence and dither
CHROMIUM_FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--use-fake-device-for-media-stream",
    "--use-fake-ui-for-media-stream",
    "--autoplay-policy=no-user-gesture-required",
]


def require_page() -> None:
    """livekit-client in tests/browser/node_modules, or skip (fail under CI=true, where
    .ci/run installs it)."""
    if not UMD.is_file():
        miss = pytest.fail if os.environ.get("CI") == "true" else pytest.skip
        miss(
            "no livekit-client in tests/browser: run `npm ci` there "
            "(scripts/chromium.sh ensure_browser_client)"
        )


class CallerBrowser(Browser):
    """Headless Chromium with a fake microphone that plays `wav` once (then silence), and one page."""

    def __init__(self, wav: Path, timeout: float = 60.0) -> None:
        super().__init__(
            timeout=timeout, flags=[*CHROMIUM_FLAGS, f"--use-file-for-fake-audio-capture={wav}%noloop"]
        )

    def run(self, expression: str):
        """`expression`'s value, awaited when it is a promise; a page exception raises."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result.get("result", {}).get("value")

    def caller(self) -> dict:
        return self.run("JSON.parse(JSON.stringify(window.caller || null))") or {}


@contextlib.contextmanager
def serve(directory: Path):
    """`directory` over HTTP on 127.0.0.1 (a secure context for getUserMedia); yields the base URL."""

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Quiet, directory=str(directory))
    )
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def caller_wav(path: Path) -> np.ndarray:
    """Two committed callers, half a second apart, as a 48 kHz mono 16-bit WAV at `path`;
    returns the samples."""
    gap = np.zeros(RATE // 2, np.int16)
    pcm = np.concatenate(
        [caller_pcm("caller_booking.wav", RATE), gap, caller_pcm("caller_question.wav", RATE)]
    )
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(pcm.tobytes())
    return pcm


def envelope(pcm: np.ndarray, times_ms: np.ndarray, window: int = 2048) -> np.ndarray:
    """The RMS (full scale 1.0) of the `window` samples of `pcm` before each time, as the
    page's analyser sees."""
    x = pcm.astype(np.float64) / 32768.0
    c = np.concatenate([[0.0], np.cumsum(x**2)])
    end = np.clip((times_ms * RATE / 1000).astype(int), 0, x.size)
    start = np.clip(end - window, 0, None)
    return np.sqrt((c[end] - c[start]) / window)


def best_match(
    heard_ms: np.ndarray, heard: np.ndarray, sent: np.ndarray, within_ms: int = 1000
) -> tuple[float, int]:
    """The highest Pearson correlation of the page's microphone level `heard` (at times `heard_ms` since it
    was published) with `sent`'s level at those times shifted by -within_ms..within_ms in 10 ms steps, and
    that shift (positive: the file had been playing that long when the track was published)."""
    best = (-1.0, 0)
    for shift in range(-within_ms, within_ms + 1, 10):
        expected = envelope(sent, heard_ms + shift)
        if heard.std() > 0 and expected.std() > 0:
            best = max(best, (float(np.corrcoef(heard, expected)[0, 1]), shift))
    return best


def test_a_browser_caller_is_dispatched_heard_and_answered_over_webrtc(store_dir, tmp_path):
    server = require_livekit()
    chromium_path()
    require_page()
    sent = caller_wav(tmp_path / "caller.wav")
    sent_s = sent.size / RATE
    room = f"browser-{uuid.uuid4().hex[:8]}"

    with Worker(server, store_dir, slots=2) as worker, serve(PAGE_DIR) as base:
        jwt = token(server, room, "browser-caller", worker.agent_name)
        query = urllib.parse.urlencode({"url": server.url, "token": jwt})
        with CallerBrowser(tmp_path / "caller.wav") as browser:

            def page(what: str, timeout: float, expression: str):
                try:
                    return wait_until(lambda: browser.run(expression), what, timeout, every=POLL_S)
                except AssertionError as e:
                    raise AssertionError(f"{e}\npage: {browser.caller()}\nworker:\n{worker.tail()}") from None

            t0 = time.monotonic()
            browser.open(f"{base}/caller.html?{query}")
            page("the page's connecting", 30, "window.caller && caller.state !== 'loading' && caller.state")
            page("the agent's audio track at the page", 30, "caller.agentTrackMs !== null || caller.error")
            page("the microphone published", 15, "['published', 'failed'].includes(caller.state)")
            state = browser.caller()
            assert state["state"] == "published", state
            joined_s = time.monotonic() - t0

            # the fake microphone plays the file once from when it opened: count the engine's frames meanwhile
            growth: list[tuple[float, int]] = []
            t_mic = time.monotonic()
            while time.monotonic() - t_mic < sent_s + 1.0:
                s = sessions_by_label(worker.snapshot()).get(room)
                if s is not None:
                    growth.append((round(time.monotonic() - t_mic, 2), int(s["frames_in"])))
                time.sleep(0.25)
            page(
                "the agent's transcription on lk.transcription",
                15,
                "caller.transcripts.some(t => t.text.toLowerCase().includes('thank you for calling'))",
            )
            state = browser.caller()

            assert browser.run("room.localParticipant.isMicrophoneEnabled"), state
            mic_pubs = browser.run(
                "[...room.localParticipant.audioTrackPublications.values()].map(p => p.source)"
            )
            assert mic_pubs == ["microphone"], mic_pubs
            agents = browser.run(
                "[...room.remoteParticipants.values()].filter(p => p.isAgent).map(p => p.identity)"
            )

            browser.run("room.disconnect()")  # the caller hangs up
            left = time.monotonic()
            wait_until(
                lambda: room not in sessions_by_label(worker.snapshot()), "the slot freed", 2.0, every=0.05
            )
            freed_s = time.monotonic() - left
            assert str(browser.run("caller.state")).startswith("disconnected"), browser.caller()["log"]

    (tmp_path / "caller.json").write_text(json.dumps({"page": state, "frames_in": growth}, indent=1))
    # the agent, dispatched by name, joined the room; its transcription came from it
    assert state["agent"] and state["agent"].startswith("agent-"), state
    assert agents == [state["agent"]], agents
    greeting = [t for t in state["transcripts"] if "thank you for calling" in t["text"].lower()]
    assert greeting and greeting[0]["sender"] == state["agent"], state["transcripts"]

    # the agent's audio reached the page and was not silence
    h = state["heard"]
    rms = (h["sumSquares"] / h["samples"]) ** 0.5 if h["samples"] else 0.0
    assert rms > HEARD_RMS and h["peak"] > 10 * HEARD_RMS, h
    assert h["loudWindows"] * 0.02 >= 1.0, h  # analysed every 20 ms: at least a second of the agent's voice

    # the engine received the browser's audio: frames_in grew by more than 3 s worth while the file played
    assert growth, "the room's session never appeared in the engine"
    assert growth[-1][1] - growth[0][1] >= FRAMES_PER_S * 3.0, growth
    assert growth[-1][1] >= FRAMES_PER_S * (sent_s - 1.0), growth

    # the page's microphone carried the file, not Chromium's default tone: its level follows the file's
    mic = np.asarray(state["mic"], dtype=np.float64)
    corr, shift_ms = best_match(mic[:, 0], mic[:, 1], sent)
    assert corr > 0.8, (corr, shift_ms, state["mic"])

    assert freed_s < 2.0
    print(
        f"\nbrowser caller: agent track {joined_s:.1f} s after opening the page; heard rms {rms:.4f} peak "
        f"{h['peak']:.3f} ({h['loudWindows']}/{h['windows']} windows loud); frames_in {growth[0][1]} -> "
        f"{growth[-1][1]} over {growth[-1][0]:.1f} s (file {sent_s:.1f} s); mic envelope r={corr:.2f} at "
        f"{shift_ms} ms; slot freed {freed_s:.2f} s after disconnect"
    )
