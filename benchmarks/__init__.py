"""Chorus's benchmarks, each run from the repository root as `python -m benchmarks.NAME` (or as a script where
its docstring says so). What the LiveKit benchmarks share with the end-to-end tests is testkit."""
