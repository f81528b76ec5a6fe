"""The codec decoder's LayerNorm over channels of a channel-first `[C, B, L]` activation, in one kernel on
CUDA: each (b, l) column normed over its C channels (mean, then the mean of squares of the centred values),
then scaled and shifted per channel.

Knows tensors only. `channel_norm` dispatches to the Triton kernel (one launch where the torch reference
launches eight: two means, the centring, the square, the epsilon, rsqrt, the product and the affine) on CUDA
for fp32 activations, and to the plain-torch `channel_norm_ref` elsewhere. One program per block of columns
holds all C channels; on the GPU it differs from the reference by the order of the sums only.
"""

from __future__ import annotations

import torch

from engine.kernels._triton import FUSED, on_device, tl, triton
from engine.kernels._triton import jit as _jit


def channel_norm_ref(y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over dim 0 of y [C, B, L] (statistics in fp32 whatever the dtype), then `bias + y * weight`
    per channel in y's dtype. y is consumed (normed in place where it is fp32)."""
    dtype = y.dtype
    y = y.float()
    y = y.sub_(y.mean(0, keepdim=True))
    rstd = torch.rsqrt(y.square().mean(0, keepdim=True).add_(eps))
    y = y.mul_(rstd).to(dtype)
    return torch.addcmul(bias[:, None, None], y, weight[:, None, None])


@_jit
def _channel_norm_kernel(
    y_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    channels,
    columns,
    eps,
    BLOCK_C: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    ch = tl.arange(0, BLOCK_C)
    inside = (ch[:, None] < channels) & (cols[None, :] < columns)
    offs = ch[:, None].to(tl.int64) * columns + cols[None, :]
    y = tl.load(y_ptr + offs, mask=inside, other=0.0)
    centred = tl.where(inside, y - tl.sum(y, axis=0)[None, :] / channels, 0.0)
    rstd = tl.rsqrt(tl.sum(centred * centred, axis=0) / channels + eps)
    w = tl.load(w_ptr + ch, mask=ch < channels, other=0.0)
    b = tl.load(b_ptr + ch, mask=ch < channels, other=0.0)
    tl.store(out_ptr + offs, b[:, None] + (centred * rstd[None, :]) * w[:, None], mask=inside)


def channel_norm_triton(
    y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    """Triton version of `channel_norm_ref` for a contiguous fp32 y (y is left as it is)."""
    if triton is None:
        raise RuntimeError("Triton is not installed; use channel_norm_ref")
    c = y.shape[0]
    if y.dim() != 3 or weight.shape != (c,) or bias.shape != (c,):
        raise ValueError(f"y {tuple(y.shape)} must be [C, B, L] with weight and bias [{c}]")
    if any(t.dtype != torch.float32 or not t.is_contiguous() for t in (y, weight, bias)):
        raise ValueError("channel_norm_triton: contiguous fp32 tensors")
    out = torch.empty_like(y)
    columns = y.shape[1] * y.shape[2]
    if out.numel() == 0:
        return out
    block_c = triton.next_power_of_2(c)
    block_n = max(1, min(triton.next_power_of_2(columns), 8192 // block_c))
    with on_device(y):
        _channel_norm_kernel[(triton.cdiv(columns, block_n),)](
            y, weight, bias, out, c, columns, eps, BLOCK_C=block_c, BLOCK_N=block_n, num_warps=8
        )
    return out


def channel_norm(y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA for contiguous fp32 y, the reference elsewhere."""
    if FUSED and y.is_cuda and y.dtype == torch.float32 and y.is_contiguous():
        return channel_norm_triton(y, weight, bias, eps)
    if y.is_meta:  # the operator count (benchmarks/step_ops.py): one kernel, its output
        return torch.empty_like(y)
    return channel_norm_ref(y, weight, bias, eps)
