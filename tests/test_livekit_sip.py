"""`python -m agent sip ...` against a real LiveKit server with Redis (scripts/livekit.sh): the server's own
SIP API keeps the trunk and dispatch rule that `setup` makes, setup run again changes nothing or updates in
place, `list` reads them back, `teardown` removes exactly those, a wrong secret is refused by the server, and
an outbound call that no SIP bridge can place is one line, a non-zero exit and no room left behind.

LiveKit's SIP bridge itself (github.com/livekit/sip) is not served by the Go module proxy at any version:
tests/test_sip_bridge.py takes calls through the server with a stand-in for the bridge's control plane, and
tests/test_sip.py keeps, against a protocol fake, only the refusals that a bridge and a carrier give.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from livekit_support import require_livekit
from testkit.server import Server, agent_sip

pytestmark = pytest.mark.livekit

NUMBER = "+15550100"  # fictional (+1 555 01xx)


@pytest.fixture(scope="module")
def server() -> Server:
    s = require_livekit()
    if not os.environ.get("CHORUS_TEST_LIVEKIT_REDIS"):
        miss = pytest.fail if os.environ.get("CI") == "true" else pytest.skip
        miss("the LiveKit server runs without Redis (install redis-server): its SIP API needs it")
    return s


async def _lk(server: Server, fn):
    from livekit import api

    lk = api.LiveKitAPI(server.http_url, server.key, server.secret)
    try:
        return await fn(lk, api)
    finally:
        await lk.aclose()


def lk(server: Server, fn):
    return asyncio.run(_lk(server, fn))


def test_setup_list_and_teardown_through_the_servers_sip_api(server):
    name = "chorus-e2e"

    async def foreign_trunk(lk, api):
        info = api.SIPInboundTrunkInfo(name="front-office", numbers=["+15550001"])
        return (await lk.sip.create_inbound_trunk(api.CreateSIPInboundTrunkRequest(trunk=info))).sip_trunk_id

    foreign = lk(server, foreign_trunk)  # a trunk someone else made: list shows it, teardown leaves it
    try:
        first = agent_sip(
            server, "setup", "--number", "+1 555 0100", "--name", name, "--allowed-address", "203.0.113.0/24"
        )
        assert first.returncode == 0, first.stderr
        assert first.stdout.count("created") == 2, first.stdout

        async def read(lk, api):
            trunks = (await lk.sip.list_inbound_trunk(api.ListSIPInboundTrunkRequest())).items
            rules = (await lk.sip.list_dispatch_rule(api.ListSIPDispatchRuleRequest())).items
            return [t for t in trunks if t.name == name], [r for r in rules if r.name == name]

        trunks, rules = lk(server, read)
        (trunk,) = trunks
        assert list(trunk.numbers) == [NUMBER]  # normalised to E.164
        assert list(trunk.allowed_addresses) == ["203.0.113.0/24"]
        (rule,) = rules
        assert list(rule.trunk_ids) == [trunk.sip_trunk_id]
        # one room per call, named after the number called and a random part (never the caller's number)
        assert rule.rule.WhichOneof("rule") == "dispatch_rule_callee"
        assert (
            rule.rule.dispatch_rule_callee.room_prefix == "call-" and rule.rule.dispatch_rule_callee.randomize
        )
        assert [a.agent_name for a in rule.room_config.agents] == ["chorus-concierge"]

        # nothing new, nothing changed (an address inside the same range is the same range)
        again = agent_sip(
            server, "setup", "--number", NUMBER, "--name", name, "--allowed-address", "203.0.113.7/24"
        )
        assert again.returncode == 0 and again.stdout.count("unchanged") == 2, again.stdout
        # a new provider address updates the same trunk in place
        moved = agent_sip(
            server, "setup", "--number", NUMBER, "--name", name, "--allowed-address", "198.51.100.10"
        )
        assert moved.returncode == 0 and "inbound trunk" in moved.stdout and "updated" in moved.stdout, (
            moved.stdout
        )
        trunks, rules = lk(server, read)
        assert [t.sip_trunk_id for t in trunks] == [trunk.sip_trunk_id] and len(rules) == 1
        assert list(trunks[0].allowed_addresses) == ["198.51.100.10/32"]

        listed = agent_sip(server, "list")
        assert listed.returncode == 0, listed.stderr
        assert f"{trunk.sip_trunk_id}  {name}  numbers {NUMBER} (made by setup)" in listed.stdout, (
            listed.stdout
        )
        assert f"{foreign}  front-office" in listed.stdout and "agents chorus-concierge" in listed.stdout

        gone = agent_sip(server, "teardown", "--name", name)
        assert gone.returncode == 0, gone.stderr
        # the rule first, then the trunk; nothing else
        assert gone.stdout.splitlines() == [
            f"dispatch rule {rule.sip_dispatch_rule_id}: removed",
            f"inbound trunk {trunk.sip_trunk_id}: removed",
        ], gone.stdout
        assert lk(server, read) == ([], [])
        left = lk(server, lambda lk, api: lk.sip.list_inbound_trunk(api.ListSIPInboundTrunkRequest()))
        assert foreign in {t.sip_trunk_id for t in left.items}
        nothing = agent_sip(server, "teardown", "--name", name)
        assert nothing.returncode == 0 and "nothing to remove" in nothing.stdout
    finally:
        lk(server, lambda lk, api: lk.sip.delete_trunk(api.DeleteSIPTrunkRequest(sip_trunk_id=foreign)))


def test_a_wrong_secret_is_refused_by_the_server_in_one_line(server):
    wrong = Server(server.url, server.key, "a-wrong-secret-that-is-long-enough")
    out = agent_sip(wrong, "list")
    assert out.returncode == 1 and out.stdout == "", (out.stdout, out.stderr)
    assert out.stderr.count("\n") == 1 and "refused the credentials" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_an_outbound_call_no_bridge_can_place_is_one_line_and_leaves_no_room(server):
    async def trunk(lk, api):
        info = api.SIPOutboundTrunkInfo(name="chorus-e2e-out", address="10.99.0.2:5090", numbers=[NUMBER])
        return (
            await lk.sip.create_outbound_trunk(api.CreateSIPOutboundTrunkRequest(trunk=info))
        ).sip_trunk_id

    trunk_id = lk(server, trunk)
    try:
        rooms_before = lk(server, lambda lk, api: lk.room.list_rooms(api.ListRoomsRequest()))
        out = agent_sip(server, "call", "+15550199", "--trunk", trunk_id, "--reason", "your booking")
        assert out.returncode == 1, (out.stdout, out.stderr)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("sip call: "), out.stderr  # no traceback
        assert "+15550199" not in out.stderr + out.stdout  # the guest's number is personal data
        rooms_after = lk(server, lambda lk, api: lk.room.list_rooms(api.ListRoomsRequest()))
        # no room was left behind (rooms of earlier tests may close meanwhile: an empty room outlives its
        # last participant by the server's departure timeout)
        new_rooms = {r.name for r in rooms_after.rooms} - {r.name for r in rooms_before.rooms}
        assert not new_rooms, new_rooms
        print("real server, no SIP bridge:", lines[0])
    finally:
        lk(server, lambda lk, api: lk.sip.delete_trunk(api.DeleteSIPTrunkRequest(sip_trunk_id=trunk_id)))
