"""The simulation (`python -m agent simulate`, `make run`): virtual rooms on an engine of the simulation's
own, and its report.

Runs in: one process of its own, its engine in another (engine/client/process.py `EngineProcess`), which it
reaches as a worker does. May import: what `agent/` may; nothing of the engine's own side.
"""
