"""The tick thread's CPU priority. A tick is due every 80 ms whatever else the host runs; a room's event loop,
its audio runtime or the LiveKit server can wait a few milliseconds. Under the kernel's normal policy a core
full of such threads takes turns with the tick, stretches its live step and makes it miss deadlines (8 rooms
on two cores); under SCHED_FIFO the live step runs as soon as it is due and keeps its core until it is done,
as an audio server's processing thread does. Its default priority (50) is above what the rtc runtime gives its
own media threads where it may (libwebrtc: SCHED_FIFO 49 for the audio device, captures and encoders, 2 for a
low-priority thread), which would otherwise preempt it in mid-step. Paused work in the slack after it (tool
calls, prefills, catch-up) may fill the tick, so it runs at normal priority and takes turns with the rooms.
The kernel keeps 5% of every second for the rest anyway (`sched_rt_runtime_us`). Knows the OS; nothing of the
model.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("chorus.engine.priority")


class TickPriority:
    """The calling thread's scheduling policy: real time for the live step, normal for the slack work. Both
    switches are one syscall each, made only on ticks with slack work to do."""

    def __init__(self, priority: int) -> None:
        self.priority = priority
        self.realtime = False  # the thread has SCHED_FIFO (granted once at `start`)
        self.relaxed = False  # ...and has given it up for this tick's slack work

    def start(self) -> bool:
        """Take SCHED_FIFO at `priority` (1-99; 0: leave the thread as it is) for the calling thread. A
        process the kernel refuses (no CAP_SYS_NICE, RLIMIT_RTPRIO below `priority`, a container's policy)
        runs its tick at normal priority, said once in the log. True when it has it."""
        if self.priority <= 0:
            return False
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(self.priority))  # 0: this thread (Linux)
        except (OSError, AttributeError) as e:  # AttributeError: no such policy on this OS
            log.warning(
                "the tick runs at normal priority (real-time priority %d refused: %s); busy threads on this "
                "host can delay it: give the process CAP_SYS_NICE or RLIMIT_RTPRIO, or set the priority to 0",
                self.priority,
                e,
            )
            return False
        self.realtime = True
        log.info("the tick's live step runs at real-time priority %d (SCHED_FIFO)", self.priority)
        return True

    def relax(self) -> None:
        """Normal priority for the slack work that follows the live step."""
        if self.realtime and not self.relaxed:
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
            self.relaxed = True

    def restore(self) -> None:
        """Real time again, before the thread sleeps until its next tick."""
        if self.relaxed:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(self.priority))
            self.relaxed = False
