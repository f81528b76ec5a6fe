"""The conformer's residual joins in one kernel on CUDA: `s = x + alpha * y` and the LayerNorm after it,
`layer_norm(s) * weight + bias`, both returned (the sum goes on as the residual, the norm into the next
module).

Knows tensors only. `add_layer_norm` dispatches to the Triton kernel (one launch where the torch reference
launches two: the sum and the norm) on CUDA for fp32 or bf16 rows, and to the plain-torch
`add_layer_norm_ref` elsewhere. One program per row: the sum rounded to x's dtype as torch rounds it, the
statistics in fp32 over the rounded sum, the output rounded once; on the GPU it differs from the reference by
the order of the sums only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels._triton import FUSED, on_device, tl, to_bf16_rtne, triton
from engine.kernels._triton import jit as _jit


def add_layer_norm_ref(
    x: torch.Tensor, y: torch.Tensor, alpha: float, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`s = x + alpha * y`, `layer_norm(s, weight, bias, eps)`) over the last dim: x, y [..., d] one dtype;
    weight, bias [d]."""
    s = x + y if alpha == 1.0 else torch.add(x, y, alpha=alpha)
    return s, F.layer_norm(s, (s.shape[-1],), weight, bias, eps)


@_jit
def _add_layer_norm_kernel(
    x_ptr,
    y_ptr,
    w_ptr,
    b_ptr,
    s_ptr,
    out_ptr,
    d,
    alpha,
    eps,
    stride_x,
    stride_y,
    BF16: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    inside = j < d
    x = tl.load(x_ptr + row * stride_x + j, mask=inside, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + row * stride_y + j, mask=inside, other=0.0).to(tl.float32)
    s = x + alpha * y
    if BF16:  # the residual as torch keeps it: rounded to bf16, and the norm reads the rounded sum
        s_low = to_bf16_rtne(s)
        s = s_low.to(tl.float32)
        tl.store(s_ptr + row * d + j, s_low, mask=inside)
    else:
        tl.store(s_ptr + row * d + j, s, mask=inside)
    mean = tl.sum(s, axis=0) / d
    centred = tl.where(inside, s - mean, 0.0)
    rstd = tl.rsqrt(tl.sum(centred * centred, axis=0) / d + eps)
    w = tl.load(w_ptr + j, mask=inside, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + j, mask=inside, other=0.0).to(tl.float32)
    out = centred * rstd * w + b
    if BF16:
        tl.store(out_ptr + row * d + j, to_bf16_rtne(out), mask=inside)
    else:
        tl.store(out_ptr + row * d + j, out, mask=inside)


def add_layer_norm_triton(
    x: torch.Tensor, y: torch.Tensor, alpha: float, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `add_layer_norm_ref` for rows [r, d] with a contiguous last dim, x and y one dtype
    (fp32 or bf16), weight and bias [d] in any float dtype."""
    if triton is None:
        raise RuntimeError("Triton is not installed; use add_layer_norm_ref")
    if x.dim() != 2 or y.shape != x.shape or weight.shape != (x.shape[1],) or bias.shape != weight.shape:
        raise ValueError(f"x {tuple(x.shape)} and y {tuple(y.shape)} must be [r, d] with weight and bias [d]")
    if x.dtype != y.dtype or x.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"add_layer_norm_triton: x and y fp32 or bf16 alike, got {x.dtype} and {y.dtype}")
    if any(t.stride(-1) != 1 for t in (x, y, weight, bias)):
        raise ValueError("add_layer_norm_triton: tensors with a contiguous last dim")
    r, d = x.shape
    s, out = torch.empty(2, r, d, dtype=x.dtype, device=x.device).unbind(0)  # one allocation
    if r == 0:
        return s, out
    with on_device(x):
        _add_layer_norm_kernel[(r,)](
            x,
            y,
            weight,
            bias,
            s,
            out,
            d,
            float(alpha),
            eps,
            x.stride(0),
            y.stride(0),
            BF16=x.dtype == torch.bfloat16,
            BLOCK=triton.next_power_of_2(d),
            num_warps=4 if d <= 2048 else 8,
        )
    return s, out


def add_layer_norm(
    x: torch.Tensor, y: torch.Tensor, alpha: float, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch: the Triton kernel on CUDA for fp32 or bf16 rows [r, d], the reference elsewhere. Same
    contract as the reference."""
    fits = x.dim() == 2 and x.dtype == y.dtype and x.dtype in (torch.float32, torch.bfloat16)
    fits = fits and x.stride(-1) == y.stride(-1) == 1
    if FUSED and x.is_cuda and fits:
        return add_layer_norm_triton(x, y, alpha, weight, bias, eps)
    if x.is_meta:  # the operator count (benchmarks/step_ops.py): one kernel, its two outputs in one tensor
        s, out = x.new_empty((2, *x.shape)).unbind(0)
        return s, out
    return add_layer_norm_ref(x, y, alpha, weight, bias, eps)
