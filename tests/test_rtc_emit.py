"""agent/audio_in/rtc_emit.py: the rtc SDK's event emitter with each callback's argument count learnt once,
against the SDK's own `emit` as the reference (the same callbacks, the same events: the same calls, in the
same order, and the same errors raised or logged)."""

from __future__ import annotations

import functools
import inspect
import logging

import pytest
from livekit.rtc import event_emitter

from agent.audio_in import rtc_emit

SDK_EMIT = event_emitter.EventEmitter.emit  # as imported, before any install in this process's tests


class Recorder:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def method(self, a, b=None):
        self.calls.append(("method", a, b))

    def star(self, *args):
        self.calls.append(("star", args))

    def __call__(self, a):
        self.calls.append(("object", a))


def callbacks(calls: list) -> list:
    def none():
        calls.append(("none",))

    def one(a):
        calls.append(("one", a))

    def two_kw(a, b, *, c=3):
        calls.append(("two_kw", a, b, c))

    def varargs(a, *rest):
        calls.append(("varargs", a, rest))

    def inner(x):
        calls.append(("wrapped", x))

    @functools.wraps(inner)  # its signature is the wrapped one's: one argument
    def wrapper(*args):
        return inner(*args)

    def fails(a):
        raise ValueError("a callback's own error")

    r = Recorder(calls)
    return [
        none,
        one,
        two_kw,
        varargs,
        wrapper,
        fails,
        r.method,
        r.star,
        r,
        functools.partial(two_kw, "p"),
        lambda *a: calls.append(("lambda", a)),
    ]


def run(emit, args_list) -> tuple[list, list[str]]:
    calls: list = []
    em = event_emitter.EventEmitter()
    for cb in callbacks(calls):
        em.on("e", cb)
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda rec: logged.append(rec.getMessage())
    event_emitter.logger.addHandler(handler)
    try:
        for args in args_list:
            emit(em, "e", *args)
        emit(em, "nobody listens", 1)
    finally:
        event_emitter.logger.removeHandler(handler)
    return calls, logged


def test_every_callback_gets_what_the_sdks_emit_gives_it_in_the_same_order():
    args_list = [(1, 2, 3), (4, 5), (6, 7, 8, 9)]
    assert run(rtc_emit.emit, args_list) == run(SDK_EMIT, args_list)
    calls, logged = run(rtc_emit.emit, args_list)
    assert ("two_kw", 1, 2, 3) in calls and ("method", 4, 5) in calls and ("star", (6, 7, 8, 9)) in calls
    assert ("two_kw", "p", 1, 3) in calls and ("none",) in calls and ("wrapped", 4) in calls
    assert logged == ["failed to emit event e"] * 3  # a callback's error is logged, the others still run


def test_a_callback_given_too_few_arguments_raises_as_in_the_sdk():
    em = event_emitter.EventEmitter()
    em.on("e", lambda a, b: None)
    for emit in (SDK_EMIT, rtc_emit.emit):
        with pytest.raises(TypeError):
            emit(em, "e", 1)


def test_a_functions_signature_is_inspected_once_however_often_it_is_emitted_to(monkeypatch):
    seen: list = []
    real = inspect.signature
    monkeypatch.setattr(rtc_emit.inspect, "signature", lambda cb: seen.append(cb) or real(cb))

    def listener(a, b):
        pass

    class Fresh(Recorder):  # methods no earlier test emitted to
        def method(self, a, b=None):
            pass

    r = Fresh([])
    em = event_emitter.EventEmitter()
    em.on("e", listener)
    em.on("e", r.method)
    for i in range(100):
        rtc_emit.emit(em, "e", i, i, i)
    assert len(seen) == 2  # once for the function, once for the method's
    other = Fresh([])
    em.on("e", other.method)  # another instance's bound method: the same function, known already
    rtc_emit.emit(em, "e", 1, 2)
    assert len(seen) == 2


def test_install_puts_it_in_the_sdks_emitter_once(monkeypatch):
    monkeypatch.setattr(event_emitter.EventEmitter, "emit", SDK_EMIT)
    monkeypatch.setattr(rtc_emit, "_installed", False)
    assert rtc_emit.install() and rtc_emit.install()
    assert event_emitter.EventEmitter.emit is rtc_emit.emit
    calls: list = []
    em = event_emitter.EventEmitter()
    em.on("e", lambda a: calls.append(a))
    em.emit("e", 7, 8)
    assert calls == [7]


def test_an_emitter_it_was_not_written_for_keeps_its_own(monkeypatch):
    def other_emit(self, event, *args):
        pass

    monkeypatch.setattr(event_emitter.EventEmitter, "emit", other_emit)
    monkeypatch.setattr(rtc_emit, "_installed", False)
    assert not rtc_emit.install()
    assert event_emitter.EventEmitter.emit is other_emit
