"""Tuning of a process, either side's: real-time priority, the C heap, the collector."""
