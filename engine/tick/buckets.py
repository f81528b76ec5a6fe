"""The shapes slack work runs at: a piece's rows padded to a power of two, a prefill's rows in groups of at
most MAX_PREFILL_ROWS and its positions in power-of-two pieces, each bounded in rows x positions (its memory).
One step (on CUDA one graph) per bucket `(kind, rows, positions)`: the runner runs them, the cost model
predicts a piece as the sum of its buckets. Pure arithmetic.
"""

from __future__ import annotations

from engine.tick.graph import pow2_at_least, pow2_pieces

# one prefill forward's rows, and rows x positions: they bound its transient memory (engine/memory.py
# traces it: about 0.6 GiB at the 11B shape)
MAX_PREFILL_ROWS = 8
MAX_PREFILL_POSITIONS = 512
# held caller frames one replay piece gives each of its rows (a power of two): its frames are replayed in
# order over the rows' gathered state, so a session back from a tool catches up faster than its audio comes
MAX_REPLAY_FRAMES = 4


def prefill_pieces(positions: int, rows: int, max_positions: int = MAX_PREFILL_POSITIONS) -> list[int]:
    """A prefill chunk of `positions` for `rows` padded rows as the lengths of its forwards: powers of two,
    each with rows x length <= max_positions (one position a forward at the least)."""
    cap = max(1, 1 << max(0, (max_positions // rows).bit_length() - 1))
    whole, rest = divmod(positions, cap)
    return [cap] * whole + (pow2_pieces(rest) if rest else [])


def longest_prefill_piece(rows: int, max_chunk: int) -> int:
    """The most positions one prefill forward of `rows` padded rows takes, for chunks of at most
    `max_chunk`."""
    return max(prefill_pieces(max_chunk, rows))


def work_buckets(kind: str, b: int, t: int = 1) -> list[tuple[str, int, int]]:
    """The buckets one piece of `kind` over `b` rows and `t` positions (a replay's: frames) runs, in
    order."""
    if kind == "replay":
        return [(kind, pow2_at_least(b), t)]
    if kind not in ("result", "prompt"):
        return [(kind, pow2_at_least(b), 1)]
    out = []
    for first in range(0, b, MAX_PREFILL_ROWS):
        rows = pow2_at_least(min(b, first + MAX_PREFILL_ROWS) - first)
        out += [(kind, rows, p) for p in prefill_pieces(t, rows)]
    return out
