"""The agent's audio on its way out: the playout buffer and its timing, the sinks that write a track or a
file, and the acknowledgement clips.

Runs in: a room's process. May import: what `agent/` may.
"""
