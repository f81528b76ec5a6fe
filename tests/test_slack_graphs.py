"""Slack work at fixed shapes (engine/tick/runner.py, engine/tick/graph.py `StepGraphs`): tool-call steps,
prefill chunks and replay run as the step of a bucket, their rows padded to a power of two and a chunk's
positions split into power-of-two pieces. On CPU each bucket runs eagerly over its static buffers; these tests
prove that the padding and the splitting change nothing but float rounding, that padding rows touch no slot,
and that every bucket's step has nothing a CUDA graph capture refuses. With a CUDA device the graphed buckets
are compared with eager calls.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.config.presets import load_preset
from engine.model.pipeline import Pipeline
from engine.text.tokens import Tokens
from engine.tick.graph import audit_step, pow2_at_least, pow2_pieces
from engine.tick.plan import ToolWork
from engine.tick.runner import Runner, prefill_pieces

CFG = load_preset("tiny")
S = 6
TOL = {"rtol": 0, "atol": 2e-5}  # float rounding of another batch size or chunking (fp32)


def pipeline(device: str = "cpu") -> Pipeline:
    with torch.device(device):
        p = Pipeline(CFG, S, Tokens(CFG.tokens)).eval()
    p.prepare()
    return p


def history(p: Pipeline, seed: int = 0) -> None:
    """A few live steps on every slot, so that the state under test is not the fresh one."""
    gen = torch.Generator().manual_seed(seed)
    minus = torch.full((S,), -1, dtype=torch.long, device=p.silence.device)
    every = torch.ones(S, dtype=torch.bool, device=p.silence.device)
    for _ in range(3):
        audio = 0.1 * torch.randn(S, CFG.clock.input_samples, generator=gen)
        p.live_step(audio.to(p.silence.device), every, minus, minus)


def thinker_rows(p: Pipeline, slots) -> list[torch.Tensor]:
    return [t[list(slots)].clone() for t in p.thinker.slot_state().values()]


def close(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    for x, y in zip(a, b, strict=True):
        if x.is_floating_point():
            torch.testing.assert_close(x, y, **TOL)
        else:
            assert torch.equal(x, y)


def work(kind: str, slots: list[int], tokens: np.ndarray, **kw) -> ToolWork:
    return ToolWork(kind, [], np.array(slots, dtype=np.int64), tokens, **kw)


def test_buckets():
    assert [pow2_at_least(n) for n in (1, 2, 3, 4, 5, 17, 64)] == [1, 2, 4, 4, 8, 32, 64]
    assert (
        pow2_pieces(11) == [8, 2, 1]
        and pow2_pieces(64) == [64]
        and pow2_pieces(255) == [2**i for i in range(7, -1, -1)]
    )
    for n in range(1, 300):
        pieces = pow2_pieces(n)
        assert sum(pieces) == n and len(set(pieces)) == len(pieces)
    with pytest.raises(ValueError):
        pow2_pieces(0)


def test_a_padded_call_step_equals_the_unpadded_one():
    """Three slots calling a tool run in the 4-row bucket: the same function tokens and the same thinker state
    as three rows run alone, and the other slots' state is untouched, bit for bit."""
    a, b = pipeline(), pipeline()
    history(a), history(b)
    runner = Runner(a, torch.device("cpu"))
    slots, forced = [4, 0, 2], np.array([[-1], [7], [-1]])
    idle = thinker_rows(a, [1, 3, 5])
    for _ in range(3):
        got = runner.tool(work("call", slots, forced)).func
        want = b.call_step(torch.tensor(slots), torch.from_numpy(forced[:, 0]))
        assert got.tolist() == want.tolist()
    assert ("call", 4, 1) in runner.slack.graphs
    close(thinker_rows(a, slots), thinker_rows(b, slots))
    assert all(torch.equal(x, y) for x, y in zip(thinker_rows(a, [1, 3, 5]), idle, strict=True))


@pytest.mark.parametrize("kind", ["result", "prompt"])
def test_a_chunk_in_power_of_two_pieces_equals_one_prefill(kind):
    """An 11-position chunk for 3 slots runs as the (4 rows, 8), (4, 2) and (4, 1) buckets: the thinker state
    of one 11-position forward over the 3 rows, to float rounding; the idle slots untouched."""
    a, b = pipeline(), pipeline()
    history(a, 1), history(b, 1)
    runner = Runner(a, torch.device("cpu"))
    ids = np.random.default_rng(2).integers(0, Tokens(CFG.tokens).vocab_size, size=(3, 11))
    slots = [5, 1, 3]
    idle = thinker_rows(a, [0, 2, 4])
    runner.tool(work(kind, slots, ids))
    getattr(b, f"prefill_{kind}")(torch.tensor(slots), torch.from_numpy(ids))
    assert {k for k in runner.slack.graphs if k[0] == kind} == {(kind, 4, 8), (kind, 4, 2), (kind, 4, 1)}
    close(thinker_rows(a, slots), thinker_rows(b, slots))
    assert all(torch.equal(x, y) for x, y in zip(thinker_rows(a, [0, 2, 4]), idle, strict=True))
    # and both go on alike: the next call step agrees
    got = runner.tool(work("call", slots, np.full((3, 1), -1))).func
    assert got.tolist() == b.call_step(torch.tensor(slots), torch.full((3,), -1)).tolist()


def test_a_prefill_runs_in_groups_of_rows_and_bounded_pieces():
    """Rows beyond MAX_PREFILL_ROWS go in further groups, and a forward holds at most MAX_PREFILL_POSITIONS
    rows x positions: 12 rows of 40 positions run as 8 rows (32 + 8 positions) and 4 rows (32 + 8), and leave
    the state of one 12 x 40 prefill, to float rounding."""
    assert prefill_pieces(40, 8) == [32, 8] and prefill_pieces(200, 8) == [64, 64, 64, 8]
    assert prefill_pieces(3, 1024) == [1, 1, 1] and prefill_pieces(512, 1) == [512]
    assert all(max(prefill_pieces(n, r)) * r <= max(r, 512) for n in (1, 7, 64, 300) for r in (1, 4, 64))
    slots_total = 14
    with torch.device("cpu"):
        a = Pipeline(CFG, slots_total, Tokens(CFG.tokens)).eval()
        b = Pipeline(CFG, slots_total, Tokens(CFG.tokens)).eval()
    a.prepare(), b.prepare()
    runner = Runner(a, torch.device("cpu"))
    ids = np.random.default_rng(6).integers(0, Tokens(CFG.tokens).vocab_size, size=(12, 40))
    slots = [13, 0, 5, 2, 9, 11, 1, 7, 3, 12, 4, 8]
    runner.tool(work("result", slots, ids))
    b.prefill_result(torch.tensor(slots), torch.from_numpy(ids))
    assert set(runner.slack.graphs) == {
        ("result", 8, 32),
        ("result", 8, 8),
        ("result", 4, 32),
        ("result", 4, 8),
    }
    close(thinker_rows(a, slots), thinker_rows(b, slots))


def test_the_prepared_buckets_cover_every_piece_of_work_the_runner_runs():
    """What the engine captures at warm-up on CUDA is every bucket `tool` ever uses: random pieces of every
    kind (rows 1..S, chunks up to the window) add no bucket to those prepared."""
    p = pipeline()
    runner = Runner(p, torch.device("cpu"))
    window = CFG.thinker.attention_window
    n = runner.prepare_slack(window)
    prepared = set(runner.slack.graphs)
    assert n == len(prepared) == len(runner.slack_buckets(window))
    assert {k for k in prepared if k[0] == "call"} == {("call", r, 1) for r in (1, 2, 4, 8)}  # S = 6
    rng = np.random.default_rng(7)
    vocab = Tokens(CFG.tokens).vocab_size
    for _ in range(12):
        b = int(rng.integers(1, S + 1))
        slots = [int(x) for x in rng.permutation(S)[:b]]
        runner.tool(work("call", slots, np.full((b, 1), -1)))
        runner.tool(work("result", slots, rng.integers(0, vocab, size=(b, int(rng.integers(1, window + 1))))))
        audio = np.zeros((S, CFG.clock.input_samples), np.float32)
        active = np.isin(np.arange(S), slots)
        runner.tool(work("replay", slots, np.zeros((b, 0), np.int64), audio=audio, active=active))
    assert set(runner.slack.graphs) == prepared


def test_a_padded_replay_step_equals_the_unpadded_one():
    a, b = pipeline(), pipeline()
    history(a, 3), history(b, 3)
    runner = Runner(a, torch.device("cpu"))
    gen = torch.Generator().manual_seed(4)
    audio = (0.1 * torch.randn(S, CFG.clock.input_samples, generator=gen)).numpy()
    active = np.array([False, True, False, True, True, False])
    slots = [1, 3, 4]
    runner.tool(work("replay", slots, np.zeros((3, 0), np.int64), audio=audio, active=active))
    b.replay_step(torch.from_numpy(audio), torch.from_numpy(active), torch.tensor(slots))
    assert ("replay", 4, 1) in runner.slack.graphs
    for name in ("perception", "thinker"):
        got, want = getattr(a, name).slot_state(), getattr(b, name).slot_state()
        assert got.keys() == want.keys(), name
        close([t[:S] for t in got.values()], [want[k][:S] for k in got])


@pytest.mark.parametrize(
    "key", [("call", 4, 1), ("result", 2, 8), ("prompt", 1, 16), ("replay", 4, 1)], ids=lambda k: f"{k[0]}"
)
def test_every_slack_bucket_has_nothing_a_capture_refuses(key):
    p = pipeline()
    runner = Runner(p, torch.device("cpu"))
    step = runner.slack[key]
    step.inputs[0 if key[0] != "replay" else 2][:1] = 2  # one real row, the rest padding
    if key[0] == "replay":
        step.inputs[1][2] = True
    state = [t for ts in p.slot_state().values() for t in ts.values()]
    report = audit_step(step.fn, step.inputs, lambda: state)
    print(key, report.ops, "operators;", report.by_op.most_common(5))
    assert report.capturable, report.problems
    assert report.ops > 20


@pytest.mark.gpu
def test_graphed_slack_buckets_equal_eager_calls():
    """On CUDA: a call step, a split prefill and a replay through captured buckets, against eager calls on a
    second pipeline with the same seeded weights: the same tokens, and the same state."""
    a, b = pipeline("cuda"), pipeline("cuda")
    runner = Runner(a, torch.device("cuda"))
    ids = np.random.default_rng(5).integers(0, Tokens(CFG.tokens).vocab_size, size=(2, 13))
    runner.tool(work("prompt", [0, 3], ids))
    b.prefill_prompt(torch.tensor([0, 3], device="cuda"), torch.from_numpy(ids).cuda())
    assert runner.slack.captured == len(runner.slack.graphs) == 3
    for _ in range(2):
        got = runner.tool(work("call", [0, 3], np.full((2, 1), -1))).func
        want = b.call_step(torch.tensor([0, 3], device="cuda"), torch.full((2,), -1, device="cuda"))
        assert got.tolist() == want.tolist()
    close([t.cpu() for t in thinker_rows(a, [0, 3])], [t.cpu() for t in thinker_rows(b, [0, 3])])
