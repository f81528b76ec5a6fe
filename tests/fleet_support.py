"""The fleet's tests' stand-ins (tests/test_fleet.py, tests/test_fleet_dispatch.py): a real Redis
(redis-server, started on a free port, one per test module) and LiveKit's API as a stand-in that holds rooms,
participants and dispatches.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from types import SimpleNamespace

import pytest
from livekit import api


def redis_server():
    """A redis-server on a free port for the test module, its address yielded (a fixture: `fixture`)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            break
        time.sleep(0.05)
    yield f"127.0.0.1:{port}"
    proc.terminate()
    proc.wait(10)


class FakeLiveKit:
    """LiveKit's room and dispatch API as the watch uses it (`call(method, request)`): rooms with their
    participants and dispatches, and the dispatches created."""

    def __init__(self) -> None:
        self.rooms: dict[str, tuple[api.Room, list[api.ParticipantInfo], list[api.AgentDispatch]]] = {}
        self.created: list[api.CreateAgentDispatchRequest] = []
        self.api = SimpleNamespace(
            room=SimpleNamespace(list_rooms=self.list_rooms, list_participants=self.list_participants),
            agent_dispatch=SimpleNamespace(
                create_dispatch=self.create_dispatch, list_dispatch=self.list_dispatch
            ),
        )

    def add(self, name: str, agent: str, *, caller_joined: float, meta: str = "{}") -> api.Room:
        # as the server lists a room for seconds after its participants changed: its count lags
        room = api.Room(sid=f"RM_{name}", name=name, num_participants=0)
        caller = api.ParticipantInfo(
            identity="caller",
            kind=api.ParticipantInfo.Kind.STANDARD,
            state=api.ParticipantInfo.State.ACTIVE,
            joined_at=int(caller_joined),
        )
        dispatch = api.AgentDispatch(agent_name=agent, room=name, metadata=meta)
        self.rooms[name] = (room, [caller], [dispatch])
        return room

    def agent(self, name: str, job: str, *, joined: float | None = None) -> None:
        """Job `job`'s agent in room `name`, as the server lists it: a participant `agent-<job>` and the job
        in the room's dispatch."""
        self.rooms[name][1].append(
            api.ParticipantInfo(
                identity=f"agent-{job}",
                kind=api.ParticipantInfo.Kind.AGENT,
                state=api.ParticipantInfo.State.ACTIVE,
                joined_at=int(time.time() if joined is None else joined),
            )
        )
        self.job(name, job, started=time.time() - 60)

    def job(self, name: str, job: str, *, started: float) -> None:
        """Job `job` among the jobs the server started for room `name`'s dispatch, at `started`."""
        state = api.JobState(started_at=int(started * 1e9))
        self.rooms[name][2][0].state.jobs.append(
            api.Job(id=job, agent_name=self.rooms[name][2][0].agent_name, state=state)
        )

    async def call(self, method, *args):
        return await method(*args)

    async def __aenter__(self):  # as the worker's watch opens LiveKit's API
        return self

    async def __aexit__(self, *exc):
        return None

    async def list_rooms(self, _req):
        return api.ListRoomsResponse(rooms=[r for r, _, _ in self.rooms.values()])

    async def list_participants(self, req):
        return api.ListParticipantsResponse(participants=self.rooms[req.room][1])

    async def list_dispatch(self, room):
        return list(self.rooms[room][2])

    async def create_dispatch(self, req):
        self.created.append(req)
        return api.AgentDispatch(agent_name=req.agent_name, room=req.room, metadata=req.metadata)


# the fixture `redis_url`, for a test module to take: `from fleet_support import fixture as _redis_url`
fixture = pytest.fixture(scope="module", name="redis_url")(redis_server)
