"""The planning tick's CPU priority: the driver's thread runs a tick under the lowest real-time priority
(``SCHED_RR`` at :data:`DECISION_RT_PRIORITY`), as an orchestrator has its own host's CPU in a real cluster.

Measured (an instrumented emulated run of the default scenario, 2 cores shared with 8 agents and the userspace
datapath; docs/orchestrator.md): the slow ticks' time was the thread waiting on the run queue for a CPU
(up to 25 ms of a 33 ms tick, both cores busy), not its computing (p99 10 ms) nor the driver's other threads
(under 2 ms in all 151 ticks). A nice value does not reach that: with autogroups (Debian's kernels) a thread's
nice weighs only against its own session's threads, and Mininet starts every agent in a session of its own
(nice -10 for the tick: p99 27.7 ms against 19.8 ms at nice 0 in the run before, i.e. noise); real-time
classes stand outside the fair scheduler's groups. Only the calling thread changes class (Linux schedules
threads), only for the tick (a few ms of computing and the servers' RPCs, which block), and it is restored
after: processes the driver forks outside a tick (the agents, at the pool's start) keep the default, and the
kernel's real-time throttling (95% of a CPU) bounds what a runaway tick could take. Without the privilege (not
root, no CAP_SYS_NICE) the tick runs as it is, and the first refusal is logged.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading

log = logging.getLogger(__name__)

DECISION_RT_PRIORITY = 1  # the lowest SCHED_RR priority: above every fair-scheduled task, below the kernel's own
_refused = False


@contextlib.contextmanager
def raised_priority(priority: int = DECISION_RT_PRIORITY):
    """Run the block with the calling thread under ``SCHED_RR`` at ``priority`` (unless it is real-time
    already); yields whether it was raised. Restores the thread's own class and priority on the way out,
    whatever the block raised."""
    global _refused
    tid = threading.get_native_id()
    try:
        old = (os.sched_getscheduler(tid), os.sched_getparam(tid))
    except (AttributeError, OSError):  # not Linux
        old = None
    raised = False
    if old is not None and old[0] not in (os.SCHED_FIFO, os.SCHED_RR):
        try:
            os.sched_setscheduler(tid, os.SCHED_RR, os.sched_param(priority))
            raised = True
        except OSError as e:
            if not _refused:
                _refused = True
                log.info("planning ticks run in the fair scheduler: real-time priority %d was refused (%s)",
                         priority, e)
    try:
        yield raised
    finally:
        if raised:
            os.sched_setscheduler(tid, old[0], old[1])
