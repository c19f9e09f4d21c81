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
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from agents.costmodel import CostModel
from emulation.orchestration import OrchestratorSettings
from emulation.workload import LengthSchedule, step_stats
from testbed.backends.base import Backend, PhaseDecision, PhaseResult
from testbed.backends.phase_model import PhaseModel
from testbed.forecast_service import ForecastService
from testbed.generation import GenerationPhase, wake_at
from testbed.orchestrator.balancer import PAID_S
from testbed.orchestrator.estimate import Estimator
from testbed.orchestrator.forecast import ForecastErrors, LengthForecast, forecast_next
from testbed.orchestrator.policies import Policy
from testbed.planning import PlanningTick
from testbed.recovery import Recovery
from testbed.ticks import tick_deadline_s

log = logging.getLogger(__name__)

FIT_WAIT_S = 30.0


@dataclass
class Timeline:
    """Everything that happened, in backend seconds: events (phases, decisions, switches, migrations,
    failures) and per-tick samples (per replica running/waiting counts, per server load index).

    ``observers`` see each event and sample as it is recorded (``on_event(e)``, ``on_sample(s)``): the live
    metrics (testbed/runs/metrics.py) subscribe here, so no metric call sits in the planning logic. An observer
    that raises is logged and left out of that one call; the run goes on."""

    events: list[dict] = field(default_factory=list)
    samples: list[dict] = field(default_factory=list)
    observers: list = field(default_factory=list, repr=False)

    def event(self, t: float, kind: str, **kw) -> dict:
        e = {"t": round(float(t), 6), "kind": kind, **kw}
        self.events.append(e)
        for o in self.observers:
            _notify(o.on_event, e)
        return e

    def sample(self, s: dict) -> dict:
        self.samples.append(s)
        for o in self.observers:
            _notify(o.on_sample, s)
        return s


def _notify(fn, item: dict) -> None:
    try:
        fn(item)
    except Exception:  # noqa: BLE001 - watching a run must never stop it
        log.exception("timeline observer %r failed on %s", fn, item.get("kind", "a sample"))


class Driver:
    """A scenario's RL steps on ``backend`` under ``policy``: the step loop (synchronous, or one step off
    policy), the fabric's phase changes, the forecasts fitted between steps and the run's result. Each step's
    generation is a :class:`testbed.generation.GenerationPhase` run, with the planner and the balancer in its
    planning ticks (:class:`testbed.planning.PlanningTick`) and failures acted on by
    :class:`testbed.recovery.Recovery`."""

    def __init__(self, scenario, backend: Backend, policy: Policy, settings: OrchestratorSettings,
                 progress: Callable[[str, float], None] | None = None):
        self.scn = scenario
        self.backend = backend
        self.policy = policy
        self.settings = settings
        self.progress = progress
        w = scenario.workload
        self.w = w
        self.cm = CostModel.for_engine(w.model, w.gpu, settings.engine)  # the engine profile the policy runs
        self.gpus = scenario.fabric.gpus_per_server
        self.est = Estimator(self.cm, self.gpus, settings.engine)
        self.model = PhaseModel(scenario)
        self.timeline = Timeline()
        self.errors = ForecastErrors()
        # independent streams from the scenario's seed: every policy sees the same lengths and the same deal
        self.rng_lengths = np.random.default_rng([scenario.seed, 0])
        self.rng_history = np.random.default_rng([scenario.seed, 1])
        self.schedule = LengthSchedule(w)
        self.installed = scenario.controller.initial_phase
        self.steps: list[dict] = []
        self.lost_total = 0
        self.tick_log: list[dict] = []  # every planning tick: when it was due, started, how long it took
        self._ticket = 0
        self._first_step = 0  # the run's first step: its layouts are chosen free of charge
        self.recovery = Recovery(backend, self.timeline, settings.planning_interval_s)
        self.planning = PlanningTick(scenario, backend, policy, settings, self.est, self.timeline, self.recovery)
        self.generation = GenerationPhase(backend, settings, self.timeline, self.recovery, self.planning, self.est,
                                          w.prompt_tokens, np.random.default_rng([scenario.seed, 2]),
                                          self._enter_gen, self.cm.prefill_s(1, w.prompt_tokens, 1))

    @property
    def failed(self) -> dict[int, str]:
        """Every server failed so far, with why."""
        return self.recovery.failed

    # ---- workload ----
    def lengths(self, step: int) -> tuple[np.ndarray, np.ndarray]:
        sch = self.schedule
        lengths = sch.lengths_for_step(step, self.rng_lengths)
        return lengths, sch.prompt_ids_for_step(step)

    # ---- phases on the fabric ----
    def phase(self, phase: str, lengths: np.ndarray | None = None, first_step_s: float = 0.0) -> PhaseDecision:
        """Ask for ``phase``'s topology (the phase model's :meth:`~PhaseModel.topology_for`: "train:mp" for a
        train phase that re-wires inside)."""
        window = self.model.window_ms(phase, lengths, first_step_s)
        gain = self.model.gain_ms(phase, self.installed, lengths)
        t0 = self.backend.now()
        topology = self.model.topology_for(phase)
        d = self.backend.set_phase(topology, window, gain)
        if d.changed:
            self.installed = topology
        self.timeline.event(t0, "fabric", phase=phase, topology=self.installed,
                            **{k: v for k, v in d.to_json().items() if k != "reason"}, reason=d.reason,
                            took_s=self.backend.now() - t0)
        return d

    def _enter_gen(self, first_step_s: float) -> None:
        """Generation's circuits before a step's generation (the asynchronous mode keeps the sync tree while
        weights go out beside it)."""
        if self.settings.step_mode == "sync" or self.installed not in ("gen", "sync"):
            self.phase("gen", first_step_s=first_step_s)

    # ---- generation of one step ----
    def generate(self, step: int, forecast: LengthForecast, on_tick: Callable[[float], None] | None = None,
                 wake_hint: Callable[[], float] | None = None) -> dict:
        """One step's generation phase with the planner and the balancer in the loop (GenerationPhase.run)."""
        lengths, prompt_ids = self.lengths(step)
        g = self.generation.run(step, lengths, prompt_ids, forecast, step == self._first_step, on_tick, wake_hint)
        self.lost_total += g["lost"]
        self.tick_log.extend(dict(r, step=step) for r in g["tick_log"])
        return g

    def record(self, g: dict, forecast: LengthForecast, tr: PhaseResult, sy: PhaseResult, period_end: float,
                extra: dict | None = None) -> dict:
        step, lengths, out = g["step"], g["lengths"], g["out"]
        realised = step_stats(lengths, step, self.w.max_response_tokens)
        rec = self.errors.record(forecast, realised)
        fin = out["finish"]
        res = {"step": step, "start": g["start"], "end": period_end, "makespan_s": period_end - g["start"],
               "phases": {"gen_s": g["gen_end"] - g["start"], "train_s": tr.duration, "sync_s": sy.duration},
               "generation_s": g["gen_end"] - g["gen_start"], "requests": g["req"].n, "tokens": int(lengths.sum()),
               "lost_requests": g["lost"], "layout_switches": g["switches"], "migrations": g["migrations"],
               "forecast": {"method": forecast.method, "mean": forecast.mean(), "realised_mean": realised.mean,
                            "ape": rec.ape},
               "finish_times": {"p50": float(np.median(list(fin.values()))) - g["gen_start"] if fin else None,
                                "max": float(max(fin.values())) - g["gen_start"] if fin else None},
               "train": tr.detail, "sync": sy.detail, "accounting": g["accounting"], "ticks": g["ticks"], **(extra or {})}
        self.steps.append(res)
        self.timeline.event(period_end, "step_end", step=step, makespan_s=res["makespan_s"], tokens=res["tokens"],
                            phases=res["phases"], forecast_ape=rec.ape, lost_requests=g["lost"])
        return res

    # ---- synchronous on-policy steps ----
    def run_step(self, step: int, forecast: LengthForecast, on_generated: Callable | None = None) -> dict:
        b = self.backend
        g = self.generate(step, forecast)
        if on_generated is not None:  # the next forecast is fitted while this step trains and syncs
            on_generated(g["lengths"])
        # train on the step's responses, then push the new weights
        self.phase("train", g["lengths"])
        tr = b.train(step, g["lengths"])
        self.installed = tr.detail.get("topology_end", self.installed)  # re-wired inside ("train:dp")
        self.phase_event(tr, step)
        self.phase("sync", g["lengths"])
        sy = b.sync_weights(step)
        self.phase_event(sy, step)
        return self.record(g, forecast, tr, sy, b.now())

    def phase_event(self, r: PhaseResult, step: int) -> None:
        self.timeline.event(r.start, "phase_start", phase=r.phase, step=step)
        self.timeline.event(r.end, "phase_end", phase=r.phase, step=step, duration_s=r.duration,
                            **{k: v for k, v in r.detail.items() if isinstance(v, (int, float, str))})

    def run(self, steps: int) -> dict:
        """Run ``steps`` RL steps. Each step's forecast is fitted (ARIMA, in the forecast service's thread)
        from the steps before it while that step's training and weight sync run, and is waited for (at most
        ``FIT_WAIT_S``) only at the next step boundary: never inside a generation phase."""
        history = self.schedule.history(self.rng_history)
        prior = None if self.schedule.is_trace else LengthForecast.from_workload(self.w, 0)
        settle_heap()
        with ForecastService(self.settings.forecast, history, prior=prior) as svc:
            def forecast_for(step: int) -> LengthForecast:
                if self._ticket:
                    svc.wait(self._ticket, timeout=FIT_WAIT_S)
                return svc.latest() or forecast_next(history, self.settings.forecast, prior, use_arima=False)

            if self.settings.step_mode == "async":
                OffPolicySteps(self).run(steps, forecast_for, lambda lengths, st: self._observe(svc, history, lengths, st))
            else:
                for step in range(steps):
                    fc = forecast_for(step)
                    if self.progress:
                        self.progress(f"step {step}/{steps}", step / steps)
                    self.run_step(step, fc, on_generated=lambda lengths, st=step: self._observe(svc, history, lengths, st))
        res = self.result()
        fid = res["fidelity"] or {}
        self.timeline.event(self.backend.now(), "run_end", steps=len(self.steps), distorted=fid.get("distorted"),
                            tdf_needed=fid.get("tdf_needed"), link_efficiency_min=fid.get("link_efficiency_min"),
                            agents_distorted={s: bool(a.get("distorted")) for s, a in fid.get("agents", {}).items()})
        return res

    def _observe(self, svc: ForecastService, history: list, lengths: np.ndarray, step: int) -> None:
        """A step's lengths are known: the next forecast's fit starts now, beside the step's train and sync."""
        history.append(step_stats(lengths, step, self.w.max_response_tokens))
        self.planning.observe_step(lengths, self.schedule.prompt_ids_for_step(step))
        self._ticket = svc.submit(history)

    def result(self) -> dict:
        st = self.steps
        total_t = sum(s["makespan_s"] for s in st)
        realised, decision_ms = self.planning.realised, self.planning.decision_ms
        tokens = sum(s["tokens"] for s in st)
        return {"policy": self.policy.name, "backend": self.backend.name, "static": self.policy.static,
                "layouts": {str(s): lay.name(self.gpus) for s, lay in self.backend.layouts().items()},
                "step_makespan_s": [s["makespan_s"] for s in st],
                "phases": [s["phases"] for s in st],
                "throughput_tokens_per_s": tokens / total_t if total_t else None,
                "migrations": sum(s["migrations"] for s in st), "layout_switches": sum(s["layout_switches"] for s in st),
                "forecast_mape": self.errors.mape(), "forecast": self.errors.to_json(), "lost_requests": self.lost_total,
                "failures": self.failed, "steps": st,
                "step_mode": self.settings.step_mode,
                "idle_s": {"generators": sum(s.get("async", {}).get("generator_idle_s", 0.0) for s in st),
                           "trainers": sum(s.get("async", {}).get("trainer_idle_s", 0.0) for s in st)}
                if self.settings.step_mode == "async" else None,
                **self._tokens_total(), "ticks": self._ticks_total(),
                **self._paid(realised, self.planning.tick_realised),
                "decision_ms_p50": float(np.percentile(decision_ms, 50)) if decision_ms else None,
                "decision_ms_p99": float(np.percentile(decision_ms, 99)) if decision_ms else None,
                "fidelity": self._fidelity(total_t)}

    @staticmethod
    def _paid(realised: list, ticks: list) -> dict:
        """The shares that paid (a realised gain above PAID_S; None where the backend cannot tell):
        ``migrations_paid_fraction`` of the migrations, each held against its tick without it;
        ``migration_ticks_paid_fraction`` of the ticks that moved, their moves together against none."""
        def share(xs):
            return sum(1 for x in xs if x > PAID_S) / len(xs) if xs else None
        return {"migrations_paid_fraction": share([r for _, r in realised]),
                "migration_ticks_paid_fraction": share([g for _, g in ticks]),
                "migration_gains_s": {"predicted": [round(p, 4) for p, _ in realised],
                                      "realised": [round(r, 4) for _, r in realised],
                                      "ticks": [[n, round(g, 4)] for n, g in ticks]} if realised else None}

    def _tokens_total(self) -> dict:
        """The run's token accounting (the steps' summed): exactly once is shown, not inferred. ``tokens_by_agent``:
        per server, the tokens the collectors received from it (``received``; a failed one's up to its death)
        and how many of those were new (``unique``)."""
        out = {"tokens_target": 0, "tokens_unique": 0, "tokens_duplicate": 0, "tokens_by_agent": {}}
        for st in self.steps:
            t = st["accounting"]
            for k in ("tokens_target", "tokens_unique", "tokens_duplicate"):
                out[k] += t[k]
            for a, v in t["by_agent"].items():
                acc = out["tokens_by_agent"].setdefault(str(a), {"received": 0, "unique": 0})
                acc["received"] += v["received"]
                acc["unique"] += v["unique"]
        out["exactly_once"] = bool(self.steps) and all(st["accounting"]["exactly_once"] for st in self.steps)
        return out

    def _ticks_total(self) -> dict:
        interval = self.settings.planning_interval_s
        took = [r["took_s"] for r in self.tick_log if r["took_s"] is not None]
        return {"interval_s": interval, "deadline_s": tick_deadline_s(interval), "ticks": len(self.tick_log),
                "took_s_max": max(took) if took else None,
                "took_s_p50": float(np.percentile(took, 50)) if took else None,
                "late_s_max": max((r["late_s"] for r in self.tick_log), default=None),
                "skipped_intervals": sum(st["ticks"]["skipped_intervals"] for st in self.steps),
                "migrations_per_interval_max": max((st["ticks"]["migrations_per_interval_max"] for st in self.steps),
                                                   default=0)}

    def _fidelity(self, total_t: float) -> dict:
        """The backend's fidelity report, plus whether its distortions reached the step makespans: in the async
        mode, train and sync run beside generation, and slow transfers there delay a step only if the
        generators had to wait for the weights (``generator_idle_s``)."""
        fid = self.backend.fidelity()
        if not fid.get("distorted") or self.settings.step_mode != "async":
            return fid
        cpu = any(a.get("distorted") for a in fid.get("agents", {}).values())
        waited = sum(s.get("async", {}).get("generator_idle_s", 0.0) for s in self.steps)
        fid["step_makespan_affected"] = bool(cpu or waited > 0.01 * total_t)
        if not fid["step_makespan_affected"]:
            fid["verdict"] += (f" (the slow train and sync phases overlapped generation, off the critical path: "
                               f"the generators waited {waited:.2f} s for weights in all, so the step makespans are "
                               f"unaffected; the train and sync phase times are not faithful)")
        return fid


class OffPolicySteps:
    """One step off policy: generation of step k+1 runs while step k trains; step k's weights go out when
    its training ends (the broadcast overlaps generation on the fabric) and step k+2's generation waits for
    them. A step's period runs from its generation start to the next one's. The jobs beside generation are
    served at every poll of the generation loop (:meth:`service`)."""

    def __init__(self, drv: Driver):
        self.drv = drv
        self.b = drv.backend
        self.train_q: list[tuple[int, np.ndarray]] = []
        self.sync_q: list[int] = []
        self.train_job = self.sync_job = None
        self.train_step = self.sync_step = None
        self.trains: dict[int, PhaseResult] = {}
        self.syncs: dict[int, PhaseResult] = {}

    def service(self, now: float) -> None:
        """Collect a finished job (its phase events), start the next one queued (a sync on its circuits)."""
        drv, b = self.drv, self.b
        if self.train_job is not None and self.train_job.done():
            r = self.train_job.wait()
            self.trains[self.train_step] = r
            drv.phase_event(r, self.train_step)
            self.sync_q.append(self.train_step)
            self.train_job = None
        if self.train_job is None and self.train_q:
            k, lengths = self.train_q.pop(0)
            self.train_job, self.train_step = b.start_train(k, lengths), k
        if self.sync_job is not None and self.sync_job.done():
            r = self.sync_job.wait()
            self.syncs[self.sync_step] = r
            drv.phase_event(r, self.sync_step)
            self.sync_job = None
            drv.phase("gen")
        if self.sync_job is None and self.sync_q:
            k = self.sync_q.pop(0)
            drv.phase("sync")
            self.sync_job, self.sync_step = b.start_sync(k), k

    def job_ends(self) -> float:
        """The jobs' known ends (virtual time), where the next poll must be."""
        ends = [j.end_hint() for j in (self.train_job, self.sync_job) if j is not None]
        return min((e for e in ends if e is not None), default=math.inf)

    def wait_for(self, cond) -> None:
        while not cond():
            self.b.wait_until(wake_at(self.b, math.inf, self.job_ends))
            self.service(self.b.now())

    def run(self, steps: int, forecast_for, observe) -> None:
        drv = self.drv
        gens, fcs = [], []
        for k in range(steps):
            if k >= 2:
                self.wait_for(lambda k=k: (k - 2) in self.syncs)  # staleness 1: step k uses the weights of step k-2
            fc = forecast_for(k)
            if drv.progress:
                drv.progress(f"step {k}/{steps}", k / steps)
            g = drv.generate(k, fc, on_tick=self.service, wake_hint=self.job_ends)
            observe(g["lengths"], k)
            self.train_q.append((k, g["lengths"]))
            self.service(self.b.now())
            gens.append(g)
            fcs.append(fc)
        self.wait_for(lambda: len(self.syncs) == steps and self.sync_job is None and self.train_job is None)
        trains, syncs = self.trains, self.syncs
        for k, g in enumerate(gens):
            # the period: until the next step's generation could start (its own done, and step k-1's weights in)
            nxt = max(g["gen_end"], syncs[k - 1].end) if k >= 1 else g["gen_end"]
            period_end = gens[k + 1]["start"] if k + 1 < len(gens) else nxt
            gen_idle = (gens[k + 1]["start"] - g["gen_end"]) if k + 1 < len(gens) else 0.0
            train_idle = trains[k].start - trains[k - 1].end if k >= 1 else trains[k].start - g["gen_end"]
            drv.record(g, fcs[k], trains[k], syncs[k], period_end,
                        {"async": {"generator_idle_s": gen_idle, "trainer_idle_s": train_idle,
                                   "train_start": trains[k].start, "sync_end": syncs[k].end}})


def settle_heap() -> None:
    """Collect once and freeze what survives (the imports, the cluster, the scenario) before the decision
    path starts: the process's first full collection otherwise lands in some planning tick (~12 ms for ~45k
    objects on the 2-core machine; testbed/benchmarks/bench_orchestrator.py measures the path after the same call)."""
    import gc

    gc.collect()
    gc.freeze()

