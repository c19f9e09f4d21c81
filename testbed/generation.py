"""One RL step's generation phase: the step's requests dealt to the live generators, the servers polled until
every response is complete, a planning tick (testbed/planning.py) on the clock every
``planning_interval_s``, failures acted on when they happen (testbed/recovery.py), a sample of every
server's state at every tick, and the step's token accounting at its end. Everything through the Backend
interface (testbed/backends/base.py).
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np

from emulation.orchestration import OrchestratorSettings
from testbed.backends.base import Backend, StepRequests, step_requests
from testbed.orchestrator.balancer import freeness
from testbed.orchestrator.estimate import Estimator
from testbed.orchestrator.forecast import LengthForecast
from testbed.orchestrator.planner import ServerView, loads_from_snapshot
from testbed.planning import PlanningTick
from testbed.recovery import Recovery
from testbed.ticks import TickClock, tick_fail_after_s


def wake_at(backend: Backend, until: float, hint: Callable[[], float] | None) -> float:
    """The next time the driver must look: ``until``, the backend's poll (emulated: the end of generation
    and the jobs beside it are seen only by looking), and a known job end (``hint()``)."""
    t = until if backend.poll_s is None else min(until, backend.now() + backend.poll_s)
    if hint is not None:
        t = min(t, max(hint(), backend.now()))
    if math.isinf(t):
        raise RuntimeError("internal: the driver would wait for nothing")
    return t


class GenerationPhase:
    """The generation phases of a run, one :meth:`run` per step. ``enter_gen(first_step_s)``: the fabric's
    generation phase asked for (the driver's, which knows the installed one)."""

    def __init__(self, backend: Backend, settings: OrchestratorSettings, timeline, recovery: Recovery,
                 planning: PlanningTick, est: Estimator, prompt_tokens: int, rng_deal: np.random.Generator,
                 enter_gen: Callable[[float], None], first_step_s: float):
        self.backend, self.settings, self.timeline = backend, settings, timeline
        self.recovery, self.planning, self.est = recovery, planning, est
        self.prompt_tokens = prompt_tokens
        self.rng_deal = rng_deal
        self.enter_gen = enter_gen
        self.first_step_s = first_step_s  # the first decode step's lead-in before generation's first tokens
        self.gpus = est.gpus

    def run(self, step: int, lengths: np.ndarray, prompt_ids: np.ndarray, forecast: LengthForecast, first: bool,
            on_tick: Callable[[float], None] | None = None, wake_hint: Callable[[], float] | None = None) -> dict:
        """Step ``step``'s generation (``first``: the run's first step, whose layouts are chosen free);
        ``on_tick(now)`` is called at every poll (the asynchronous mode runs training and weight sync beside
        it) and ``wake_hint()`` says when it next needs a poll (a job's known end; inf: none)."""
        req, placed, chunked, t_start = self._deal(step, lengths, prompt_ids, forecast)
        switches = self.planning.initial_layouts(placed, req, forecast, first)
        self.enter_gen(self.first_step_s)
        t_gen = self.backend.now()
        for s, idx in placed.items():
            self.recovery.place(s, req.specs(idx), chunked=chunked)
        self.timeline.event(t_gen, "phase_start", phase="gen", step=step)
        failed_before = set(self.recovery.failed)
        ticks = TickClock(t_gen, self.settings.planning_interval_s)  # on the clock: a late tick is never made up for
        self.planning.begin_phase(t_gen)
        fc, sw, migrations = self._loop(req, forecast, ticks, failed_before, on_tick, wake_hint)
        return self._finish(req, lengths, ticks, fc, failed_before,
                            {"step": step, "req": req, "lengths": lengths, "start": t_start, "gen_start": t_gen,
                             "switches": switches + sw, "migrations": migrations})

    def _deal(self, step: int, lengths: np.ndarray, prompt_ids: np.ndarray,
              forecast: LengthForecast) -> tuple[StepRequests, dict, bool, float]:
        """The step's requests dealt to the live generators by the policy's dispatcher (one that died between
        steps gets no share; what it holds back waits in its pool), each generator streaming to one trainer's
        collector (RLSim's pairing): (requests, server -> indices, chunked per replica, start)."""
        b = self.backend
        self.recovery.check(None)
        req = step_requests(step, lengths, prompt_ids, self.prompt_tokens, np.zeros(len(lengths), np.int64))
        placed, chunked = self.planning.deal(req, self.recovery.live(), forecast, self.rng_deal)
        t_start = b.now()
        self.timeline.event(t_start, "step", step=step, requests=req.n, tokens=int(lengths.sum()))
        return req, placed, chunked, t_start

    def _loop(self, req: StepRequests, forecast: LengthForecast, ticks: TickClock, failed_before: set,
              on_tick, wake_hint) -> tuple[LengthForecast, int, int]:
        """Poll until every response is complete, a planning tick when one is due: (the last tick's forecast,
        layout switches, migrations)."""
        b, recovery = self.backend, self.recovery
        deadline = self.planning.deadline  # no tick waits longer than this on the servers
        fc, switches, migrations = forecast, 0, 0
        while True:
            b.wait_until(wake_at(b, ticks.next_at, wake_hint), until_idle=True)
            if on_tick is not None:
                on_tick(b.now())
            recovery.check(req)  # a process exit is acted on at once, not at the next tick
            if b.finished_count(deadline) >= req.n and not b.in_flight():
                return fc, switches, migrations
            if not ticks.due(b.now()):
                continue
            tick = ticks.begin(b.now())
            fc, sw, mg = self._tick(tick["t"], req, forecast, fc, failed_before)
            switches += sw
            migrations += mg
            ticks.end(tick, b.now())

    def _tick(self, now: float, req: StepRequests, forecast: LengthForecast, fc: LengthForecast,
              failed_before: set) -> tuple[LengthForecast, int, int]:
        """A planning tick: every server at once (one that misses the deadline is left out, and failed if it
        stays silent), a sample, and the planner's and balancer's decisions."""
        b, recovery = self.backend, self.recovery
        deadline = self.planning.deadline
        states = b.states(deadline, tick_fail_after_s(self.settings.planning_interval_s))
        if recovery.check(req, states):
            states = {s: st for s, st in states.items() if s not in recovery.failed}
        late = [s for s in b.gen_servers if s not in recovery.failed and s not in states]
        if late:
            self.timeline.event(now, "agents_late", servers=late, step=req.step, deadline_s=deadline)
        if not late and set(recovery.failed) - failed_before:  # a server failed in this step
            recovery.repair(req, states, deadline)
        self.sample(now, states, fc)
        if not self.planning.active:
            return fc, 0, 0
        fc, sw, mg = self.planning.tick(now, states, forecast, fc, req, late)
        recovery.check(req)
        return fc, sw, mg

    def _finish(self, req: StepRequests, lengths: np.ndarray, ticks: TickClock, fc: LengthForecast,
                failed_before: set, g: dict) -> dict:
        """The step's end: the engines' final counters, what was delivered, the hand-overs, the accounting."""
        b, recovery = self.backend, self.recovery
        interval = self.settings.planning_interval_s
        last = {s: st for s, st in b.states(self.planning.deadline, tick_fail_after_s(interval)).items()
                if s not in recovery.failed}
        self.sample(b.now(), last, fc)
        self.planning.step_end(req.step, last)
        out = b.end_generation(req)
        t_gen_end = out["ended_at"]  # the last token, not the tick that noticed it
        for m in b.take_handovers():  # simulated hand-overs: their downtime once they happened
            self.timeline.event(m.stopped, "handover", **m.to_json())
        self.timeline.event(t_gen_end, "phase_end", phase="gen", step=req.step)
        delivered = out["delivered"]
        lost = sum(1 for r, n in zip(req.rid.tolist(), req.target.tolist()) if delivered.get(r, 0) != n)
        return dict(g, gen_end=t_gen_end, out=out, lost=lost,
                    ticks=dict(ticks.summary(), migrations_per_interval_max=self.planning.budget.most()),
                    accounting=self._accounting(failed_before, req, out), tick_log=list(ticks.ticks))

    def _accounting(self, failed_before: set, req: StepRequests, out: dict) -> dict:
        """The step's tokens: every response's target, the distinct tokens that reached the collectors, the
        duplicates among what arrived, and what arrived from each server (a failed one's up to its death)."""
        by_agent = {int(a): {"received": int(v["received"]), "unique": int(v["unique"])}
                    for a, v in out.get("tokens_by_agent", {}).items()}
        target = int(req.target.sum())
        unique = int(out.get("tokens_unique", sum(out["delivered"].values())))
        return {"tokens_target": target, "tokens_unique": unique, "tokens_duplicate": int(out.get("duplicates", 0)),
                "exactly_once": unique == target and all(out["delivered"].get(r, 0) == n for r, n in
                                                         zip(req.rid.tolist(), req.target.tolist())),
                "by_agent": by_agent, "failed_during_step": sorted(set(self.recovery.failed) - failed_before)}

    def sample(self, now: float, states, fc: LengthForecast) -> None:
        """Every server's state at ``now`` in the timeline: per replica running/waiting counts and KV use, the
        engine's counters, and its load index (its predicted time to finish what it holds)."""
        srv, load = {}, {}
        self.est.use_forecast(fc)
        for s, st in states.items():
            reps = st.stats["replicas"]
            srv[s] = {"layout": st.layout.name(self.gpus), "running": [r["num_requests_running"] for r in reps],
                      "waiting": [r["num_requests_waiting"] for r in reps],
                      "kv": [round(r["kv_cache_usage_perc"], 4) for r in reps],
                      "tokens": st.stats.get("generation_tokens_total"),
                      "preemptions": st.stats.get("num_preemptions_total"),
                      "freeness": round(freeness(st.stats), 2) if math.isfinite(freeness(st.stats)) else None,
                      "switching": bool(st.busy_until and st.busy_until > now)}
            view = ServerView(s, st.layout, loads_from_snapshot(st.snapshot, fc), st.busy_until)
            load[s] = round(self.est.server_s(view.layout, view.load, current=view.layout)
                            + max(0.0, st.busy_until - now), 3)
        self.timeline.sample({"t": round(now, 4), "servers": srv, "load": load})
