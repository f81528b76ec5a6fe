"""Triton, imported guarded: `triton` and `tl` are None where it is missing, and `jit` then leaves the
kernel a plain function that is never launched (the torch references run instead)."""

import contextlib
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the references still work without Triton
    triton = None
    tl = None


# The live step's fused chains (norms, relu^2, q/k norm with RoPE, ring writes, the conformer's softmax, the
# codec's channel norm) run as Triton kernels on CUDA; CHORUS_FUSED_KERNELS=0 keeps them on their torch
# references (one operator each again), to tell on a device whether a fused kernel is at fault.
FUSED = triton is not None and os.environ.get("CHORUS_FUSED_KERNELS", "1") != "0"


def on_device(t: torch.Tensor):
    """The context a kernel reading `t` launches in: `t`'s CUDA device made current (Triton launches on the
    current device, which need not be the tensor's); off CUDA, none."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def jit(fn):
    """`triton.jit` where Triton is installed; otherwise the plain function."""
    return triton.jit(fn) if triton is not None else fn


@jit
def to_bf16_rtne(x):
    """fp32 -> bf16 rounded to nearest even on the bits, as torch's `.to(torch.bfloat16)` rounds (the
    interpreter's own cast truncates); a NaN stays a quiet NaN of its sign."""
    bits = x.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    quiet = (bits >> 16) | 0x40
    return tl.where(x != x, quiet, rounded).to(tl.uint16).to(tl.bfloat16, bitcast=True)
