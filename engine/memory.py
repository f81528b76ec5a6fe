"""Peak device memory predicted without a device: what `engine info` sizes (weights, derived buffers, per-slot
state) plus the transient memory of the engine's largest step, traced on the `meta` device.

`transient_bytes(fn, args, held)` runs a step on meta tensors under a dispatch mode that follows every storage
the step allocates (outputs and temporaries) from the op that makes it until it is freed, and returns the most
bytes alive at once beyond the `held` tensors (weights, state, inputs), which in-place ops update without
allocating. `step_peaks` traces the live step at N slots and the slack work's largest buckets;
`predict_peak_bytes` adds the largest of them to the resident memory. On a GPU the caching allocator rounds
each block up to 512 bytes, and a CUDA graph keeps its capture's transient memory in its pool: the peak that
`torch.cuda.max_memory_allocated` reports is the resident memory plus the largest capture's transient, which
is what this predicts. Knows torch and the pipeline's steps; knows nothing of sessions or time.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from engine.config.dtype_policy import DtypePolicy
from engine.config.stage_config import ModelConfig
from engine.sizing.info import GB, needed_bytes

ALLOCATION_GRANULE = 512  # the CUDA caching allocator's block rounding


class _Tracker(TorchDispatchMode):
    def __init__(self, held: Iterable[torch.Tensor], granule: int) -> None:
        super().__init__()
        self.granule = granule
        self._held = {id(s): s for s in (t.untyped_storage() for t in held)}  # strong refs: ids stay unique
        self._live: dict[int, int] = {}
        self.now = self.peak = 0

    def _free(self, key: int) -> None:
        self.now -= self._live.pop(key, 0)

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._held or key in self._live:
            return
        n = -(-storage.nbytes() // self.granule) * self.granule
        self._live[key] = n
        self.now += n
        self.peak = max(self.peak, self.now)
        weakref.finalize(storage, self._free, key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


def transient_bytes(
    fn: Callable[..., Any], args: Sequence[Any], held: Iterable[torch.Tensor], granule: int = 1
) -> int:
    """The most bytes a call of `fn(*args)` holds at once in storages it allocates itself (each rounded up to
    `granule`), its outputs included while they are alive; storages of `held` tensors are not counted."""
    tracker = _Tracker([*held, *(a for a in args if isinstance(a, torch.Tensor))], granule)
    with tracker:
        out = fn(*args)
    del out
    return tracker.peak


def step_peaks(
    cfg: ModelConfig,
    dtypes: DtypePolicy,
    num_slots: int,
    granule: int = ALLOCATION_GRANULE,
    live_only: bool = False,
) -> dict[str, int]:
    """Transient bytes of each kind of step the engine runs, traced on meta tensors at the preset's shape: the
    live step over `num_slots` slots, and the slack work's largest buckets as the runner pads and splits
    them (engine/tick/runner.py): tool-call steps and replay over every slot (a replay piece of each
    power-of-two number of frames up to MAX_REPLAY_FRAMES: its k frames' embeddings live at once), and for
    each power-of-two number of rows up to MAX_PREFILL_ROWS the longest prefill piece it runs; and, from
    building the pipeline, the talker's refresh of its derived tables. `live_only`: the live step alone."""
    from engine.model.pipeline import Pipeline, live_inputs
    from engine.text.tokens import Tokens
    from engine.tick.buckets import MAX_REPLAY_FRAMES
    from engine.tick.graph import pow2_at_least
    from engine.tick.runner import MAX_PREFILL_ROWS, longest_prefill_piece

    with torch.device("meta"):
        p = Pipeline(cfg, num_slots, Tokens(cfg.tokens), dtypes).eval()
    held = [*p.parameters(), *p.buffers()]
    meta = torch.device("meta")
    live = live_inputs(cfg, num_slots, meta)
    most = pow2_at_least(num_slots)

    def slots(b: int) -> torch.Tensor:
        return torch.full((b,), -1, dtype=torch.long, device=meta)

    steps = {"live": (p.live_step, live)}
    if not live_only:
        steps["call"] = (p.call_step, (slots(most), slots(most)))
        steps["replay"] = (p.replay_step, (live[0], live[1], slots(most)))
        frames = 2
        while frames <= MAX_REPLAY_FRAMES:
            audio, active = (t.expand(frames, *t.shape) for t in live[:2])
            steps[f"replay {frames} frames"] = (p.replay_frames, (audio, active, slots(most)))
            frames *= 2
        rows = 1
        while rows <= min(most, MAX_PREFILL_ROWS):
            t = longest_prefill_piece(rows, cfg.thinker.attention_window)
            ids = torch.zeros(rows, t, dtype=torch.long, device=meta)
            steps[f"prefill {rows}x{t}"] = (p.prefill_prompt, (slots(rows), ids))
            rows *= 2
        # building: the talker's derived tables, with every weight and state buffer in place
        steps["talker refresh"] = (p.talker.refresh, ())
    out = {}
    with torch.inference_mode():
        for name, (fn, args) in steps.items():
            out[name] = transient_bytes(fn, args, held, granule)
    return out


def predict_peak_bytes(
    cfg: ModelConfig, dtypes: DtypePolicy, num_slots: int, live_only: bool = False
) -> tuple[int, dict[str, int]]:
    """Peak device memory of a pipeline with `num_slots` slots that has run its steps (`live_only`: the live
    step alone, as the benches run it): weights, derived buffers, state, and the largest step's transient
    memory. Returns (bytes, parts)."""
    return _peak(cfg, dtypes, num_slots, step_peaks(cfg, dtypes, num_slots, live_only=live_only))


def _peak(
    cfg: ModelConfig, dtypes: DtypePolicy, num_slots: int, peaks: dict[str, int]
) -> tuple[int, dict[str, int]]:
    _, parts = needed_bytes(cfg, dtypes, num_slots, workspace=False)
    parts["largest transient"] = max(peaks.values())
    return sum(parts.values()), parts


def peak_report(cfg: ModelConfig, info: dict, num_slots: int) -> dict:
    """The predicted peak with `num_slots` slots, under the policy of `info` (an `engine info` report)."""
    policy = DtypePolicy(**info["dtype_policy"])
    peaks = step_peaks(cfg, policy, num_slots)
    total, parts = _peak(cfg, policy, num_slots, peaks)
    return {
        "slots": num_slots,
        "bytes": total,
        "parts": parts,
        "step_transient_bytes": peaks,
        # --gpu-mem-gb is in GB (engine/sizing/info.py); 1 GiB kept for CUDA's own allocations
        "fits": total + int(1.0 * 2**30) <= info["gpu_mem_gb"] * GB,
    }


def print_peak(r: dict) -> None:
    detail = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in r["parts"].items())
    steps = ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in r["step_transient_bytes"].items())
    print(
        f"predicted peak device memory with {r['slots']} slots (torch.cuda.max_memory_allocated): "
        f"{r['bytes'] / 2**30:.2f} GiB ({detail})"
    )
    print(f"  transient memory per step: {steps}")
