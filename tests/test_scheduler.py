"""The scheduler on hand-made results: no model, just plans, phases and events."""

import json
import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest

from engine.api import (
    AudioFrame,
    FunctionCall,
    SubmitResult,
    ToolCallRejected,
    ToolCallStarted,
    ToolResultConsumed,
    TurnEnded,
    TurnStarted,
)
from engine.config.stage_config import TokenConfig
from engine.text.tokens import Tokens
from engine.tick.plan import Limits, LivePlan, LiveResult, Tick, ToolResult
from engine.tick.scheduler import Scheduler
from engine.tick.session import Phase, Session
from engine.tick.slots import FrameInbox

S, FRAME = 8, 1280
TOK = Tokens(TokenConfig())


def make_session(slot: int, phase: Phase = Phase.LIVE, tools=("check_availability",)) -> tuple[Session, list]:
    got: list = []
    s = Session(f"s{slot}", slot, frozenset(tools), FrameInbox(FRAME, 100), got.extend, phase=phase)
    return s, got


def result(text=None, func=None) -> LiveResult:
    t = np.full(S, TOK.pad) if text is None else text
    f = np.full(S, TOK.pad) if func is None else func
    return LiveResult(t, f, np.zeros((S, 1764), np.float32))


def sched(encode_pool=None, clock=time.monotonic, **limits) -> Scheduler:
    return Scheduler(S, TOK, FRAME, Limits(**limits), clock=clock, encode_pool=encode_pool)


def live_plan(sch: Scheduler, k: int, sessions: list[Session], reset: np.ndarray) -> tuple[Tick, LivePlan]:
    """Tick `k` begins over `sessions`, and its live batch is planned: the tick and its plan."""
    tick = sch.begin_tick(k, sessions)
    return tick, sch.plan_live(tick, reset)


def test_every_live_slot_is_in_the_batch_and_paused_ones_never_are():
    sch = sched()
    phases = [
        Phase.LIVE,
        Phase.PROMPT,
        Phase.TOOL_CALL,
        Phase.WAITING,
        Phase.PREFILL,
        Phase.REPLAY,
        Phase.LIVE,
    ]
    sessions = [make_session(i, p)[0] for i, p in enumerate(phases)]
    sessions[0].inbox.push(np.ones(FRAME, np.float32) * 0.5)
    for s in sessions[1:6]:
        s.inbox.push(np.ones(FRAME * 3, np.float32))
    t, plan = live_plan(sch, 0, sessions, np.zeros(S, bool))
    # a replaying session steps quietly in the live batch: its held audio goes in, nothing comes out
    assert plan.live.tolist() == [True, False, False, False, False, True, True, False]
    assert plan.quiet.tolist() == [False, False, False, False, False, True, False, False]
    assert np.all(plan.audio[0] == 0.5) and np.all(plan.audio[5] == 1) and np.all(plan.audio[1:5] == 0)
    # slot 6 had no frame: it is still stepped (silence), and the underrun is counted
    assert sessions[6].feed.underruns == 1 and sch.underruns == 1
    # paused sessions keep their audio for later
    assert all(len(s.inbox) == 3 for s in sessions[1:5]) and len(sessions[5].inbox) == 2
    # two frames at planning time: still replaying (one would stay behind as a frame of latency)
    t, plan = live_plan(sch, 1, sessions, np.zeros(S, bool))
    assert sessions[5].phase is Phase.REPLAY and plan.quiet[5] and len(sessions[5].inbox) == 1
    # one frame at planning time (this tick's): caught up, live again, nothing held back
    t, plan = live_plan(sch, 2, sessions, np.zeros(S, bool))
    assert sessions[5].phase is Phase.LIVE and plan.live[5] and not plan.quiet[5]
    assert len(sessions[5].inbox) == 0


def test_tool_work_is_never_planned_past_the_budget():
    sch = sched(prefill_chunk=64)
    s, _ = make_session(0, Phase.PROMPT)
    s.progress.prefill_ids = list(range(40, 140))
    t = sch.begin_tick(0, [s])
    sch.costs.observe("prompt", 1, 64, 30.0)
    sch.costs.observe("prompt", 1, 32, 12.0)
    sch.costs.observe("prompt", 1, 16, 6.0)
    # unmeasured shapes are predicted from the nearest measured one, scaled by positions x rows
    assert sch.next_tool_work(t, budget_ms=5.0).tokens.shape == (1, 8)  # 16 positions cost 6 ms: 8 cost 3
    assert sch.next_tool_work(t, budget_ms=0.3) is None  # even one position is predicted at 0.375 ms
    w = sch.next_tool_work(t, budget_ms=13.0)
    assert w.kind == "prompt" and w.tokens.shape == (1, 32)
    w = sch.next_tool_work(t, budget_ms=100.0)
    assert w.tokens.shape == (1, 64)
    c, _ = make_session(1, Phase.TOOL_CALL)
    t = sch.begin_tick(0, [s, c])
    sch.costs.observe("call", 1, 1, 4.0)
    assert (
        sch.next_tool_work(t, budget_ms=3.0).kind == "prompt"
    )  # the call does not fit; a smaller prefill does
    assert sch.next_tool_work(t, budget_ms=4.5).kind == "call"
    assert sch.next_tool_work(t, budget_ms=7.0).kind == "call"  # calls come first when both fit
    # a group too big for the budget is split: half the rows
    many = [make_session(i, Phase.PROMPT)[0] for i in range(8)]
    for i, m in enumerate(many):
        m.progress.prefill_ids, m.prompt_key = list(range(40, 140)), i  # eight different prompts
    t = sch.begin_tick(0, many)
    sch.costs.observe("prompt", 8, 1, 8.0)
    w = sch.next_tool_work(t, budget_ms=4.5)
    assert w.tokens.shape == (4, 1)


def test_sessions_with_the_same_prompt_share_one_prefill():
    sch = sched(prefill_chunk=64)
    same = [make_session(i, Phase.PROMPT)[0] for i in range(4)]
    other, _ = make_session(4, Phase.PROMPT)
    for s in same:
        s.progress.prefill_ids, s.prompt_key = list(range(40, 140)), 7
    other.progress.prefill_ids, other.prompt_key = list(range(40, 100)), 8
    t, _ = live_plan(sch, 0, same + [other], np.zeros(S, bool))
    w = sch.next_tool_work(t, 1000.0)
    assert w.kind == "prompt" and sorted(w.slots.tolist()) == [0, 4]  # one per distinct prompt
    saves = []
    while w is not None and w.kind == "prompt":
        done = sch.apply_tool(t, w, ToolResult(), 1.0)
        for _, key in done.saves:  # the runner keeps the state, as the engine has it do at once
            sch.prompts.save(key, {})
        saves += done.saves
        w = sch.next_tool_work(t, 1000.0)
    assert sorted(saves) == [(0, 7), (4, 8)] and same[0].phase is Phase.REPLAY
    assert sch.cached_prompts == {7, 8}
    assert all(s.phase is Phase.PROMPT for s in same[1:])
    t, plan = live_plan(sch, 1, same + [other], np.zeros(S, bool))
    assert sorted(plan.restore) == [(1, 7), (2, 7), (3, 7)]
    assert all(s.phase is not Phase.PROMPT for s in same)


def run_call(sch: Scheduler, t: Tick, s: Session, text: str, forced_end: bool = True) -> None:
    """Feed the call's tokens as if the model produced them, one call step each."""
    ids = TOK.encode(text) + ([TOK.call_end] if forced_end else [])
    for token in ids:
        w = sch.next_tool_work(t, 100.0)
        assert w.kind == "call" and w.sessions == [s]
        sch.apply_tool(t, w, ToolResult(func=np.array([token])), 1.0)


def test_the_tool_path_in_order():
    sch = sched(result_chunk=16)
    s, got = make_session(3)
    other, other_got = make_session(5)
    sessions = [s, other]
    t, plan = live_plan(sch, 0, sessions, np.zeros(S, bool))
    text = np.full(S, TOK.pad)
    text[3] = TOK.bos
    func = np.full(S, TOK.pad)
    func[3] = TOK.call_start
    audio = np.zeros((S, 1764), np.float32)
    audio[3] = 0.25
    sch.apply_live(t, plan, LiveResult(text, func, audio))
    started, frame, ended, call_started = got
    # the turn opens with this frame, and the call that starts on it interrupts the model's own turn
    assert (started, ended, call_started) == (TurnStarted(0), TurnEnded(0), ToolCallStarted(0))
    assert isinstance(frame, AudioFrame) and frame.tick == 0 and frame.text == ""  # <bos> is not spoken
    assert np.array_equal(frame.samples, audio[3])  # the session's own row of the result
    assert s.phase is Phase.TOOL_CALL and other.phase is Phase.LIVE
    # the next live batch leaves the paused slot out
    assert not live_plan(sch, 1, sessions, np.zeros(S, bool))[1].live[3]
    got.clear()
    run_call(sch, t, s, '<TOOLCALL>[{"name": "check_availability", "arguments": {"guests": 2}}]</TOOLCALL>')
    assert s.phase is Phase.WAITING
    (call,) = got
    assert isinstance(call, FunctionCall) and call.name == "check_availability"
    assert json.loads(call.arguments) == {"guests": 2}
    # caller keeps talking while paused: held, not dropped
    for _ in range(3):
        s.inbox.push(np.full(FRAME, 0.1, np.float32))
    s.requests.put(SubmitResult(call.call_id, '{"rooms": 3}'))
    sch.poll(t, time.monotonic())
    assert s.phase is Phase.PREFILL
    expected = TOK.response_ids([{"name": "check_availability", "output": '{"rooms": 3}'}])
    assert s.progress.prefill_ids == expected
    chunks = []
    while s.phase is Phase.PREFILL:
        w = sch.next_tool_work(t, 100.0)
        chunks.append(w.tokens[0].tolist())
        sch.apply_tool(t, w, ToolResult(), 1.0)
    assert sum(chunks, []) == expected and len(chunks) > 1 and all(len(c) <= 16 for c in chunks)
    assert s.phase is Phase.REPLAY
    replayed = 0
    while s.phase is Phase.REPLAY:
        w = sch.next_tool_work(t, 100.0)
        if w is None:
            break
        frames = np.atleast_2d(w.active)  # [k, S]: frame j of each row replayed (a piece may take several)
        assert w.kind == "replay" and frames[0, 3] and frames.sum() == frames[:, 3].sum()
        replayed += int(frames[:, 3].sum())
        sch.apply_tool(t, w, ToolResult(), 1.0)
    # the slack replays every held frame; the frame that arrives for the next tick is taken live
    assert replayed == 3 and s.phase is Phase.REPLAY and len(s.inbox) == 0
    s.inbox.push(np.zeros(FRAME, np.float32))
    underruns = s.feed.underruns
    t, plan = live_plan(sch, 2, sessions, np.zeros(S, bool))
    assert s.phase is Phase.LIVE and plan.live[3] and not plan.quiet[3] and s.feed.underruns == underruns
    assert isinstance(got[-1], ToolResultConsumed)
    assert s.feed.frames_consumed == s.inbox.frames_in == 4
    # the other session saw only its own frames
    assert all(isinstance(e, AudioFrame) for e in other_got)


@pytest.mark.parametrize(
    "text, reason",
    [
        ('<TOOLCALL>[{"name": "check_availability", "arguments": {"guests": 2}</TOOLCALL>', "not valid JSON"),
        ('<TOOLCALL>[{"arguments": {}}]</TOOLCALL>', "no tool name"),
        ("check_availability(2)", "must be wrapped"),
    ],
)
def test_a_malformed_call_gets_an_error_result_and_the_session_carries_on(text, reason):
    sch = sched()
    s, got = make_session(2, Phase.TOOL_CALL)
    t = sch.begin_tick(0, [s])
    run_call(sch, t, s, text)
    rejected = [e for e in got if isinstance(e, ToolCallRejected)]
    assert rejected and reason in rejected[0].reason
    assert s.phase is Phase.PREFILL and s.call.errors == 1
    assert "could not be run" in TOK.decode(s.progress.prefill_ids)


def test_unknown_tools_and_timeouts_become_error_results():
    now = [100.0]
    sch = sched(tool_timeout_s=0.05, clock=lambda: now[0])  # the calls' time, moved by hand
    s, got = make_session(1, Phase.TOOL_CALL)
    t = sch.begin_tick(0, [s])
    run_call(
        sch,
        t,
        s,
        '<TOOLCALL>[{"name": "launch_rocket", "arguments": {}}, '
        '{"name": "check_availability", "arguments": {}}]</TOOLCALL>',
    )
    assert [type(e) for e in got] == [ToolCallRejected, FunctionCall]
    sch.poll(t, now[0])
    assert s.phase is Phase.WAITING  # still waiting for the known tool
    now[0] += 0.04
    sch.poll(t, now[0])
    assert s.phase is Phase.WAITING  # not yet past the bound
    now[0] += 0.02
    sch.poll(t, now[0])
    assert s.phase is Phase.PREFILL
    text = TOK.decode(s.progress.prefill_ids)
    assert "no tool named 'launch_rocket'" in text and "did not answer within" in text


def test_a_result_polled_at_the_start_of_a_tick_is_due_by_that_tick_plus_the_bound():
    """The tick's number and sessions are set before its first poll: a result that arrives between ticks is
    due `result_ticks` after the tick that takes it in, not after the tick before."""
    sch = sched(result_ticks=12)
    s, got = make_session(1, Phase.TOOL_CALL)
    t = sch.begin_tick(4, [s])
    run_call(sch, t, s, '<TOOLCALL>[{"name": "check_availability", "arguments": {}}]</TOOLCALL>')
    (call,) = [e for e in got if isinstance(e, FunctionCall)]
    s.requests.put(SubmitResult(call.call_id, "{}"))
    t = sch.begin_tick(5, [s])
    sch.poll(t, time.monotonic())
    assert s.phase is Phase.PREFILL and s.progress.prefill_by == 5 + 12


def test_a_runaway_call_is_cut_at_the_token_limit():
    sch = sched(max_call_tokens=16)
    s, got = make_session(0, Phase.TOOL_CALL)
    t = sch.begin_tick(0, [s])
    for _ in range(16):
        w = sch.next_tool_work(t, 100.0)
        sch.apply_tool(t, w, ToolResult(func=np.array([TOK.encode("a")[0]])), 1.0)
    assert s.phase is Phase.PREFILL
    assert "exceeded 16 tokens" in got[-1].reason


class HeldPool:
    """An executor that runs nothing until `run_all`."""

    def __init__(self) -> None:
        self.jobs: list = []

    def submit(self, fn, *args) -> Future:
        fut: Future = Future()
        self.jobs.append((fut, fn, args))
        return fut

    def run_all(self) -> None:
        for fut, fn, args in self.jobs:
            fut.set_result(fn(*args))
        self.jobs.clear()


def test_results_are_tokenised_off_the_tick_and_the_others_keep_their_cadence():
    """A long tool result's tokens are encoded by the engine's encoder pool: the session stays WAITING until
    they are ready, every other session stays in the live batch meanwhile, and the prefill is exactly the
    tokens of the whole response."""
    pool = HeldPool()
    sch = sched(encode_pool=pool)
    s, got = make_session(1, Phase.TOOL_CALL)
    other, _ = make_session(4)
    sessions = [s, other]
    t = sch.begin_tick(0, sessions)
    run_call(sch, t, s, '<TOOLCALL>[{"name": "check_availability", "arguments": {}}]</TOOLCALL>')
    (call,) = [e for e in got if isinstance(e, FunctionCall)]
    output = json.dumps({"rooms": ["a quiet room facing the garden"] * 400})  # about 13,000 characters
    s.requests.put(SubmitResult(call.call_id, output))
    for tick in range(1, 4):  # the tokens are not ready: the session waits, the other one is live
        sch.poll(t, time.monotonic())
        assert s.phase is Phase.WAITING and len(pool.jobs) == 1
        t, plan = live_plan(sch, tick, sessions, np.zeros(S, bool))
        assert plan.live[4] and not plan.live[1]
        assert sch.next_tool_work(t, 100.0) is None  # nothing of the waiting session's on the tick
    pool.run_all()
    sch.poll(t, time.monotonic())
    assert s.phase is Phase.PREFILL
    assert s.progress.prefill_ids == TOK.response_ids([{"name": "check_availability", "output": output}])


def test_an_oversized_result_is_owed_a_chunk_a_tick_not_its_whole_length_within_the_bound():
    """Positions forced whatever the time are the others' cadence: a result too long to prefill within
    `result_ticks` at one chunk a tick gets one chunk a tick; a short one is still done within the bound."""
    sch = sched(result_chunk=16, result_ticks=4)
    for n_chars, most_owed in ((10, None), (8000, 16)):
        s, got = make_session(2, Phase.TOOL_CALL)
        t = sch.begin_tick(0, [s])
        run_call(sch, t, s, '<TOOLCALL>[{"name": "check_availability", "arguments": {}}]</TOOLCALL>')
        (call,) = [e for e in got if isinstance(e, FunctionCall)]
        s.requests.put(SubmitResult(call.call_id, "x " * (n_chars // 2)))
        sch.poll(t, time.monotonic())
        total, owed, ticks = len(s.progress.prefill_ids), [], 0
        while s.phase is Phase.PREFILL:
            t, _ = live_plan(sch, ticks, [s], np.zeros(S, bool))
            owed.append(s.progress.owed)
            while (w := sch.owed_work(t)) is not None:  # no slack at all: only what is owed runs
                sch.apply_tool(t, w, ToolResult(), 1.0)
            ticks += 1
        if most_owed is None:
            assert ticks <= 4 and total > 16, (owed, total)  # within the bound: up to 4 x 16 positions
        else:
            assert max(owed) <= most_owed and ticks == -(-total // 16), (max(owed), ticks, total)


def test_a_rejected_call_is_answered_through_the_encoder_pool_too():
    pool = HeldPool()
    sch = sched(encode_pool=pool)
    s, got = make_session(2, Phase.TOOL_CALL)
    t = sch.begin_tick(0, [s])
    run_call(sch, t, s, "check_availability(2)")
    assert isinstance(got[-1], ToolCallRejected) and s.phase is Phase.WAITING
    pool.run_all()
    sch.poll(t, time.monotonic())
    assert s.phase is Phase.PREFILL and "could not be run" in TOK.decode(s.progress.prefill_ids)


def test_the_tokenizer_lets_go_of_the_gil_while_it_encodes():
    """`Tokens.encode` gives the ids of the tokenizer's own `encode`, and another thread keeps running while
    it works on a long text (the tick thread, while a result is tokenised)."""
    text = json.dumps([{"name": "hotel_info", "output": "The pool opens at seven. " * 4000}])
    assert TOK.encode(text) == TOK.tok.encode(text, add_special_tokens=False).ids
    done = threading.Event()
    steps = 0

    def encode() -> None:
        for _ in range(5):
            TOK.encode(text)
        done.set()

    t = threading.Thread(target=encode)
    t.start()
    while not done.is_set():
        steps += 1
        time.sleep(0)
    t.join()
    # holding the GIL, the encoder would let this loop through about once per 5 ms switch interval
    assert steps > 50, steps


def test_frame_inbox_cuts_any_chunking_into_exact_frames():
    inbox = FrameInbox(FRAME, max_frames=4)
    audio = (np.arange(3 * FRAME + 100) % 1000).astype(np.int16)
    for chunk in np.array_split(audio, 7):
        inbox.push(chunk)
    frames = [inbox.pop() for _ in range(3)]
    assert inbox.pop() is None and inbox.frames_in == 3
    assert np.allclose(np.concatenate(frames), audio[: 3 * FRAME] / 32768.0)
    bad = np.full(FRAME, np.nan, np.float32)
    inbox.push(bad)
    frame = inbox.pop()  # the 100-sample tail of the first push, then the NaNs replaced by silence
    assert inbox.nonfinite == FRAME
    assert np.allclose(frame[:100], audio[3 * FRAME :] / 32768.0) and np.all(frame[100:] == 0)
    for _ in range(6):
        inbox.push(np.zeros(FRAME, np.float32))
    assert len(inbox) == 4 and inbox.dropped == 2
    with pytest.raises(ValueError, match="mono"):
        inbox.push(np.zeros((2, 100), np.float32))
    with pytest.raises(ValueError, match="int16 or float"):
        inbox.push(np.zeros(100, np.int32))


def frames_at_each_tick(sch: Scheduler, s: Session, arrivals: list[int], loud: bool = False) -> list[int]:
    """Tick by tick, `arrivals[k]` frames arrive before tick k is planned; the inbox's depth at each plan."""
    depth = []
    for k, n in enumerate(arrivals):
        for _ in range(n):
            s.inbox.push(np.full(FRAME, 0.5 if loud else 0.0, np.float32))
        depth.append(len(s.inbox))
        t, _ = live_plan(sch, k, [s], np.zeros(S, bool))
    return depth


def test_a_frame_the_steady_arrivals_never_need_is_shed_after_a_while():
    """A live session that came back from replay with a frame of reserve: while every tick finds a frame to
    spare (steady arrivals), the reserve is a frame of latency, so after `spare_ticks` the oldest silent
    frame goes, once; then each frame is taken in the tick it arrived for. (Before, the reserve stood for the
    call.)"""
    sch = sched(spare_ticks=10)
    s, _ = make_session(0)
    s.inbox.push(np.zeros(FRAME, np.float32))  # the reserve
    depth = frames_at_each_tick(sch, s, [1] * 30)
    assert depth[:10] == [2] * 10 and depth[10:] == [1] * 20, depth
    assert s.inbox.skipped == 1 and s.feed.underruns == 0


def test_speech_is_never_shed_and_jittery_arrivals_keep_their_reserve():
    sch = sched(spare_ticks=10)
    loud, _ = make_session(0)
    loud.inbox.push(np.full(FRAME, 0.5, np.float32))
    assert frames_at_each_tick(sch, loud, [1] * 30, loud=True) == [2] * 30  # the caller talking: kept
    assert loud.inbox.skipped == 0
    # arrivals that straddle the tick (none, then two): every other tick takes the reserve, never shed
    jittery, _ = make_session(1)
    jittery.inbox.push(np.zeros(FRAME, np.float32))
    depth = frames_at_each_tick(sch, jittery, [0, 2] * 15)
    assert jittery.inbox.skipped == 0 and jittery.feed.underruns == 0 and min(depth) == 1, depth


def test_a_session_back_from_replay_holds_no_frame_until_an_arrival_comes_late():
    """Caught up, a session takes each frame in the tick it arrived for: no frame is held back as a reserve
    (with a reserve of one, as before, every frame waited a tick: 80 ms of mouth to ear). A late arrival makes
    the reserve it needs (the tick it missed hears silence, counted), and steady arrivals shed it again."""
    sch = sched(spare_ticks=10, live_lag_frames=12)
    s, _ = make_session(0, Phase.REPLAY)
    s.progress.live_by = 5
    s.inbox.push(np.zeros(FRAME * 3, np.float32))  # held while the prompt was prefilled
    depth = frames_at_each_tick(sch, s, [1] * 10)
    assert s.phase is Phase.LIVE and depth[-4:] == [1] * 4, depth  # each frame taken in the tick it came for
    assert s.feed.underruns == 0
    # one arrival a tick late: that tick underruns once, and the late frame then waits behind the next
    depth = frames_at_each_tick(sch, s, [0, 2] + [1] * 5)
    assert s.feed.underruns == 1 and depth[2:] == [2] * 5, depth
    # steady arrivals for `spare_ticks`: the reserve goes again (its oldest silent frame)
    depth = frames_at_each_tick(sch, s, [1] * 12)
    assert depth[-2:] == [1, 1] and s.inbox.skipped >= 1, depth


def test_arrivals_late_again_and_again_keep_their_reserve_longer_and_a_lone_late_one_does_not():
    """As NetEQ keeps a buffer for the jitter it keeps seeing: each arrival late again within
    `late_memory_ticks` of the last doubles how long its reserve is kept (up to `max_spare_ticks`), so a
    caller whose frames keep coming late stops underrunning at every one; a late arrival long after the last
    keeps its reserve `spare_ticks` again. (Before, every reserve went after `spare_ticks`, and each late
    arrival after that was an underrun again.)"""
    sch = sched(spare_ticks=10, live_lag_frames=12, late_memory_ticks=60, max_spare_ticks=40)
    s, _ = make_session(0)
    tick = 0

    def run(arrivals: list[int]) -> list[int]:
        nonlocal tick
        depth = []
        for n in arrivals:
            for _ in range(n):
                s.inbox.push(np.zeros(FRAME, np.float32))
            depth.append(len(s.inbox))
            live_plan(sch, tick, [s], np.zeros(S, bool))
            tick += 1
        return depth

    def held_for(steady: int) -> int:
        """A late arrival (a tick with none, then two), then `steady` ticks of one: how many ticks the reserve
        it made was held (the inbox at two after the late tick)."""
        before = s.feed.underruns
        depth = run([0, 2] + [1] * steady)
        assert s.feed.underruns == before + 1, depth  # the late arrival: its tick heard silence
        return sum(d == 2 for d in depth[2:])

    run([1] * 5)
    assert [held_for(45) for _ in range(4)] == [9, 19, 39, 39]  # late again within the memory: doubled
    run([1] * 80)  # steady for longer than the memory
    assert held_for(45) == 9  # a lone late arrival: the reserve goes after `spare_ticks` again
    assert s.inbox.skipped == 5  # each reserve shed once, as a silent frame


def test_a_reserve_the_caller_never_falls_silent_for_is_heard_in_the_slack_while_the_agent_listens():
    """A caller who talks without a pause: no silent frame to shed. While the agent is not speaking the
    slack hears the reserve's frame in a quiet step, so nothing of the caller is lost and each later frame
    is heard in the tick it arrived for. While the agent speaks the reserve stands (a quiet step would cut
    its speech)."""
    sch = sched(spare_ticks=10)
    talking, _ = make_session(0)
    talking.turn.speaking = True
    talking.inbox.push(np.full(FRAME, 0.5, np.float32))  # the reserve
    assert frames_at_each_tick(sch, talking, [1] * 15, loud=True) == [2] * 15
    assert sch.next_tool_work(sch.begin_tick(15, [talking]), 100.0) is None and not talking.feed.catch_up

    listening, _ = make_session(1)
    listening.inbox.push(np.full(FRAME, 0.5, np.float32))
    depth = []
    for k in range(15):
        listening.inbox.push(np.full(FRAME, 0.5, np.float32))
        depth.append(len(listening.inbox))
        t, _ = live_plan(sch, k, [listening], np.zeros(S, bool))
        while (w := sch.next_tool_work(t, 100.0)) is not None:
            assert w.kind == "replay" and w.active.tolist() == [False, True] + [False] * (S - 2)
            sch.apply_tool(t, w, ToolResult(), 1.0)
    assert depth[:10] == [2] * 10 and depth[10:] == [1] * 5, depth
    assert listening.feed.caught_up == 1 and listening.inbox.skipped == 0 and listening.feed.underruns == 0
    assert listening.feed.frames_consumed == listening.inbox.frames_in == 16


def test_the_fixed_buffer_baseline_keeps_a_frame_in_reserve_for_the_call():
    """The benchmarks' baseline (EngineConfig.fixed_buffers): back from replay a session keeps one frame in
    reserve, and steady arrivals never shed it, as before the reserve followed the arrivals."""
    from engine.config.engine_config import EngineConfig
    from engine.config.presets import load_preset
    from engine.tick import build

    lim = build.limits(EngineConfig(preset="tiny", fixed_buffers=True), load_preset("tiny"))
    assert (lim.reserve_frames, lim.spare_ticks > 10**6) == (1, True)
    sch = Scheduler(S, TOK, FRAME, lim)
    s, _ = make_session(0, Phase.REPLAY)
    s.progress.live_by = 5
    s.inbox.push(np.zeros(FRAME * 3, np.float32))
    depth = frames_at_each_tick(sch, s, [1] * 60)
    assert s.phase is Phase.LIVE and depth[-40:] == [2] * 40 and s.inbox.skipped <= 2, depth
