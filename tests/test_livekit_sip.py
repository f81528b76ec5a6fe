"""`python -m agent sip ...` against a real LiveKit server with Redis (scripts/livekit.sh): the server's own
SIP API keeps the trunk and dispatch rule that `setup` makes, `list` reads them back, `teardown` removes
exactly those, and an outbound call that no SIP bridge can place is one line, a non-zero exit and no
room left behind.

LiveKit's SIP bridge itself (github.com/livekit/sip) is not served by the Go module proxy at any version:
tests/test_sip_bridge.py takes an inbound call through the server with a stand-in for the bridge's control
plane, and tests/test_sip.py covers the rest of a call against a protocol fake.
"""

from __future__ import annotations

import asyncio
import os

import pytest

from livekit_support import Server, agent_sip, require_livekit

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
    first = agent_sip(server, "setup", "--number", NUMBER, "--name", name)
    assert first.returncode == 0, first.stderr
    assert first.stdout.count("created") == 2, first.stdout

    async def read(lk, api):
        trunks = (await lk.sip.list_inbound_trunk(api.ListSIPInboundTrunkRequest())).items
        rules = (await lk.sip.list_dispatch_rule(api.ListSIPDispatchRuleRequest())).items
        return [t for t in trunks if t.name == name], [r for r in rules if r.name == name]

    trunks, rules = lk(server, read)
    assert len(trunks) == 1 and list(trunks[0].numbers) == [NUMBER]
    (rule,) = rules
    assert list(rule.trunk_ids) == [trunks[0].sip_trunk_id]
    assert rule.rule.dispatch_rule_callee.room_prefix == "call-" and rule.rule.dispatch_rule_callee.randomize
    assert [a.agent_name for a in rule.room_config.agents] == ["chorus-concierge"]

    again = agent_sip(server, "setup", "--number", NUMBER, "--name", name)  # nothing new, nothing changed
    assert again.returncode == 0 and again.stdout.count("unchanged") == 2, again.stdout
    listed = agent_sip(server, "list")
    assert (
        listed.returncode == 0
        and trunks[0].sip_trunk_id in listed.stdout
        and "(made by setup)" in listed.stdout
    )

    gone = agent_sip(server, "teardown", "--name", name)
    assert gone.returncode == 0 and gone.stdout.count("removed") == 2, gone.stdout
    assert lk(server, read) == ([], [])


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
        assert {r.name for r in rooms_after.rooms} == {r.name for r in rooms_before.rooms}
        print("real server, no SIP bridge:", lines[0])
    finally:
        lk(server, lambda lk, api: lk.sip.delete_trunk(api.DeleteSIPTrunkRequest(sip_trunk_id=trunk_id)))
