"""Triton kernels, each beside its plain-torch `*_ref`; the wrappers fall back to the reference off-GPU."""
