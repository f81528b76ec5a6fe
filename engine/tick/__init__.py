"""The engine's process: the tick and everything it runs: the engine, its scheduler and plan, sessions and
slots, tool calls, the runner and its graphs, and how they are built.
"""
