"""A session's phase moves and the agent's requests (engine/tick/session.py), and the prompt cache
(engine/tick/prompt_cache.py): plain objects, no model."""

import pytest

from engine.api import ForceTokens, SubmitResult
from engine.tick.prompt_cache import PromptCache
from engine.tick.session import MOVES, Hold, Phase, Session
from engine.tick.slots import FrameInbox


def session(phase: Phase = Phase.PROMPT) -> Session:
    return Session(
        "s0", 0, frozenset({"check_availability"}), FrameInbox(1280, 8), lambda items: None, phase=phase
    )


def test_a_phase_moves_only_along_the_table_and_records_when():
    s = session(Phase.LIVE)
    with pytest.raises(ValueError, match="no move from live to prefill"):
        s.enter(Phase.PREFILL, 3)
    assert s.phase is Phase.LIVE and s.since == -1
    s.enter(Phase.TOOL_CALL, 4)
    s.enter(Phase.PREFILL, 5, ids=[7, 8, 9], by=17)
    assert (s.phase, s.since, s.progress.prefill_ids, s.progress.prefill_pos) == (
        Phase.PREFILL,
        5,
        [7, 8, 9],
        0,
    )
    assert s.progress.prefill_by == 17
    s.progress.prefill_pos = 3
    s.enter(Phase.REPLAY, 6, by=31)
    assert (s.progress.prefill_ids, s.progress.prefill_pos, s.progress.live_by) == ([], 0, 31)
    s.enter(Phase.LIVE, 7)
    # every phase can be left, and every phase reached
    assert set(MOVES) == set(Phase) and set().union(*MOVES.values()) == set(Phase) - {Phase.PROMPT}


def test_the_agents_requests_reach_the_session_only_when_the_tick_takes_them():
    s = session(Phase.WAITING)
    s.requests.put(ForceTokens("text", (1, 2)))
    s.requests.put(ForceTokens("function", (3,)))
    s.requests.put(Hold(0))
    s.requests.put(SubmitResult("call_x", "{}"))
    assert not s.forcing.text and s.forcing.hold_text == -1  # nothing written before the tick drains
    results = []
    s.take_requests(lambda sess, r: results.append((sess, r["call_id"])))
    assert list(s.forcing.text) == [1, 2] and list(s.forcing.func) == [3]
    assert (s.forcing.hold_text, s.forcing.hold_func) == (0, 0) and results == [(s, "call_x")]
    assert s.requests.empty()


def test_the_prompt_cache_evicts_the_least_recently_used_and_publishes_its_keys():
    cache = PromptCache(2)
    cache.save(1, {"a": 1})
    cache.save(2, {"a": 2})
    assert cache.load(1) == {"a": 1}  # 1 is now the most recently used
    keys = cache.keys
    cache.save(3, {"a": 3})
    assert 2 not in cache and 1 in cache and 3 in cache and cache.evicted == 1
    assert keys == {1, 2} and cache.keys == {1, 3}  # a reader's copy never changes under it
