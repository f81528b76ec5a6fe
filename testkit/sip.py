"""Phone calls through the real LiveKit server's SIP machinery, for the tests and the benchmark: the bridge
stand-in (scripts/sip-bridge), the inbound call it asks the server for, and a caller on a phone line. Knows
nothing of the agent's side of the call beyond what the bridge would see.

LiveKit's SIP bridge does not build here, so scripts/sip-bridge stands in for its control plane: over psrpc on
the server's Redis it asks the server to authenticate the trunk and evaluate the dispatch rules, and signs the
SIP participant's token as the bridge does. No SIP, RTP or G.711 is on the wire: the caller is a WebRTC
participant that joins with that token, and `phone_line` degrades its audio as a phone line would.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np

from testkit.callers import RATE, Caller
from testkit.server import ROOT, Server

BRIDGE_DIR = ROOT / "scripts" / "sip-bridge"


def cached_bridge() -> Path:
    """Where scripts/livekit.sh's ensure_livekit builds the stand-in: the cache, keyed by its go.sum and
    sources."""
    cache = os.environ.get("CHORUS_CACHE") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "chorus"
    )
    source = b"".join(p.read_bytes() for p in [BRIDGE_DIR / "go.sum", *sorted(BRIDGE_DIR.glob("*.go"))])
    crc = subprocess.run(["cksum"], input=source, capture_output=True, check=True).stdout.split()[0].decode()
    return Path(cache) / f"sip-bridge-{crc}" / "sip-bridge"


def find_bridge() -> Path | str:
    """The sip-bridge binary: $CHORUS_SIP_BRIDGE, else the cached build, else built now from the module cache
    (offline: GOPROXY=off); or why none can be had."""
    named = os.environ.get("CHORUS_SIP_BRIDGE")
    path = Path(named) if named else cached_bridge()
    if path.is_file() and os.access(path, os.X_OK):
        return path
    if named:
        return f"CHORUS_SIP_BRIDGE={named} is not an executable file"
    if shutil.which("go") is None:
        return "sip-bridge is not built and there is no Go toolchain (scripts/livekit.sh: ensure_livekit)"
    path.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "CGO_ENABLED": "0", "GOPROXY": "off"}
    built = subprocess.run(
        ["go", "build", "-o", f"{path}.tmp", "."],
        cwd=BRIDGE_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if built.returncode != 0:
        return f"sip-bridge is not built and cannot be built offline here:\n{built.stderr[-2000:]}"
    os.replace(f"{path}.tmp", path)
    return path


def inbound(server: Server, bridge: Path, *args: str) -> subprocess.CompletedProcess:
    """`sip-bridge inbound ...`: what the SIP bridge asks the server when an INVITE arrives."""
    return subprocess.run(
        [str(bridge), "inbound", "--redis", os.environ["CHORUS_TEST_LIVEKIT_REDIS"], "--url", server.url]
        + ["--api-key", server.key, "--api-secret", server.secret, *args],
        capture_output=True,
        text=True,
        timeout=30,
    )


class PhoneCaller(Caller):
    """A phone caller as the bridge puts one in a room: it joins with the token the bridge signed (kind SIP,
    its `sip.*` attributes, `sip.callStatus` ringing, the dispatch rule's room configuration) instead of one
    of its own, marks the call active `answer_after` seconds after it has subscribed to the agent's track (as
    the bridge answers the phone; None: only when `activate` is called), and speaks through a phone line:
    8 kHz, G.711 mu-law coded and decoded, back up to 48 kHz, on a track published without RED."""

    def __init__(self, server: Server, call: dict, answer_after: float | None = 0.0):
        super().__init__(Server(call["url"], server.key, server.secret), call["room"], "", call["identity"])
        self.jwt = call["token"]
        self.answer_after = answer_after
        self.answered_at: float | None = None
        self.disconnected: tuple[float, int] | None = None  # (loop time, rtc.DisconnectReason)

    async def join(self) -> None:
        await super().join()
        loop = asyncio.get_running_loop()
        self.room.on("disconnected", lambda reason: setattr(self, "disconnected", (loop.time(), reason)))
        if self.answer_after is not None:
            self._tasks.append(asyncio.ensure_future(self._answer()))

    async def _answer(self) -> None:
        await self.first_audio.wait()  # the agent's track, subscribed
        await asyncio.sleep(self.answer_after)
        await self.activate()

    def publish_options(self):
        from livekit import rtc

        return rtc.TrackPublishOptions(source=rtc.TrackSource.SOURCE_MICROPHONE, red=False)

    async def speak(self, pcm: np.ndarray, seconds: float | None = None) -> None:
        await super().speak(phone_line(pcm), seconds)

    async def activate(self) -> None:
        await self.room.local_participant.set_attributes({"sip.callStatus": "active"})
        self.answered_at = asyncio.get_running_loop().time()

    async def press(self, digit: str) -> None:
        """A keypad press, as the bridge sends one it received from the phone (RFC 2833) into the room."""
        code = {"*": 10, "#": 11}.get(digit) or int(digit)
        await self.room.local_participant.publish_dtmf(code=code, digit=digit)


def phone_line(pcm: np.ndarray) -> np.ndarray:
    """48 kHz int16 as a phone line carries it: down to 8 kHz, G.711 mu-law coded and decoded, and back up to
    48 kHz (as the bridge decodes a call's audio for the room)."""
    from livekit import rtc

    from agent.phone.telephony import PHONE_RATE, telephone_band

    narrow = telephone_band(pcm, RATE)
    up = rtc.AudioResampler(PHONE_RATE, RATE, num_channels=1, quality=rtc.AudioResamplerQuality.HIGH)
    frames = [*up.push(rtc.AudioFrame(narrow.tobytes(), PHONE_RATE, 1, narrow.size)), *up.flush()]
    return np.concatenate([np.frombuffer(f.data, np.int16) for f in frames])
