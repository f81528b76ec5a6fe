"""The thinker's two RMSNorms, each one kernel on CUDA: the block norm (fp32 arithmetic on a narrower
residual, cast back), alone or with the residual join before it (`residual_rms_norm`), and the Mamba mixer's
gated, group-wise norm (NemotronH's `mixer.norm`).

Knows tensors only. `rms_norm` and `gated_rms_norm` dispatch to the Triton kernel on CUDA (one launch where
the torch reference launches four and seven: the casts to fp32 and back, the gate's SiLU and product, the
norm, the weight) and to the plain-torch references elsewhere, which are the model's maths as NVIDIA's
code writes it and what the CPU runs. The kernel reduces each row (or group) in one program, in fp32, and
rounds to the output dtype as torch does; on the GPU it differs from the reference by the order of the
sum of squares and the hardware's exp, within one rounding of the output dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels._triton import FUSED, on_device, tl, to_bf16_rtne, triton
from engine.kernels._triton import jit as _jit


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * (h * rsqrt(mean(h^2) + eps))` in fp32 over the last dim of `h = x.float()`, in x's dtype."""
    h = x.float()
    return F.rms_norm(h, (h.shape[-1],), weight.float(), eps).to(x.dtype)


def residual_rms_norm_ref(
    h: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's residual join and the next block's norm: `h += y` in place (in h's dtype, as `h + y`
    rounds), then (h, `rms_norm_ref(h)`). The residual stream moves on in its own memory."""
    h.add_(y)
    return h, rms_norm_ref(h, weight, eps)


def gated_rms_norm_ref(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, group: int, eps: float
) -> torch.Tensor:
    """`weight * rms_norm(x * silu(gate))` over groups of `group` channels, the norm in fp32 and rounded to
    x's dtype before the weight (in the weight's dtype) scales it."""
    h = x.float() * F.silu(gate.float())
    g = F.rms_norm(h.unflatten(-1, (-1, group)), (group,), None, eps)
    return weight * g.flatten(-2).to(x.dtype)


@_jit
def _rms_norm_kernel(
    x_ptr,
    gate_ptr,
    w_ptr,
    out_ptr,
    group,
    eps,
    stride_x,
    stride_g,
    stride_o,
    GATED: tl.constexpr,
    ROUND_X: tl.constexpr,
    ROUND_OUT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # One program per (row, group); without a gate a row is one group.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * group + tl.arange(0, BLOCK)
    inside = tl.arange(0, BLOCK) < group
    h = tl.load(x_ptr + row * stride_x + offs, mask=inside, other=0.0).to(tl.float32)
    if GATED:
        g = tl.load(gate_ptr + row * stride_g + offs, mask=inside, other=0.0).to(tl.float32)
        h = h * (g / (1.0 + tl.exp(-g)))
    y = h * tl.rsqrt(tl.sum(h * h, axis=0) / group + eps)
    w = tl.load(w_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    if GATED:  # rounded to x's dtype first, then scaled in the weight's
        if ROUND_X:
            y = to_bf16_rtne(y).to(tl.float32)
        y = w * y
    else:
        y = w * y
    if ROUND_OUT:
        tl.store(out_ptr + row * stride_o + offs, to_bf16_rtne(y), mask=inside)
    else:
        tl.store(out_ptr + row * stride_o + offs, y.to(out_ptr.dtype.element_ty), mask=inside)


@_jit
def _residual_rms_norm_kernel(
    h_ptr, y_ptr, w_ptr, out_ptr, n, eps, stride_h, stride_y, ROUND: tl.constexpr, BLOCK: tl.constexpr
):
    # One program per row (it reads its row whole before writing it): the sum rounded to the residual's
    # dtype as torch's add rounds it, written over h, and the norm of it.
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    inside = offs < n
    h = tl.load(h_ptr + row * stride_h + offs, mask=inside, other=0.0).to(tl.float32)
    h += tl.load(y_ptr + row * stride_y + offs, mask=inside, other=0.0).to(tl.float32)
    if ROUND:
        low = to_bf16_rtne(h)
        tl.store(h_ptr + row * stride_h + offs, low, mask=inside)
        h = low.to(tl.float32)
    else:
        tl.store(h_ptr + row * stride_h + offs, h, mask=inside)
    y = h * tl.rsqrt(tl.sum(h * h, axis=0) / n + eps)
    y = tl.load(w_ptr + offs, mask=inside, other=0.0).to(tl.float32) * y
    if ROUND:
        tl.store(out_ptr + row * n + offs, to_bf16_rtne(y), mask=inside)
    else:
        tl.store(out_ptr + row * n + offs, y, mask=inside)


def residual_rms_norm_triton(
    h: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `residual_rms_norm_ref` for rows [r, n] (h and y one dtype, fp32 or bf16, with a
    contiguous last dim): h updated in place, the norm in h's dtype."""
    if triton is None:
        raise RuntimeError("Triton is not installed; use the references")
    if h.dim() != 2 or y.shape != h.shape or weight.shape != (h.shape[1],):
        raise ValueError(f"h {tuple(h.shape)} and y {tuple(y.shape)} must be [r, n] with weight [n]")
    if h.dtype != y.dtype or h.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"residual_rms_norm_triton: h and y fp32 or bf16 alike, got {h.dtype}, {y.dtype}")
    if any(t.stride(-1) != 1 for t in (h, y, weight)):
        raise ValueError("residual_rms_norm_triton: the last dim must be contiguous")
    r, n = h.shape
    out = torch.empty_like(h)
    if r == 0:
        return h, out
    with on_device(h):
        _residual_rms_norm_kernel[(r,)](
            h,
            y,
            weight,
            out,
            n,
            eps,
            h.stride(0),
            y.stride(0),
            ROUND=h.dtype == torch.bfloat16,
            BLOCK=triton.next_power_of_2(n),
            num_warps=8 if n >= 2048 else 4,
        )
    return h, out


def _launch(
    x: torch.Tensor, gate: torch.Tensor | None, weight: torch.Tensor, group: int, eps: float
) -> torch.Tensor:
    if triton is None:
        raise RuntimeError("Triton is not installed; use the references")
    n = x.shape[-1]
    if weight.shape != (n,) or n % group:
        raise ValueError(f"weight {tuple(weight.shape)} and group {group} do not fit rows of {n}")
    if gate is not None and gate.shape != x.shape:
        raise ValueError(f"gate {tuple(gate.shape)} must be shaped as x {tuple(x.shape)}")
    out_dtype = _gated_dtype(x, weight) if gate is not None else x.dtype
    rows = x.reshape(-1, n)
    gates = gate.reshape(-1, n) if gate is not None else rows
    out = torch.empty(rows.shape, dtype=out_dtype, device=x.device)
    if rows.shape[0] == 0:
        return out.view(x.shape)
    for t, name in ((rows, "x"), (gates, "gate"), (weight, "weight")):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: the last dim must be contiguous")
    with on_device(x):
        _rms_norm_kernel[(rows.shape[0], n // group)](
            rows,
            gates,
            weight,
            out,
            group,
            eps,
            rows.stride(0),
            gates.stride(0),
            out.stride(0),
            GATED=gate is not None,
            ROUND_X=x.dtype == torch.bfloat16,
            ROUND_OUT=out_dtype == torch.bfloat16,
            BLOCK=triton.next_power_of_2(group),
            num_warps=8 if group >= 2048 else 4,
        )
    return out.view(x.shape)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton version of `rms_norm_ref`: same contract, one program per row (rows with a contiguous last
    dim, fp32 or bf16)."""
    return _launch(x, None, weight, x.shape[-1], eps)


def gated_rms_norm_triton(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, group: int, eps: float
) -> torch.Tensor:
    """Triton version of `gated_rms_norm_ref`: same contract, one program per group of a row."""
    return _launch(x, gate, weight, group, eps)


def _gated_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The gated norm's output dtype, the promotion of x's and the weight's (the dtypes the kernel takes;
    `torch.promote_types` would reach the dispatcher)."""
    return x.dtype if weight.dtype == x.dtype else torch.float32


def _kernel_fits(*ts: torch.Tensor) -> bool:
    return all(t.dtype in (torch.float32, torch.bfloat16) for t in ts) and ts[0].shape[-1] > 0


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA, the reference elsewhere. Same contract as the reference."""
    if FUSED and x.is_cuda and _kernel_fits(x, weight):
        return rms_norm_triton(x, weight, eps)
    if x.is_meta:  # the operator count (benchmarks/step_ops.py): one kernel, its output
        return torch.empty_like(x)
    return rms_norm_ref(x, weight, eps)


def residual_rms_norm(
    h: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch: the Triton kernel on CUDA for rows [r, n], the reference elsewhere. Same contract as the
    reference."""
    fits = h.dim() == 2 and h.dtype == y.dtype and h.stride(-1) == y.stride(-1) == 1
    if FUSED and h.is_cuda and fits and _kernel_fits(h, weight):
        return residual_rms_norm_triton(h, y, weight, eps)
    if h.is_meta:  # the operator count: one kernel, its output (the sum is written over h)
        return h, torch.empty_like(h)
    return residual_rms_norm_ref(h, y, weight, eps)


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, group: int, eps: float
) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA, the reference elsewhere. Same contract as the reference."""
    if FUSED and x.is_cuda and _kernel_fits(x, gate, weight):
        return gated_rms_norm_triton(x, gate, weight, group, eps)
    if x.is_meta:  # the operator count: one kernel, its output
        return torch.empty_like(x, dtype=_gated_dtype(x, weight))
    return gated_rms_norm_ref(x, gate, weight, group, eps)
