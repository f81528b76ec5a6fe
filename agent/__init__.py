"""The LiveKit side of Chorus: the worker (`worker.py`), a room's job (`room.py`) and its call (`call.py`,
`duplex.py`), with what a call does in folders of its own: `audio_in/`, `audio_out/`, `phone/`, `fleet/`,
and `sim/` (the simulation).

Runs in: the worker's process and each room's (`CHORUS_ROOM_PROCESSES`). May import: `tools/`, `prompts/`,
`envsettings/`, `redaction/`, and of the engine only the rooms' side (`engine.api`, `engine.client`,
`engine.sizing`, `engine.text`, `engine.process`); `agent/sim/` any of it (tests/test_imports.py).
"""
