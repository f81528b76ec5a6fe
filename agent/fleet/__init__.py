"""A fleet of workers: a room whose agent died is given another (agent/fleet/fleet.py), its conversation
carried over, the engine's process watched and started again, a drain's goodbye.

Runs in: the worker's process (the watch, the engine's process), and a room's (the carried conversation,
the goodbye). May import: what `agent/` may.
"""
