"""Replay of several held frames a row in one piece (`Pipeline.replay_frames`, the runner's `("replay", rows,
k)` buckets): k frames replayed in one piece leave every slot's state as k one-frame pieces leave it, a row
with fewer frames held replays only those, and the scheduler hands a session back from a tool as many
frames as it holds, up to MAX_REPLAY_FRAMES, taken in order from its inbox."""

from __future__ import annotations

import numpy as np
import torch

from engine.config.presets import load_preset
from engine.config.stage_config import TokenConfig
from engine.model.pipeline import Pipeline
from engine.text.tokens import Tokens
from engine.tick.buckets import MAX_REPLAY_FRAMES, work_buckets
from engine.tick.plan import Limits, ToolResult, ToolWork
from engine.tick.runner import Runner
from engine.tick.scheduler import Scheduler
from engine.tick.session import Phase, Session
from engine.tick.slots import FrameInbox
from engine_support import pipeline_with_history

CFG = load_preset("tiny")
S = 8
N = CFG.clock.input_samples


def pipeline() -> Pipeline:
    return pipeline_with_history(CFG, S, seed=5)


def state(p: Pipeline) -> dict[str, torch.Tensor]:
    return {f"{stage}.{n}": t.clone() for stage, ts in p.slot_state().items() for n, t in ts.items()}


def replay(slots: list[int], audio: np.ndarray, active: np.ndarray) -> ToolWork:
    return ToolWork("replay", [], np.array(slots), np.zeros((len(slots), 0), np.int64), audio, active)


def test_k_frames_in_one_replay_piece_equal_k_one_frame_pieces_and_touch_no_other_slot():
    k = 4
    gen = torch.Generator().manual_seed(11)
    audio = (0.1 * torch.randn(k, S, N, generator=gen)).numpy()
    active = np.zeros((k, S), dtype=bool)
    active[:, 5] = True
    active[:2, 2] = True  # slot 2 holds two frames only: inactive on the last two
    a, b = pipeline(), pipeline()
    before = state(a)
    ra, rb = Runner(a, torch.device("cpu"), capture=False), Runner(b, torch.device("cpu"), capture=False)
    ra.tool(replay([5, 2], audio, active))
    assert ("replay", 2, k) in ra.slack.graphs
    for j in range(k):  # the same frames over the same rows, one piece each (slot 2 masked off at the end)
        rb.tool(replay([5, 2], audio[j], active[j]))
    after_a, after_b = state(a), state(b)
    for name, want in after_b.items():
        assert torch.equal(after_a[name], want), name
    # the replayed rows moved, by their own frames; no other slot did
    assert a.perception.frames[5] == before["perception.frames"][5] + 4
    assert a.perception.frames[2] == before["perception.frames"][2] + 2
    others = [s for s in range(S) if s not in (5, 2)]
    for name, was in before.items():
        assert torch.equal(after_a[name][others], was[others]), name


def test_a_session_back_from_a_tool_gets_its_held_frames_in_order_several_a_piece():
    sch = Scheduler(16, Tokens(TokenConfig()), N, Limits())
    held = {}
    for slot, n in ((3, 7), (9, 1)):
        inbox = FrameInbox(N, 100)
        s = Session(f"s{slot}", slot, frozenset(), inbox, lambda _items: None, phase=Phase.WAITING)
        s.enter(Phase.PREFILL, 0, ids=[1], by=12)
        s.enter(Phase.REPLAY, 0, by=25)
        for i in range(n):
            s.inbox.push(np.full(N, 0.01 * (slot + i + 1), np.float32))
        held[slot] = s
    sch.costs.observe("replay", 1, 1, 1.0)  # a replay measured: pieces of several frames are sized on it
    t = sch.begin_tick(0, list(held.values()))
    w = sch.next_tool_work(t, 1000.0)
    assert w.kind == "replay" and w.positions == MAX_REPLAY_FRAMES == 4, w
    assert w.slots.tolist() == [3, 9]
    assert np.allclose(w.audio[:, 3, 0], [0.04, 0.05, 0.06, 0.07])  # slot 3's first four, in order
    assert w.active[:, 9].tolist() == [True, False, False, False]  # slot 9 held one
    assert work_buckets("replay", 2, 4) == [("replay", 2, 4)]
    sch.apply_tool(t, w, ToolResult(), 1.0)
    assert len(held[3].inbox) == 3 and len(held[9].inbox) == 0
    assert held[3].feed.frames_replayed == 4
    w = sch.next_tool_work(t, 1000.0)  # three left: two frames a row is the largest power of two
    assert w.positions == 2 and w.slots.tolist() == [3] and np.allclose(w.audio[:, 3, 0], [0.08, 0.09])


def test_the_first_replay_piece_replays_one_frame_a_row_until_a_replay_is_measured():
    """With no replay timed yet (a CPU engine times no bucket at warm-up) a piece of several frames would
    start on a guess: the first is one frame a row, and its measured time sizes the next."""
    sch = Scheduler(16, Tokens(TokenConfig()), N, Limits())
    s = Session("s3", 3, frozenset(), FrameInbox(N, 100), lambda _items: None, phase=Phase.WAITING)
    s.enter(Phase.PREFILL, 0, ids=[1], by=12)
    s.enter(Phase.REPLAY, 0, by=25)
    for _ in range(7):
        s.inbox.push(np.full(N, 0.1, np.float32))
    t = sch.begin_tick(0, [s])
    w = sch.next_tool_work(t, 1000.0)
    assert w.positions == 1, w.positions
    sch.apply_tool(t, w, ToolResult(), 2.0)  # measured: 2 ms a frame
    assert sch.next_tool_work(t, 1000.0).positions == 4


def test_the_runner_has_a_replay_bucket_for_each_frame_count():
    keys = Runner.slack_buckets(type("R", (), {"p": type("P", (), {"num_slots": 4})})(), 64)
    frames = [t for kind, r, t in keys if kind == "replay" and r == 4]
    assert frames == [1 << i for i in range(MAX_REPLAY_FRAMES.bit_length())]
