"""What an operator reads of the engine: its metrics, its snapshot, the small process that serves them, and
its traced sessions' spans (`spans.py`, OpenTelemetry's SDK).

Runs in: the engine's process (and `snapshot_serve.py` in a process of its own, standard library only). May
import: `engine.api`, `engine.config`, `engine.process`, `engine.session_phase`, `engine.transport` and
`redaction/`; never the tick, which it reads through Protocols (`Observed`).
Imported by: `engine.door` and `engine.tick`.
"""
