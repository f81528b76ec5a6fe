"""The conformer's attention weights in one kernel on CUDA: scores scaled, biased by the additive mask,
softmaxed in fp32 and cast to the attention's dtype.

Knows tensors only. `scaled_softmax` dispatches to the Triton kernel (one launch where the torch reference
launches five: the cast to fp32, the division, the bias, the softmax and the cast back) on CUDA and to the
plain-torch `scaled_softmax_ref` elsewhere. One program per row; on the GPU the kernel differs from the
reference by the hardware's exp and the order of the row's sum, within one rounding of the output dtype.
"""

from __future__ import annotations

import torch

from engine.kernels._triton import FUSED, on_device, tl, to_bf16_rtne, triton
from engine.kernels._triton import jit as _jit


def scaled_softmax_ref(
    scores: torch.Tensor, divisor: float, bias: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """`softmax(scores.float() / divisor + bias, -1)` in `dtype`: scores [B, H, L]; bias [B, 1, L] fp32
    (broadcast over H)."""
    return torch.softmax(scores.float().div_(divisor).add_(bias), dim=-1).to(dtype)


@_jit
def _scaled_softmax_kernel(
    s_ptr,
    bias_ptr,
    out_ptr,
    heads,
    length,
    divisor,
    s_s_b,
    s_s_h,
    s_bias_b,
    s_out_b,
    s_out_h,
    ROUND: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // heads
    h = row % heads
    j = tl.arange(0, BLOCK)
    inside = j < length
    s = tl.load(s_ptr + b * s_s_b + h * s_s_h + j, mask=inside, other=0.0).to(tl.float32)
    s = s / divisor + tl.load(bias_ptr + b * s_bias_b + j, mask=inside, other=0.0)
    s = tl.where(inside, s, -float("inf"))
    e = tl.exp(s - tl.max(s, axis=0))
    p = e / tl.sum(e, axis=0)
    if ROUND:
        tl.store(out_ptr + b * s_out_b + h * s_out_h + j, to_bf16_rtne(p), mask=inside)
    else:
        tl.store(out_ptr + b * s_out_b + h * s_out_h + j, p.to(out_ptr.dtype.element_ty), mask=inside)


def scaled_softmax_triton(
    scores: torch.Tensor, divisor: float, bias: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Triton version of `scaled_softmax_ref` (scores and `dtype` fp32 or bf16, each row contiguous)."""
    if triton is None:
        raise RuntimeError("Triton is not installed; use scaled_softmax_ref")
    bsz, heads, length = scores.shape
    if bias.shape != (bsz, 1, length) or bias.dtype != torch.float32:
        raise ValueError(f"bias must be fp32 [{bsz}, 1, {length}], got {bias.dtype} {tuple(bias.shape)}")
    if not _fits(scores, dtype) or scores.stride(-1) != 1 or bias.stride(-1) != 1:
        raise ValueError("scaled_softmax_triton: fp32 or bf16 scores, rows contiguous")
    out = torch.empty(bsz, heads, length, dtype=dtype, device=scores.device)
    if out.numel() == 0:
        return out
    with on_device(scores):
        _scaled_softmax_kernel[(bsz * heads,)](
            scores,
            bias,
            out,
            heads,
            length,
            divisor,
            scores.stride(0),
            scores.stride(1),
            bias.stride(0),
            out.stride(0),
            out.stride(1),
            ROUND=dtype == torch.bfloat16,
            BLOCK=triton.next_power_of_2(length),
            num_warps=1,
        )
    return out


def _fits(scores: torch.Tensor, dtype: torch.dtype) -> bool:
    return scores.dtype in (torch.float32, torch.bfloat16) and dtype in (torch.float32, torch.bfloat16)


def scaled_softmax(
    scores: torch.Tensor, divisor: float, bias: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA, the reference elsewhere. Same contract as the reference."""
    if FUSED and scores.is_cuda and _fits(scores, dtype):
        return scaled_softmax_triton(scores, divisor, bias, dtype)
    if scores.is_meta:  # the operator count (benchmarks/step_ops.py): one kernel, its output
        return torch.empty_like(scores, dtype=dtype)
    return scaled_softmax_ref(scores, divisor, bias, dtype)
