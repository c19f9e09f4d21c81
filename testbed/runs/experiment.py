"""Runs and comparisons of policies on one scenario and one backend (what `orchestrrl run` and `compare` do).

On the emulated backend the cluster (controller, fabric, one agent per server) starts once and serves every
policy of a comparison in turn: between two runs the agents drop their requests, the collectors start afresh
and each server is put in the next policy's starting layout without charge (as if its weights had been
loaded that way). Every policy sees the same response lengths and the same dealing of responses to servers
(independent streams from the scenario's seed).

The baseline is tuned as a user would tune it (testbed.runs.tuning): every feasible layout x every
``max_num_seqs`` of the grid, on the simulated backend, first; the best of them (``best_static``) then runs on
the requested backend beside ``static-low`` and ``static-high`` (the two named set-ups at the scenario's
engine settings) and the adaptive policies. ``speedup_vs_best_static`` = mean step makespan of the tuned
static configuration / the policy's, both on the requested backend.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
from pathlib import Path

import numpy as np

from agents.costmodel import CostModel
from emulation.orchestration import PolicySpec
from testbed.backends.registry import backend_kind
from testbed.orchestrator.policies import (Policy, check_plugins, defined_policies, feasible_layouts, make_policy,
                                           needs_tuning, started)
from testbed.runs.report import plot_makespans, write_json, write_run
from testbed.runs.tuning import GRID, GridPoint, best, cache_key, cached, static_name, tune

log = logging.getLogger(__name__)

ADAPTIVE = ("planner", "balancer", "orchestrrl")


class Experiment:
    def __init__(self, scenario, backend: str, steps: int | None = None, use_cache: bool = True,
                 grid: tuple[int, ...] = GRID, metrics=None):
        self.scn = scenario
        self.backend_name = backend
        self.kind = backend_kind(backend)  # testbed.backends.registry: SpecError naming ``backend`` when unknown
        self.metrics = metrics  # testbed.runs.metrics.DriverMetrics: every run's timeline feeds it (or None)
        self.settings = scenario.orchestrator
        w = scenario.workload
        self.cm = CostModel.for_engine(w.model, w.gpu, self.settings.engine)
        self.gpus = scenario.fabric.gpus_per_server
        self.layouts = feasible_layouts(self.cm, self.gpus, self.settings.engine, w.prompt_tokens,
                                        w.max_response_tokens)
        self.steps = steps if steps is not None else w.steps
        check_plugins(self.settings)  # every plug-in the scenario names resolves (SpecError) before anything starts
        self.defined = defined_policies(self.settings)  # the composed policies: built-in and the scenario's
        self.use_cache = use_cache
        self.grid_values = grid
        self._grid: list[GridPoint] | None = None
        self._starts: dict[str, Policy] = {}  # policy name -> the policy in its tuned layout (``start: best``)
        self.start_progress = None  # called (policy name, layout name, runs done, runs in all) after each of them
        self._kv_memo: dict = {}  # (layout, max_num_seqs) -> KV blocks per replica (_kv_blocks)
        self._stack = contextlib.ExitStack()
        self.cluster = None
        self.fit = None  # testbed.cluster.fit.Fit: what an emulated run was fitted to (set by the CLI)

    # ---- the tuned baseline ----
    def tuning_grid(self, progress=None) -> list[GridPoint]:
        """Every layout x max_num_seqs of the grid on the simulated backend (cached: testbed.runs.tuning)."""
        if self._grid is None:
            self._grid = tune(self.scn, self.layouts, self.gpus, self.steps, self._simulate, self.grid_values,
                              self.use_cache, progress, kv_blocks=self._kv_blocks, fits=self._fits)
        return self._grid

    def oracle(self, progress=None) -> dict:
        """The oracle bounds of this scenario against its tuned static configuration (testbed.runs.oracle; cached
        like the tuning grid)."""
        from testbed.runs.oracle import Oracle

        pt = best(self.tuning_grid())
        key = cache_key(self.scn, self.steps, tuple(self.grid_values)) + f"-{pt.name}"
        return cached("oracle", key, lambda: Oracle(self.scn, (pt.layout, pt.max_num_seqs), self.grid_values,
                                                    self.steps).compute(progress), self.use_cache)

    def tuned(self) -> Policy:
        pt = best(self.tuning_grid())
        return self.policy(pt.name)

    def _kv_blocks(self, layout, max_num_seqs: int) -> int:
        """KV blocks of one replica of ``layout`` at ``max_num_seqs`` (the engine's cache sizing; remembered: the
        grid asks it and :meth:`_fits` of every configuration)."""
        key = (layout, max_num_seqs)
        if key not in self._kv_memo:
            self._kv_memo[key] = self._kv_blocks_of(layout, max_num_seqs)
        return self._kv_memo[key]

    def _kv_blocks_of(self, layout, max_num_seqs: int) -> int:
        from agents.engine import ModelledCost

        e = self.settings.engine
        eng = dataclasses.replace(e, max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=max(e.max_num_batched_tokens, max_num_seqs))
        cm = CostModel.for_engine(self.scn.workload.model, self.scn.workload.gpu, eng)
        return ModelledCost(cm, self.gpus).kv_capacity_tokens(layout, eng.gpu_memory_utilization) // eng.block_size

    def _fits(self, layout, max_num_seqs: int) -> bool:
        """Whether a replica of ``layout`` at ``max_num_seqs`` holds one request of the prompt and the cap (the
        engine's own check, agents.engine): the activation workspace follows max_num_seqs, so a layout that
        holds one at 256 may not at 1024 (Qwen2.5-32B on TP1x8 of H800: 1,074 blocks at 256, 1,036 at 512 for
        the 1,040 a 256 + 16,384-token request needs)."""
        from agents.engine import kv_blocks_needed

        w = self.scn.workload
        need = kv_blocks_needed(w.prompt_tokens, w.max_response_tokens, self.settings.engine.block_size)
        return self._kv_blocks(layout, max_num_seqs) >= need

    def _simulate(self, layout, max_num_seqs: int):
        """One static configuration on the simulated backend (no files): the result, and what bound its engines
        (testbed.runs.tuning.Bounds: whether a larger max_num_seqs runs the same)."""
        from testbed.runs.tuning import Bounds

        pol = make_policy(static_name(layout.name(self.gpus), max_num_seqs), self.layouts, self.gpus)
        res, es = self._simulated(pol, layout)
        return res, Bounds(any(e.seq_bound for e in es), any(e.kv_bound for e in es),
                           max((e.kv_peak for e in es), default=0))

    def _simulated(self, pol: Policy, layout) -> tuple:
        """One run of ``pol`` with every generator server loaded in ``layout``, on the simulated backend, the
        experiment's steps (no files): the result and the backend's engines (what bound them)."""
        from testbed.backends.simulated import SimulatedBackend
        from testbed.driver import Driver

        settings = self._settings(pol)
        gen = self.scn.layout.gen_servers(self.scn.fabric)
        with SimulatedBackend(self.scn, {s: layout for s in gen}, settings.engine) as b:
            return Driver(self.scn, b, pol, settings).run(self.steps), list(b.engines.values())

    # ---- policies ----
    def policy(self, name: str | PolicySpec) -> Policy:
        """The policy ``name`` names (a static configuration, a composed policy: built-in, the scenario's, or a
        :class:`PolicySpec` from the command line); one without a planner runs on the tuned configuration."""
        tuned = None
        if needs_tuning(name, self.defined):
            tuned = make_policy(best(self.tuning_grid()).name, self.layouts, self.gpus)
        pol = make_policy(name, self.layouts, self.gpus, tuned, self.defined)
        if pol.tune_start:  # once per policy name and experiment (a comparison asks for a policy more than once)
            if pol.name not in self._starts:
                self._starts[pol.name] = self._tune_start(pol)
            pol = self._starts[pol.name]
        if pol.static:  # one name per configuration: static-low is static-TP1x8@<the scenario's max_num_seqs>
            mns = pol.max_num_seqs or self.settings.engine.max_num_seqs
            pol = dataclasses.replace(pol, name=static_name(pol.layout.name(self.gpus), mns), max_num_seqs=mns)
        return pol

    def _tune_start(self, pol: Policy) -> Policy:
        """``pol`` (``start: best``) loaded in the layout where it does best: run from every feasible layout on
        the simulated backend (its own steps and seed, at its max_num_seqs, as the tuning grid runs a static
        configuration), the smallest mean step makespan taken (ties: the tuned static layout, then the smaller
        TP). Not cached (a plug-in's code is not part of any key): one run per layout, every time."""
        here = pol.start or pol.layout
        order = sorted(self.layouts, key=lambda lay: (lay != here, lay.tp))
        tried = []
        for lay in order:
            res, _ = self._simulated(dataclasses.replace(started(pol, lay), tune_start=False), lay)
            tried.append((lay, float(np.mean(res["step_makespan_s"]))))
            log.info("%s from %s: %.2f s a step (simulated)", pol.name, lay.name(self.gpus), tried[-1][1])
            if self.start_progress:
                self.start_progress(pol.name, lay.name(self.gpus), len(tried), len(order))
        pick = min(tried, key=lambda x: x[1])[0]  # min keeps the first of equal ones: ``order``'s
        return dataclasses.replace(started(pol, pick), tune_start=False,
                                   start_tuning=tuple((lay.name(self.gpus), round(t, 4)) for lay, t in tried))

    def aliases(self) -> dict[str, str]:
        return {a: self.policy(a).name for a in ("static-tuned", "static-low", "static-high")}

    def same_runs(self) -> dict[str, str]:
        """Static configurations the tuning grid found to be another's run step for step (``same_as``:
        max_num_seqs never bound at the smaller value), by name: the alias' run is not made again."""
        grid = self.tuning_grid()
        return {p.name: static_name(p.layout, p.same_as) for p in grid if p.same_as is not None}

    def default_policies(self) -> list[str]:
        """The tuned static configuration, static-low and static-high (each distinct run once: one the grid
        found identical to another is reported as its alias), the adaptive policies and the scenario's own
        (``orchestrator.policies``)."""
        same = self.same_runs()
        names = list(dict.fromkeys(same.get(n, n) for n in self.aliases().values()))
        return names + list(ADAPTIVE) + [p.name for p in self.settings.policies]

    def _settings(self, policy: Policy):
        return dataclasses.replace(self.settings, engine=policy.engine(self.settings.engine))

    # ---- life cycle ----
    def __enter__(self) -> "Experiment":
        start = {s: self.layouts[0] for s in self.scn.layout.gen_servers(self.scn.fabric)}
        self.cluster = self._stack.enter_context(self.kind.cluster(self.scn, start, self.settings.engine))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def backend(self, policy: Policy):
        gen = self.scn.layout.gen_servers(self.scn.fabric)
        start = policy.start_layout or self.layouts[0]
        layouts = {s: start for s in gen}
        engine = policy.engine(self.settings.engine)
        return self.kind.backend(self.scn, layouts, engine, self.settings, self.cluster, bool(policy.balancer))

    # ---- runs ----
    def run(self, policy: Policy, steps: int, out: Path, progress=None) -> tuple[dict, dict]:
        from testbed.driver import Driver

        with self.backend(policy) as backend:
            drv = Driver(self.scn, backend, policy, self._settings(policy), progress=progress)
            with (self.metrics.observe(drv.timeline, policy.name, self.scn.workload.model, self.backend_name,
                                       self.scn.name) if self.metrics is not None else contextlib.nullcontext()):
                res = drv.run(steps)
            res["scenario"] = self.scn.name
            res["max_num_seqs"] = policy.engine(self.settings.engine).max_num_seqs
            if self.fit is not None:
                res["fit"] = self.fit.to_json()
            files = write_run(Path(out), res, {"events": drv.timeline.events, "samples": drv.timeline.samples})
        return res, files

    def compare(self, policies: list[Policy], steps: int, out: Path, progress=None, on_policy=None,
                oracle: bool = True) -> tuple[dict, dict]:
        """Every policy of ``policies`` (the tuned static configuration is added when missing) on the same seed;
        ``oracle``: each adaptive policy's speedup also as a fraction of its oracle's (testbed.runs.oracle)."""
        out = Path(out)
        grid = self.tuning_grid()
        orc = self.oracle() if oracle and steps == self.steps else None
        tuned = self.tuned()
        if tuned.name not in {p.name for p in policies}:
            policies = [tuned] + list(policies)
        results, files = {}, {}
        for p in policies:
            if on_policy:
                on_policy(p.name)
            res, f = self.run(p, steps, out / p.name, progress=progress)
            results[p.name] = res
            files.update({f"{p.name}_{k}": v for k, v in f.items()})
        mean = {n: float(np.mean(r["step_makespan_s"])) for n, r in results.items()}
        base = mean[tuned.name]
        flagged = sum(1 for r in results.values() if (r.get("fidelity") or {}).get("distorted"))
        report = {"scenario": self.scn.name, "backend": self.backend_name, "steps": steps, "seed": self.scn.seed,
                  "best_static": tuned.name, "baseline_grid": [p.to_json() for p in grid],
                  "fidelity_flagged_runs": flagged, "policies": {}}
        if self.fit is not None:
            report["fit"] = self.fit.to_json()
        by_name = {p.name: p for p in policies}
        for n, r in results.items():
            report["policies"][n] = {
                "step_makespan_s": r["step_makespan_s"], "phases": r["phases"],
                "throughput_tokens_per_s": r["throughput_tokens_per_s"],
                "speedup_vs_best_static": base / mean[n], "migrations": r["migrations"],
                "layout_switches": r["layout_switches"], "forecast_mape": r["forecast_mape"],
                "lost_requests": r["lost_requests"], "fidelity": r["fidelity"], "layouts": r["layouts"],
                "max_num_seqs": r["max_num_seqs"], "migrations_paid_fraction": r["migrations_paid_fraction"],
                "migration_ticks_paid_fraction": r["migration_ticks_paid_fraction"],
                "decision_ms_p50": r["decision_ms_p50"], "decision_ms_p99": r["decision_ms_p99"],
                "step_mode": r["step_mode"], "idle_s": r["idle_s"], "failures": r["failures"],
                # ``start: best``: the mean step makespan (s, simulated) from every layout tried
                **({"start_tuning": dict(by_name[n].start_tuning)} if by_name[n].start_tuning else {}),
                # token accounting (driver.Driver._tokens_total) and the planning ticks (testbed/ticks.py)
                **{k: r[k] for k in ("tokens_target", "tokens_unique", "tokens_duplicate", "exactly_once",
                                     "tokens_by_agent", "ticks")}}
        report["aliases"] = self.aliases()
        # a configuration not run because the grid found it another's run, step for step (Experiment.same_runs)
        report["same_runs"] = {a: b for a, b in self.same_runs().items()
                               if a in report["aliases"].values() and a not in results and b in results}
        for n, p in report["policies"].items():
            p["oracle_kind"] = by_name[n].oracle_kind
        if orc is not None:
            report["oracle"] = {k: v for k, v in orc.items() if k != "kinds"}
            report["oracle"]["kinds"] = {k: {"speedup": v["speedup"], "gen_s": v["gen_s"]} for k, v in orc["kinds"].items()}
            for n, p in report["policies"].items():
                kind = p["oracle_kind"]
                p["oracle_fraction"] = (p["speedup_vs_best_static"] / orc["kinds"][kind]["speedup"]) if kind else None
            write_json(out / "oracle.json", orc)
            files["oracle"] = str(out / "oracle.json")
        write_json(out / "report.json", report)
        files["report"] = str(out / "report.json")
        files["makespan_png"] = plot_makespans(out, report)
        return report, files
