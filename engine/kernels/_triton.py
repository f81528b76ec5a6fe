"""Triton, imported guarded: `triton` and `tl` are None where it is missing, and `jit` then leaves the
kernel a plain function that is never launched (the torch references run instead)."""

try:
    import triton
    import triton.language as tl
except ImportError:  # the references still work without Triton
    triton = None
    tl = None


def jit(fn):
    """`triton.jit` where Triton is installed; otherwise the plain function."""
    return triton.jit(fn) if triton is not None else fn
