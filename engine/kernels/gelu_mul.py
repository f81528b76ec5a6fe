"""The talker's gated MLP activation, `gelu_tanh(gate) * up`, over the two halves of the joint gate/up
projection's output, in one kernel on CUDA.

Knows tensors only. `gelu_mul` dispatches to the Triton kernel (one launch where torch launches two: the GELU
and the product) on CUDA and to the plain-torch `gelu_mul_ref` elsewhere. The kernel computes in fp32 and
rounds as torch does (the GELU to x's dtype, then the product); its tanh is `1 - 2 / (1 + exp(2z))`, which
differs from the device's tanh within a few fp32 ulps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels._triton import FUSED, on_device, tl, to_bf16_rtne, triton
from engine.kernels._triton import jit as _jit

_BLOCK = 1024


def gelu_mul_ref(gu: torch.Tensor) -> torch.Tensor:
    """gu [..., 2n] (gate, then up) -> `gelu(gate, approximate="tanh") * up` [..., n] in gu's dtype."""
    g, u = gu.chunk(2, dim=-1)
    return F.gelu(g, approximate="tanh") * u


@_jit
def _gelu_mul_kernel(gu_ptr, out_ptr, n, stride_row, ROUND: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < n
    g = tl.load(gu_ptr + row * stride_row + offs, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_row + n + offs, mask=inside, other=0.0).to(tl.float32)
    # tanh is +-1 in fp32 beyond |z| = 15: clamped there, exp(2z) never overflows
    z = tl.minimum(tl.maximum(0.7978845608028654 * (g + 0.044715 * g * g * g), -15.0), 15.0)
    gelu = 0.5 * g * (2.0 - 2.0 / (1.0 + tl.exp(2.0 * z)))  # 0.5 g (1 + tanh z)
    if ROUND:  # torch rounds the GELU to bf16, then the product
        y = to_bf16_rtne(gelu).to(tl.float32) * u
        tl.store(out_ptr + row * n + offs, to_bf16_rtne(y), mask=inside)
    else:
        tl.store(out_ptr + row * n + offs, gelu * u, mask=inside)


def gelu_mul_triton(gu: torch.Tensor) -> torch.Tensor:
    """Triton version of `gelu_mul_ref` for fp32 or bf16 rows with a contiguous last dim (of even width)."""
    if triton is None:
        raise RuntimeError("Triton is not installed; use gelu_mul_ref")
    if gu.dtype not in (torch.float32, torch.bfloat16) or gu.shape[-1] % 2 or gu.stride(-1) != 1:
        raise ValueError(
            f"gelu_mul_triton: fp32 or bf16 rows of even width, got {gu.dtype} {tuple(gu.shape)}"
        )
    n = gu.shape[-1] // 2
    rows = gu.reshape(-1, 2 * n)
    out = torch.empty(rows.shape[0], n, dtype=gu.dtype, device=gu.device)
    if out.numel() > 0:
        with on_device(gu):
            _gelu_mul_kernel[(rows.shape[0], triton.cdiv(n, _BLOCK))](
                rows, out, n, rows.stride(0), ROUND=gu.dtype == torch.bfloat16, BLOCK=_BLOCK, num_warps=4
            )
    return out.view(*gu.shape[:-1], n)


def gelu_mul(gu: torch.Tensor) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA, the reference elsewhere. Same contract as the reference."""
    if FUSED and gu.is_cuda and gu.dtype in (torch.float32, torch.bfloat16) and gu.stride(-1) == 1:
        return gelu_mul_triton(gu)
    if gu.is_meta:  # the operator count (benchmarks/step_ops.py): one kernel, its output
        return gu.new_empty((*gu.shape[:-1], gu.shape[-1] // 2))
    return gelu_mul_ref(gu)
