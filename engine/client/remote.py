"""The engine as a room's process sees it: `RemoteEngine`, over engine/door/host.py's socket.

Runs in a room's process. It offers what a call uses of `Engine` (`open_session`, `config.preset`,
`model_cfg.clock`, `tokens`, `vocab_size`): building it asks the engine for its clock, tokens and preset, and
`open_session` asks for a session and gets back, with the answer, the session's shared memory and eventfd,
which its handle (engine/client/handle.py `RemoteHandle`) reads and writes from then on. A room never waits on
the engine for longer than `REQUEST_TIMEOUT_S`. Knows sockets, the shared-memory layout and asyncio; nothing
of LiveKit or the model.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass

from engine.api import EngineClosed, SessionRejected
from engine.client.handle import REQUEST_TIMEOUT_S, RemoteHandle
from engine.config.stage_config import ClockConfig, TokenConfig
from engine.transport.link import Layout, SessionLink
from engine.transport.wire import (
    ADDRESS_ENV,
    KEY_ENV,
    connect,
    context_error,
    encode,
    raise_error,
    read_line,
    trace_error,
)


@dataclass(frozen=True)
class RemoteConfig:
    """The part of the engine's config a call reads."""

    preset: str
    max_result_chars: int
    fixed_buffers: bool = False  # the benchmarks' baseline (EngineConfig.fixed_buffers): the playout's too
    echo: bool = False  # the latency benchmark's echo mode (EngineConfig.echo): the playout keeps its times


@dataclass(frozen=True)
class RemoteModelConfig:
    clock: ClockConfig
    tokens: TokenConfig


class RemoteEngine:
    """The engine of another process of this machine, at `address` with the rooms' `key` (default: the
    worker's, from the environment). Building it asks the engine for its clock, tokens and preset
    (EngineClosed if there is none, or it refuses the key). The worker's own questions (admission, load,
    drain) are engine/client/control.py's."""

    def __init__(
        self, address: str | None = None, *, key: str | None = None, timeout: float = REQUEST_TIMEOUT_S
    ) -> None:
        self.address = address or os.environ.get(ADDRESS_ENV, "")
        if not self.address:
            raise EngineClosed(f"no engine to reach: {ADDRESS_ENV} is not set")
        self._key = key or os.environ.get(KEY_ENV, "")
        if not self._key:
            raise EngineClosed(f"no key to the engine's door: {KEY_ENV} is not set")
        self.timeout = timeout
        with connect(self.address, timeout, self._key) as sock:
            sock.sendall(encode({"op": "hello"}))
            hello = read_line(sock, bytearray())
        raise_error(hello)
        if hello.get("op") != "hello":
            raise EngineClosed(f"the engine refused this room ({str(hello.get('why', ''))[:200]})")
        self.config = RemoteConfig(
            hello["preset"],
            int(hello["max_result_chars"]),
            bool(hello.get("fixed_buffers", False)),
            bool(hello.get("echo", False)),
        )
        self.model_cfg = RemoteModelConfig(ClockConfig(**hello["clock"]), TokenConfig(**hello["tokens"]))
        self.vocab_size = int(hello["vocab_size"])
        clock = self.model_cfg.clock
        self.layout = Layout(clock.input_samples, clock.output_samples)
        self._tokens = None
        self.on_drain: Callable[[float], None] | None = None  # the worker's drain, as the engine reports it

    @property
    def tokens(self):
        """The engine's tokenizer with its special ids (loaded here on first use)."""
        if self._tokens is None:
            from engine.text.tokens import Tokens

            self._tokens = Tokens(self.model_cfg.tokens)
        return self._tokens

    def open_session(
        self,
        prompt: str,
        tools: list[dict] | None = None,
        *,
        loop: asyncio.AbstractEventLoop | None = None,
        label: str = "",
        caller: str = "",
        admission: str | None = None,
        context: str = "",
        trace: str = "",
    ) -> RemoteHandle:
        """A session on the engine, its outputs on `loop` (the running one by default); the engine's refusal
        as the EngineError it raised there. `admission`: the job id the worker admitted (its reserved
        slot); `context`: the call's own part of the prompt (`Engine.open_session`; SessionRejected, unsent,
        beyond engine/transport/wire.py MAX_CONTEXT_CHARS); `trace`: the call's W3C traceparent, whose
        trace the engine's spans of the session join (SessionRejected, unsent, for anything else)."""
        loop = loop or asyncio.get_running_loop()
        if (why := context_error(context)) is not None:
            raise SessionRejected(why)
        if (why := trace_error(trace)) is not None:
            raise SessionRejected(why)
        sock = connect(self.address, self.timeout, self._key)
        buf = bytearray()
        try:
            msg = {"op": "open", "prompt": prompt, "tools": tools or [], "label": label, "caller": caller}
            if admission is not None:
                msg["admission"] = admission
            if context:
                msg["context"] = context
            if trace:
                msg["trace"] = trace
            sock.sendall(encode(msg))
            while b"\n" not in buf:  # the answer comes alone, with the descriptors
                try:
                    data, fds, _flags, _addr = socket.recv_fds(sock, 1 << 16, 2)
                except TimeoutError:
                    raise EngineClosed(f"the engine did not answer within {self.timeout:.0f} s") from None
                if not data:
                    raise EngineClosed("the engine closed the connection")
                buf += data
                if fds:
                    break
            reply = read_line(sock, buf)
            raise_error(reply)
            if reply.get("op") == "refused":
                raise EngineClosed(f"the engine refused the session ({str(reply.get('why', ''))[:200]})")
            if reply.get("op") != "opened" or len(fds) != 2:
                raise EngineClosed(f"the engine answered {reply.get('op')!r} to open")
        except BaseException:
            sock.close()
            raise
        try:
            link = SessionLink.attach(fds[0], self.layout)
        except BaseException:
            for fd in fds:
                os.close(fd)
            sock.close()
            raise
        link.forget_fd()
        return RemoteHandle(self, sock, buf, link, fds[1], reply, loop)
