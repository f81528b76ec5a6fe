"""The engine's transport, shared by both sides: the door's wire codec (one JSON object a line on a Unix
socket, and how the engine's process is started) and a session's shared memory (its rings and counters).

Runs in: either side (the engine's process, a room's, the worker's). May import: `engine.api`; never torch.
Imported by: `engine.client`, `engine.door`, `engine.observe`, `engine.tick` and `agent`.
"""
