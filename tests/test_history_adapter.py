"""agent/history.py against the installed livekit-agents: each private attribute it relies on (`PRIVATE`) is
still where it was and still does what the trim needs, on a real `AgentSession` running a duplex model.

These fail when livekit-agents moves or changes one of them, before a long call's memory quietly stops being
bounded. The model is a stub that tells nothing to anyone (no engine): only the framework's side is under
test; tests/test_agent_session.py runs the trim on the real engine through a long call.
"""

from __future__ import annotations

import asyncio
import logging

from livekit import rtc
from livekit.agents import Agent, AgentSession, ConversationItemAddedEvent, get_job_context, llm
from livekit.agents.testing import fake_job_context
from livekit.agents.utils import aio

from agent import history

APPEND_ONLY = "append-only"  # the duplex adapter's warning when a context update removes what it was told


class StubDuplex(llm.DuplexModel):
    """A duplex model that stays silent and records what the framework tells it."""

    def __init__(self) -> None:
        super().__init__(
            capabilities=llm.DuplexCapabilities(user_transcription=False, auto_tool_reply_generation=True)
        )
        self.sessions: list[StubSession] = []

    def session(self) -> StubSession:
        self.sessions.append(StubSession(self))
        return self.sessions[-1]

    async def aclose(self) -> None:
        for s in self.sessions:
            await s.aclose()


class StubSession(llm.DuplexSession):
    def __init__(self, model: StubDuplex) -> None:
        super().__init__(model)
        self.appended: list[llm.ChatItem] = []
        self._audio: aio.Chan[llm.DuplexAudioFrame] = aio.Chan()

    @property
    def audio_stream(self):
        return self._audio

    @property
    def tools(self) -> llm.ToolContext:
        return llm.ToolContext.empty()

    def push_audio(self, frame: rtc.AudioFrame) -> None:
        pass

    async def _update_instructions(self, instructions: str) -> None:
        pass

    async def _append_items(self, items: list[llm.ChatItem]) -> None:
        self.appended.extend(items)

    async def _update_tools(self, tools: list[llm.Tool]) -> None:
        pass

    def _update_options(self, *, tool_choice=None) -> None:
        pass

    async def aclose(self) -> None:
        await super().aclose()
        if not self._audio.closed:
            self._audio.close()


def said(text: str) -> llm.ChatMessage:
    return llm.ChatMessage(role="user", content=[text])


async def started() -> tuple[AgentSession, Agent, StubDuplex]:
    model = StubDuplex()
    session = AgentSession(llm=model, vad=None, turn_handling={"turn_detection": None})
    agent = Agent(instructions="You are a test concierge.")
    await session.start(agent=agent, record=False)
    return session, agent, model


async def tell(agent: Agent, *items: llm.ChatItem) -> None:
    """The framework's public way to add to the agent's context (the adapter passes the new items on)."""
    ctx = agent.chat_ctx.copy()
    for item in items:
        ctx.insert(item)
    await agent.update_chat_ctx(ctx)


def test_the_private_attributes_are_there_on_a_running_session():
    async def main():
        with fake_job_context():
            session, agent, _ = await started()
            found = {
                "AgentSession._recorded_events": history.recorded_events(session),
                "Agent._chat_ctx": getattr(agent, "_chat_ctx", None),
                "_DuplexRealtimeSession._chat_ctx": getattr(agent.realtime_llm_session, "_chat_ctx", None),
            }
            adapter = type(agent.realtime_llm_session).__name__
            contexts = history.contexts(session)
            await session.aclose()
            return found, adapter, contexts

    found, adapter, contexts = asyncio.run(main())
    assert set(found) == set(history.PRIVATE)  # every attribute relied on is checked here
    assert isinstance(found["AgentSession._recorded_events"], list)
    assert isinstance(found["Agent._chat_ctx"], llm.ChatContext)
    assert isinstance(found["_DuplexRealtimeSession._chat_ctx"], llm.ChatContext)
    assert adapter == "_DuplexRealtimeSession"
    assert [id(c) for c in contexts[1:]] == [
        id(found["Agent._chat_ctx"]),
        id(found["_DuplexRealtimeSession._chat_ctx"]),
    ]


def test_the_session_report_lists_the_bounded_event_record():
    """`AgentSession.emit` appends to the record `bound_call_memory` replaced, and the job's session report
    reads that record: both bounded, the newest events kept."""

    async def main():
        with fake_job_context():
            session, _, _ = await started()
            assert history.bound_call_memory(session, keep=4, events=8)
            for i in range(50):
                session.emit("conversation_item_added", ConversationItemAddedEvent(item=said(f"event {i}")))
            report = get_job_context().make_session_report(session)
            recorded = list(history.recorded_events(session))
            await session.aclose()
            return [
                e.item.text_content for e in recorded if isinstance(e, ConversationItemAddedEvent)
            ], report.events

    recorded, reported = asyncio.run(main())
    print(len(recorded), len(reported))
    assert 8 <= len(recorded) < 16 and recorded[-1] == "event 49"  # the newest kept, at most twice the bound
    assert len(reported) < 16


def test_trimming_the_agents_and_the_adapters_context_in_step_keeps_the_adapters_diff_append_only(caplog):
    """The adapter diffs a context update against its private context: trimmed in step with the agent's, the
    next update hands the model only what is new, with no warning; the agent's alone trimmed, the adapter
    sees removals (the negative control: what the in-step trim prevents)."""

    async def main():
        with fake_job_context():
            session, agent, model = await started()
            await tell(agent, *[said(f"turn {i}") for i in range(10)])
            told_before = len(model.sessions[-1].appended)
            ctxs = history.contexts(session)[1:]  # the agent's and the adapter's
            dropped = history.trim_contexts(ctxs, keep=4)
            shown = [m.text_content for m in agent.chat_ctx.messages()]  # the public view of the agent's
            copied = [m.text_content for m in agent.realtime_llm_session.chat_ctx.messages()]
            with caplog.at_level(logging.WARNING):
                await tell(agent, said("turn 10"))
                in_step = [r for r in caplog.records if APPEND_ONLY in r.getMessage()]
                told = [i.text_content for i in model.sessions[-1].appended[told_before:]]
                caplog.clear()
                history.trim_contexts([history.contexts(session)[1]], keep=2)  # the agent's only
                await tell(agent, said("turn 11"))
                agent_only = [r for r in caplog.records if APPEND_ONLY in r.getMessage()]
            await session.aclose()
            return dropped, shown, copied, in_step, told, agent_only

    dropped, shown, copied, in_step, told, agent_only = asyncio.run(main())
    print(dropped, shown, copied, told)
    assert dropped == 2 * 6  # six old turns from each context
    assert [t for t in shown if t.startswith("turn")] == [f"turn {i}" for i in range(6, 10)]
    assert [t for t in copied if t.startswith("turn")] == [f"turn {i}" for i in range(6, 10)]
    assert in_step == [] and told == ["turn 10"]
    assert agent_only, (
        "the adapter diffs against its own context: trimming the agent's alone shows as removals"
    )
