"""The RL step driver: a scenario's steps on a backend under a policy, with the planner and the balancer in
the loop and the fabric switched at every phase boundary; every phase, decision and switch in a timeline.

Synchronous on-policy mode, per step: generate every response (planning ticks every
``planning_interval_s``: the planner re-plans layouts, the balancer migrates), train on them (modelled compute
plus the gradient all-reduce), then sync the new weights to the generators (pipelined along the sync tree)
before the next step's generation. (The cycle is the issue's generate -> sync -> train, entered at a
different phase: the weights a generation uses are the ones the previous training produced.)

Asynchronous mode (one step off policy, as veRL's one_step_off_policy or AReaL with staleness 1): step k+1's
generation runs while step k trains; step k's weights go out when its training ends (overlapping generation
on the fabric); step k+2's generation waits for them. Each pool's idle time is reported.

Before each phase the driver asks the controller for that phase's circuits with the slack window and the
predicted gain RLSim's phase model gives (benefit-aware switching: switched, stalled or deferred).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from agents.costmodel import CostModel
from agents.engine import Layout
from emulation.workload import LengthSchedule, step_stats
from testbed.backends.base import Backend, PhaseResult, StepRequests, deal, step_requests
from testbed.backends.phases import PhaseModel
from testbed.orchestrator.balancer import Balancer, freeness
from testbed.orchestrator.estimate import Estimator, ServerLoad
from testbed.orchestrator.forecast import ForecastErrors, ForecastService, LengthForecast, forecast_next
from testbed.orchestrator.planner import Planner, ServerView, loads_from_snapshot, request_levels
from testbed.orchestrator.settings import OrchestratorSettings, Policy

log = logging.getLogger(__name__)

FIT_WAIT_S = 30.0
POLL_S = 0.05  # how often the end of generation is looked for between planning ticks (backend seconds)


@dataclass
class Timeline:
    """Everything that happened, in backend seconds: events (phases, decisions, switches, migrations,
    failures) and per-tick samples (per replica running/waiting counts, per server load index)."""

    events: list[dict] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)

    def event(self, t: float, kind: str, **kw) -> dict:
        e = {"t": round(float(t), 6), "kind": kind, **kw}
        self.events.append(e)
        return e


class Driver:
    def __init__(self, scenario, backend: Backend, policy: Policy, settings: OrchestratorSettings,
                 progress: Callable[[str, float], None] | None = None):
        self.scn = scenario
        self.backend = backend
        self.policy = policy
        self.settings = settings
        self.progress = progress
        w = scenario.workload
        self.w = w
        self.cm = CostModel.for_names(w.model, w.gpu)
        self.gpus = scenario.fabric.gpus_per_server
        self.est = Estimator(self.cm, self.gpus, settings.engine)
        self.planner = Planner(self.est, backend_cost(self.cm), settings.planner, self.cm.model.is_moe) \
            if policy.planner else None
        self.balancer = Balancer(self.est, settings.balancer) if policy.balancer else None
        self.model = PhaseModel(scenario)
        self.timeline = Timeline()
        self.errors = ForecastErrors()
        # independent streams from the scenario's seed: every policy sees the same lengths and the same deal
        self.rng_lengths = np.random.default_rng([scenario.seed, 0])
        self.rng_history = np.random.default_rng([scenario.seed, 1])
        self.rng_deal = np.random.default_rng([scenario.seed, 2])
        self.schedule = LengthSchedule(w)
        self.last_switch_end: dict[int, float] = {}
        self.installed = scenario.controller.initial_phase
        self.steps: list[dict] = []
        self.lost_total = 0
        self.failed: dict[int, str] = {}
        self.decision_ms: list[float] = []
        self._ticket = 0

    # ---- workload ----
    def lengths(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        sch = self.schedule
        lengths = sch.lengths_for_step(step, self.rng_lengths)
        return lengths, sch.prompt_ids_for_step(step)

    # ---- phases on the fabric ----
    def phase(self, phase: str, lengths: np.ndarray | None = None, first_step_s: float = 0.0) -> dict:
        window = self.model.window_ms(phase, lengths, first_step_s)
        gain = self.model.gain_ms(phase, self.installed, lengths)
        t0 = self.backend.now()
        d = self.backend.set_phase(phase, window, gain)
        if d.get("decision") in ("switched", "stalled"):
            self.installed = phase
        self.timeline.event(t0, "fabric", phase=phase, topology=self.installed, **{k: v for k, v in d.items()
                                                                                     if k != "reason"},
                            reason=d.get("reason"), took_s=self.backend.now() - t0)
        return d

    # ---- one step ----
    def run_step(self, step: int, forecast: LengthForecast, on_generated: Callable | None = None) -> dict:
        b = self.backend
        lengths, prompt_ids = self.lengths(step)
        req = step_requests(step, lengths, prompt_ids, self.w.prompt_tokens, len(b.train_servers))
        servers = [s for s in b.gen_servers if s not in self.failed]
        placed = deal(req.n, servers, self.rng_deal, self.settings.dispatch)
        t_start = b.now()
        self.timeline.event(t_start, "step", step=step, requests=req.n, tokens=int(lengths.sum()))
        self._initial_layouts(placed, req, forecast)
        first = self.cm.prefill_s(1, self.w.prompt_tokens, 1)
        self.phase("gen", first_step_s=first)
        t_gen = b.now()
        for s, idx in placed.items():
            b.submit(s, req.specs(idx))
        self.timeline.event(t_gen, "phase_start", phase="gen", step=step)
        switches = migrations = 0
        fc = forecast
        interval = self.settings.planning_interval_s
        poll = min(interval, POLL_S)
        next_tick = t_gen + interval
        while True:
            b.wait_until(min(next_tick, b.now() + poll))
            if b.finished_count() >= req.n and not b.in_flight():
                break
            if b.now() + 1e-9 < next_tick:
                continue
            next_tick += interval
            now = b.now()
            states = b.states()
            self._sample(now, states, fc)
            new_fail = {s: why for s, why in b.failures().items() if s not in self.failed}
            if new_fail:
                self._requeue(new_fail, req, states)
                states = {s: st for s, st in states.items() if s not in self.failed}
            if self.planner is None and self.balancer is None:
                continue
            t_dec = time.perf_counter()
            fc = self._online(forecast, states, req)
            self.est.forecast = fc
            views = {s: ServerView(s, st.layout, loads_from_snapshot(st.snapshot, fc), st.busy_until,
                                   self.last_switch_end.get(s, -math.inf)) for s, st in states.items()}
            if self.planner is not None:
                for s, v in views.items():
                    d = self.planner.evaluate(v, now, interval)
                    if d.switch:
                        sw = b.set_layout(s, Layout.parse(d.best, self.gpus))
                        self.last_switch_end[s] = sw["end"]
                        switches += 1
                        views[s] = ServerView(s, Layout.parse(d.best, self.gpus), v.load.__class__(
                            v.load.ctx0, v.load.rem, v.load.running, np.full(v.load.n, -1)), sw["end"], sw["end"])
                        self.timeline.event(now, "layout_switch", server=s, step=step, frm=d.current, to=d.best,
                                            gain_s=round(d.gain_s, 3), cost_s=round(d.switch_cost_s, 3),
                                            start=sw["start"], end=sw["end"], predicted=d.predicted_s)
            if self.balancer is not None:
                rids = {s: states[s].snapshot["rid"] for s in views}
                moves, loads = self.balancer.decide(views, rids, now)
                for m in moves:
                    try:
                        res = b.migrate(m.rid, m.src, m.dst, self.settings.balancer.mode, m.dst_replica)
                    except Exception as e:  # noqa: BLE001 - a request that finished meanwhile, a busy agent
                        self.timeline.event(now, "migration_failed", rid=m.rid, src=m.src, dst=m.dst, error=str(e))
                        continue
                    migrations += 1
                    self.timeline.event(now, "migration", rid=m.rid, src=m.src, dst=m.dst, step=step,
                                        before=[round(x, 3) for x in m.before], after=[round(x, 3) for x in m.after],
                                        downtime_s=res.get("downtime_s"), kv_bytes=res.get("kv_bytes"),
                                        result=res.get("result"))
            self.decision_ms.append((time.perf_counter() - t_dec) * 1e3)
        out = b.end_generation(req)
        t_gen_end = out["ended_at"]  # the last token, not the tick that noticed it
        for m in getattr(b, "migrations", [])[:]:  # simulated hand-overs: their downtime once they happened
            self.timeline.event(m["stopped"], "handover", **m)
        if hasattr(b, "migrations"):
            b.migrations.clear()
        self.timeline.event(t_gen_end, "phase_end", phase="gen", step=step)
        if on_generated is not None:  # the next forecast is fitted while this step trains and syncs
            on_generated(lengths)
        # train on the step's responses, then push the new weights
        self.phase("train", lengths)
        tr = b.train(step, lengths)
        self._phase_event(tr, step)
        self.phase("sync", lengths)
        sy = b.sync_weights(step)
        self._phase_event(sy, step)
        t_end = b.now()
        delivered = out["delivered"]
        lost = sum(1 for r, n in zip(req.rid.tolist(), req.target.tolist()) if delivered.get(r, 0) != n)
        self.lost_total += lost
        realised = step_stats(lengths, step, self.w.max_response_tokens)
        rec = self.errors.record(forecast, realised)
        res = {"step": step, "start": t_start, "end": t_end, "makespan_s": t_end - t_start,
               "phases": {"gen_s": t_gen_end - t_start, "train_s": tr.duration, "sync_s": sy.duration},
               "generation_s": t_gen_end - t_gen, "requests": req.n, "tokens": int(lengths.sum()),
               "lost_requests": lost, "layout_switches": switches, "migrations": migrations,
               "forecast": {"method": forecast.method, "mean": forecast.mean(), "realised_mean": realised.mean,
                            "ape": rec.ape if hasattr(rec, "ape") else None},
               "finish_times": {"p50": float(np.median(list(out["finish"].values()))) - t_gen if out["finish"] else None,
                                "max": float(max(out["finish"].values())) - t_gen if out["finish"] else None},
               "train": tr.detail, "sync": sy.detail}
        self.steps.append(res)
        self.timeline.event(t_end, "step_end", step=step, makespan_s=res["makespan_s"])
        return res

    def _phase_event(self, r: PhaseResult, step: int) -> None:
        self.timeline.event(r.start, "phase_start", phase=r.phase, step=step)
        self.timeline.event(r.end, "phase_end", phase=r.phase, step=step, duration_s=r.duration,
                            **{k: v for k, v in r.detail.items() if isinstance(v, (int, float, str))})

    def _initial_layouts(self, placed: dict[int, np.ndarray], req: StepRequests, fc: LengthForecast) -> None:
        b = self.backend
        cur = b.layouts()
        for s, idx in placed.items():
            if self.policy.layout is not None:
                want = self.policy.layout
            else:
                n = len(idx)
                self.est.forecast = fc
                load = ServerLoad(np.full(n, float(self.w.prompt_tokens)), np.full(n, fc.mean()), np.zeros(n, bool),
                                  np.full(n, -1), np.zeros(n), request_levels(req.rid[idx]))
                d = self.planner.initial(ServerView(s, cur[s], load))
                want = Layout.parse(d.best, self.gpus)
            if want != cur[s]:  # at a step boundary: the weights are (re)loaded in the new layout anyway
                sw = b.set_layout(s, want, free=True)
                self.last_switch_end[s] = sw["end"]
                self.timeline.event(b.now(), "layout_switch", server=s, step=req.step, frm=cur[s].name(self.gpus),
                                    to=want.name(self.gpus), start=sw["start"], end=sw["end"], initial=True)

    def _online(self, forecast: LengthForecast, states, req: StepRequests) -> LengthForecast:
        """The step's forecast updated with what the step has shown so far (finished and running requests)."""
        if not self.settings.forecast.online_update:
            return forecast
        running = np.concatenate([st.snapshot["generated"] for st in states.values()]) if states else np.zeros(0)
        held = set(np.concatenate([st.snapshot["rid"] for st in states.values()]).tolist()) if states else set()
        done = [int(n) for r, n in zip(req.rid.tolist(), req.target.tolist()) if r not in held]
        # requests not on any server finished (or are moving): their length is known once finished; count only
        # those the backends report finished
        k = self.backend.finished_count()
        done = done[:k] if len(done) > k else done
        try:
            return forecast.updated(np.asarray(done, dtype=float), running.astype(float), self.settings.forecast)
        except ValueError:
            return forecast

    def _sample(self, now: float, states, fc: LengthForecast) -> None:
        srv, load = {}, {}
        self.est.forecast = fc
        for s, st in states.items():
            reps = st.stats["replicas"]
            srv[s] = {"layout": st.layout.name(self.gpus), "running": [r["num_requests_running"] for r in reps],
                      "waiting": [r["num_requests_waiting"] for r in reps],
                      "kv": [round(r["kv_cache_usage_perc"], 4) for r in reps],
                      "freeness": round(freeness(st.stats), 2) if math.isfinite(freeness(st.stats)) else None,
                      "switching": bool(st.busy_until and st.busy_until > now)}
            view = ServerView(s, st.layout, loads_from_snapshot(st.snapshot, fc), st.busy_until)
            load[s] = round(self.est.server_s(view.layout, view.load, current=view.layout)
                            + max(0.0, st.busy_until - now), 3)
        self.timeline.samples.append({"t": round(now, 4), "servers": srv, "load": load})

    def _requeue(self, failed: dict[int, str], req: StepRequests, states) -> None:
        b = self.backend
        live = [s for s in b.gen_servers if s not in self.failed and s not in failed]
        now = b.now()
        for s, why in failed.items():
            self.failed[s] = why
            lost = b.lost_requests(s)
            self.timeline.event(now, "agent_failed", server=s, why=why, requests=len(lost))
            if not live:
                raise RuntimeError(f"every generator failed ({why})")
            tgt = dict(zip(req.rid.tolist(), req.target.tolist()))
            pr = dict(zip(req.rid.tolist(), req.prompt.tolist()))
            dest = dict(zip(req.rid.tolist(), req.dest.tolist()))
            per: dict[int, list[dict]] = {}
            for k, (rid, got) in enumerate(sorted(lost.items())):
                if got >= tgt[rid]:
                    continue
                per.setdefault(live[k % len(live)], []).append(
                    {"rid": rid, "prompt": pr[rid], "target": tgt[rid], "dest": dest[rid], "generated": got})
            for s2, specs in per.items():
                b.submit(s2, specs)
            self.timeline.event(now, "requeued", server=s, to=sorted(per), requests=sum(len(v) for v in per.values()),
                                delivered_tokens=int(sum(lost.values())))

    # ---- the run ----
    def run(self, steps: int) -> dict:
        """Run ``steps`` RL steps. Each step's forecast is fitted (ARIMA, in the forecast service's thread)
        from the steps before it while that step's training and weight sync run, and is waited for (at most
        ``FIT_WAIT_S``) only at the next step boundary: never inside a generation phase."""
        history = self.schedule.history(self.rng_history)
        prior = None if self.schedule.is_trace else LengthForecast.from_workload(self.w, 0)
        with ForecastService(self.settings.forecast, history, prior=prior) as svc:
            ticket = 0
            for step in range(steps):
                if ticket:
                    svc.wait(ticket, timeout=FIT_WAIT_S)
                fc = svc.latest() or forecast_next(history, self.settings.forecast, prior, use_arima=False)
                if self.progress:
                    self.progress(f"step {step}/{steps}", step / steps)
                self.run_step(step, fc, on_generated=lambda lengths, st=step: self._observe(svc, history, lengths, st))
                ticket = self._ticket
        return self.result()

    def _observe(self, svc: ForecastService, history: list, lengths: np.ndarray, step: int) -> None:
        history.append(step_stats(lengths, step, self.w.max_response_tokens))
        self._ticket = svc.submit(history)

    def result(self) -> dict:
        st = self.steps
        total_t = sum(s["makespan_s"] for s in st)
        tokens = sum(s["tokens"] for s in st)
        return {"policy": self.policy.name, "backend": self.backend.name, "static": self.policy.static,
                "layouts": {str(s): lay.name(self.gpus) for s, lay in self.backend.layouts().items()},
                "step_makespan_s": [s["makespan_s"] for s in st],
                "phases": [s["phases"] for s in st],
                "throughput_tokens_per_s": tokens / total_t if total_t else None,
                "migrations": sum(s["migrations"] for s in st), "layout_switches": sum(s["layout_switches"] for s in st),
                "forecast_mape": self.errors.mape(), "forecast": self.errors.to_json(), "lost_requests": self.lost_total,
                "failures": self.failed, "steps": st,
                "decision_ms_p50": float(np.percentile(self.decision_ms, 50)) if self.decision_ms else None,
                "decision_ms_p99": float(np.percentile(self.decision_ms, 99)) if self.decision_ms else None,
                "fidelity": self.backend.fidelity()}


def backend_cost(cm):
    from agents.engine import ModelledCost

    return ModelledCost(cm)

