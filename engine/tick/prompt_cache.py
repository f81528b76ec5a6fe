"""The prompt cache: the slot state each prefilled system prompt leaves, by prompt key, the least recently
used evicted past its size. One object, which the runner fills and loads from and the scheduler consults.

Knows keys and opaque states (a dict of tensors by name, from `save_slot`); nothing of sessions or the model.
"""

from __future__ import annotations

from collections import OrderedDict


class PromptCache:
    """Written by the tick thread only (`save`, `load`); `keys` is a frozen copy replaced whole on every
    change, so other threads (admission) read it without a lock."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._states: OrderedDict[int, dict] = OrderedDict()
        self.keys: frozenset[int] = frozenset()
        self.evicted = 0  # states dropped for room

    def __contains__(self, key: int) -> bool:
        return key in self._states

    def __len__(self) -> int:
        return len(self._states)

    def save(self, key: int, state: dict) -> None:
        """Keep `state` for `key`, the most recently used; the least recently used go past `size`."""
        self._states[key] = state
        self._states.move_to_end(key)
        while len(self._states) > self.size:
            self._states.popitem(last=False)
            self.evicted += 1
        self.keys = frozenset(self._states)

    def load(self, key: int) -> dict:
        """The state saved for `key`, now the most recently used."""
        self._states.move_to_end(key)
        return self._states[key]
