"""The slot-state contract every stage follows (moshi's `StreamingModule` states, mamba's padding row).

- **Slot-first buffers.** All of a stage's per-slot state is in the buffers `slot_state()` lists, each with
  the slot on dim 0: row `i` is slot `i`, for `num_slots` rows, then `scratch_rows` more that no session owns
  (the thinker's padding row, where the rows of a padded batch write). Nothing else changes as slots run.
- **`reset(mask)`** returns the masked slots ([num_slots] bool) to the state of a fresh stage.
- **`save_slot(slot)` / `load_slot(slot, saved)`** copy one slot's whole state out and into any slot, which
  then continues exactly as the saved one would have (a shared system prompt is prefilled once).
- **`step(..., exec_mask)`**: every row is computed (fixed shapes), only the rows where `exec_mask` is set
  advance their state. The thinker's step also takes a batch of slot indices with -1 for padding rows.

Memory accounting (`engine info`), prompt sharing and graph capture rely on nothing else. Knows tensors;
knows nothing of the model.
"""

from __future__ import annotations

import torch


class SlotState:
    """Mixin for a stage: the contract's generic half over the stage's `slot_state()` buffers."""

    num_slots: int
    scratch_rows: int = 0

    def slot_state(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def reset(self, mask: torch.Tensor) -> None:
        raise NotImplementedError

    def check_mask(self, mask: torch.Tensor, name: str = "mask") -> None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != (self.num_slots,):
            got = (
                f"{mask.dtype} {list(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
            )
            raise ValueError(f"{name}: expected a bool tensor of shape [{self.num_slots}], got {got}")

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot: expected 0..{self.num_slots - 1}, got {slot}")

    def save_slot(self, slot: int) -> list[torch.Tensor]:
        """A copy of one slot's whole state, for `load_slot`."""
        self._check_slot(slot)
        return [t[slot].clone() for t in self.slot_state()]

    def load_slot(self, slot: int, saved: list[torch.Tensor]) -> None:
        """Give `slot` the state `save_slot` copied (from any slot of a stage built alike)."""
        self._check_slot(slot)
        state = self.slot_state()
        if len(saved) != len(state) or any(
            v.shape != t.shape[1:] for t, v in zip(state, saved, strict=False)
        ):
            raise ValueError("load_slot: the saved state is not this stage's (other buffers or shapes)")
        for t, v in zip(state, saved, strict=True):
            t[slot].copy_(v)

    def slot_bytes(self) -> int:
        """Bytes of one row of state (one session's, or one scratch row's)."""
        return sum(t.nbytes // t.shape[0] for t in self.slot_state())

    def check_slot_state(self) -> None:
        """Every state buffer is slot-first with `num_slots + scratch_rows` rows (raises otherwise)."""
        rows = self.num_slots + self.scratch_rows
        bad = [tuple(t.shape) for t in self.slot_state() if t.dim() == 0 or t.shape[0] != rows]
        if bad:
            raise AssertionError(
                f"{type(self).__name__}: state buffers not slot-first with {rows} rows: {bad}"
            )


def ring_write(cache: torch.Tensor, index: torch.Tensor, value: torch.Tensor, keep: torch.Tensor) -> None:
    """Write one entry per row into a KV ring, for the kept rows only (no host sync, fixed shapes).

    cache [r, h, n, d]; index [r, h, 1, d] int64, the ring entry of each row (expanded); value [r, h, d];
    keep [r, 1, 1, 1] bool. Rows not kept rewrite the entry they already hold."""
    cache.scatter_(2, index, torch.where(keep, value[:, :, None].to(cache.dtype), cache.gather(2, index)))
