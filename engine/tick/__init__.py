"""The tick and everything it runs: the engine, its scheduler and plan, sessions and slots, tool calls, the
runner and its graphs, the prompt cache, and how the engine is built.

Runs in: the engine's process (its tick thread). May import: any of `engine/`, and `redaction/`.
Imported by: `engine.door` and `engine.memory`.
"""
