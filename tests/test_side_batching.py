"""Side work batched as vLLM, Sarathi-Serve and SGLang batch it (docs/engine.md, "Side work: timed, budgeted
and fenced"): the tool results that arrive in one tick are prefilled as one piece of rows x positions, every
session replaying catches up in one piece, and the batched prefill leaves each session the state it would have
had alone. On the scheduler with hand-made sessions, then on the runner at the tiny preset."""

import numpy as np
import torch

from engine.config.presets import load_preset
from engine.config.stage_config import TokenConfig
from engine.model.pipeline import Pipeline
from engine.text.tokens import Tokens
from engine.tick.plan import Limits, ToolResult, ToolWork
from engine.tick.runner import Runner
from engine.tick.scheduler import Scheduler
from engine.tick.session import Phase, Session
from engine.tick.slots import FrameInbox
from engine_support import engine_on, run_ticks
from testkit.concierge import PROMPT, TOOLS

S, FRAME = 16, 1280
TOK = Tokens(TokenConfig())


def waiting(slot: int) -> Session:
    return Session(
        f"s{slot}", slot, frozenset(), FrameInbox(FRAME, 100), lambda _items: None, phase=Phase.WAITING
    )


def test_the_results_that_arrive_in_one_tick_are_prefilled_as_one_piece():
    """Twelve results of one length (more rows than `owed_rows`) and a short one arrive in one tick with no
    slack at all: what the tick owes them runs as pieces that each take every result owed with as many
    positions left, the twelve in one piece, never a piece per session or per group of eight; each result
    is prefilled exactly once, within the bound."""
    lim = Limits(result_chunk=64, result_ticks=12)
    sch = Scheduler(S, TOK, FRAME, lim)
    sessions = [waiting(slot) for slot in range(13)]
    lengths = [300] * 12 + [40]
    for s, n in zip(sessions, lengths, strict=True):
        s.enter(Phase.PREFILL, 0, ids=list(range(1000 + s.slot, 1000 + s.slot + n)), by=lim.result_ticks)
    prefilled = {s.slot: [] for s in sessions}
    k = 0
    while any(s.phase is Phase.PREFILL for s in sessions):
        t = sch.begin_tick(k, sessions)
        sch.plan_live(t, np.zeros(S, bool))
        pieces = []
        while (w := sch.owed_work(t)) is not None:  # no slack: only what is owed runs
            T = w.tokens.shape[1]
            owing = {
                s.slot
                for s in sessions
                if s.phase is Phase.PREFILL and s.progress.owed > 0 and s.progress.left >= T
            }
            assert w.kind == "result" and {int(x) for x in w.slots} == owing, (k, pieces)
            pieces.append(len(w.sessions))
            for s, row in zip(w.sessions, w.tokens, strict=True):
                prefilled[s.slot] += row.tolist()
            sch.apply_tool(t, w, ToolResult(), 1.0)
        print(f"tick {k}: owed pieces of {pieces} rows")
        assert k > 0 or pieces[0] == 12
        k += 1
    assert k <= lim.result_ticks
    for s, n in zip(sessions, lengths, strict=True):
        assert prefilled[s.slot] == list(range(1000 + s.slot, 1000 + s.slot + n))


def test_every_session_replaying_catches_up_in_one_piece():
    """Six sessions back from their tools at different times, holding 3 to 8 frames: each replay piece takes
    one frame from every one of them with a frame still held, never a piece per session, until all are
    live again."""
    sch = Scheduler(S, TOK, FRAME, Limits())
    sessions = []
    for slot, held in enumerate((3, 5, 8, 4, 6, 7)):
        s = waiting(slot)
        s.enter(Phase.PREFILL, 0, ids=[1], by=12)
        s.enter(Phase.REPLAY, 0, by=25)
        for _ in range(held):
            s.inbox.push(np.full(FRAME, 0.1, np.float32))
        sessions.append(s)
    k = 0
    while any(s.phase is Phase.REPLAY for s in sessions):
        t = sch.begin_tick(k, sessions)
        sch.plan_live(t, np.zeros(S, bool))
        while True:
            held = {s.slot for s in sessions if s.phase is Phase.REPLAY and len(s.inbox) >= 1}
            if (w := sch.next_tool_work(t, 1000.0)) is None:
                break
            assert w.kind == "replay" and set(w.slots.tolist()) == held, (k, w.slots)
            sch.apply_tool(t, w, ToolResult(), 1.0)
        k += 1
    assert k <= 3 and all(s.phase is Phase.LIVE for s in sessions)


CFG = load_preset("tiny")
TOL = {torch.float32: 2e-5}  # float rounding of another batch size (fp32, as tests/test_slack_graphs.py)


def tiny(slots: int) -> Pipeline:
    with torch.device("cpu"):
        p = Pipeline(CFG, slots, Tokens(CFG.tokens)).eval()
    p.prepare()
    return p


def worst_difference(a: Pipeline, b: Pipeline, slots: list[int]) -> float:
    """The largest absolute difference between the two pipelines' states of `slots`, every stage; integer
    state (positions, tokens) must be equal."""
    worst = 0.0
    for slot in slots:
        for stage, state in a.save_slot(slot).items():
            other = b.save_slot(slot)[stage]
            for name, x in state.items():
                y = other[name]
                if x.is_floating_point():
                    worst = max(worst, (x.float() - y.float()).abs().max().item())
                else:
                    assert torch.equal(x, y), (slot, stage, name)
    return worst


def test_a_batched_result_prefill_gives_each_session_the_state_it_has_prefilled_alone():
    """Ten sessions' results prefilled as one piece (two groups of rows, power-of-two pieces) leave each
    session's state what prefilling its result alone leaves, to float rounding; so does one replay piece
    over five sessions against five replays of one."""
    n, slots, T = 12, list(range(10)), 40
    a, b = tiny(n), tiny(n)
    runner = Runner(a, torch.device("cpu"))
    ids = np.random.default_rng(3).integers(0, Tokens(CFG.tokens).vocab_size, size=(len(slots), T))
    runner.tool(ToolWork("result", [], np.array(slots, dtype=np.int64), ids))
    for i, slot in enumerate(slots):
        b.prefill_result(torch.tensor([slot]), torch.from_numpy(ids[i : i + 1]))
    worst = worst_difference(a, b, list(range(n)))
    print(f"result prefill, 10 rows x {T} batched against alone: max abs difference {worst:.2e}")
    assert worst <= TOL[torch.float32]

    replaying = [1, 4, 6, 7, 9]
    audio = (0.1 * np.random.default_rng(4).standard_normal((n, CFG.clock.input_samples))).astype(np.float32)
    active = np.zeros(n, dtype=bool)
    active[replaying] = True
    runner.tool(
        ToolWork("replay", [], np.array(replaying, dtype=np.int64), np.zeros((5, 0), np.int64), audio, active)
    )
    for slot in replaying:
        one = np.zeros(n, dtype=bool)
        one[slot] = True
        b.replay_step(torch.from_numpy(audio), torch.from_numpy(one), torch.tensor([slot]))
    worst = worst_difference(a, b, list(range(n)))
    print(f"replay, 5 rows batched against alone: max abs difference {worst:.2e}")
    assert worst <= TOL[torch.float32]


def test_sixty_four_sessions_of_one_prompt_prefill_it_once_and_start_from_copies():
    """64 sessions opened at once with the same prompt on a 64-slot engine: one session prefills it, once,
    and the 63 others start from a copy of its state (one each), with no prefill of their own."""
    with engine_on(num_slots=64) as e:
        prefills: list[tuple[list[int], int]] = []  # (slots, positions) per prompt piece
        copies: list[tuple[int, int]] = []
        tool, live = e.runner.tool, e.runner.live

        def counted_tool(work):
            if work.kind == "prompt":
                prefills.append((work.slots.tolist(), work.tokens.shape[1]))
            return tool(work)

        def counted_live(plan):
            copies.extend(plan.restore)
            return live(plan)

        e.runner.tool, e.runner.live = counted_tool, counted_live
        handles = [e.open_session(PROMPT, TOOLS) for _ in range(64)]
        k = 0
        while any(h.phase == "prompt" for h in handles) and k < 25:
            k = run_ticks(e, k, 1)
        ids, _ = TOK.prompt_parts(PROMPT, TOOLS)
        (leader,) = {slot for slots, _ in prefills for slot in slots}
        print(f"{len(prefills)} prompt pieces on slot {leader}, {len(copies)} copies in {k} ticks")
        assert sum(t for _, t in prefills) == len(ids)
        assert sorted(slot for slot, _ in copies) == sorted(h.slot for h in handles if h.slot != leader)
        assert all(h.phase != "prompt" for h in handles)
