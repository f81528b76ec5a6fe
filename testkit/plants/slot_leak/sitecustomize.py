"""A planted defect, for benchmarks/soak.py `--plant slot-leak` only: the engine no longer lets go of a
session's slot when its call ends (the room's process ends and its connection closes, but the session stays
in the engine, with the memory the tick reads for it). It shows that the soak's checks catch a slot not freed
on a hang-up. Loaded through PYTHONPATH by every process the workers start; acts in the engine's alone.
Never part of Chorus."""

import sys

if "engine.door.serve" in sys.orig_argv:
    from engine.door.host import EngineHost
    from engine.tick.handle import SessionHandle

    SessionHandle.close = lambda self: None
    EngineHost._release_link = lambda self, conn: None
