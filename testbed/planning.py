"""The planning tick: what the policy's plug-ins decide (testbed.orchestrator.interfaces: the dispatcher, the
planner, the balancer, built-in or a user's, made from one PolicyContext), carried out through the Backend
interface (the deal of a step's batch and the release of its pool, layout switches, migrations), and the layouts
chosen at a step's start. Every decision is checked before it is carried out: one that cannot be (a layout the
servers cannot hold, a migration of a request its source does not hold, a request dealt twice) is an
emulation.plugins.DecisionError naming the plug-in, and the run stops.

The estimator's forecast is the tick's: the step's forecast updated online with what the step has shown
(``forecast.online_update``), and every request's offset from its prompt's other samples
(``forecast.prompt_groups``). The decision time (``decision_ms``) counts the planner's and the balancer's
computing, not the calls to the servers (the snapshots, the collectors' finished count: asked before the clock
starts).
"""
from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from emulation.orchestration import OrchestratorSettings
from emulation.plugins import DecisionError
from emulation.validation import SpecError
from testbed.backends.base import Backend, StepRequests
from testbed.decision_checks import (check_decision, check_whole_deal, checked_deal, checked_decisions, checked_moves,
                                     indices)
from testbed.decision_priority import raised_priority
from testbed.orchestrator.balancer import Balancer
from testbed.orchestrator.estimate import Estimator, ServerLoad
from testbed.orchestrator.forecast import LengthForecast, prompt_prior, prompt_share, shifted_forecast
from testbed.orchestrator.interfaces import Batch, Deal, Pool, PolicyContext
from testbed.orchestrator.planner import ServerView, loads_from_snapshots, request_levels
from testbed.orchestrator.policies import Policy, feasible_layouts, scenario_dispatch
from testbed.recovery import Recovery
from testbed.ticks import IntervalBudget, tick_deadline_s


class PlanningTick:
    """The policy's plug-ins of a run (its dispatcher; its planner and its balancer, either may be off) and
    what they need between ticks: each server's last switch end, the phase's migration budget and per-tick
    deadline, the dispatcher's pool, the finished steps' prompt groups; for the run's result ``decision_ms``, ``realised`` (every migration's
    predicted gain and its realised one, where the backend tells: against the tick without it) and
    ``tick_realised`` (per tick that moved, its moves and their realised gain together)."""

    def __init__(self, scenario, backend: Backend, policy: Policy, settings: OrchestratorSettings, est: Estimator,
                 timeline, recovery: Recovery):
        w = scenario.workload
        self.backend, self.policy, self.settings, self.est = backend, policy, settings, est
        self.timeline, self.recovery = timeline, recovery
        self.w = w
        self.gpus = est.gpus
        self.ctx = policy_context(scenario, backend, settings, est, balanced=policy.balancer is not None)
        # planner ``lengths: truth`` (an oracle): the planner estimates on the true lengths, with an estimator of
        # its own that never holds a forecast (its loads' ``rem`` are then used as given, and the lookahead
        # advances them by their progress)
        self.truth = None
        if policy.planner and settings.planner.lengths == "truth":
            if backend.true_remaining is None:
                raise SpecError("orchestrator.planner.lengths",
                                f"'truth' reads the true lengths, which only the simulated backend has ({backend.name})")
            self.truth = backend.true_remaining
        pctx = self.ctx if self.truth is None else dataclasses.replace(
            self.ctx, estimator=Estimator(est.cm, est.gpus, est.settings))
        self.planner = policy.planner.create(pctx) if policy.planner else None
        self.balancer = policy.balancer.create(self.ctx) if policy.balancer else None
        dispatch = policy.dispatch or scenario_dispatch(settings)
        self.dispatcher = dispatch.create(self.ctx)
        self.who = {role: f"policy {policy.name!r}: {role} {c.ref!r}" for role, c in
                    (("planner", policy.planner), ("balancer", policy.balancer), ("dispatch", dispatch)) if c}
        self._placed = np.zeros(0, bool)  # per request of the step: dealt to a server so far
        self._tick_done: np.ndarray | None = None  # this tick's finished requests (_done), once computed
        if isinstance(self.balancer, Balancer) and settings.balancer.pay_judge == "truth":
            if backend.true_remaining is None:
                raise SpecError("orchestrator.balancer.pay_judge",
                                f"'truth' reads the true lengths, which only the simulated backend has ({backend.name})")
            self.balancer.truth = backend.true_remaining
        self.last_switch_end: dict[int, float] = {}
        self.decision_ms: list[float] = []
        self.realised: list[tuple[float, float]] = []  # per move: predicted and realised (the tick without it)
        self.tick_realised: list[tuple[int, float]] = []  # per tick that moved: its moves, their gain together
        self.budget: IntervalBudget | None = None  # this generation phase's max_migrations per interval of time
        self.deadline: float | None = None  # this generation phase's per-tick call deadline
        self._thinking = 0.0  # this tick's decision time so far
        self._finished = 0  # requests the collectors had complete when this tick began (finished_count)
        self._prompt_steps: list = []  # (lengths, prompt ids) of every finished step: the prompt share's data
        # before any: the workload's own split of the spread (its prior, as the length forecast's is)
        self._prompt_prior = prompt_prior(w)

    @property
    def pool(self) -> np.ndarray:
        """The step's requests the dispatcher holds back (not dealt yet), in index order."""
        return np.flatnonzero(~self._placed)

    @property
    def active(self) -> bool:
        """Whether anything is decided at a tick (the policy has a planner or a balancer, or requests wait in
        the dispatcher's pool)."""
        return self.planner is not None or self.balancer is not None or len(self.pool) > 0

    def begin_phase(self, t_gen: float) -> None:
        """A generation phase starts at ``t_gen``: its migration budget and per-tick deadline."""
        interval = self.settings.planning_interval_s
        self.budget = IntervalBudget(t_gen, interval, self.settings.balancer.max_migrations)
        self.deadline = tick_deadline_s(interval)

    def observe_step(self, lengths: np.ndarray, prompt_ids: np.ndarray) -> None:
        """A finished step's lengths by prompt: the data of the prompt share (forecast.prompt_share)."""
        self._prompt_steps.append((np.asarray(lengths), prompt_ids))

    # ---- the step's deal and its pool ----
    def deal(self, req: StepRequests, servers: list[int], forecast: LengthForecast,
             rng: np.random.Generator) -> tuple[dict[int, np.ndarray], bool]:
        """The dispatcher's deal of the step's batch to the live ``servers``: (server -> indices in queue order,
        for every live server; chunked per replica). What it holds back waits in :attr:`pool`."""
        d = self.dispatcher.deal(Batch(req.step, req.n, req.prompt_id, req.prompt, tuple(servers),
                                       self.backend.layouts(), forecast, rng))
        who = self.who["dispatch"]
        if not isinstance(d, Deal):
            raise DecisionError(who, f"deal() must return a Deal, got {type(d).__name__}")
        placed = checked_deal(who, d.placed, set(servers), np.arange(req.n), "deal()")
        held = indices(who, d.held, "deal(): held")
        check_whole_deal(who, placed, held, req.n)
        self._placed = np.ones(req.n, bool)
        self._placed[held] = False
        self._tick_done = None
        for s, idx in placed.items():
            self._route(req, s, idx)
        if len(held):
            self.timeline.event(self.backend.now(), "dispatch_held", step=req.step, held=int(len(held)))
        return {s: placed.get(s, np.zeros(0, np.int64)) for s in servers}, bool(d.chunked)

    def _route(self, req: StepRequests, srv: int, idx: np.ndarray) -> None:
        """Requests ``idx`` dealt to generator ``srv`` stream to its trainer's collector (RLSim's pairing)."""
        req.dest[idx] = self.backend.gen_servers.index(srv) % len(self.backend.train_servers)

    def release(self, now: float, states: dict, req: StepRequests) -> int:
        """A tick with requests in the pool: the dispatcher's release, checked and queued (each server's share
        in the order given, on its least loaded replicas). Returns how many went out."""
        finished = self._done(states, req)
        held = self.pool
        pool = Pool(now, req.step, held.copy(), req.prompt_id, req.prompt,
                    dict(zip(finished.tolist(), req.target[finished].tolist())), states)
        out = checked_deal(self.who["dispatch"], self.dispatcher.release(pool) or {}, set(states), held,
                           "release()")
        n = 0
        for srv, idx in out.items():
            if not len(idx):
                continue
            self._route(req, srv, idx)
            self.recovery.place(srv, req.specs(idx))
            self._placed[idx] = True
            n += len(idx)
        if n:
            self.timeline.event(now, "release", step=req.step, released={s: int(len(i)) for s, i in out.items()
                                                                         if len(i)}, held=int(len(self.pool)))
        elif len(self.pool) and all(not len(st.snapshot["rid"]) for st in states.values()) and not self.backend.in_flight():
            raise DecisionError(self.who["dispatch"], f"holds {len(self.pool)} requests while every server is "
                                                      "idle: release() must deal them")
        return n

    def _done(self, states: dict, req: StepRequests) -> np.ndarray:
        """Indices of the step's requests that finished: dealt, on no server, as many as the backends report
        finished (``finished_count``, asked at the tick's start). Worked out once per tick (the forecast's
        update, the prompt shifts and the pool's release all read it; nothing is dealt between them)."""
        if self._tick_done is None:
            on = np.concatenate([st.snapshot["rid"] for st in states.values()]) if states else np.zeros(0, np.int64)
            dealt = self._placed if len(self._placed) == req.n else np.ones(req.n, bool)
            self._tick_done = np.nonzero(dealt & ~np.isin(req.rid, on))[0][:max(self._finished, 0)]
        return self._tick_done

    def step_end(self, step: int, states: dict) -> None:
        """The step's generation ended (``states``: the live servers' last): the planner is told."""
        if self.planner is not None:
            self.planner.step_end(step, states)

    # ---- the step's start ----
    def initial_layouts(self, placed: dict[int, np.ndarray], req: StepRequests, fc: LengthForecast,
                        first: bool) -> int:
        """Every generator's layout for the step. The run's first step (``first``) starts in whatever layout its
        policy picks, free (the weights are loaded once, in that layout, as every static layout's are); a
        change at a later step boundary is a switch like any other, charged what the cost model says and
        counted (the engine re-shards before the step's requests start)."""
        b = self.backend
        cur = b.layouts()
        charged = 0
        for s, idx in placed.items():
            if self.policy.layout is not None:
                want = self.policy.layout
                d = None
            else:
                n = len(idx)
                self.est.use_forecast(fc)
                rem = np.full(n, fc.mean()) if self.truth is None else req.target[idx].astype(float)
                load = ServerLoad(np.full(n, float(self.w.prompt_tokens)), rem, np.zeros(n, bool),
                                  np.full(n, -1), np.zeros(n), request_levels(req.rid[idx]))
                d = self.planner.initial(ServerView(s, cur[s], load), charged=not first)
                check_decision(self.who["planner"], s, d, {s}, self.ctx.layouts, self.gpus)
                want = d.best
            if want != cur[s]:
                sw = b.set_layout(s, want, free=first)
                self.last_switch_end[s] = sw.end
                charged += not first
                self.timeline.event(b.now(), "layout_switch", server=s, step=req.step, frm=cur[s].name(self.gpus),
                                    to=want.name(self.gpus), start=sw.start, end=sw.end, initial=True,
                                    charged=not first, cost_s=round(sw.end - sw.start, 3),
                                    reason=None if d is None else d.reason)
        return charged

    def _planner_views(self, views: dict) -> dict:
        """The views the planner decides on: ``views`` themselves, or under ``lengths: truth`` the same with
        every request's true remaining tokens (at least 1, as the forecast's) as its ``rem``."""
        if self.truth is None:
            return views
        return {s: dataclasses.replace(v, load=dataclasses.replace(
            v.load, rem=np.maximum(np.asarray(self.truth(v.load.rid), float), 1.0))) for s, v in views.items()}

    # ---- a tick ----
    def tick(self, now: float, states: dict, forecast: LengthForecast, fc: LengthForecast, req: StepRequests,
             late: list[int]) -> tuple[LengthForecast, int, int]:
        """One planning tick at ``now`` on the servers' ``states``: the tick's forecast (``fc`` updated from the
        step's ``forecast``, unless a server is ``late``: its requests are unknown this tick), then the
        decisions, carried out. Returns (the tick's forecast, layout switches, migrations)."""
        # what the collectors have complete: asked once per tick, before the clock starts (a call to the
        # servers, like the snapshots in ``states``; the forecast's update and the prompt shifts both read it)
        self._finished = self.backend.finished_count(tick_deadline_s(self.settings.planning_interval_s))
        self._tick_done = None
        with raised_priority():  # the tick's thread first on a shared CPU (testbed/decision_priority.py)
            t_dec = time.perf_counter()
            if not late:  # a late server's requests are unknown this tick: the forecast waits for them
                fc = self._online(forecast, states, req)
            self._thinking = time.perf_counter() - t_dec
            sw, mg = (self._decide(now, states, fc, req, late) if self.planner is not None or self.balancer is not None
                      else (0, 0))
            if len(self.pool) and not late:  # after the decisions: the states do not hold what is released now
                self.release(now, states, req)
        self.decision_ms.append(self._thinking * 1e3)
        return fc, sw, mg

    def _decide(self, now: float, states: dict, fc: LengthForecast, req: StepRequests,
                late: list[int]) -> tuple[int, int]:
        """One planning tick's decisions, carried out: (layout switches, migrations). The planner decides first;
        the balancer then leaves alone every server in or near a switch (switching, cooling down after one, or
        held by the lookahead where the switch would otherwise be made: its replicas are being or about to be
        rebuilt), and the planner looks again at the servers the balancer's moves changed, so its predictions see
        the moves."""
        t0 = time.perf_counter()
        fc, shifts = self._prompt_shifts(fc, states, req, late)  # the shifted requests' law (forecast.PromptLaw)
        self.est.use_forecast(fc)
        loads = loads_from_snapshots({s: st.snapshot for s, st in states.items()}, fc, shifts)
        views = {s: ServerView(s, st.layout, loads[s], st.busy_until, self.last_switch_end.get(s, -math.inf), st.stats)
                 for s, st in states.items()}
        switches = migrations = 0
        near: set[int] = set()
        if self.planner is not None:
            decisions = checked_decisions(self.who["planner"], self.planner.evaluate_all(
                self._planner_views(views), now, self.settings.planning_interval_s), views, self.ctx.layouts,
                self.gpus)
            near = {s for s, d in decisions.items() if d.near_switch}
            self.timeline.event(now, "plan", step=req.step, gain_s={s: round(d.gain_s, 3) for s, d in decisions.items()},
                                switch=[s for s, d in decisions.items() if d.switch])
            self._thinking += time.perf_counter() - t0
            switches += self._switch(now, req, decisions)
            t0 = time.perf_counter()
        if self.balancer is not None:
            steady = {s: v for s, v in views.items() if v.busy_until <= now and s not in near}
            rids = {s: states[s].snapshot["rid"] for s in steady}
            moves = checked_moves(self.who["balancer"], self.balancer.moves(steady, rids, now), steady, rids, self.gpus)
            self._thinking += time.perf_counter() - t0
            moved = self._migrate(now, req, moves)
            migrations += len(moved)
            if self.planner is not None and moved:
                t0 = time.perf_counter()
                after = _after_moves(views, rids, moved)
                decisions = checked_decisions(self.who["planner"], self.planner.evaluate_all(
                    self._planner_views(after), now, self.settings.planning_interval_s), after, self.ctx.layouts,
                    self.gpus)
                self._thinking += time.perf_counter() - t0
                switches += self._switch(now, req, decisions)
        else:
            self._thinking += time.perf_counter() - t0
        return switches, migrations

    def _switch(self, now: float, req: StepRequests, decisions: dict) -> int:
        b = self.backend
        failed = self.recovery.failed
        n = 0
        for s, d in decisions.items():
            if not d.switch or s in failed:
                continue
            try:
                sw = b.set_layout(s, d.best)
            except Exception as e:  # noqa: BLE001 - the server failed meanwhile: its requests are re-queued
                self.timeline.event(b.now(), "layout_switch_failed", server=s, step=req.step,
                                    to=d.best.name(self.gpus), error=str(e), tick=round(now, 6))
                self.recovery.check(req)
                continue
            self.last_switch_end[s] = sw.end
            n += 1
            self.timeline.event(b.now(), "layout_switch", server=s, step=req.step, frm=d.current.name(self.gpus),
                                to=d.best.name(self.gpus),
                                gain_s=round(d.gain_s, 3), cost_s=round(d.switch_cost_s, 3), start=sw.start,
                                end=sw.end, predicted=d.predicted_s, reason=d.reason, tick=round(now, 6),
                                **({} if d.judged_gain_s is None else {"judged_gain_s": round(d.judged_gain_s, 3)}))
        return n

    def _migrate(self, now: float, req: StepRequests, moves: list) -> list:
        """Carry out the balancer's moves, in order, while the tick has time and the interval has budget: a
        tick past its deadline (it spent its time on the servers) or an interval that already holds
        ``max_migrations`` (a tick that ran into the next one) defers the rest to a later tick. A move to or from
        a server that failed during this tick is dropped; one that fails because an agent died under it has
        that agent's requests re-queued at once."""
        b = self.backend
        budget, deadline, failed = self.budget, self.deadline, self.recovery.failed
        done = []
        for m in moves:
            t_m = b.now()
            if m.src in failed or m.dst in failed:
                continue  # one of them failed during this tick
            if deadline is not None and t_m - now > deadline:
                self.timeline.event(t_m, "migration_deferred", rid=m.rid, src=m.src, dst=m.dst, tick=round(now, 6),
                                    reason=f"the tick is {t_m - now:.3f} s old (deadline {deadline:g} s)")
                break
            if budget is not None:
                if budget.left(t_m) <= 0:
                    self.timeline.event(t_m, "migration_deferred", rid=m.rid, src=m.src, dst=m.dst,
                                        tick=round(now, 6),
                                        reason=f"max_migrations ({budget.limit}) reached in this interval")
                    break
                budget.spend(t_m)
            try:
                res = b.migrate(m.rid, m.src, m.dst, self.settings.balancer.mode, m.dst_replica,
                                predicted_gain_s=m.gain_s)
            except Exception as e:  # noqa: BLE001 - a request that finished meanwhile, a busy or failed agent
                self.timeline.event(b.now(), "migration_failed", rid=m.rid, src=m.src, dst=m.dst, error=str(e),
                                    start=round(t_m, 6), tick=round(now, 6))
                self.recovery.check(req)  # if an agent died under the migration: re-queued now
                continue
            done.append((m, res, t_m, b.now()))
        # what the moves realised (a backend that can tell): each against the tick without it, and the tick's
        # moves together against none of them
        each, together = b.tick_gains([m.rid for m, *_ in done]) if done else ({}, None)
        for m, res, t_m, t_done in done:
            loo = each.get(m.rid)
            self.timeline.event(t_done, "migration", rid=m.rid, src=m.src, dst=m.dst, dst_replica=m.dst_replica,
                                step=req.step, before=[round(x, 3) for x in m.before],
                                after=[round(x, 3) for x in m.after], downtime_s=res.downtime_s,
                                kv_bytes=res.kv_bytes, result=res.result, predicted_gain_s=round(m.gain_s, 4),
                                pays=None if m.pays is None else round(m.pays, 4),
                                realised_gain_s=None if loo is None else round(loo, 4), start=round(t_m, 6),
                                tick=round(now, 6))
            if loo is not None:
                self.realised.append((m.gain_s, float(loo)))
        if together is not None:
            self.tick_realised.append((len(done), float(together)))
        return [m for m, *_ in done]

    # ---- the tick's forecast ----
    def _online(self, forecast: LengthForecast, states, req: StepRequests) -> LengthForecast:
        """The step's forecast updated with what the step has shown so far (finished and running requests)."""
        if not self.settings.forecast.online_update:
            return forecast
        running = np.concatenate([st.snapshot["generated"] for st in states.values()]) if states else np.zeros(0)
        # requests dealt and on no server finished (or are moving): their length is known once finished; count
        # only as many as the backends report finished
        done = req.target[self._done(states, req)]
        try:
            return forecast.updated(np.asarray(done, dtype=float), running.astype(float), self.settings.forecast)
        except ValueError:
            return forecast

    def _prompt_shifts(self, fc: LengthForecast, states, req: StepRequests, late: list[int]) -> tuple:
        """(the tick's forecast with the prompt share set, per server every request's log-offset from what its
        prompt's samples have shown: forecast.shifted_forecast, finished ones by their lengths, running ones by
        their tokens so far; NaN for a request whose prompt has shown nothing); ``(fc, {})`` where none has."""
        if not self.settings.forecast.prompt_groups or req is None or not states or late:
            return fc, {}  # (a late server's requests would look finished)
        share = prompt_share(self._prompt_steps, self._prompt_prior)
        if share <= 0:
            return fc, {}
        di = self._done(states, req)  # as _online: only as many as the backends report finished
        pids = [req.prompt_id[st.snapshot["rid"] - req.rid[0]] for st in states.values()]  # each server's requests'
        run_gen = np.concatenate([st.snapshot["generated"] for st in states.values()])
        fc, shifts = shifted_forecast(fc, share, req.prompt_id[di], req.target[di], np.concatenate(pids), run_gen,
                                      pids)
        return fc, ({} if shifts is None else dict(zip(states, shifts)))


def _after_moves(views: dict, rids: dict, moves: list) -> dict:
    """The views of the servers that ``moves`` touched, with the moved requests where they went (the forecast
    fields kept: the planner stratifies and looks ahead on them as on any load)."""
    cur = {s: (views[s].load, np.asarray(rids[s])) for m in moves for s in (m.src, m.dst)}
    for m in moves:
        (ls, rs), (ld, rd) = cur[m.src], cur[m.dst]
        hit = np.nonzero(rs == m.rid)[0]
        if not len(hit):
            continue
        i = int(hit[0])
        rep = -1 if m.dst_replica is None else int(m.dst_replica)
        if m.src == m.dst:
            cur[m.src] = (ls.without(i).plus_from(ls, i, rep), np.r_[np.delete(rs, i), rs[i]])
        else:
            cur[m.dst] = (ld.plus_from(ls, i, rep), np.r_[rd, rs[i]])
            cur[m.src] = (ls.without(i), np.delete(rs, i))
    return {s: ServerView(s, views[s].layout, ld, views[s].busy_until, views[s].last_switch_end, views[s].stats)
            for s, (ld, _) in cur.items()}


def backend_cost(cm, gpus: int, engine):
    from agents.engine import ModelledCost

    return ModelledCost(cm, gpus, engine.switch_reinit_s)


def policy_context(scenario, backend: Backend, settings: OrchestratorSettings, est: Estimator,
                   balanced: bool = False) -> PolicyContext:
    """What a run's plug-ins see (interfaces.PolicyContext): never the true lengths."""
    w, cm = scenario.workload, est.cm
    feasible = feasible_layouts(cm, est.gpus, settings.engine, w.prompt_tokens, w.max_response_tokens)
    return PolicyContext(est, backend_cost(cm, est.gpus, settings.engine), cm, est.gpus, tuple(feasible),
                         cm.model.is_moe, settings, tuple(backend.gen_servers), w.prompt_tokens,
                         w.max_response_tokens, backend.now, np.random.default_rng([scenario.seed, 3]), balanced)
