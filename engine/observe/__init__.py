"""The engine's process: what an operator reads, the metrics, the snapshot and the small process that serves
them.
"""
