"""The engine's process: its entry point (`python -m engine.door.serve`), the door (a Unix socket and shared
memory per session) and who may use it.
"""
