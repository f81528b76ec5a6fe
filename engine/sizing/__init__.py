"""What a preset needs of a device: its stages built on the meta device, their parameters, weight and state
bytes, and the sessions that fit (`python -m engine info`, the engine's memory check at build). The torch
side of sizing; the configs it sizes are `engine.config`'s.

Runs in: the engine's process, and the worker's where it reports a preset. May import: `engine.config`,
`engine.model`.
Imported by: `engine.__main__`, `engine.memory`, `engine.tick` and `agent.worker`.
"""
