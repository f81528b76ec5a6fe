"""Replay over the replaying rows only (engine/model/perception_rows.py, `Pipeline.replay_step`): a replay
piece's perception runs over the rows it replays, gathered into a batch of their own, so its work scales with
them; its result is the full-batch replay's for those rows, and every other slot keeps its state bit for
bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from engine.config.presets import load_preset
from engine.model.perception_rows import PerceptionRows
from engine.model.pipeline import Pipeline
from engine.tick.plan import ToolWork
from engine.tick.runner import Runner
from engine_support import pipeline_with_history

CFG = load_preset("tiny")
S = 8
TOL = {"rtol": 0, "atol": 2e-5}  # float rounding of another batch size (fp32)


def pipeline() -> Pipeline:
    return pipeline_with_history(CFG, S, seed=3)


@torch.inference_mode()
def full_batch_replay(p: Pipeline, audio: torch.Tensor, active: torch.Tensor, slots: torch.Tensor) -> None:
    """Replay as it ran over every slot: perception over the whole batch, the thinker over the slots."""
    emb = p.perception.step(audio, active)
    pad = torch.full((slots.shape[0],), p.tok.pad, dtype=torch.long)
    out = p.thinker.step_rows(emb.index_select(0, slots), slots, pad, pad)
    end = p.tok.response_end
    p.thinker.set_func_rows(slots, torch.where(out.func_logits.argmax(-1) == end, end, pad))


def state(p: Pipeline) -> dict[str, torch.Tensor]:
    return {
        f"{stage}.{name}": t.clone()
        for stage, ts in p.slot_state().items()
        for name, t in ts.items()
        if stage in ("perception", "thinker")
    }


def test_replay_of_some_rows_equals_the_full_batch_replay_and_leaves_every_other_slot_as_it_was():
    a, b = pipeline(), pipeline()
    before = state(a)
    runner = Runner(a, torch.device("cpu"))
    replaying = [6, 1, 4]  # three rows: a bucket of four, one padding row (slot 0) that must not move
    audio = (0.1 * np.random.default_rng(5).standard_normal((S, CFG.clock.input_samples))).astype(np.float32)
    active = np.isin(np.arange(S), replaying)
    for _ in range(2):
        work = ToolWork("replay", [], np.array(replaying), np.zeros((3, 0), np.int64), audio, active)
        runner.tool(work)
        full_batch_replay(b, torch.from_numpy(audio), torch.from_numpy(active), torch.tensor(replaying))
    assert ("replay", 4, 1) in runner.slack.graphs
    got, want = state(a), state(b)
    others = [s for s in range(S) if s not in replaying]
    for name, t in got.items():
        rows = t[:S]  # the thinker's scratch row aside
        assert torch.equal(rows[others], before[name][:S][others]), name
        if t.is_floating_point():
            torch.testing.assert_close(rows[replaying], want[name][:S][replaying], **TOL)
        else:
            assert torch.equal(rows[replaying], want[name][:S][replaying]), name
    # the replayed rows moved: their perception took two frames
    assert a.perception.frames[replaying].tolist() == [b.perception.frames[s] for s in replaying]
    assert (a.perception.frames[replaying] == before["perception.frames"][replaying] + 2).all()


def replay_flops(p: Pipeline, rows: int) -> int:
    audio = torch.zeros(S, CFG.clock.input_samples)
    active = torch.zeros(S, dtype=torch.bool)
    active[:rows] = True
    with FlopCounterMode(display=False) as count:
        p.replay_step(audio, active, torch.arange(rows))
    return count.get_total_flops()


def test_a_replay_pieces_work_scales_with_the_rows_it_replays():
    """Four rows cost three to four times one (before: perception over every slot, whatever the rows)."""
    p = pipeline()
    one, four = replay_flops(p, 1), replay_flops(p, 4)
    print(f"replay flops: 1 row {one:,}, 4 rows {four:,}")
    assert 3 * one <= four <= 4.5 * one


def test_perception_rows_refuses_an_empty_batch():
    with pytest.raises(ValueError, match="rows: expected at least 1"):
        PerceptionRows(pipeline().perception, 0)
