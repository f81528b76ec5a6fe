"""The thinker MLP's activation, `relu(x)^2`, in one kernel on CUDA.

Knows tensors only. `relu_square` dispatches to the Triton kernel (one launch where torch launches two) on
CUDA and to the plain-torch `relu_square_ref` elsewhere. The kernel squares in fp32 and rounds to x's dtype
to nearest even, as torch's bf16 arithmetic does, so it is bit for bit the reference on either device.
"""

from __future__ import annotations

import torch

from engine.kernels._triton import FUSED, on_device, tl, to_bf16_rtne, triton
from engine.kernels._triton import jit as _jit

_BLOCK = 1024


def relu_square_ref(x: torch.Tensor) -> torch.Tensor:
    """`relu(x) ** 2` in x's dtype."""
    return torch.relu(x).square()


@_jit
def _relu_square_kernel(x_ptr, out_ptr, n, ROUND: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    x = tl.maximum(tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32), 0.0)
    y = x * x
    if ROUND:
        tl.store(out_ptr + offs, to_bf16_rtne(y), mask=inside)
    else:
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=inside)


def relu_square_triton(x: torch.Tensor) -> torch.Tensor:
    """Triton version of `relu_square_ref` for a contiguous fp32 or bf16 tensor."""
    if triton is None:
        raise RuntimeError("Triton is not installed; use relu_square_ref")
    if not x.is_contiguous() or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"relu_square_triton: a contiguous fp32 or bf16 tensor, got {x.dtype}")
    out = torch.empty_like(x)
    n = x.numel()
    if n == 0:
        return out
    with on_device(x):
        _relu_square_kernel[(triton.cdiv(n, _BLOCK),)](
            x, out, n, ROUND=x.dtype == torch.bfloat16, BLOCK=_BLOCK, num_warps=4
        )
    return out


def relu_square(x: torch.Tensor) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA, the reference elsewhere. Same contract as the reference."""
    if FUSED and x.is_cuda and x.is_contiguous() and x.dtype in (torch.float32, torch.bfloat16):
        return relu_square_triton(x)
    if x.is_meta:  # the operator count (benchmarks/step_ops.py): one kernel, its output
        return torch.empty_like(x)
    return relu_square_ref(x)
