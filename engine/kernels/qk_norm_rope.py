"""The talker's query and key heads, normed and rotated in one kernel on CUDA: each head's Gemma RMSNorm
(`x * rsqrt(mean(x^2) + eps) * scale`, fp32) then rotate-half RoPE, queries and keys in one output.

Knows tensors only. `qk_norm_rope` dispatches to the Triton kernel (one launch where the torch reference
launches six: two norms, their concatenation, the rotation's gather, two products and a sum) on CUDA for fp32
heads, and to the plain-torch `qk_norm_rope_ref` elsewhere. One program per (row, head) reads the head twice,
as it is and rotated by half, so the rotation needs no gather; on the GPU it differs from the reference by the
order of the sum of squares only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels._triton import FUSED, on_device, tl, triton
from engine.kernels._triton import jit as _jit


def gemma_rms_norm_ref(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """The talker's GemmaRMSNorm over the last dim (`scale` = 1 + weight, fp32), computed in fp32."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), scale, eps)
    return F.rms_norm(x.float(), (x.shape[-1],), scale, eps).type_as(x)


def qk_norm_rope_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    q_scale: torch.Tensor,
    k_scale: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    perm: torch.Tensor,
) -> torch.Tensor:
    """`rope(cat([norm(q), norm(k)], 1))`: q [r, hq, d], k [r, hk, d]; q_scale, k_scale [d] fp32 (Gemma's
    `1 + weight`); cos, signed_sin [r, 1, d] fp32 (`signed_sin = sign * sin`, rotate_half_tables); perm [d]
    the rotate-half permutation. Returns [r, hq + hk, d] in q's dtype."""
    qk = torch.cat([gemma_rms_norm_ref(q, q_scale, eps), gemma_rms_norm_ref(k, k_scale, eps)], dim=1)
    return qk * cos + qk.index_select(-1, perm) * signed_sin


@_jit
def _qk_norm_rope_kernel(
    q_ptr,
    k_ptr,
    qs_ptr,
    ks_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    hq,
    d,
    eps,
    s_q_r,
    s_q_h,
    s_k_r,
    s_k_h,
    s_cos,
    s_sin,
    s_out_r,
    s_out_h,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    j = tl.arange(0, BLOCK)
    inside = j < d
    half = d // 2
    rot = tl.where(j < half, j + half, j - half)  # rotate_half(x)[j] = sign[j] * x[rot[j]]
    if head < hq:
        base = q_ptr + row * s_q_r + head * s_q_h
        scale_ptr = qs_ptr
    else:
        base = k_ptr + row * s_k_r + (head - hq) * s_k_h
        scale_ptr = ks_ptr
    x = tl.load(base + j, mask=inside, other=0.0)
    xr = tl.load(base + rot, mask=inside, other=0.0)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / d + eps)
    y = x * rstd * tl.load(scale_ptr + j, mask=inside, other=0.0)
    yr = xr * rstd * tl.load(scale_ptr + rot, mask=inside, other=0.0)
    c = tl.load(cos_ptr + row * s_cos + j, mask=inside, other=0.0)
    s = tl.load(sin_ptr + row * s_sin + j, mask=inside, other=0.0)
    tl.store(out_ptr + row * s_out_r + head * s_out_h + j, y * c + yr * s, mask=inside)


def qk_norm_rope_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    q_scale: torch.Tensor,
    k_scale: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    perm: torch.Tensor,
) -> torch.Tensor:
    """Triton version of `qk_norm_rope_ref` for fp32 heads (each head's d values contiguous; `perm` must be
    the rotate-half permutation, which the kernel computes itself)."""
    if triton is None:
        raise RuntimeError("Triton is not installed; use qk_norm_rope_ref")
    r, hq, d = q.shape
    hk = k.shape[1]
    if k.shape != (r, hk, d) or cos.shape != (r, 1, d) or signed_sin.shape != (r, 1, d) or d % 2:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, cos {tuple(cos.shape)} and signed_sin "
            f"{tuple(signed_sin.shape)} must be [r, hq, d], [r, hk, d] and [r, 1, d] with d even"
        )
    ts = (q, k, q_scale, k_scale, cos, signed_sin)
    if any(t.dtype != torch.float32 for t in ts) or any(t.stride(-1) != 1 for t in ts):
        raise ValueError("qk_norm_rope_triton: fp32 tensors with a contiguous last dim")
    out = torch.empty(r, hq + hk, d, dtype=q.dtype, device=q.device)
    if r == 0:
        return out
    with on_device(q):
        _qk_norm_rope_kernel[(r, hq + hk)](
            q,
            k,
            q_scale,
            k_scale,
            cos,
            signed_sin,
            out,
            hq,
            d,
            eps,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            cos.stride(0),
            signed_sin.stride(0),
            out.stride(0),
            out.stride(1),
            BLOCK=triton.next_power_of_2(d),
            num_warps=2,
        )
    return out


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_scale: torch.Tensor,
    k_scale: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    perm: torch.Tensor,
) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA for fp32 heads, the reference elsewhere. Same contract."""
    if FUSED and q.is_cuda and q.dtype == torch.float32:
        return qk_norm_rope_triton(q, k, q_scale, k_scale, eps, cos, signed_sin, perm)
    if q.is_meta:  # the operator count (benchmarks/step_ops.py): one kernel, its output
        return q.new_empty(q.shape[0], q.shape[1] + k.shape[1], q.shape[2])
    return qk_norm_rope_ref(q, k, q_scale, k_scale, eps, cos, signed_sin, perm)
