"""LiveKit's server API with every call bounded: the one client Chorus reaches its LiveKit server through (the
`sip` commands; a phone call's hang-up, transfer and room).

livekit-api sends a request without a timeout of its own, so a server that takes the connection and never
answers would hold the caller for ever. Here each try of a call is bounded by CHORUS_LIVEKIT_API_TIMEOUT_S,
and a call that rings a phone (an outbound call waiting to be answered, a transfer) by
CHORUS_SIP_RING_TIMEOUT_S more. `POLICIES` says which calls are sent again when no answer came (those that
change nothing, or leave the same state however often they run) and which are sent once. A failure is one
`LiveKitFailure`, whose message is a line for an operator without the request (which can hold a phone number).
Knows livekit-api and aiohttp; nothing of the hotel or of the calls' meaning.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar, cast
from urllib.parse import urlsplit

import aiohttp
from livekit import api

if TYPE_CHECKING:
    from agent.settings import AgentSettings

log = logging.getLogger("chorus.agent.lkapi")

T = TypeVar("T")

RETRY_AFTER_S = 0.5  # the pause before a call is sent again
CLOSE_S = 1.0  # the longest closing the client's connections may take


@dataclass(frozen=True)
class Policy:
    tries: int  # how often the call is sent when no answer comes (a timeout, a lost connection, a 5xx)
    rings: bool = False  # it waits for a phone to be answered: the ring window on top of the API timeout
    gone_is_done: bool = False  # a delete: a retry answered not_found means an earlier try did it


AGAIN = Policy(tries=2)  # changes nothing, or leaves the same state however often it runs
DELETE = Policy(tries=2, gone_is_done=True)
ONCE = Policy(tries=1)  # a second send could make a second one
DIAL = Policy(tries=1, rings=True)  # a second send could ring the phone a second time

# Every call Chorus makes, by the SDK method's name; a call not in here is refused (KeyError) until it is.
POLICIES: dict[str, Policy] = {
    "list_inbound_trunk": AGAIN,
    "list_dispatch_rule": AGAIN,
    "list_participants": AGAIN,
    "list_rooms": AGAIN,
    "list_dispatch": AGAIN,
    "update_inbound_trunk": AGAIN,  # the whole trunk replaced by the one given
    "update_dispatch_rule": AGAIN,  # the whole rule replaced by the one given
    "delete_trunk": DELETE,
    "delete_dispatch_rule": DELETE,
    "remove_participant": DELETE,
    "delete_room": DELETE,
    "create_inbound_trunk": ONCE,
    "create_dispatch_rule": ONCE,
    "create_dispatch": ONCE,  # a second agent in the room
    "create_sip_participant": DIAL,  # Chorus waits until the guest answers
    "transfer_sip_participant": DIAL,  # a SIP REFER: the front desk rings
}


class LiveKitFailure(Exception):
    """A LiveKit API call that failed. The message is one line for an operator, without the request;
    `operation` is the call (the SDK method's name); `error` the server's own answer when it gave one (None:
    no answer in time, or no connection)."""

    def __init__(self, operation: str, message: str, error: api.ServerError | None = None) -> None:
        super().__init__(message)
        self.operation = operation
        self.error = error


def describe_api_error(e: api.ServerError) -> str:
    """The server's error answer in a few words, without the request (which can hold a phone number)."""
    if isinstance(e, api.SipCallError) and (e.sip_status_code or e.sip_transfer_reason):
        return str(e)
    if e.status == 401 or e.code == api.ServerErrorCode.UNAUTHENTICATED:
        return "LiveKit refused the credentials: check LIVEKIT_API_KEY and LIVEKIT_API_SECRET"
    if e.status == 403 or e.code == api.ServerErrorCode.PERMISSION_DENIED:
        return f"LiveKit denied the request: {e.message}"
    return f"LiveKit answered {e.code or e.status}: {e.message}"


def try_s(settings: AgentSettings, operation: str) -> float:
    """The longest one try of `operation` may take."""
    rings = POLICIES[operation].rings
    return settings.livekit_api_timeout_s + (settings.sip_ring_timeout_s if rings else 0.0)


def bound_s(settings: AgentSettings, *operations: str) -> float:
    """The longest a client may take for `operations` one after another, every try and pause included, and
    its closing."""
    total = CLOSE_S
    for op in operations:
        tries = POLICIES[op].tries
        total += tries * try_s(settings, op) + (tries - 1) * RETRY_AFTER_S
    return total


class LiveKit:
    """A client of the LiveKit server's API (LIVEKIT_URL with its key and secret); use it `async with` and
    send every request through `call`, e.g. `await lk.call(lk.api.room.delete_room, request)`."""

    def __init__(self, settings: AgentSettings) -> None:
        missing = settings.missing_livekit()
        if missing:
            raise LiveKitFailure("connect", f"set {', '.join(missing)} to reach LiveKit")
        self.settings = settings
        parts = urlsplit(settings.livekit_url)  # the URL as messages name it: without a user or password
        self.url = parts._replace(netloc=parts.netloc.rpartition("@")[2]).geturl()
        self.api = api.LiveKitAPI(
            settings.livekit_url,
            settings.livekit_api_key,
            settings.livekit_api_secret,
            timeout=aiohttp.ClientTimeout(total=settings.livekit_api_timeout_s),
        )

    async def __aenter__(self) -> LiveKit:
        return self

    async def __aexit__(self, *_: object) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CLOSE_S):
                await self.api.aclose()

    async def call(self, method: Callable[..., Awaitable[T]], *args: Any) -> T:
        """`method(*args)` (a method of `self.api`'s services) within its bound, sent again as its policy
        allows; LiveKitFailure if it fails. A delete that a retry finds already done returns None."""
        name = method.__name__
        policy = POLICIES[name]
        limit = try_s(self.settings, name)
        kwargs: dict[str, Any] = {}
        if policy.rings:
            args[0].ringing_timeout.seconds = math.ceil(self.settings.sip_ring_timeout_s)
            kwargs["timeout"] = limit  # the SDK's own bound for these, the same
        for attempt in range(1, policy.tries + 1):
            last = attempt == policy.tries
            try:
                async with asyncio.timeout(limit):
                    return await method(*args, **kwargs)
            except api.ServerError as e:
                if policy.gone_is_done and attempt > 1 and e.code == api.ServerErrorCode.NOT_FOUND:
                    return cast(T, None)
                if last or e.status < 500:
                    raise LiveKitFailure(name, describe_api_error(e), e) from None
                why = f"status {e.status}"
            except TimeoutError:  # aiohttp's own timeouts are TimeoutErrors too
                if last:
                    raise LiveKitFailure(name, self._no_answer(name, limit, policy.tries)) from None
                why = "no answer"
            except (aiohttp.ClientError, OSError) as e:
                if last:
                    raise LiveKitFailure(name, self._unreachable(e, policy.tries)) from None
                why = type(e).__name__
            # info, not warning: the command line shows warnings, and the failure, if it comes, is one line
            log.info("LiveKit API %s: %s on try %d of %d; sending it again", name, why, attempt, policy.tries)
            await asyncio.sleep(RETRY_AFTER_S)
        raise AssertionError("unreachable: the last try returns or raises")

    def _no_answer(self, name: str, limit: float, tries: int) -> str:
        times = f" ({tries} tries)" if tries > 1 else ""
        return f"the LiveKit server at {self.url} did not answer {name} within {limit:g} s{times}"

    def _unreachable(self, e: BaseException, tries: int) -> str:
        times = f", {tries} tries" if tries > 1 else ""
        return f"cannot reach LiveKit at {self.url} ({type(e).__name__}: {e}{times})"
