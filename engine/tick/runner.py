"""Executes the scheduler's plans on the model: numpy in, one batched call, numpy out.

Inputs are copied into device buffers allocated once; the live step runs over them (one CUDA graph on CUDA,
engine/tick/graph.py) and makes exactly one host transfer back (text, function tokens and audio of every slot
together). Slack work runs at fixed shapes too, one graph per bucket: rows padded to a power of two, a
prefill split into groups of rows and power-of-two pieces of positions, which bound its memory. Knows the
pipeline and the plan types.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from functools import partial

import numpy as np
import torch

from engine.model.pipeline import PROMPT_STAGES, LiveOutput, Pipeline, all_inactive
from engine.tick.buckets import MAX_PREFILL_ROWS, MAX_REPLAY_FRAMES, longest_prefill_piece, prefill_pieces
from engine.tick.device_time import device_times
from engine.tick.graph import StepGraph, StepGraphs, pow2_at_least
from engine.tick.plan import LivePlan, LiveResult, ToolResult, ToolWork
from engine.tick.prompt_cache import PromptCache

__all__ = ["MAX_PREFILL_ROWS", "Runner", "longest_prefill_piece", "prefill_pieces"]

TRACE_WARMUP = 3  # runs of a traced step before it serves


class _Traces:
    """TorchScript keeps the classes of every module it traces, with their compiled methods and executors, in
    one compilation unit for the whole process (pytorch#43119, #35600): about 50 MB for a tiny engine that
    dropping the traced module never frees, so a process that builds engine after engine (the test suite, a
    sweep) grows by that much each time. When the last traced step is gone and the unit holds nothing but what
    the traces put there, it is cleared; anything else in it (another library's scripts) keeps it as it is:
    clearing would pull their methods from under them."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # re-entered by a finalizer that a collection runs inside a trace
        self.live = 0
        self._ours = 0  # functions the traces added to the unit since it was last cleared

    @staticmethod
    def _in_unit() -> int:
        return len(torch.jit._state._python_cu.get_functions())

    @contextlib.contextmanager
    def tracing(self) -> Iterator[None]:
        """One trace at a time, counted live from its start (`end` when its module is gone)."""
        with self._lock:
            before = self._in_unit()
            self.live += 1
            try:
                yield
            except BaseException:
                self.live -= 1
                raise
            self._ours += self._in_unit() - before

    def end(self) -> None:
        with self._lock:
            self.live -= 1
            if self.live == 0 and self._in_unit() == self._ours:
                torch._C._jit_clear_class_registry()
                self._ours = 0


TRACES = _Traces()


class _LiveStep(torch.nn.Module):
    """The pipeline's live step as a module, so that a trace reads and updates its state as attributes."""

    def __init__(self, pipeline: Pipeline) -> None:
        super().__init__()
        self.p = pipeline

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        out = self.p.live_step(*inputs)
        return out.text, out.func, out.audio


def traced_live_step(pipeline: Pipeline, inputs: tuple[torch.Tensor, ...]) -> Callable[..., LiveOutput]:
    """The live step traced into one TorchScript graph (CPU). Eager, every tensor op gives the GIL up and
    waits to get it back behind the rooms' event loops: with 16 rooms in the process the tick thread held the
    GIL in 8% of samples, and a 20 ms step took hundreds. The traced graph runs all its ops in one call that
    gives the GIL up once. It is the same ops on the same state (the step has no host syncs or data-dependent
    branches: `engine.tick.graph.audit_step`), bit for bit; tests/test_runner_trace.py checks it through
    resets, loads, masks and replaying rows. Traced and warmed up on steps that change nothing (every slot
    inactive); the inputs are restored. What TorchScript keeps of it goes with the last traced step
    (`_Traces`)."""
    saved = [t.clone() for t in inputs]
    all_inactive(inputs)
    with TRACES.tracing(), torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        warnings.simplefilter("ignore", DeprecationWarning)  # torch 2.13 marks TorchScript deprecated
        graph = torch.jit.trace(_LiveStep(pipeline), tuple(inputs), check_trace=False)
        for _ in range(TRACE_WARMUP):  # TorchScript profiles and optimises its first runs: not in a tick
            graph(*inputs)
    gone = weakref.finalize(graph, TRACES.end)  # with the engine's runner (Engine.close)
    gone.atexit = False  # at exit the module may still run (a daemon tick thread): its unit stays
    for t, s in zip(inputs, saved, strict=True):
        t.copy_(s)

    def step(*x: torch.Tensor) -> LiveOutput:
        return LiveOutput(*graph(*x))

    return step


class Runner:
    def __init__(
        self, pipeline: Pipeline, device: torch.device, prompt_cache_size: int = 8, *, capture: bool = True
    ) -> None:
        self.p = pipeline
        self.device = device
        S = pipeline.num_slots
        n_in = pipeline.cfg.clock.input_samples
        self.audio = torch.zeros(S, n_in, device=device)
        self.active = torch.zeros(S, dtype=torch.bool, device=device)
        self.force_text = torch.full((S,), -1, dtype=torch.long, device=device)
        self.force_func = torch.full((S,), -1, dtype=torch.long, device=device)
        self.reset_mask = torch.zeros(S, dtype=torch.bool, device=device)
        self.quiet = torch.zeros(S, dtype=torch.bool, device=device)
        # a replay piece of k frames a row reads the first k of these (one frame: the live step's buffers)
        self.replay_audio = torch.zeros(MAX_REPLAY_FRAMES, S, n_in, device=device)
        self.replay_active = torch.zeros(MAX_REPLAY_FRAMES, S, dtype=torch.bool, device=device)
        # prompt key -> the slot state a prompt sets: the runner saves and loads, the scheduler asks for keys
        self.prompts = PromptCache(prompt_cache_size)
        n_out = pipeline.cfg.clock.output_samples
        self._out = torch.empty(S, 2 + n_out, dtype=torch.float32)  # one host buffer for all outputs
        if device.type == "cuda":
            self._out = self._out.pin_memory()
        # the live step over the buffers above: with `capture`, one CUDA graph on CUDA and one traced graph on
        # the CPU; eager otherwise
        inputs = (self.audio, self.active, self.force_text, self.force_func, self.quiet)
        live = traced_live_step(pipeline, inputs) if capture and device.type == "cpu" else pipeline.live_step
        self.step = StepGraph(live, inputs, capture=capture, prepare_warmup=all_inactive)
        # the slack work's steps, one per bucket of rows and positions
        # (no reference back to the runner: nothing but the engine keeps it alive, see Engine.close)
        frames = (self.audio, self.active, self.replay_audio, self.replay_active)
        self.slack = StepGraphs(partial(_slack_step, pipeline, frames), capture=capture)
        # device time (engine/tick/device_time.py): the live step's last, the slack pieces' since the fence
        self.times = device_times(device)
        self.asynchronous = self.times.asynchronous  # pieces return before the device has run them
        self.live_device_ms = 0.0
        self._pieces: list[tuple] = []

    def live(self, plan: LivePlan) -> LiveResult:
        start = self.times.mark()
        if plan.reset.any():
            self.reset_mask.copy_(torch.from_numpy(plan.reset))
            self.p.reset(self.reset_mask)
        for slot, key in plan.restore:
            self.p.load_slot(slot, self.prompts.load(key))
        self.audio.copy_(torch.from_numpy(plan.audio))
        self.active.copy_(torch.from_numpy(plan.live))
        self.force_text.copy_(torch.from_numpy(plan.force_text))
        self.force_func.copy_(torch.from_numpy(plan.force_func))
        self.quiet.copy_(torch.from_numpy(plan.quiet))
        out = self.step()
        end = self.times.mark()  # recorded in the queue: nothing waits for it here
        # token ids are far below 2**24, so they travel exactly as float32 beside the audio
        self._out[:, 0].copy_(out.text)
        self._out[:, 1].copy_(out.func)
        self._out[:, 2:].copy_(out.audio)
        host = self._out.numpy().copy()
        self.live_device_ms = self.times.elapsed_ms(start, end)  # the copy above has passed both marks
        return LiveResult(host[:, 0].astype(np.int64), host[:, 1].astype(np.int64), host[:, 2:])

    def save_prompt(self, slot: int, key: int) -> None:
        """Keep the state of a slot that just prefilled a prompt (the cache evicts for room)."""
        self.prompts.save(key, self.p.save_slot(slot, PROMPT_STAGES))

    # -- slack work: one step per bucket (engine/tick/graph.py), captured on CUDA, eager elsewhere ----------

    def slack_buckets(self, max_chunk: int) -> list[tuple[str, int, int]]:
        """Every bucket `tool` can run, for prefill chunks of at most `max_chunk` positions: tool-call
        steps for each power-of-two number of rows up to the slots, replay steps for each of those and each
        power-of-two number of frames up to MAX_REPLAY_FRAMES, and for each power-of-two group of prefill
        rows every power-of-two piece up to its bound."""
        most = pow2_at_least(self.p.num_slots)
        rows = [1 << i for i in range(most.bit_length())]
        keys = [("call", r, 1) for r in rows]
        keys += [("replay", r, 1 << i) for r in rows for i in range(MAX_REPLAY_FRAMES.bit_length())]
        for r in rows:
            if r > MAX_PREFILL_ROWS:
                break
            longest = longest_prefill_piece(r, max_chunk)
            keys += [(kind, r, 1 << i) for kind in ("result", "prompt") for i in range(longest.bit_length())]
        return keys

    def prepare_slack(self, max_chunk: int) -> int:
        """Make (on CUDA: capture) the step of every bucket now, so that no capture falls in a tick. Returns
        how many buckets there are."""
        keys = self.slack_buckets(max_chunk)
        for key in keys:
            self.slack[key]
        return len(keys)

    def _prefill(self, kind: str, slots: np.ndarray, tokens: np.ndarray) -> None:
        b, positions = tokens.shape
        padded = _padded_slots(slots)
        rows = len(padded)
        ids = torch.full((rows, positions), self.p.tok.pad, dtype=torch.long)
        ids[:b] = torch.from_numpy(tokens)
        start = 0
        for t in prefill_pieces(positions, rows):
            step = self.slack[(kind, rows, t)]
            step.inputs[0].copy_(padded)
            step.inputs[1].copy_(ids[:, start : start + t])
            self._timed((kind, rows, t), step)
            start += t

    def _timed(self, key: tuple[str, int, int], step: Callable[[], torch.Tensor]) -> torch.Tensor:
        """Bucket `key`'s step, between two marks in the device's queue (read at the `fence`)."""
        start = self.times.mark()
        out = step()
        self._pieces.append((key, start, self.times.mark()))
        return out

    def fence(self) -> list[tuple[tuple[str, int, int], float]]:
        """Wait for the device to finish all slack work launched since the last fence: each bucket step's
        device time, in launch order."""
        self.times.fence()
        ms = [(key, self.times.elapsed_ms(a, b)) for key, a, b in self._pieces]
        self._pieces.clear()
        return ms

    def time_slack(self, max_chunk: int) -> list[tuple[tuple[str, int, int], float]]:
        """Each slack bucket's step run once, timed on the device: what the cost model starts from. At
        warm-up only, while every step's inputs are still padding rows (no slot changes)."""
        timed = []
        for key in self.slack_buckets(max_chunk):
            step = self.slack[key]
            start = self.times.mark()
            step()
            end = self.times.mark()
            self.times.fence()
            timed.append((key, self.times.elapsed_ms(start, end)))
        return timed

    def tool(self, work: ToolWork) -> ToolResult:
        """Run one piece of slack work: its rows padded to a power of two (a prefill's in groups of at most
        MAX_PREFILL_ROWS), a prefill chunk's positions in power-of-two pieces, each piece the step of its
        bucket (engine/tick/buckets.py), each step timed on the device (read at the `fence`)."""
        b = len(work.slots)
        if work.kind in ("result", "prompt"):
            for first in range(0, b, MAX_PREFILL_ROWS):
                last = min(b, first + MAX_PREFILL_ROWS)
                self._prefill(work.kind, work.slots[first:last], work.tokens[first:last])
            return ToolResult()
        slots = _padded_slots(work.slots)
        if work.kind == "call":
            step = self.slack[("call", len(slots), 1)]
            step.inputs[0].copy_(slots)
            step.inputs[1].fill_(-1)
            step.inputs[1][:b].copy_(torch.from_numpy(work.tokens[:, 0]))
            # slack work, not the live step: the host needs the tokens to decide each session's phase
            return ToolResult(func=self._timed(("call", len(slots), 1), step)[:b].cpu().numpy())
        k = work.positions
        if work.audio.ndim == 3:
            self.replay_audio[:k].copy_(torch.from_numpy(work.audio))
            self.replay_active[:k].copy_(torch.from_numpy(work.active))
        else:
            self.audio.copy_(torch.from_numpy(work.audio))
            self.active.copy_(torch.from_numpy(work.active))
        step = self.slack[("replay", len(slots), k)]
        step.inputs[2].copy_(_replay_rows(work.slots, len(step.inputs[2])))
        self._timed(("replay", len(slots), k), step)
        return ToolResult()


def _slack_step(p: Pipeline, frames: tuple[torch.Tensor, ...], key: tuple[str, int, int]):
    """(step, its static inputs, what makes them a step that changes no slot) for bucket `key`: (kind, rows,
    positions). Padding rows have slot -1: the thinker computes them on its scratch row. A replay of one
    frame a row reads the live step's audio and activity buffers, one of t frames the first t of the
    replay buffers (`frames`: those four)."""
    audio, active, replay_audio, replay_active = frames
    kind, b, t = key
    slots = torch.full((b,), -1, dtype=torch.long, device=audio.device)
    if kind == "call":
        return p.call_step, (slots, torch.full_like(slots, -1)), _padding_only
    if kind in ("result", "prompt"):
        ids = torch.full((b, t), p.tok.pad, dtype=torch.long, device=audio.device)
        return (p.prefill_result if kind == "result" else p.prefill_prompt), (slots, ids), _padding_only
    # replay runs over distinct rows (its perception writes them back): at most every slot
    rows = torch.arange(min(b, p.num_slots), device=audio.device)
    if t == 1:
        return p.replay_step, (audio, active, rows), _no_replay
    return p.replay_frames, (replay_audio[:t], replay_active[:t], rows), _no_replay


def _padded_slots(slots: np.ndarray) -> torch.Tensor:
    """A batch's slots padded with -1 to its bucket's power-of-two rows (host tensor)."""
    padded = torch.full((pow2_at_least(len(slots)),), -1, dtype=torch.long)
    padded[: len(slots)] = torch.from_numpy(slots)
    return padded


def _padding_only(inputs) -> None:
    inputs[0].fill_(-1)


def _replay_rows(slots: np.ndarray, rows: int) -> torch.Tensor:
    """A replay piece's rows: its slots, then as padding the first slots not among them (distinct rows, so
    that writing the gathered rows back is exact; not replaying, so their state stays)."""
    rest = np.setdiff1d(np.arange(rows + len(slots)), slots)[: rows - len(slots)]
    return torch.from_numpy(np.concatenate([slots, rest]).astype(np.int64))


def _no_replay(inputs) -> None:
    inputs[1].zero_()
    inputs[2].copy_(torch.arange(len(inputs[2])))
