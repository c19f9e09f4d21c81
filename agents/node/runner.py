"""The agent's engine runner: the generation engine (agents.engine) in real time, and its token streams.

Engine time is ``CLOCK_MONOTONIC / TDF`` (the time-dilation factor), so every modelled step lasts
``modelled x TDF`` of wall time and every reported time is real-time equivalent. After each wake-up the loop
streams the tokens of the steps that ended, one message per collector, over the fabric (ZeroMQ PUSH to the
collectors' fabric addresses). Every caller that reads or changes the engine takes :attr:`EngineRunner.lock`
and brings the engine up to the present first (:meth:`EngineRunner.at_now`).
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable

import numpy as np
import zmq

from agents.engine import Engine, Layout, NewRequest, StepCost
from agents.protocol import AgentConfig, TokenBatch, token_ids
from emulation.orchestration import EngineSettings

from .fidelity import Fidelity

log = logging.getLogger("agents.node")


def _tight_timer_slack() -> None:
    """1 us timer slack (default 50 us) so waits for the next step end wake on time; best effort."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(29, 1000, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class EngineRunner:
    """One agent's engine, paced by the wall clock, its fidelity record and its token streams."""

    def __init__(self, cfg: AgentConfig, ctx: zmq.Context, cost: StepCost, stopping: threading.Event,
                 cost_for: Callable[[EngineSettings, StepCost], StepCost] | None = None):
        self.cfg = cfg
        self.tdf = cfg.time_dilation
        self.cost_for = cost_for  # the step cost of other engine settings (reset), None: this one's always
        self.engine = Engine(cost, cfg.gpus, Layout.parse(cfg.layout, cfg.gpus, "config.layout"), cfg.engine)
        self.lock = threading.Lock()  # the engine, the fidelity record, the detach waiters
        self.detach_cv = threading.Condition(self.lock)
        self.wake = threading.Event()
        self.stopping = stopping
        self.fidelity = Fidelity()
        self.pending: list = []  # step outputs completed by an RPC's catch-up, streamed by the loop
        self.tokens_sent = 0
        self.token_messages = 0
        self.send_wait_s = 0.0
        self._seq = 0
        self.push: list[zmq.Socket] = []
        for ep in cfg.collectors:
            s = ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.SNDHWM, 100_000)
            s.setsockopt(zmq.LINGER, 2000)
            s.connect(ep.url)
            self.push.append(s)

    def now(self) -> float:
        return time.monotonic() / self.tdf

    def at_now(self) -> float:
        """Bring the engine up to the present (every step that ended by now completed, each next step started
        when the one before it ended) and return the present; the caller holds ``self.lock``. Every RPC that
        reads or changes the engine calls this first, so it acts on the engine as of its own arrival."""
        now = self.now()
        outs: list = []
        self.engine.run_until(now, outs)
        self.engine.finished_log.clear()  # the collectors count finishes; the agent keeps no log of them
        if outs:
            for o in outs:
                self.fidelity.record(o.modelled_s, now - o.t_end, len(o.ids))
            if any(o.detached or len(o.finished) for o in outs):
                # a request asked to stop may instead finish in its last step: its waiter must hear that too
                # (it slept out its whole timeout otherwise: a 30 s planning tick)
                self.detach_cv.notify_all()
            self.pending.extend(outs)
        return now

    def loop(self) -> None:
        """Pace the engine by the wall clock: wake when the next step ends (at most every ``tick_s`` of wall
        time), complete what ended, stream its tokens. A late wake delays tokens, never the schedule: the
        engine starts each step when the one before it ended (Engine.run_until), so the modelled timeline is
        the simulator's; the lateness (delivery lag) is what the fidelity monitor reports."""
        _tight_timer_slack()
        tick = self.cfg.tick_s
        while not self.stopping.is_set():
            self.wake.clear()
            woke = time.monotonic()
            with self.lock:
                now = self.at_now()
                outs, self.pending = self.pending, []
                nxt = self.engine.next_event()
            if outs:
                self._emit(outs, now)
            if nxt is None:
                self.wake.wait(0.5)
            else:
                delay = max((nxt - self.now()) * self.tdf, woke + tick - time.monotonic())
                if delay > 0:
                    self.wake.wait(delay)

    def _emit(self, outs, now: float) -> None:
        if not self.push:
            return
        ids = np.concatenate([o.ids for o in outs])
        if not len(ids):
            return
        pos = np.concatenate([o.pos for o in outs])
        dest = np.concatenate([o.dest for o in outs])
        fin = np.concatenate([o.finished for o in outs])
        tok = token_ids(ids, pos)
        t0 = time.perf_counter()
        for d in np.unique(dest):
            m = dest == d
            f = fin[np.isin(fin, ids[m])] if len(fin) else fin
            self._seq += 1
            msg = TokenBatch(self.cfg.index, self._seq, now, ids[m], pos[m], tok[m], f).encode()
            self.push[int(d)].send(msg)
            self.token_messages += 1
        self.send_wait_s += time.perf_counter() - t0
        self.tokens_sent += len(ids)

    # ---- what the RPCs do to the engine ----
    def add(self, reqs: list[NewRequest], replica: int | None = None, chunked: bool = False) -> list[int]:
        """Queue requests now (Engine.add); the replica of each."""
        with self.lock:
            where = self.engine.add(reqs, self.at_now(), replica, chunked)
        self.wake.set()
        return where

    def resume(self, req: NewRequest, replica: int | None) -> tuple[float, int]:
        """Take over a request that arrives with its state (a migration), on ``replica`` if this layout has it
        (else the least loaded); (when it resumed, its replica)."""
        with self.lock:
            rep = replica if replica is not None and replica < len(self.engine.replicas) else None
            resumed = self.at_now()
            where = self.engine.add([req], resumed, rep)
        self.wake.set()
        return resumed, where[0]

    def footprint(self, rid: int) -> tuple[int, bool] | None:
        """Engine.footprint of ``rid`` now."""
        with self.lock:
            self.at_now()
            return self.engine.footprint(rid)

    def detach(self, rid: int, timeout_s: float) -> tuple[NewRequest, float] | None:
        """Stop ``rid`` here (at the end of its step in flight); (state, stop time), or None if it finished."""
        deadline = time.monotonic() + timeout_s
        with self.lock:
            now = self.at_now()  # first: a request that finished by now is not held any more
            if not self.engine.holds(rid):
                return None
            st = self.engine.detach(rid, now)
            while st is None:
                st = self.engine.detached.get(rid)
                if st is not None:
                    break
                if not self.engine.holds(rid) and not self.engine.detaching(rid):
                    return None
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"request {rid} did not stop within {timeout_s} s")
                self.detach_cv.wait(left)
            self.engine.detached.pop(rid, None)
            return st, self.now()

    def reset(self, settings: EngineSettings | None) -> int:
        """Drop every request (the layout stays; the engine settings unless ``settings`` gives new ones);
        how many were dropped."""
        with self.lock:
            dropped = len(self.engine.held)
            settings = settings if settings is not None else self.engine.settings
            cost = self.engine.cost
            if self.cost_for is not None and settings != self.engine.settings:
                cost = self.cost_for(settings, cost)  # the cost model follows the settings (KV sizing, graph cap)
            self.engine = Engine(cost, self.cfg.gpus, self.engine.layout, settings)
            self.fidelity.clear()
            self.pending = []
        self.wake.set()
        return dropped

    def close(self) -> None:
        for s in self.push:
            s.close(2000)
