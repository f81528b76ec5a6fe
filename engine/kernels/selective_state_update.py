"""Mamba2 selective state update for one token over slot-indexed state.

Knows tensors only. `selective_state_update` dispatches to the Triton kernel (`selective_state_update_triton`)
on CUDA and to the plain-torch `selective_state_update_ref` elsewhere. Triton is imported guarded, so this
module imports (and the reference runs) where Triton is missing. A batch names its slots by index, -1 for a
row that neither reads nor writes state; the live batch is row i on slot i (`slot_state.live_rows`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels._rows import write_rows
from engine.kernels._triton import jit as _jit
from engine.kernels._triton import on_device, tl, triton


def selective_state_update_ref(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    state_indices: torch.Tensor,
    dt_min: float = 0.0,
    dt_max: float = float("inf"),
    a_log: bool = False,
) -> torch.Tensor:
    """One Mamba2 recurrence step, updating `state` in place.

    Shapes (b = batch rows, S = slots, h = heads, p = head dim, g = groups, n = state size):
      state [S, h, p, n] fp32, mutated for rows whose index is >= 0
      x [b, h, p]; dt [b, h] (before bias and softplus); A [h] (negative); B, C [b, g, n]; D [h];
      dt_bias [h]; state_indices [b] int64, the slot of each row, -1 for a padding row.
    Returns y [b, h, p] in x's dtype; padding rows give zeros and leave every slot untouched. Rows with an
    index >= 0 should name distinct slots (a repeated one is written by its last row). With `a_log`, A is
    given as the checkpoint's `A_log` and the step takes `-exp(A_log)` itself (in the kernel, on CUDA).
    """
    if a_log:
        A = -torch.exp(A.float())
    h = x.shape[1]
    g = B.shape[1]
    valid = state_indices >= 0
    dt = F.softplus(dt.float() + dt_bias.float()).clamp(dt_min, dt_max)  # [b, h]
    dA = torch.exp(dt * A.float())  # [b, h]
    Bh = B.float().repeat_interleave(h // g, dim=1)  # [b, h, n]
    Ch = C.float().repeat_interleave(h // g, dim=1)
    s = state.index_select(0, state_indices.clamp(min=0))  # [b, h, p, n]
    s = s * dA[:, :, None, None] + (dt[:, :, None] * x.float())[..., None] * Bh[:, :, None, :]
    y = torch.matmul(s, Ch[:, :, :, None])[..., 0] + D.float()[None, :, None] * x.float()
    write_rows(state, state_indices, s)
    return torch.where(valid[:, None, None], y, 0.0).to(x.dtype)


@_jit
def _selective_state_update_kernel(
    state_ptr,
    x_ptr,
    dt_ptr,
    A_ptr,
    B_ptr,
    C_ptr,
    D_ptr,
    dt_bias_ptr,
    idx_ptr,
    out_ptr,
    dim,
    dstate,
    heads_per_group,
    dt_min,
    dt_max,
    stride_state_slot,
    stride_state_head,
    stride_state_dim,
    stride_state_n,
    stride_x_b,
    stride_x_h,
    stride_x_p,
    stride_dt_b,
    stride_dt_h,
    stride_A_h,
    stride_B_b,
    stride_B_g,
    stride_B_n,
    stride_C_b,
    stride_C_g,
    stride_C_n,
    stride_D_h,
    stride_dt_bias_h,
    stride_idx_b,
    stride_out_b,
    stride_out_h,
    stride_out_p,
    A_LOG: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    # One program per (block of head dim, batch row, head).
    pid_p = tl.program_id(0)
    pid_b = tl.program_id(1)
    pid_h = tl.program_id(2)
    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < dim
    mask_n = offs_n < dstate
    out_ptrs = out_ptr + pid_b * stride_out_b + pid_h * stride_out_h + offs_p * stride_out_p

    slot = tl.load(idx_ptr + pid_b * stride_idx_b).to(tl.int64)
    if slot < 0:  # padding row: zero output, no state access at all
        tl.store(out_ptrs, tl.zeros([BLOCK_P], dtype=tl.float32).to(out_ptr.dtype.element_ty), mask=mask_p)
        return

    group = pid_h // heads_per_group
    state_ptrs = (
        state_ptr
        + slot * stride_state_slot
        + pid_h * stride_state_head
        + offs_p[:, None] * stride_state_dim
        + offs_n[None, :] * stride_state_n
    )
    mask_s = mask_p[:, None] & mask_n[None, :]
    s = tl.load(state_ptrs, mask=mask_s, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + pid_b * stride_x_b + pid_h * stride_x_h + offs_p * stride_x_p, mask=mask_p, other=0.0)
    x = x.to(tl.float32)

    dt = tl.load(dt_ptr + pid_b * stride_dt_b + pid_h * stride_dt_h).to(tl.float32)
    dt = dt + tl.load(dt_bias_ptr + pid_h * stride_dt_bias_h).to(tl.float32)
    # softplus with torch's threshold (identity above 20); log1p(e) as log(u) * e / (u - 1), u = 1 + e,
    # which stays accurate when e is tiny.
    e = tl.exp(tl.minimum(dt, 20.0))
    u = 1.0 + e
    log1p_e = tl.where(u == 1.0, e, tl.log(u) * (e / tl.where(u == 1.0, 1.0, u - 1.0)))
    dt = tl.where(dt <= 20.0, log1p_e, dt)
    dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    A = tl.load(A_ptr + pid_h * stride_A_h).to(tl.float32)
    if A_LOG:
        A = -tl.exp(A)
    dA = tl.exp(dt * A)

    B = tl.load(B_ptr + pid_b * stride_B_b + group * stride_B_g + offs_n * stride_B_n, mask=mask_n, other=0.0)
    C = tl.load(C_ptr + pid_b * stride_C_b + group * stride_C_g + offs_n * stride_C_n, mask=mask_n, other=0.0)
    dtx = dt * x
    s = s * dA + dtx[:, None] * B.to(tl.float32)[None, :]
    tl.store(state_ptrs, s.to(state_ptr.dtype.element_ty), mask=mask_s)

    y = tl.sum(s * C.to(tl.float32)[None, :], axis=1)
    y = y + tl.load(D_ptr + pid_h * stride_D_h).to(tl.float32) * x
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=mask_p)


def selective_state_update_triton(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    state_indices: torch.Tensor,
    dt_min: float = 0.0,
    dt_max: float = float("inf"),
    a_log: bool = False,
) -> torch.Tensor:
    """Triton version of `selective_state_update_ref`: same contract, one program per (row, head, p block).

    Shapes (b = batch rows, S = slots, h = heads, p = head dim, g = groups, n = state size):
      state [S, h, p, n] fp32 (any strides), mutated in place for rows whose index is >= 0
      x [b, h, p] fp32 or bf16
      dt [b, h] (before bias and softplus), any float dtype
      A [h] (negative), D [h], dt_bias [h], any float dtype
      B, C [b, g, n], any float dtype; head i uses group i // (h // g)
      state_indices [b] int64 or int32, the slot of each row, -1 for a padding row
    Returns y [b, h, p] in x's dtype. Arithmetic is fp32. A padding row gets zeros and never reads or
    writes state. Rows with an index >= 0 must name distinct slots (the scheduler's invariant); the
    reference lets the last such row win, the kernel would race.
    """
    if triton is None:
        raise RuntimeError("Triton is not installed; use selective_state_update_ref")
    b, h, p = x.shape
    n = state.shape[-1]
    g = B.shape[1]
    if state.dim() != 4 or state.shape[1:] != (h, p, n):
        raise ValueError(f"state {tuple(state.shape)} does not match x {tuple(x.shape)}")
    if state.dtype != torch.float32:
        raise ValueError(f"state must be fp32, got {state.dtype}")
    if dt.shape != (b, h) or A.shape != (h,) or D.shape != (h,) or dt_bias.shape != (h,):
        raise ValueError("dt must be [b, h] and A, D, dt_bias [h]")
    if B.shape != (b, g, n) or C.shape != (b, g, n) or h % g != 0:
        raise ValueError(f"B, C must be [b, g, n] with g dividing h, got {tuple(B.shape)}, {tuple(C.shape)}")
    if state_indices.shape != (b,):
        raise ValueError("state_indices must be [b]")
    out = torch.empty_like(x)
    if b == 0:
        return out
    block_n = triton.next_power_of_2(n)
    # mamba_ssm's choice: fewer head-dim rows per program as the state row grows.
    block_p, num_warps = (
        (32, 4) if n <= 16 else (16, 4) if n <= 32 else (8, 4) if n <= 64 else (4, 4) if n <= 128 else (4, 8)
    )
    grid = (triton.cdiv(p, block_p), b, h)
    with on_device(x):
        _selective_state_update_kernel[grid](
            state,
            x,
            dt,
            A,
            B,
            C,
            D,
            dt_bias,
            state_indices,
            out,
            p,
            n,
            h // g,
            float(dt_min),
            float(dt_max),
            *state.stride(),
            *x.stride(),
            *dt.stride(),
            A.stride(0),
            *B.stride(),
            *C.stride(),
            D.stride(0),
            dt_bias.stride(0),
            state_indices.stride(0),
            *out.stride(),
            A_LOG=a_log,
            BLOCK_P=block_p,
            BLOCK_N=block_n,
            num_warps=num_warps,
        )
    return out


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    dt_bias: torch.Tensor,
    state_indices: torch.Tensor,
    dt_min: float = 0.0,
    dt_max: float = float("inf"),
    a_log: bool = False,
) -> torch.Tensor:
    """Dispatch: the Triton kernel on CUDA, the reference elsewhere. Same contract as the reference."""
    if triton is not None and x.is_cuda:
        return selective_state_update_triton(
            state, x, dt, A, B, C, D, dt_bias, state_indices, dt_min, dt_max, a_log
        )
    if x.is_meta:  # memory planning (engine/memory.py): the kernel allocates its output only
        return torch.empty_like(x)
    return selective_state_update_ref(state, x, dt, A, B, C, D, dt_bias, state_indices, dt_min, dt_max, a_log)
