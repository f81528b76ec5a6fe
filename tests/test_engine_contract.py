"""engine/api.py's contract between the rooms and the engine: both sides of it, the client across the door
(engine/client/remote.py, engine/client/handle.py) and the engine's own objects (engine/tick/engine.py,
engine/tick/handle.py), have every member each Protocol declares, with the parameters it declares (names,
kinds and defaults; an implementation may add parameters of its own, never required ones). Read from the
classes; nothing is started. And a room's typed requests through the one codec (engine/transport/wire.py):
each comes back as it was sent, a malformed one is refused saying what is wrong.
"""

from __future__ import annotations

import inspect
import json
import re
import typing

import pytest

from engine.api import (
    Admissions,
    Admit,
    AskLoad,
    Drain,
    EngineClient,
    ForceTokens,
    KeepPrivate,
    PadBetween,
    Release,
    ReportFleet,
    SessionPort,
    SubmitResult,
)
from engine.client.control import EngineControl
from engine.client.handle import RemoteHandle
from engine.client.remote import RemoteEngine
from engine.tick.engine import Engine
from engine.tick.handle import SessionHandle
from engine.transport.wire import (
    CONTROLS,
    REQUESTS,
    control_message,
    decode_control,
    decode_request,
    encode,
    request_message,
)


def members(proto: type) -> dict[str, object]:
    """The Protocol's own members: methods and properties by their objects, data attributes as None."""
    out: dict[str, object] = {
        n: None for n in typing.get_type_hints(proto, localns=vars(__import__("engine.api")))
    }
    out.update(
        {
            n: v
            for n, v in vars(proto).items()
            if not n.startswith("_") and callable(v) or isinstance(v, property)
        }
    )
    return out


def has_data(cls: type, name: str) -> bool:
    """A class attribute, a property, or an attribute its __init__ sets on the instance."""
    return (
        hasattr(cls, name)
        or re.search(rf"self\.{name}\b\s*[:=,]", inspect.getsource(cls.__init__)) is not None
    )


def breaches(proto: type, cls: type) -> list[str]:
    out = []
    for name, want in members(proto).items():
        if want is None or isinstance(want, property):
            if not has_data(cls, name):
                out.append(f"{cls.__name__}.{name} missing")
            continue
        got = getattr(cls, name, None)
        if got is None or not callable(got):
            out.append(f"{cls.__name__}.{name}() missing")
            continue
        theirs = inspect.signature(got).parameters
        for p in inspect.signature(want).parameters.values():
            q = theirs.get(p.name)
            if q is None and p.kind != p.VAR_POSITIONAL:
                out.append(f"{cls.__name__}.{name} has no parameter {p.name}")
            elif q is not None and (q.kind != p.kind or q.default != p.default):
                out.append(f"{cls.__name__}.{name}'s {p.name} is {q} where the contract says {p}")
        for q in theirs.values():
            if (
                q.name not in inspect.signature(want).parameters
                and q.default is q.empty
                and q.kind
                not in (
                    q.VAR_POSITIONAL,
                    q.VAR_KEYWORD,
                )
            ):
                out.append(f"{cls.__name__}.{name} requires {q.name}, which the contract does not pass")
    return out


@pytest.mark.parametrize(
    ("proto", "cls"),
    [
        (SessionPort, RemoteHandle),
        (SessionPort, SessionHandle),
        (EngineClient, RemoteEngine),
        (EngineClient, Engine),
        (Admissions, EngineControl),
        (Admissions, Engine),
    ],
)
def test_both_sides_of_the_door_keep_the_rooms_contract(proto, cls):
    assert breaches(proto, cls) == []


def test_the_contract_check_finds_a_missing_member_a_renamed_parameter_and_a_new_required_one():
    class Port:
        id = ""
        outputs = None
        closed = frames_in = False

        def push_audio(self, samples): ...  # renamed

        def submit_tool_result(self, call_id, output, is_error=False, *, urgent): ...  # a new required one

        def force_text(self, tokens): ...

        def force_function(self, tokens): ...

        def pad_between(self, on=True): ...

        def keep_private(self, *terms): ...

        def report_receive(self, jitter_s, concealed_s): ...

        def close(self): ...

    assert breaches(SessionPort, Port) == [
        "Port.push_audio has no parameter pcm",
        "Port.push_audio requires samples, which the contract does not pass",
        "Port.submit_tool_result requires urgent, which the contract does not pass",
        "Port.report_playout() missing",
    ]


@pytest.mark.parametrize(
    "request_",
    [
        SubmitResult("call-1", '{"rooms": 2}', False),
        SubmitResult("call-2", "no such room", True),
        ForceTokens("text", (5, 6, 7)),
        ForceTokens("function", ()),
        PadBetween(True),
        KeepPrivate(("Ada Lovelace", "+14155550100")),
    ],
)
def test_every_request_crosses_the_door_and_comes_back_the_same(request_):
    msg = json.loads(encode(request_message(request_, "s1")))
    assert msg["session"] == "s1" and msg["op"] in REQUESTS
    assert decode_request(msg["op"], msg) == request_


@pytest.mark.parametrize(
    ("msg", "why"),
    [
        ({"op": "result", "call_id": 7, "output": "x"}, "result: call_id and output must be strings"),
        ({"op": "force", "channel": "text", "ids": [1, "2"]}, "force: ids must be a list of at most"),
        ({"op": "force", "channel": "audio", "ids": [1]}, "force: channel must be text or function"),
        ({"op": "force", "channel": "text", "ids": [True]}, "force: ids must be a list"),
        ({"op": "pad_between", "on": 1}, "pad_between: on must be true or false"),
        ({"op": "private", "terms": "Ada"}, "private: terms must be a list of strings"),
        ({"op": "drain"}, "unknown operation 'drain'"),
    ],
)
def test_a_malformed_request_is_refused_with_what_is_wrong(msg, why):
    with pytest.raises(ValueError, match=re.escape(why)):
        decode_request(msg["op"], msg)


@pytest.mark.parametrize(
    "request_",
    [
        Admit("AJ_1"),
        Release("AJ_1"),
        AskLoad(),
        AskLoad(figures=True),
        Drain(12.5),
        ReportFleet({"agent lost": 2, "handed over": 1}),
    ],
)
def test_every_request_of_the_worker_crosses_the_door_and_comes_back_the_same(request_):
    msg = json.loads(encode(control_message(request_)))
    assert msg["op"] in CONTROLS
    assert decode_control(msg["op"], msg) == request_


@pytest.mark.parametrize(
    ("msg", "why"),
    [
        ({"op": "admit"}, "admit: admission must name a job"),
        ({"op": "release", "admission": "x" * 201}, "release: admission must name a job"),
        ({"op": "load", "figures": "yes"}, "load: figures must be true or false"),
        ({"op": "drain", "seconds": -1}, "drain: seconds must be a number of seconds"),
        ({"op": "drain", "seconds": True}, "drain: seconds must be a number of seconds"),
        ({"op": "fleet", "redispatches": {"agent lost": -1}}, "fleet: redispatches must be a few counts"),
        ({"op": "fleet", "redispatches": {str(i): 1 for i in range(9)}}, "fleet: redispatches must be a few"),
        ({"op": "result", "call_id": "c", "output": "x"}, "unknown operation 'result'"),
    ],
)
def test_a_malformed_request_of_the_worker_is_refused_with_what_is_wrong(msg, why):
    with pytest.raises(ValueError, match=re.escape(why)):
        decode_control(msg["op"], msg)
