"""The talker backbone's residual joins in one kernel on CUDA: `x + norm_a(y)`, and the next norm of that
sum, `norm_b(x + norm_a(y))`, both Gemma RMSNorms (`v * rsqrt(mean(v^2) + eps) * scale`, fp32).

Knows tensors only. `add_rms_norm` dispatches to the Triton kernel (one launch where the torch reference
launches three: two norms and the sum) on CUDA for fp32 rows, and to the plain-torch `add_rms_norm_ref`
elsewhere. One program per row; on the GPU it differs from the reference by the order of the sums of squares
only.
"""

from __future__ import annotations

import torch

from engine.kernels._triton import FUSED, on_device, tl, triton
from engine.kernels._triton import jit as _jit
from engine.kernels.qk_norm_rope import gemma_rms_norm_ref


def add_rms_norm_ref(
    x: torch.Tensor, y: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`s = x + norm(y, scale_a)`, `norm(s, scale_b)`) over the last dim: x, y [..., d]; scales [d] fp32."""
    s = x + gemma_rms_norm_ref(y, scale_a, eps)
    return s, gemma_rms_norm_ref(s, scale_b, eps)


@_jit
def _add_rms_norm_kernel(
    x_ptr, y_ptr, sa_ptr, sb_ptr, s_ptr, out_ptr, d, eps, stride_x, stride_y, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    inside = j < d
    y = tl.load(y_ptr + row * stride_y + j, mask=inside, other=0.0)
    y = y * tl.rsqrt(tl.sum(y * y, axis=0) / d + eps) * tl.load(sa_ptr + j, mask=inside, other=0.0)
    s = tl.load(x_ptr + row * stride_x + j, mask=inside, other=0.0) + y
    tl.store(s_ptr + row * d + j, s, mask=inside)
    out = s * tl.rsqrt(tl.sum(s * s, axis=0) / d + eps) * tl.load(sb_ptr + j, mask=inside, other=0.0)
    tl.store(out_ptr + row * d + j, out, mask=inside)


def add_rms_norm_triton(
    x: torch.Tensor, y: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `add_rms_norm_ref` for fp32 rows [r, d] with a contiguous last dim."""
    if triton is None:
        raise RuntimeError("Triton is not installed; use add_rms_norm_ref")
    if x.dim() != 2 or y.shape != x.shape or scale_a.shape != (x.shape[1],) or scale_b.shape != scale_a.shape:
        raise ValueError(f"x {tuple(x.shape)} and y {tuple(y.shape)} must be [r, d] with scales [d]")
    ts = (x, y, scale_a, scale_b)
    if any(t.dtype != torch.float32 or t.stride(-1) != 1 for t in ts):
        raise ValueError("add_rms_norm_triton: fp32 tensors with a contiguous last dim")
    r, d = x.shape
    s, out = torch.empty(2, r, d, dtype=x.dtype, device=x.device).unbind(0)  # one allocation
    if r == 0:
        return s, out
    with on_device(x):
        _add_rms_norm_kernel[(r,)](
            x,
            y,
            scale_a,
            scale_b,
            s,
            out,
            d,
            eps,
            x.stride(0),
            y.stride(0),
            BLOCK=triton.next_power_of_2(d),
            num_warps=4,
        )
    return s, out


def add_rms_norm(
    x: torch.Tensor, y: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch: the Triton kernel on CUDA for fp32 rows [r, d], the reference elsewhere. Same contract."""
    if FUSED and x.is_cuda and x.dtype == y.dtype == torch.float32 and x.dim() == 2:
        return add_rms_norm_triton(x, y, scale_a, scale_b, eps)
    if x.is_meta:  # the operator count (benchmarks/step_ops.py): one kernel, its two outputs in one tensor
        s, out = x.new_empty((2, *x.shape)).unbind(0)
        return s, out
    return add_rms_norm_ref(x, y, scale_a, scale_b, eps)
