"""Triton kernels, each beside its plain-torch `*_ref`; the wrappers fall back to the reference off-GPU.

Runs in: the engine's process. May import: nothing of Chorus's.
Imported by: `engine.model`.
"""
