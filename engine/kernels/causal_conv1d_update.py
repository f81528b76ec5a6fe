"""Causal depthwise conv1d update for one new column over slot-indexed state.

Knows tensors only. `causal_conv1d_update` dispatches to the Triton kernel (`causal_conv1d_update_triton`)
on CUDA and to the plain-torch `causal_conv1d_update_ref` elsewhere. Triton is imported guarded, so this
module imports (and the reference runs) where Triton is missing. A batch names its slots by index, -1 for a
row that neither reads nor writes state; the live batch is row i on slot i (`slot_state.live_rows`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels._rows import write_rows
from engine.kernels._triton import jit as _jit
from engine.kernels._triton import on_device, tl, triton


def causal_conv1d_update_ref(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state_indices: torch.Tensor,
    silu: bool = True,
) -> torch.Tensor:
    """Append one column per row to its slot's window, convolve, optionally apply SiLU.

    Shapes (b = batch rows, S = slots, d = channels, w = kernel width):
      x [b, d]; conv_state [S, d, w - 1] (the last w - 1 inputs, oldest first), mutated for rows whose
      index is >= 0; weight [d, w]; bias [d] or None; state_indices [b] int64, -1 for a padding row.
    Returns [b, d] in x's dtype; padding rows give zeros and leave every slot untouched. Rows with an index
    >= 0 should name distinct slots (a repeated one is written by its last row).
    """
    valid = state_indices >= 0
    idx = state_indices.clamp(min=0)
    window = torch.cat([conv_state.index_select(0, idx), x.to(conv_state.dtype)[:, :, None]], dim=-1)
    out = (window * weight.to(window.dtype)).sum(-1)
    if bias is not None:
        out = out + bias.to(out.dtype)
    if silu:
        out = F.silu(out)
    write_rows(conv_state, state_indices, window[:, :, 1:])
    return torch.where(valid[:, None], out, 0.0).to(x.dtype)


@_jit
def _causal_conv1d_update_kernel(
    x_ptr,
    state_ptr,
    weight_ptr,
    bias_ptr,
    idx_ptr,
    out_ptr,
    dim,
    stride_x_b,
    stride_x_d,
    stride_state_slot,
    stride_state_d,
    stride_state_w,
    stride_weight_d,
    stride_weight_w,
    stride_bias_d,
    stride_idx_b,
    stride_out_b,
    stride_out_d,
    WIDTH: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    # One program per (block of channels, batch row).
    pid_d = tl.program_id(0)
    pid_b = tl.program_id(1)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < dim
    out_ptrs = out_ptr + pid_b * stride_out_b + offs_d * stride_out_d

    slot = tl.load(idx_ptr + pid_b * stride_idx_b).to(tl.int64)
    if slot < 0:  # padding row: zero output, no state access at all
        tl.store(out_ptrs, tl.zeros([BLOCK_D], dtype=tl.float32).to(out_ptr.dtype.element_ty), mask=mask_d)
        return

    state_ptrs = state_ptr + slot * stride_state_slot + offs_d * stride_state_d
    weight_ptrs = weight_ptr + offs_d * stride_weight_d
    # The new column, rounded to the state's dtype as the reference's window is.
    x_new = tl.load(x_ptr + pid_b * stride_x_b + offs_d * stride_x_d, mask=mask_d, other=0.0)
    x_new = x_new.to(state_ptr.dtype.element_ty)

    if HAS_BIAS:
        acc = tl.load(bias_ptr + offs_d * stride_bias_d, mask=mask_d, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    # Walk the window oldest first: read column j + 1 before overwriting column j with it, so each state
    # element is read before it is written, by the same thread.
    cur = tl.load(state_ptrs, mask=mask_d, other=0.0)
    for j in tl.static_range(WIDTH - 1):
        if j + 1 < WIDTH - 1:
            nxt = tl.load(state_ptrs + (j + 1) * stride_state_w, mask=mask_d, other=0.0)
        else:
            nxt = x_new
        w_j = tl.load(weight_ptrs + j * stride_weight_w, mask=mask_d, other=0.0)
        acc += cur.to(tl.float32) * w_j.to(tl.float32)
        tl.store(state_ptrs + j * stride_state_w, nxt, mask=mask_d)
        cur = nxt
    w_last = tl.load(weight_ptrs + (WIDTH - 1) * stride_weight_w, mask=mask_d, other=0.0)
    acc += cur.to(tl.float32) * w_last.to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask_d)


def causal_conv1d_update_triton(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state_indices: torch.Tensor,
    silu: bool = True,
) -> torch.Tensor:
    """Triton version of `causal_conv1d_update_ref`: same contract, one program per (row, channel block).

    Shapes (b = batch rows, S = slots, d = channels, w = kernel width, w >= 2):
      x [b, d] fp32 or bf16
      conv_state [S, d, w - 1] (the last w - 1 inputs, oldest first; any strides), usually x's dtype,
        mutated in place for rows whose index is >= 0: shifted left by one, x appended
      weight [d, w], any float dtype
      bias [d] or None
      state_indices [b] int64 or int32, the slot of each row, -1 for a padding row
    Returns [b, d] in x's dtype. The window is rounded to conv_state's dtype like the reference's, then
    multiplied and summed in fp32. A padding row gets zeros and never reads or writes state. Rows with an
    index >= 0 must name distinct slots (the scheduler's invariant).
    """
    if triton is None:
        raise RuntimeError("Triton is not installed; use causal_conv1d_update_ref")
    b, d = x.shape
    if weight.dim() != 2 or weight.shape[0] != d or weight.shape[1] < 2:
        raise ValueError(f"weight must be [d, w] with w >= 2, got {tuple(weight.shape)} for d={d}")
    width = weight.shape[1]
    if conv_state.dim() != 3 or conv_state.shape[1:] != (d, width - 1):
        raise ValueError(f"conv_state {tuple(conv_state.shape)} must be [S, {d}, {width - 1}]")
    if bias is not None and bias.shape != (d,):
        raise ValueError(f"bias must be [d], got {tuple(bias.shape)}")
    if state_indices.shape != (b,):
        raise ValueError("state_indices must be [b]")
    out = torch.empty_like(x)
    if b == 0:
        return out
    block_d = min(256, triton.next_power_of_2(d))
    grid = (triton.cdiv(d, block_d), b)
    with on_device(x):
        _causal_conv1d_update_kernel[grid](
            x,
            conv_state,
            weight,
            bias if bias is not None else weight,
            state_indices,
            out,
            d,
            *x.stride(),
            *conv_state.stride(),
            *weight.stride(),
            bias.stride(0) if bias is not None else 0,
            state_indices.stride(0),
            *out.stride(),
            WIDTH=width,
            HAS_BIAS=bias is not None,
            SILU=silu,
            BLOCK_D=block_d,
            num_warps=4,
        )
    return out


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state_indices: torch.Tensor,
    silu: bool = True,
) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA, the reference elsewhere. Same contract as the reference."""
    if triton is not None and x.is_cuda:
        return causal_conv1d_update_triton(x, conv_state, weight, bias, state_indices, silu)
    if x.is_meta:  # memory planning (engine/memory.py): the kernel allocates its output only
        return torch.empty_like(x)
    return causal_conv1d_update_ref(x, conv_state, weight, bias, state_indices, silu)
