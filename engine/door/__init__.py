"""The engine's door: the process's entry point (`python -m engine.door.serve`), a Unix socket and shared
memory per session, and who may use it with which key.

Runs in: the engine's process. May import: any of `engine/` (the codec and the shared memory's layout from
`engine.transport`), and `redaction/`.
Imported by: none of Chorus's modules; the worker and the simulation start it as a process.
"""
