"""Perception over a few of its slots: the rows' streaming state gathered into a batch of their own, stepped,
and written back.

The live step runs perception over every slot (fixed shapes, one graph). Replay of held caller audio is slack
work for the few sessions back from a tool: run over every slot, its cost would not scale with the rows it
replays. `PerceptionRows(perception, b)` is perception's own step over `b` rows: the same modules and weights,
and for state the rows' state gathered from the full buffers (`index_select`) before the step and written back
after it (`index_copy_`). Rows are distinct slots; a row outside the step's mask keeps its state, so padding
rows (other slots) are written back unchanged. Under a CUDA graph the gathered rows are the graph's own
memory, fixed at capture; engine/memory.py traces them as the replay step's transient memory. Knows the
slot-state contract (engine/model/slot_state.py); nothing of the stages but that perception keeps its state
on itself.
"""

from __future__ import annotations

import copy

import torch

from engine.model.perception import Perception


class PerceptionRows:
    """`perception`'s step over `rows` distinct slots at a time."""

    def __init__(self, perception: Perception, rows: int) -> None:
        if rows < 1:
            raise ValueError(f"rows: expected at least 1, got {rows}")
        self.full = perception.slot_state()
        if any("." in name for name in self.full):
            raise ValueError(
                "perception keeps slot state in a submodule: PerceptionRows gathers its own only"
            )
        # the same modules and constants; `_buffers` a dict of its own, so the rows' state can stand in it
        self.view = copy.copy(perception)
        object.__setattr__(self.view, "_buffers", dict(perception._buffers))
        object.__setattr__(self.view, "num_slots", rows)
        self.rows = rows

    def step(self, audio: torch.Tensor, exec_mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """audio [rows, samples] and exec_mask [rows] bool for the slots `rows` [rows] (distinct) ->
        [rows, out_dim]: `Perception.step` over those rows, their state updated where the mask is set."""
        return self.steps(audio.unsqueeze(0), exec_mask.unsqueeze(0), rows)[0]

    def steps(self, audio: torch.Tensor, exec_mask: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """audio [k, rows, samples] and exec_mask [k, rows] bool -> [k, rows, out_dim]: k `Perception.step`s
        in order over the slots `rows`, their state gathered once before the first and written back once
        after the last (the same as k gathered steps: the copies are exact)."""
        buffers = self.view._buffers
        for name, full in self.full.items():
            buffers[name] = full.index_select(0, rows)
        try:
            out = torch.stack([self.view.step(audio[j], exec_mask[j]) for j in range(audio.shape[0])])
            for name, full in self.full.items():
                full.index_copy_(0, rows, buffers[name])
        finally:
            for name, full in self.full.items():  # nothing of the gathered rows outlives the step
                buffers[name] = full
        return out
