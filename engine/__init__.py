"""Chorus engine: the model, per-slot state and the 80 ms tick. Knows nothing of LiveKit, rooms or hotels."""
