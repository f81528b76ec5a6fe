"""The simulation (`python -m agent simulate`, `make run`): virtual rooms on an engine of the simulation's
own, and its report.

Runs in: one process of its own, the engine's door and tick in it. May import: what `agent/` may, and any
of `engine/` (it hosts the engine).
"""
