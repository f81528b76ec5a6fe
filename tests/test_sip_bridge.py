"""An inbound phone call through the real LiveKit server's SIP machinery (scripts/livekit.sh, with Redis).

LiveKit's SIP bridge does not build here, so scripts/sip-bridge stands in for its control plane: over psrpc on
the server's Redis it asks the server to authenticate the trunk and evaluate the dispatch rules that
`python -m agent sip setup` made, and signs the SIP participant's token as the bridge does. No SIP, RTP or
G.711 is on the wire: the caller is a WebRTC participant that joins with that token, so the server sees a
participant of kind SIP, the dispatch rule's room configuration dispatches the worker's agent, and the agent
answers with the phone concierge.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from livekit_support import (
    RATE,
    ROOT,
    Caller,
    Server,
    Worker,
    agent_sip,
    await_until,
    caller_pcm,
    require_livekit,
    sessions_by_label,
    wait_until,
)

pytestmark = pytest.mark.livekit

TRUNK_NUMBER = "+15550100"  # fictional (+1 555 01xx)
CALLER_NUMBER = "+15550123"
BRIDGE_DIR = ROOT / "scripts" / "sip-bridge"


def _miss(message: str) -> None:
    (pytest.fail if os.environ.get("CI") == "true" else pytest.skip)(message)


@pytest.fixture(scope="module")
def server() -> Server:
    s = require_livekit()
    if not os.environ.get("CHORUS_TEST_LIVEKIT_REDIS"):
        _miss("the LiveKit server runs without Redis (install redis-server): its SIP API needs it")
    return s


def _cached_bridge() -> Path:
    """Where scripts/livekit.sh's ensure_livekit builds the stand-in: the cache, keyed by its go.sum and
    sources."""
    cache = os.environ.get("CHORUS_CACHE") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "chorus"
    )
    source = b"".join(p.read_bytes() for p in [BRIDGE_DIR / "go.sum", *sorted(BRIDGE_DIR.glob("*.go"))])
    crc = subprocess.run(["cksum"], input=source, capture_output=True, check=True).stdout.split()[0].decode()
    return Path(cache) / f"sip-bridge-{crc}" / "sip-bridge"


@pytest.fixture(scope="module")
def bridge() -> Path:
    """The sip-bridge binary: $CHORUS_SIP_BRIDGE, else the cached build, else built now from the module cache
    (no network in the test's namespace); skipped when none can be had (failed under CI=true)."""
    named = os.environ.get("CHORUS_SIP_BRIDGE")
    path = Path(named) if named else _cached_bridge()
    if path.is_file() and os.access(path, os.X_OK):
        return path
    if named:
        _miss(f"CHORUS_SIP_BRIDGE={named} is not an executable file")
    if shutil.which("go") is None:
        _miss("sip-bridge is not built and there is no Go toolchain (scripts/livekit.sh: ensure_livekit)")
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
        _miss(f"sip-bridge is not built and cannot be built offline here:\n{built.stderr[-2000:]}")
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
    """A caller that joins with the token the bridge signed (kind SIP, its `sip.*` attributes, the dispatch
    rule's room configuration) instead of one of its own, and marks the call active once it hears the
    agent's track, as the bridge does."""

    def __init__(self, server: Server, call: dict):
        super().__init__(Server(call["url"], server.key, server.secret), call["room"], "", call["identity"])
        self.jwt = call["token"]

    async def activate(self) -> None:
        await self.room.local_participant.set_attributes({"sip.callStatus": "active"})


async def _participants(server: Server, room: str) -> list:
    from livekit import api

    lk = api.LiveKitAPI(server.http_url, server.key, server.secret)
    try:
        return list((await lk.room.list_participants(api.ListParticipantsRequest(room=room))).participants)
    finally:
        await lk.aclose()


def test_an_inbound_call_is_put_in_a_room_by_the_servers_dispatch_rule_and_answered_by_the_phone_concierge(
    server, bridge, store_dir
):
    from livekit import rtc

    worker = Worker(server, store_dir, slots=1).launch()  # it loads while the line is set up
    name = f"sipbr-{uuid.uuid4().hex[:6]}"
    try:
        setup = agent_sip(
            server, "setup", "--number", TRUNK_NUMBER, "--name", name, agent_name=worker.agent_name
        )
        assert setup.returncode == 0, setup.stderr
        nowhere = inbound(server, bridge, "--from", CALLER_NUMBER, "--to", "+15550199")
        assert nowhere.returncode == 1 and "no rule matched" in nowhere.stdout, (
            nowhere.stdout,
            nowhere.stderr,
        )

        out = inbound(server, bridge, "--from", CALLER_NUMBER, "--to", TRUNK_NUMBER)
        assert out.returncode == 0, (out.stdout, out.stderr)
        call = json.loads(out.stdout)
        # a room of its own, named after the number called, never the caller's
        assert call["room"].startswith(f"call-_{TRUNK_NUMBER}_"), call["room"]
        assert CALLER_NUMBER not in call["room"] and CALLER_NUMBER[1:] not in call["room"]
        assert call["identity"] == f"sip_{CALLER_NUMBER}"
        attrs = call["attributes"]
        assert attrs["sip.phoneNumber"] == CALLER_NUMBER and attrs["sip.trunkPhoneNumber"] == TRUNK_NUMBER
        assert attrs["sip.trunkID"] == call["trunk_id"] and attrs["sip.ruleID"] == call["rule_id"]
        assert attrs["sip.callID"] == call["call_id"]
        assert call["dispatch"] == [worker.agent_name]
        worker.start(timeout=60)

        async def phone_call() -> tuple[PhoneCaller, list]:
            caller = PhoneCaller(server, call)
            await caller.join()
            try:
                assert caller.room.local_participant.kind == rtc.ParticipantKind.PARTICIPANT_KIND_SIP
                await asyncio.wait_for(caller.agent_joined.wait(), 30)
                await asyncio.wait_for(caller.first_audio.wait(), 20)  # the agent's track, subscribed
                await caller.activate()
                speaking = asyncio.ensure_future(caller.speak(caller_pcm("caller_booking.wav")[: 4 * RATE]))
                await asyncio.wait_for(caller.first_speech.wait(), 20)
                await await_until(lambda: caller.heard.transcripts, 10, what="a transcription from the agent")
                await speaking
                snapshot = worker.snapshot()
                assert call["room"] in sessions_by_label(snapshot)
                caller.snapshot_text = json.dumps(snapshot)
                return caller, await _participants(server, call["room"])
            finally:
                await caller.leave()

        caller, participants = asyncio.run(phone_call())
        heard = caller.heard
        assert heard.tracks >= 1 and heard.audible_s() > 0.5, heard.summary()
        assert heard.agent_identity in {s for s, _, _ in heard.transcripts}, heard.transcripts
        assert "thank you for calling" in heard.text().lower(), heard.transcripts
        (phone,) = [p for p in participants if p.identity == call["identity"]]
        assert phone.kind == rtc.ParticipantKind.PARTICIPANT_KIND_SIP  # as the server has it
        assert phone.attributes["sip.callStatus"] == "active"
        assert phone.attributes["sip.phoneNumber"] == CALLER_NUMBER
        # the agent took the caller for a phone caller: the phone concierge, not the web one
        wait_until(lambda: "sip caller joined" in worker.log.read_text(), 5.0, what="the job's SIP caller")
        wait_until(lambda: "call ended" in worker.log.read_text(), 10.0, what="the call's end")
        # the caller's number is in no line of the worker's log (livekit-agents' own records, with their
        # participant and room fields, included) and nowhere in the snapshot
        digits = CALLER_NUMBER.lstrip("+")
        log = worker.log.read_text()
        assert digits not in log and digits not in caller.snapshot_text
        from agent.log_privacy import participant_label

        assert participant_label(call["identity"]) in log  # the caller's identity was there, as its label
        print(
            f"room {call['room']}, identity {call['identity']}, heard {heard.audible_s():.1f} s of speech, "
            f"{len(heard.transcripts)} transcription(s)"
        )
    finally:
        worker.stop()
        agent_sip(server, "teardown", "--name", name, agent_name=worker.agent_name)
