"""Exact, deterministic scatter of batch rows into slot-indexed state (used by the plain-torch references)."""

from __future__ import annotations

import torch


def write_rows(state: torch.Tensor, state_indices: torch.Tensor, rows: torch.Tensor) -> None:
    """state[state_indices[i]] = rows[i] for every i with state_indices[i] >= 0; no host sync.

    Padding rows (-1) write nothing, even when another row targets the slot they would clamp to.
    """
    b = state_indices.shape[0]
    owner = torch.full((state.shape[0],), -1, dtype=torch.long, device=state.device)
    row_ids = torch.arange(b, device=state.device)
    owner.scatter_reduce_(
        0, state_indices.clamp(min=0), torch.where(state_indices >= 0, row_ids, -1), reduce="amax"
    )
    picked = rows.index_select(0, owner.clamp(min=0))
    picked = picked if picked.dtype == state.dtype else picked.to(state.dtype)
    mask = (owner >= 0).view(-1, *([1] * (state.dim() - 1)))
    torch.where(mask, picked, state, out=state)
