"""What a room's process, and the worker's, imports to reach the engine: `RemoteEngine` and its handle, the
worker's control and the engine's process started and stopped. The wire and the shared memory both sides use
are `engine.transport`'s.

Runs in: a room's process and the worker's, never the engine's. May import: `engine.api`, `engine.transport`,
`engine.config.stage_config` and `engine.text`; nothing that reaches torch (tests/test_imports.py).
Imported by: `agent`.
"""
