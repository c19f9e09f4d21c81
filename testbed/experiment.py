"""Runs and comparisons of policies on one scenario and one backend (what `orchestrrl run` and `compare` do).

On the emulated backend the cluster (controller, fabric, one agent per server) starts once and serves every
policy of a comparison in turn: between two runs the agents drop their requests, the collectors start afresh
and each server is put in the next policy's starting layout without charge (as if its weights had been
loaded that way). Every policy sees the same response lengths and the same dealing of responses to servers
(independent streams from the scenario's seed).

``speedup_vs_best_static`` = mean step makespan of the best static layout (the fastest of every TP layout of a
server that holds the model, not only the two named ones) / the policy's mean step makespan.
"""
from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import numpy as np

from agents.costmodel import CostModel
from agents.engine import Layout
from testbed.orchestrator.settings import (Policy, feasible_layouts, make_policy, orchestrator_settings)
from testbed.report import plot_makespans, write_json, write_run

log = logging.getLogger(__name__)


class Experiment:
    def __init__(self, scenario, backend: str, metrics=None):
        self.scn = scenario
        self.backend_name = backend
        self.metrics = metrics  # testbed.metrics.DriverMetrics: every run's timeline feeds it (or None)
        self.settings = orchestrator_settings(scenario.orchestrator)
        w = scenario.workload
        self.cm = CostModel.for_names(w.model, w.gpu)
        self.gpus = scenario.fabric.gpus_per_server
        self.layouts = feasible_layouts(self.cm, self.gpus, self.settings.engine, w.prompt_tokens,
                                        w.max_response_tokens)
        self._stack = contextlib.ExitStack()
        self.cluster = None

    # ---- policies ----
    def policy(self, name: str) -> Policy:
        return make_policy(name, self.layouts, self.gpus)

    def static_names(self) -> list[str]:
        return [f"static-{lay.name(self.gpus)}" for lay in self.layouts]

    def default_policies(self) -> list[str]:
        return self.static_names() + ["planner", "balancer", "orchestrrl"]

    # ---- life cycle ----
    def __enter__(self) -> "Experiment":
        if self.backend_name == "emulated":
            from testbed.cluster import running_cluster

            start = {s: self.layouts[0].name(self.gpus) for s in self.scn.layout.gen_servers(self.scn.fabric)}
            self.cluster = self._stack.enter_context(running_cluster(
                self.scn, layouts=start, engine=self.settings.engine))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def backend(self, policy: Policy):
        gen = self.scn.layout.gen_servers(self.scn.fabric)
        start = policy.layout or self.layouts[0]
        layouts = {s: start for s in gen}
        if self.backend_name == "simulated":
            from testbed.backends.simulated import SimulatedBackend

            return SimulatedBackend(self.scn, layouts, self.settings.engine)
        from testbed.backends.emulated import EmulatedBackend

        b = EmulatedBackend(self.scn, layouts, self.settings.engine, self.settings.sync_bucket_mb,
                            cluster=self.cluster)
        b.prepare(layouts)
        return b

    # ---- runs ----
    def run(self, policy: Policy, steps: int, out: Path, progress=None) -> tuple[dict, dict]:
        from testbed.driver import Driver

        with self.backend(policy) as backend:
            drv = Driver(self.scn, backend, policy, self.settings, progress=progress)
            with (self.metrics.observe(drv.timeline, policy.name, self.scn.workload.model, self.backend_name,
                                       self.scn.name) if self.metrics is not None else contextlib.nullcontext()):
                res = drv.run(steps)
            res["scenario"] = self.scn.name
            files = write_run(Path(out), res, {"events": drv.timeline.events, "samples": drv.timeline.samples})
        return res, files

    def compare(self, policies: list[Policy], steps: int, out: Path, progress=None, on_policy=None) -> tuple[dict, dict]:
        out = Path(out)
        results, files = {}, {}
        for p in policies:
            if on_policy:
                on_policy(p.name)
            res, f = self.run(p, steps, out / p.name, progress=progress)
            results[p.name] = res
            files.update({f"{p.name}_{k}": v for k, v in f.items()})
        statics = {n: r for n, r in results.items() if r["static"]}
        if not statics:
            raise ValueError("a comparison needs at least one static policy to compare against")
        mean = {n: float(np.mean(r["step_makespan_s"])) for n, r in results.items()}
        best = min(statics, key=lambda n: mean[n])
        report = {"scenario": self.scn.name, "backend": self.backend_name, "steps": steps, "seed": self.scn.seed,
                  "best_static": best, "policies": {}}
        for n, r in results.items():
            report["policies"][n] = {
                "step_makespan_s": r["step_makespan_s"], "phases": r["phases"],
                "throughput_tokens_per_s": r["throughput_tokens_per_s"],
                "speedup_vs_best_static": mean[best] / mean[n], "migrations": r["migrations"],
                "layout_switches": r["layout_switches"], "forecast_mape": r["forecast_mape"],
                "lost_requests": r["lost_requests"], "fidelity": r["fidelity"], "layouts": r["layouts"],
                "decision_ms_p50": r["decision_ms_p50"], "decision_ms_p99": r["decision_ms_p99"],
                "step_mode": r["step_mode"], "idle_s": r["idle_s"], "failures": r["failures"]}
        # the two named static set-ups, as aliases of the layouts they are
        low, high = f"static-{self.layouts[0].name(self.gpus)}", f"static-{self.layouts[-1].name(self.gpus)}"
        report["aliases"] = {"static-low": low, "static-high": high}
        write_json(out / "report.json", report)
        files["report"] = str(out / "report.json")
        files["makespan_png"] = plot_makespans(out, report)
        return report, files
