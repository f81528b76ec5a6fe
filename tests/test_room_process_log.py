"""A room's process's log reaches the worker's handler as the worker's own does: a SIP call's job, run by
livekit-agents' process executor in a process of its own, writes lines whose fields (the executor adds the
job's room and ids to each as it passes them on to the worker's handlers) and text hold no digit run of the
caller's number, and name the room by its label."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import multiprocessing as mp
import re
import sys

from livekit.agents.ipc.job_proc_executor import ProcJobExecutor
from livekit.agents.job import JobAcceptArguments, RunningJobInfo
from livekit.protocol import agent, models

import room_log_job
from agent.call import room_label
from agent.log_privacy import mask_log_handlers
from wait_support import await_until

PHONE_ROOM = "call-_+14155550123_AbCd"  # a SIP dispatch rule names a call's room after the caller's number
DIGIT_RUNS = ["14155550123", "4155550123", "415555", "5550123"]


async def run_job(out: io.StringIO) -> None:
    executor = ProcJobExecutor(
        initialize_process_fnc=room_log_job.prewarm,
        job_entrypoint_fnc=room_log_job.entrypoint,
        session_end_fnc=None,
        simulation_end_fnc=None,
        inference_executor=None,
        initialize_timeout=60.0,
        close_timeout=10.0,
        session_end_timeout=5.0,
        memory_warn_mb=0,
        memory_limit_mb=0,
        ping_interval=2.5,
        ping_timeout=60.0,
        high_ping_threshold=2.0,
        http_proxy=None,
        mp_ctx=mp.get_context("spawn"),
        loop=asyncio.get_running_loop(),
    )
    await executor.start()
    try:
        await executor.initialize()
        job = agent.Job(id="AJ_sip", room=models.Room(name=PHONE_ROOM, sid="RM_sip"), type=agent.JT_ROOM)
        await executor.launch_job(
            RunningJobInfo(
                accept_arguments=JobAcceptArguments(name="", identity="agent-AJ_sip", metadata=""),
                job=job,
                url="ws://127.0.0.1:7880",
                token="",
                worker_id="W_test",
                fake_job=True,
            )
        )
        await await_until(lambda: "job done" in out.getvalue(), "the job's last line", 60)
    finally:
        await executor.aclose()


def test_a_room_process_log_line_carries_no_callers_number():
    """The lines of a SIP call's room process as the worker's handler (livekit-agents' CLI's, JSON) writes
    them: every field and the text without the caller's number, the room as its label."""
    from livekit.agents.cli.log import setup_logging

    out = io.StringIO()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    stdout, sys.stdout = sys.stdout, out
    try:
        setup_logging("INFO", devmode=False, console=False)
        mask_log_handlers()  # as the worker does once its CLI's handler is in place
        asyncio.run(run_job(out))
    finally:
        sys.stdout = stdout
        for handler in [h for h in root.handlers if h not in handlers]:
            root.removeHandler(handler)
        root.setLevel(level)
    text = out.getvalue()
    print(text)
    lines = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    joined = next(line for line in lines if line.get("message") == "participant joined")
    answered = next(line for line in lines if str(line.get("message", "")).startswith("call in "))
    assert joined["room"] == answered["room"] == room_label(PHONE_ROOM)  # the executor's field, as the label
    assert joined["lk.pii.room_name"] == room_label(PHONE_ROOM)
    assert (joined["job_id"], joined["room_id"]) == ("AJ_sip", "RM_sip")  # what is not personal stays
    assert [run for run in DIGIT_RUNS if run in text] == []
    assert re.findall(r"\d{7,}", text) == []
