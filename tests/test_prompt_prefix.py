"""A prompt's shared prefix (engine/tick/session.py, engine/tick/scheduler.py): the agent's system prompt and
tools are prefilled once and their state kept, whatever a call adds after them (`open_session(context=)`, the
earlier turns of a call carried on after a break). On the scheduler with hand-made results, then on the engine
at the tiny preset: a call carried on prefills only its own part, and hears and says exactly what the same
prompt prefilled whole from nothing gives."""

import numpy as np

from engine.api import AudioFrame
from engine.config.stage_config import TokenConfig
from engine.text.tokens import Tokens
from engine.tick.plan import Limits, ToolResult
from engine.tick.scheduler import Scheduler
from engine.tick.session import Phase, Session
from engine.tick.slots import FrameInbox
from engine_support import caller_audio, drain, engine_on, run_ticks
from testkit.concierge import PROMPT, TOOLS

S, FRAME = 8, 1280
TOK = Tokens(TokenConfig())
CONTEXT = (
    "Before the break you said:\n- Your room for two nights is ready.\nYour tools had returned:\n- (none)"
)


def prompting(slot: int, ids: list[int], prefix_len: int, own: bool) -> Session:
    """A PROMPT session of `ids` whose first `prefix_len` are the shared prefix (`own`: a call's own part
    follows it, and the whole is not kept)."""
    return Session(
        f"s{slot}",
        slot,
        frozenset(),
        FrameInbox(FRAME, 100),
        lambda _items: None,
        phase=Phase.PROMPT,
        prefill_ids=ids,
        prompt_key=hash(tuple(ids)),
        prefix_key=hash(tuple(ids[:prefix_len])),
        prefix_len=prefix_len,
        keep_prompt=not own,
    )


def test_the_prefix_is_prefilled_once_kept_and_each_call_prefills_only_its_own_part():
    """Two ordinary calls of one prompt and two carried on with it, all opened at once: the prefix is
    prefilled once, the ordinary prompt's end once, each carried call's own part once; every one of them
    goes on from the states the others made, and only the prefix and the ordinary prompt are kept."""
    sch = Scheduler(S, TOK, FRAME, Limits(prefill_chunk=64))
    prefix = list(range(40, 240))  # 200 positions
    plain = [prompting(slot, [*prefix, TOK.eos], 200, own=False) for slot in (0, 3)]
    carried = [
        prompting(1 + i, [*prefix, *range(300 + 30 * i, 330 + 30 * i), TOK.eos], 200, True) for i in (0, 1)
    ]
    sessions = [*plain, *carried]
    positions: dict[int, int] = {}
    saves, restores = [], []
    for k in range(
        20
    ):  # a piece of work a tick: the states are made over several ticks, as the engine paces them
        t = sch.begin_tick(k, sessions)
        restores += sch.plan_live(t, np.zeros(S, bool)).restore
        if (w := sch.next_tool_work(t, 1000.0)) is not None and w.kind == "prompt":
            for s in w.sessions:
                start = s.progress.prefill_pos
                assert start >= 200 or start + w.tokens.shape[1] <= 200  # never across the prefix's end
                positions[s.slot] = positions.get(s.slot, 0) + w.tokens.shape[1]
            done = sch.apply_tool(t, w, ToolResult(), 1.0)
            for _, key in done.saves:  # the runner keeps the state, as the engine has it do at once
                sch.prompts.save(key, {})
            saves += done.saves
    assert all(s.phase is not Phase.PROMPT for s in sessions)
    assert sum(positions.values()) == 200 + 1 + 30 + 30 + 2  # each made once: the prefix, the ends, the parts
    # kept: the prefix and the ordinary prompt whole; never a carried call's own whole prompt
    assert [key for _, key in saves] == [plain[0].prefix_key, plain[0].prompt_key]
    assert sch.cached_prompts == {plain[0].prefix_key, plain[0].prompt_key}
    # the calls that did not make a state were given it
    made = {slot for slot, _ in saves}
    for s in sessions:
        got = {key for slot, key in restores if slot == s.slot}
        if s in carried:
            assert positions[s.slot] >= 31 and (got == {s.prefix_key} or s.slot in made)
        elif s.slot not in made:
            assert s.prompt_key in got


def count_prompt_positions(engine) -> list[int]:
    """The prompt positions each piece of the engine's prefill work takes from here on (rows times positions),
    appended as the runner runs it."""
    prefilled: list[int] = []
    tool = engine.runner.tool

    def counted(work):
        if work.kind == "prompt":
            prefilled.append(work.tokens.shape[1] * len(work.sessions))
        return tool(work)

    engine.runner.tool = counted
    return prefilled


def frames(items) -> list[np.ndarray]:
    return [i.samples for i in items if isinstance(i, AudioFrame)]


def carried_call(cache: int, warm: bool) -> tuple[list[np.ndarray], list[str], int, set[int]]:
    """A call carried on (CONTEXT) on an engine whose prompt cache holds `cache` states, after an ordinary
    call of the same agent (`warm`) or none: its frames and texts, the prompt positions its own prefill took,
    and the prompt states kept."""
    with engine_on(num_slots=2, prompt_cache_size=cache) as e:
        k = 0
        if warm:
            first = e.open_session(PROMPT, TOOLS)
            k = run_ticks(e, k, 1)
            first.close()
        else:
            e.open_session(PROMPT, TOOLS).close()  # the same slot number as the warm engine's call
            k = run_ticks(e, k, 1)
        prefilled = count_prompt_positions(e)
        h = e.open_session(PROMPT, TOOLS, context=CONTEXT)
        assert h.slot == 1
        h.push_audio(caller_audio(9, 0.8))
        run_ticks(e, k, 8)
        out = drain(h)
        return (
            frames(out),
            [i.text for i in out if isinstance(i, AudioFrame)],
            sum(prefilled),
            set(e.scheduler.cached_prompts),
        )


def test_a_call_carried_on_prefills_only_its_own_part_and_runs_as_its_whole_prompt_prefilled_from_nothing():
    got, got_text, own, kept = carried_call(8, warm=True)
    want, want_text, whole, nothing = carried_call(0, warm=False)
    ids, prefix_len = TOK.prompt_parts(PROMPT, TOOLS, CONTEXT)
    base, _ = TOK.prompt_parts(PROMPT, TOOLS)
    assert whole == len(ids) and own == len(ids) - prefix_len  # its context and the end, nothing before
    assert kept == {hash(tuple(base[:prefix_len])), hash(tuple(base))} and not nothing
    assert len(got) == len(want) == 7
    assert all(np.array_equal(a, b) for a, b in zip(got, want, strict=True))
    assert got_text == want_text


def test_the_prompts_warmed_at_start_are_kept_and_their_sessions_closed():
    """An engine started with `warm_prompts` prefills them in sessions of their own, closed once their state
    is kept: a call then opened with one of them prefills nothing, and one carried on with it only its own
    part."""
    from engine.config.engine_config import WarmPrompt
    from engine.tick.engine import Engine, EngineConfig
    from wait_support import wait_until

    warm = [WarmPrompt(prompt=PROMPT, tools=TOOLS), WarmPrompt(prompt="You are the night porter.")]
    with Engine(EngineConfig(preset="tiny", num_slots=3, warm_prompts=warm)) as e:
        keys = {hash(tuple(TOK.prompt_parts(w.prompt, w.tools)[0])) for w in warm}
        wait_until(lambda: keys <= e.scheduler.cached_prompts and not e.pool.sessions, "the warm-up", 120)
        prefilled = count_prompt_positions(e)
        plain = e.open_session(PROMPT, TOOLS)
        wait_until(lambda: plain.phase != "prompt", "the plain call's start", 60)
        assert sum(prefilled) == 0
        ids, prefix_len = e.tokens.prompt_parts(PROMPT, TOOLS, CONTEXT)
        carried = e.open_session(PROMPT, TOOLS, context=CONTEXT)
        wait_until(lambda: carried.phase != "prompt", "the carried call's prefill", 60)
        assert sum(prefilled) == len(ids) - prefix_len
