"""A planted defect, for benchmarks/soak.py `--plant slot-leak` only: a room's process no longer lets go of
its engine session when the call ends (the session's connection is kept open, so the engine keeps its slot).
It shows that the soak's checks catch a slot not freed on a hang-up. Loaded by the workers' processes through
PYTHONPATH; never part of Chorus."""

from engine.client.handle import RemoteHandle

_KEPT: list[RemoteHandle] = []  # held, so that the connection is never collected and closed


def _close_without_freeing(self: RemoteHandle) -> None:
    if self._closed:
        return
    self._closed = True
    _KEPT.append(self)


RemoteHandle.close = _close_without_freeing
