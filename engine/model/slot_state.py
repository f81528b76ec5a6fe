"""The slot-state contract every stage follows (moshi's `StreamingModule` states, mamba's padding index).

- **Named, slot-first state.** A stage's per-slot state is the buffers its modules declare with
  `register_slot_state(module, name, tensor)`; `slot_state()` gives them all by dotted name, as
  `named_buffers()` names them. Each has the slot on dim 0: row `i` is slot `i`, for `num_slots` rows, then
  `scratch_rows` more that no session owns (the thinker's scratch row). Nothing else changes as slots run.
- **`reset(mask)`** returns the masked slots ([num_slots] bool) to the state of a fresh stage, between steps
  and without a host sync.
- **`save_slot(slot)` / `load_slot(slot, saved)`** copy one slot's whole state out, as a dict by name, and
  into any slot of a stage built alike (names and shapes are checked), which then continues exactly as the
  saved one would have (a shared system prompt is prefilled once).
- **The live form, `step(inputs, exec_mask)`**, serves the live batch of every stage: row `i` is slot `i`,
  every row is computed (fixed shapes), and only the rows where `exec_mask` is set advance their state. The
  one way a row outside the mask keeps its state: every write selects, by the mask, between the new value and
  the one held, for whole rows (`keep_rows`) or for the one ring entry a step writes (`ring_write`). Kernels
  take the mask as slot indices (`live_rows`: -1 for a row they neither read nor write) and write the same
  way. `check_mask` is the one check of a mask.
- **The slot-index form, `step_rows(inputs, slots)`**, is the thinker's for slack work only (tool-call
  tokens, prefill, replay): a batch of slot indices with -1 for padding rows, which are computed on the
  scratch row.

Memory accounting (`engine info`), prompt sharing and graph capture rely on nothing else. Knows tensors;
knows nothing of the model.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.kernels.ring_write import ring_write_kv

_NAMES = "_slot_state_names"  # per module: the names of its buffers that are per-slot state


def register_slot_state(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Register `tensor` (slot-first) as the non-persistent buffer `name` of `module`, declared per-slot
    state: it never reaches a checkpoint, and the stage's `slot_state()` lists it."""
    module.register_buffer(name, tensor, persistent=False)
    vars(module).setdefault(_NAMES, []).append(name)


class SlotState:
    """Mixin for a stage (an `nn.Module`): the contract's generic half over the state its modules declare."""

    num_slots: int
    scratch_rows: int = 0

    def slot_state(self) -> dict[str, torch.Tensor]:
        """Every per-slot state buffer of the stage, by its dotted name under the stage."""
        out: dict[str, torch.Tensor] = {}
        for prefix, module in self.named_modules():  # type: ignore[attr-defined]
            for name in vars(module).get(_NAMES, ()):
                out[f"{prefix}.{name}" if prefix else name] = module._buffers[name]
        return out

    def reset(self, mask: torch.Tensor) -> None:
        raise NotImplementedError

    def check_mask(self, mask: torch.Tensor, name: str = "mask") -> None:
        """`mask` is a bool tensor of shape [num_slots] (raises ValueError naming it otherwise)."""
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != (self.num_slots,):
            got = (
                f"{mask.dtype} {list(mask.shape)}" if isinstance(mask, torch.Tensor) else type(mask).__name__
            )
            raise ValueError(f"{name}: expected a bool tensor of shape [{self.num_slots}], got {got}")

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot: expected 0..{self.num_slots - 1}, got {slot}")

    def save_slot(self, slot: int) -> dict[str, torch.Tensor]:
        """A copy of one slot's whole state, by name, for `load_slot`."""
        self._check_slot(slot)
        return {name: t[slot].clone() for name, t in self.slot_state().items()}

    def load_slot(self, slot: int, saved: dict[str, torch.Tensor]) -> None:
        """Give `slot` the state `save_slot` copied (from any slot of a stage built alike)."""
        self._check_slot(slot)
        state = self.slot_state()
        if not isinstance(saved, dict):
            raise ValueError(f"load_slot: expected the dict save_slot returns, got {type(saved).__name__}")
        missing = [n for n in state if n not in saved]
        unknown = [n for n in saved if n not in state]
        wrong = [
            f"{n} {saved[n].dtype} {list(saved[n].shape)} (expected {t.dtype} {list(t.shape[1:])})"
            for n, t in state.items()
            if n in saved and (saved[n].shape != t.shape[1:] or saved[n].dtype != t.dtype)
        ]
        if missing or unknown or wrong:
            raise ValueError(
                f"load_slot: the saved state is not this stage's ({type(self).__name__}): "
                f"missing {missing}, unknown {unknown}, wrong {wrong}"
            )
        for name, t in state.items():
            t[slot].copy_(saved[name])

    def slot_bytes(self) -> int:
        """Bytes of one row of state (one session's, or one scratch row's)."""
        return sum(t.nbytes // t.shape[0] for t in self.slot_state().values())

    def check_slot_state(self) -> None:
        """Every state buffer is slot-first with `num_slots + scratch_rows` rows (raises otherwise)."""
        rows = self.num_slots + self.scratch_rows
        bad = {n: tuple(t.shape) for n, t in self.slot_state().items() if t.dim() == 0 or t.shape[0] != rows}
        if bad:
            raise AssertionError(
                f"{type(self).__name__}: state buffers not slot-first with {rows} rows: {bad}"
            )


def live_rows(exec_mask: torch.Tensor) -> torch.Tensor:
    """The live batch's mask as the kernels' slot indices: row i on slot i, -1 where the mask is off."""
    return torch.where(exec_mask, torch.arange(exec_mask.shape[0], device=exec_mask.device), -1)


def keep_rows(state: torch.Tensor, new: torch.Tensor, exec_mask: torch.Tensor) -> None:
    """The live form's write: state[i] = new[i] where exec_mask[i], in place; other rows keep theirs.

    state [r, ...]; new broadcastable to it; exec_mask [r] bool. No host sync, fixed shapes."""
    keep = exec_mask.view(-1, *([1] * (state.dim() - 1))) if state.dim() > 1 else exec_mask
    torch.where(keep, new if new.dtype == state.dtype else new.to(state.dtype), state, out=state)


# the live form's write of one key and one value per row into a pair of KV rings at each row's entry, rows
# outside the mask untouched: one kernel for both rings on CUDA (engine/kernels/ring_write.py)
ring_write = ring_write_kv
