"""A process's tuning: the tick thread's real-time priority, the C heap's thresholds, the collector frozen
and run in the slack.

Runs in: either side (the engine's process, a room's, the simulation's). May import: nothing of `engine/`
but itself.
Imported by: `engine.door`, `engine.observe`, `engine.tick`, `agent.room_process` and `agent.sim`.
"""
