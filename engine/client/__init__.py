"""What a room's process, and the worker's, imports to reach the engine: `RemoteEngine` and its handle, a
session's shared-memory link, the door's wire codec, the worker's control and the engine's process started
and stopped.

Runs in: a room's process and the worker's, never the engine's. May import: `engine.api`,
`engine.sizing.stage_config` and `engine.text`; nothing that reaches torch (tests/test_imports.py).
"""
