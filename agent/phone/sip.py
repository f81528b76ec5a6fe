"""`python -m agent sip setup | list | teardown | call`: the phone line through LiveKit's SIP bridge.

`setup` makes (or brings up to date) one inbound trunk for the hotel's number and one dispatch rule that puts
each call in its own room (`CHORUS_SIP_ROOM_PREFIX`, then a random suffix) with this worker's agent
dispatched by name. Both carry `managed-by: chorus` in their metadata and the setup's name, so running setup
again changes nothing that is already right, and `teardown` removes exactly what setup made. `call` places
an outbound call: a new room with the agent dispatched (the reason goes to the agent as the job's metadata),
then the SIP participant dialled into it.
Expected failures (credentials, a number not in E.164 form, a malformed LIVEKIT_URL, a server that cannot be
reached or does not answer in time, a refused call) are one line on stderr and a non-zero exit; LiveKit's
server is reached with LIVEKIT_URL, LIVEKIT_API_KEY and LIVEKIT_API_SECRET (environment or .env), every
request bounded as agent/lkapi.py says (CHORUS_LIVEKIT_API_TIMEOUT_S, CHORUS_SIP_RING_TIMEOUT_S for `call`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import json
import secrets
import sys
from collections.abc import Awaitable, Callable

from livekit import api

from agent.lkapi import LiveKit, LiveKitFailure
from agent.settings import AgentSettings, e164
from envsettings import SettingsError

MANAGED = {"managed-by": "chorus"}
DEFAULT_NAME = "chorus"


class SipCommandError(Exception):
    """An expected failure: printed as one line, exit status 1 (2 for bad arguments or settings)."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def _metadata(name: str) -> str:
    return json.dumps({**MANAGED, "name": name}, sort_keys=True)


def _ours(metadata: str, name: str | None) -> bool:
    try:
        meta = json.loads(metadata or "{}")
    except ValueError:
        return False
    return (
        isinstance(meta, dict)
        and meta.get("managed-by") == MANAGED["managed-by"]
        and (name is None or meta.get("name") == name)
    )


def _cidr(text: str) -> str:
    try:
        return str(ipaddress.ip_network(text, strict=False))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an IP address or CIDR range") from None


def _number(text: str) -> str:
    try:
        return e164(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _name(text: str) -> str:
    if not text or len(text) > 64 or not all(ch.isalnum() or ch in "-_." for ch in text):
        raise argparse.ArgumentTypeError("a name is 1 to 64 letters, digits, '-', '_' or '.'")
    return text


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m agent sip",
        description="Set up, inspect and use the hotel's phone line (LiveKit SIP).",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="{setup,list,teardown,call}")
    s = sub.add_parser("setup", help="create or update the inbound trunk and dispatch rule (idempotent)")
    s.add_argument("--number", type=_number, required=True, action="append", help="the hotel's number, E.164")
    s.add_argument("--name", type=_name, default=DEFAULT_NAME, help="what the trunk and rule are called")
    s.add_argument(
        "--allowed-address",
        type=_cidr,
        action="append",
        default=[],
        metavar="CIDR",
        help="the SIP provider's addresses (repeat; none: any address)",
    )
    sub.add_parser("list", help="show the inbound trunks and dispatch rules")
    t = sub.add_parser("teardown", help="remove the trunk and rule that setup made")
    t.add_argument("--name", type=_name, default=DEFAULT_NAME)
    c = sub.add_parser("call", help="call a guest: a new room with the agent, and the call dialled into it")
    c.add_argument("number", type=_number, help="the number to call, E.164")
    c.add_argument("--trunk", required=True, help="the outbound trunk's id (ST_...)")
    c.add_argument("--reason", default="", help="why the hotel calls; the agent is told")
    return p


async def setup(lk: LiveKit, settings: AgentSettings, args: argparse.Namespace) -> list[str]:
    numbers, allowed, name = sorted(set(args.number)), sorted(set(args.allowed_address)), args.name
    lines = []
    trunks = (await lk.call(lk.api.sip.list_inbound_trunk, api.ListSIPInboundTrunkRequest())).items
    mine = [t for t in trunks if _ours(t.metadata, name)]
    want = api.SIPInboundTrunkInfo(
        name=name, metadata=_metadata(name), numbers=numbers, allowed_addresses=allowed
    )
    if not mine:
        trunk = await lk.call(lk.api.sip.create_inbound_trunk, api.CreateSIPInboundTrunkRequest(trunk=want))
        lines.append(f"inbound trunk {trunk.sip_trunk_id}: created")
    else:
        trunk = mine[0]
        if sorted(trunk.numbers) != numbers or sorted(trunk.allowed_addresses) != allowed:
            trunk = await lk.call(lk.api.sip.update_inbound_trunk, trunk.sip_trunk_id, want)
            lines.append(f"inbound trunk {trunk.sip_trunk_id}: updated")
        else:
            lines.append(f"inbound trunk {trunk.sip_trunk_id}: unchanged")
    lines[-1] += f" ({', '.join(numbers)}; from {', '.join(allowed) or 'any address'})"

    rules = (await lk.call(lk.api.sip.list_dispatch_rule, api.ListSIPDispatchRuleRequest())).items
    mine_rules = [r for r in rules if _ours(r.metadata, name)]
    want_rule = api.SIPDispatchRuleInfo(
        name=name,
        metadata=_metadata(name),
        trunk_ids=[trunk.sip_trunk_id],
        # a room per call named after the number called (the hotel's) and a random part: LiveKit's per-caller
        # rule names the room after the caller's number, which would then be in every room name
        rule=api.SIPDispatchRule(
            dispatch_rule_callee=api.SIPDispatchRuleCallee(
                room_prefix=settings.sip_room_prefix, randomize=True
            )
        ),
        room_config=api.RoomConfiguration(agents=[api.RoomAgentDispatch(agent_name=settings.agent_name)]),
    )
    if not mine_rules:
        rule = await lk.call(
            lk.api.sip.create_dispatch_rule, api.CreateSIPDispatchRuleRequest(dispatch_rule=want_rule)
        )
        lines.append(f"dispatch rule {rule.sip_dispatch_rule_id}: created")
    else:
        rule = mine_rules[0]
        same = (
            list(rule.trunk_ids) == [trunk.sip_trunk_id]
            and rule.rule == want_rule.rule
            and rule.room_config == want_rule.room_config
        )
        if not same:
            rule = await lk.call(lk.api.sip.update_dispatch_rule, rule.sip_dispatch_rule_id, want_rule)
            lines.append(f"dispatch rule {rule.sip_dispatch_rule_id}: updated")
        else:
            lines.append(f"dispatch rule {rule.sip_dispatch_rule_id}: unchanged")
    lines[-1] += f" (a room per call, {settings.sip_room_prefix}*, agent {settings.agent_name})"
    return lines


async def list_line(lk: LiveKit, settings: AgentSettings, args: argparse.Namespace) -> list[str]:
    trunks = (await lk.call(lk.api.sip.list_inbound_trunk, api.ListSIPInboundTrunkRequest())).items
    rules = (await lk.call(lk.api.sip.list_dispatch_rule, api.ListSIPDispatchRuleRequest())).items
    lines = [f"inbound trunks: {len(trunks)}"]
    for t in trunks:
        mark = " (made by setup)" if _ours(t.metadata, None) else ""
        lines.append(f"  {t.sip_trunk_id}  {t.name or '-'}  numbers {', '.join(t.numbers) or 'any'}{mark}")
    lines.append(f"dispatch rules: {len(rules)}")
    for r in rules:
        mark = " (made by setup)" if _ours(r.metadata, None) else ""
        kind = r.rule.WhichOneof("rule") or "-"
        per_call = kind in ("dispatch_rule_individual", "dispatch_rule_callee")
        prefix = getattr(r.rule, kind).room_prefix if per_call else ""
        agents = ", ".join(a.agent_name for a in r.room_config.agents) or "-"
        trunk_ids = ", ".join(r.trunk_ids) or "any"
        lines.append(
            f"  {r.sip_dispatch_rule_id}  {r.name or '-'}  {kind} {prefix}  trunks {trunk_ids}"
            f"  agents {agents}{mark}"
        )
    return lines


async def teardown(lk: LiveKit, settings: AgentSettings, args: argparse.Namespace) -> list[str]:
    lines = []
    rules = (await lk.call(lk.api.sip.list_dispatch_rule, api.ListSIPDispatchRuleRequest())).items
    for r in rules:
        if _ours(r.metadata, args.name):
            await lk.call(
                lk.api.sip.delete_dispatch_rule,
                api.DeleteSIPDispatchRuleRequest(sip_dispatch_rule_id=r.sip_dispatch_rule_id),
            )
            lines.append(f"dispatch rule {r.sip_dispatch_rule_id}: removed")
    trunks = (await lk.call(lk.api.sip.list_inbound_trunk, api.ListSIPInboundTrunkRequest())).items
    for t in trunks:
        if _ours(t.metadata, args.name):
            await lk.call(lk.api.sip.delete_trunk, api.DeleteSIPTrunkRequest(sip_trunk_id=t.sip_trunk_id))
            lines.append(f"inbound trunk {t.sip_trunk_id}: removed")
    return lines or [f"nothing to remove: no trunk or rule named {args.name!r} made by setup"]


async def call(lk: LiveKit, settings: AgentSettings, args: argparse.Namespace) -> list[str]:
    room = f"{settings.sip_room_prefix}out-{secrets.token_hex(4)}"
    metadata = json.dumps({"direction": "outbound", "reason": args.reason})
    await lk.call(
        lk.api.agent_dispatch.create_dispatch,
        api.CreateAgentDispatchRequest(agent_name=settings.agent_name, room=room, metadata=metadata),
    )
    try:
        sip = await lk.call(
            lk.api.sip.create_sip_participant,
            api.CreateSIPParticipantRequest(
                sip_trunk_id=args.trunk,
                sip_call_to=args.number,
                room_name=room,
                participant_identity=f"phone-{secrets.token_hex(4)}",
                participant_name="guest",
                wait_until_answered=True,  # rings up to CHORUS_SIP_RING_TIMEOUT_S
            ),
        )
    except BaseException:
        # the agent would wait in an empty room: close it (best effort; the first error is the one reported)
        with contextlib.suppress(LiveKitFailure):
            await lk.call(lk.api.room.delete_room, api.DeleteRoomRequest(room=room))
        raise
    return [f"call answered: room {room}, participant {sip.participant_identity}"]


COMMANDS: dict[str, Callable[[LiveKit, AgentSettings, argparse.Namespace], Awaitable[list[str]]]] = {
    "setup": setup,
    "list": list_line,
    "teardown": teardown,
    "call": call,
}


async def run(settings: AgentSettings, args: argparse.Namespace) -> list[str]:
    missing = settings.missing_livekit()
    if missing:
        raise SipCommandError(f"set {', '.join(missing)} (environment or .env) to reach LiveKit", 2)
    try:
        async with LiveKit(settings) as lk:
            return await COMMANDS[args.command](lk, settings, args)
    except LiveKitFailure as e:
        raise SipCommandError(str(e)) from None


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        settings = AgentSettings.from_env()
        lines = asyncio.run(run(settings, args))
    except SettingsError as e:
        print(f"sip {args.command}: {e}", file=sys.stderr)
        return 2
    except SipCommandError as e:
        print(f"sip {args.command}: {e}", file=sys.stderr)
        return e.status
    print("\n".join(lines))
    return 0
