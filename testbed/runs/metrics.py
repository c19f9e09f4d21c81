"""The driver's Prometheus metrics: the orchestrator and the engines, live (README "Live metrics").

The driver process (``orchestrrl run`` / ``compare``) serves one registry (:class:`DriverMetrics`); each
policy's run subscribes a :class:`RunObserver` to its :class:`testbed.driver.Timeline` and turns the
events and per-tick samples the timeline records anyway into metrics. Nothing here is called from the
planning logic, and no listener runs inside a Mininet host: the engines' figures reach the driver over the
agents' RPC (their ``stats``, sampled at every planning tick and once when a step's generation ends).

The engines' metrics carry vLLM's names and types (vLLM V1 ``vllm/v1/metrics/loggers.py``): the gauges
``vllm:num_requests_running``, ``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc`` and the counters
``vllm:generation_tokens_total``, ``vllm:num_preemptions_total``, with vLLM's labels ``model_name`` and
``engine`` (here: the replica, one engine per data-parallel replica) plus ``server`` and ``policy``. The
counters are per server: a layout switch rebuilds a server's replicas, and the engine carries their counts
on (agents/engine.py ``Engine.stats``). Everything else is ``orchestrrl_*``.

Every series carries ``policy`` (a comparison runs its policies one after the other in one process). When
a run ends its live gauges (queues, KV, layouts, load) are removed, so they stop; counters and the last
step's figures stay.

``python -m testbed.runs.metrics`` prints README's metric table (both processes), from these definitions.
"""
from __future__ import annotations

import argparse
import logging
import math
import sys
from typing import Any

from prometheus_client.core import GaugeMetricFamily

from emulation.metrics import MetricDef, MetricsServer, build, markdown_rows, new_registry, serve
from emulation.scenario import DEFAULT_CONTROLLER_METRICS_PORT, DEFAULT_DRIVER_METRICS_PORT, check_metrics_port
from emulation.spec import PHASES

log = logging.getLogger(__name__)

ENGINE = ("model_name", "engine", "server", "policy")  # vLLM's labels, then ours
SERVER = ("model_name", "server", "policy")
DOWNTIME_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
MIGRATION_RESULTS = ("moved", "finished", "scheduled", "failed")  # agents' and the simulator's, + the driver's

DRIVER_METRICS = (
    # ---- the engines, under vLLM's names ----
    MetricDef("vllm:num_requests_running", "gauge", "requests in the replica's running batch (vLLM's gauge)",
              ENGINE),
    MetricDef("vllm:num_requests_waiting", "gauge", "requests queued for the replica (vLLM's gauge)", ENGINE),
    MetricDef("vllm:kv_cache_usage_perc", "gauge", "fraction of the replica's KV-cache blocks in use, 0-1 "
              "(vLLM's gauge)", ENGINE),
    MetricDef("vllm:generation_tokens_total", "counter", "tokens the server's engine generated (vLLM's "
              "counter; per server: a layout switch rebuilds the replicas)", SERVER),
    MetricDef("vllm:num_preemptions_total", "counter", "requests the server's engine preempted (recompute; "
              "vLLM's counter)", SERVER),
    # ---- the orchestrator ----
    MetricDef("orchestrrl_run_active", "gauge", "1 while the policy's run goes on, 0 once it ended",
              ("policy", "backend", "scenario")),
    MetricDef("orchestrrl_server_layout", "gauge", "1 for the generator server's current layout (TP<t>x<r>)",
              ("policy", "server", "layout")),
    MetricDef("orchestrrl_server_switching", "gauge", "1 while the server's layout switch is in progress",
              ("policy", "server")),
    MetricDef("orchestrrl_load_index_seconds", "gauge", "the server's load index: its predicted remaining "
              "generation time (the estimator's, with a switch in progress)", ("policy", "server")),
    MetricDef("orchestrrl_planner_decisions_total", "counter", "the planner's per-server decisions at its "
              "ticks: switch or keep", ("policy", "decision")),
    MetricDef("orchestrrl_planner_predicted_gain_seconds", "gauge", "at the last tick: the remaining time the "
              "server's best layout is predicted to save over its current one, its switch cost included",
              ("policy", "server")),
    MetricDef("orchestrrl_layout_switches_total", "counter", "layout switches: live (the planner, mid-step) "
              "or initial (at a step's start, free)", ("policy", "server", "kind")),
    MetricDef("orchestrrl_layout_switch_predicted_gain_seconds_total", "counter", "the predicted gains of the "
              "live layout switches made", ("policy",)),
    MetricDef("orchestrrl_migrations_total", "counter", "the balancer's migrations by result: moved, finished "
              "(done before it could move), scheduled (simulated), failed", ("policy", "result")),
    MetricDef("orchestrrl_migration_downtime_seconds", "histogram", "a migrated request's downtime (stopped "
              "on the source to resumed on the destination)", ("policy",), DOWNTIME_BUCKETS),
    MetricDef("orchestrrl_fabric_requests_total", "counter", "the driver's phase requests to the fabric by "
              "phase and the controller's decision (switched, stalled, deferred)", ("policy", "phase", "decision")),
    MetricDef("orchestrrl_fabric_topology", "gauge", "1 for the phase topology the fabric holds after the "
              "driver's last request (also on the simulated backend)", ("policy", "phase")),
    MetricDef("orchestrrl_steps_total", "counter", "RL steps completed", ("policy",)),
    MetricDef("orchestrrl_step_tokens_total", "counter", "response tokens of the completed steps (report.json's "
              "throughput x makespans)", ("policy",)),
    MetricDef("orchestrrl_step_makespan_seconds", "gauge", "the last completed step's makespan", ("policy",)),
    MetricDef("orchestrrl_phase_seconds", "gauge", "the last completed step's phase times (gen, train, sync)",
              ("policy", "phase")),
    MetricDef("orchestrrl_forecast_error_ratio", "gauge", "the last step's forecast error: |forecast - "
              "realised| / realised mean response length", ("policy",)),
    MetricDef("orchestrrl_lost_requests_total", "counter", "responses not delivered whole", ("policy",)),
    MetricDef("orchestrrl_agent_failures_total", "counter", "generator agents that failed mid-run (exited or "
              "stopped answering)", ("policy", "server")),
    MetricDef("orchestrrl_requeued_requests_total", "counter", "requests of failed agents re-queued on the "
              "others", ("policy",)),
    MetricDef("orchestrrl_fidelity_distorted", "gauge", "the fidelity monitor's verdict when the run ended: 1 "
              "distorted (CPU or fabric), 0 faithful (emulated backend)", ("policy",)),
    MetricDef("orchestrrl_fidelity_agent_distorted", "gauge", "1 when the agent's decode steps ran late beyond "
              "the bound (emulated)", ("policy", "server")),
    MetricDef("orchestrrl_fidelity_tdf_needed", "gauge", "the time dilation the monitor says would make the run "
              "faithful (emulated)", ("policy",)),
    MetricDef("orchestrrl_fidelity_link_efficiency_ratio", "gauge", "the slowest phase's transfers against the "
              "modelled link rates (emulated)", ("policy",)),
)

# the gauges of a tick: rendered from each run's latest sample and plan event when a scrape asks (LatestTick),
# so a tick costs the driver one reference per sample, not a gauge update per replica
TICK_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
               "orchestrrl_server_layout", "orchestrrl_server_switching", "orchestrrl_load_index_seconds",
               "orchestrrl_planner_predicted_gain_seconds")


class LatestTick:
    """A collector: the TICK_GAUGES of every running policy, from the sample and plan event its observer
    last saw (dicts the driver never changes once recorded, so a scrape thread reads them as they are)."""

    def __init__(self, defs) -> None:
        self.defs = [d for d in defs if d.name in TICK_GAUGES]
        self.runs: dict[str, "RunObserver"] = {}

    def describe(self) -> list:
        return [GaugeMetricFamily(d.name, d.help, labels=d.labels) for d in self.defs]

    def collect(self) -> list:
        f = {d.name: GaugeMetricFamily(d.name, d.help, labels=d.labels) for d in self.defs}
        run, wait, kv = f["vllm:num_requests_running"], f["vllm:num_requests_waiting"], f["vllm:kv_cache_usage_perc"]
        for policy, obs in list(self.runs.items()):
            smp, plan, model = obs.sample, obs.plan, obs.model
            if smp is not None:
                load = smp.get("load") or {}
                for s, rec in smp["servers"].items():
                    key = str(s)
                    for r, (a, b, c) in enumerate(zip(rec["running"], rec["waiting"], rec["kv"])):
                        lv = (model, str(r), key, policy)
                        run.add_metric(lv, a)
                        wait.add_metric(lv, b)
                        kv.add_metric(lv, c)
                    if rec.get("layout") is not None:
                        f["orchestrrl_server_layout"].add_metric((policy, key, rec["layout"]), 1)
                    f["orchestrrl_server_switching"].add_metric((policy, key), 1 if rec.get("switching") else 0)
                    x = load.get(s, load.get(key))
                    if _finite(x):
                        f["orchestrrl_load_index_seconds"].add_metric((policy, key), x)
            if plan is not None:
                for s, g in (plan.get("gain_s") or {}).items():
                    if _finite(g):
                        f["orchestrrl_planner_predicted_gain_seconds"].add_metric((policy, str(s)), g)
        return list(f.values())


class DriverMetrics:
    """The driver process's registry and (once :meth:`serve` ran) its endpoint."""

    def __init__(self) -> None:
        self.registry = new_registry()
        self.m = build(self.registry, [d for d in DRIVER_METRICS if d.name not in TICK_GAUGES])
        self.tick = LatestTick(DRIVER_METRICS)
        self.registry.register(self.tick)
        self.server: MetricsServer | None = None

    def serve(self, host: str, port: int | None, field: str = "metrics.driver_port") -> "DriverMetrics":
        """Serve on ``host:port`` by emulation.metrics' port rule (0: no endpoint)."""
        self.server = serve(self.registry, host, port, DEFAULT_DRIVER_METRICS_PORT, field)
        return self

    @property
    def url(self) -> str | None:
        return self.server.url if self.server is not None else None

    def observe(self, timeline: Any, policy: str, model_name: str, backend: str, scenario: str) -> "RunObserver":
        """Subscribe a run's observer to ``timeline``; close it when the run ends."""
        obs = RunObserver(self, policy, model_name, backend, scenario)
        timeline.observers.append(obs)
        obs.timeline = timeline
        return obs

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()

    def __enter__(self) -> "DriverMetrics":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class RunObserver:
    """One policy's run: timeline events and samples -> metrics (see the module docstring)."""

    def __init__(self, metrics: DriverMetrics, policy: str, model_name: str, backend: str, scenario: str):
        self.metrics = metrics
        self.m = metrics.m
        self.policy, self.model = policy, model_name
        self.timeline = None
        self._active = self.m["orchestrrl_run_active"].labels(policy, backend, scenario)
        self._active.set(1)
        self.sample: dict | None = None  # the latest tick's sample and plan event (LatestTick renders them)
        self.plan: dict | None = None
        metrics.tick.runs[policy] = self
        self._counts: dict[str, list] = {}  # server -> [tokens seen, preemptions seen, tokens child, preempt child]
        self._decisions = {d: self.m["orchestrrl_planner_decisions_total"].labels(policy, d) for d in ("switch", "keep")}
        self._topology = {p: self.m["orchestrrl_fabric_topology"].labels(policy, p) for p in PHASES}
        self._migr = {r: self.m["orchestrrl_migrations_total"].labels(policy, r) for r in MIGRATION_RESULTS}
        self._downtime = self.m["orchestrrl_migration_downtime_seconds"].labels(policy)
        for name in ("orchestrrl_requeued_requests_total", "orchestrrl_lost_requests_total",
                     "orchestrrl_steps_total", "orchestrrl_step_tokens_total"):
            self.m[name].labels(policy)  # at 0 from the start: a dashboard's increase() needs a first sample
        self._on = {"plan": self._plan, "layout_switch": self._switch, "migration": self._migration,
                    "migration_failed": self._migration_failed, "handover": self._handover,
                    "fabric": self._fabric, "step_end": self._step_end, "agent_failed": self._failed,
                    "requeued": self._requeued, "run_end": self._run_end}
        self.closed = False

    # ---- samples: the engines and the load index, per tick ----
    def on_sample(self, smp: dict) -> None:
        self.sample = smp  # the gauges: LatestTick, at the next scrape
        for s, rec in smp["servers"].items():
            self._count(str(s), rec)

    def _count(self, key: str, rec: dict) -> None:
        """The engine's cumulative counters -> counter increments (an engine that restarted from 0, e.g. a
        reset agent, counts on from its new value)."""
        c = self._counts.get(key)
        if c is None:
            c = self._counts[key] = [0, 0, self.m["vllm:generation_tokens_total"].labels(self.model, key, self.policy),
                                     self.m["vllm:num_preemptions_total"].labels(self.model, key, self.policy)]
            for kind in ("live", "initial"):  # the server's counters at 0 from its first sample on
                self.m["orchestrrl_layout_switches_total"].labels(self.policy, key, kind)
            self.m["orchestrrl_agent_failures_total"].labels(self.policy, key)
        for i, field in ((0, "tokens"), (1, "preemptions")):
            v = rec.get(field)
            if not _finite(v):
                continue
            d = v - c[i] if v >= c[i] else v
            if d:
                c[2 + i].inc(d)
            c[i] = v

    # ---- events ----
    def on_event(self, e: dict) -> None:
        fn = self._on.get(e["kind"])
        if fn is not None:
            fn(e)

    def _plan(self, e: dict) -> None:
        self.plan = e  # the predicted gains: LatestTick, at the next scrape
        gains = e.get("gain_s") or {}
        n_switch = len(set(e.get("switch") or ()) & set(gains))
        if n_switch:
            self._decisions["switch"].inc(n_switch)
        if len(gains) - n_switch:
            self._decisions["keep"].inc(len(gains) - n_switch)

    def _switch(self, e: dict) -> None:
        kind = "initial" if e.get("initial") else "live"
        self.m["orchestrrl_layout_switches_total"].labels(self.policy, str(e["server"]), kind).inc()
        if kind == "live" and _finite(e.get("gain_s")):
            self.m["orchestrrl_layout_switch_predicted_gain_seconds_total"].labels(self.policy).inc(max(0.0, e["gain_s"]))

    def _migration(self, e: dict) -> None:
        res = e.get("result") or "moved"
        child = self._migr.get(res) or self.m["orchestrrl_migrations_total"].labels(self.policy, str(res))
        child.inc()
        if _finite(e.get("downtime_s")):
            self._downtime.observe(e["downtime_s"])

    def _migration_failed(self, e: dict) -> None:
        self._migr["failed"].inc()

    def _handover(self, e: dict) -> None:  # the simulated backend: a scheduled migration's downtime, once it happened
        if _finite(e.get("downtime_s")):
            self._downtime.observe(e["downtime_s"])

    def _fabric(self, e: dict) -> None:
        self.m["orchestrrl_fabric_requests_total"].labels(self.policy, str(e.get("phase")),
                                                          str(e.get("decision") or "none")).inc()
        top = e.get("topology")
        for p, g in self._topology.items():
            g.set(1 if p == top else 0)

    def _step_end(self, e: dict) -> None:
        p = self.policy
        self.m["orchestrrl_steps_total"].labels(p).inc()
        if _finite(e.get("tokens")):
            self.m["orchestrrl_step_tokens_total"].labels(p).inc(e["tokens"])
        if _finite(e.get("makespan_s")):
            self.m["orchestrrl_step_makespan_seconds"].labels(p).set(e["makespan_s"])
        for name, v in (e.get("phases") or {}).items():
            if _finite(v):
                self.m["orchestrrl_phase_seconds"].labels(p, name[:-2] if name.endswith("_s") else name).set(v)
        if _finite(e.get("forecast_ape")):
            self.m["orchestrrl_forecast_error_ratio"].labels(p).set(e["forecast_ape"])
        lost = e.get("lost_requests")
        self.m["orchestrrl_lost_requests_total"].labels(p).inc(lost if _finite(lost) and lost > 0 else 0)

    def _failed(self, e: dict) -> None:
        self.m["orchestrrl_agent_failures_total"].labels(self.policy, str(e["server"])).inc()

    def _requeued(self, e: dict) -> None:
        if _finite(e.get("requests")):
            self.m["orchestrrl_requeued_requests_total"].labels(self.policy).inc(e["requests"])

    def _run_end(self, e: dict) -> None:
        p = self.policy
        if e.get("distorted") is not None:
            self.m["orchestrrl_fidelity_distorted"].labels(p).set(1 if e["distorted"] else 0)
        if _finite(e.get("tdf_needed")):
            self.m["orchestrrl_fidelity_tdf_needed"].labels(p).set(e["tdf_needed"])
        if _finite(e.get("link_efficiency_min")):
            self.m["orchestrrl_fidelity_link_efficiency_ratio"].labels(p).set(e["link_efficiency_min"])
        for s, bad in (e.get("agents_distorted") or {}).items():
            self.m["orchestrrl_fidelity_agent_distorted"].labels(p, str(s)).set(1 if bad else 0)

    # ---- end of the run ----
    def close(self) -> None:
        """The run ended: its live gauges go (they would go on showing its last tick), counters stay."""
        if self.closed:
            return
        self.closed = True
        if self.timeline is not None and self in self.timeline.observers:
            self.timeline.observers.remove(self)
        if self.metrics.tick.runs.get(self.policy) is self:
            del self.metrics.tick.runs[self.policy]
        for p in PHASES:
            self.m["orchestrrl_fabric_topology"].remove(self.policy, p)
        self._active.set(0)

    def __enter__(self) -> "RunObserver":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- command-line plumbing (run, compare, demo, fabric up, bench) ----------------------------------------
def add_flags(parser: argparse.ArgumentParser, driver: bool = True, controller: bool = True) -> None:
    """``--metrics-port`` (this process's endpoint) and ``--controller-metrics-port``; both override the
    scenario's ``metrics`` section (0: no endpoint)."""
    if driver:
        parser.add_argument("--metrics-port", type=int, default=None,
                            help=f"Prometheus endpoint of this run's orchestrator and engines (default: the "
                                 f"scenario's metrics.driver_port, else {DEFAULT_DRIVER_METRICS_PORT} or a free "
                                 f"port when that is taken; 0: none)")
    if controller:
        parser.add_argument("--controller-metrics-port", type=int, default=None,
                            help=f"Prometheus endpoint of the SDN controller (default: the scenario's "
                                 f"metrics.controller_port, else {DEFAULT_CONTROLLER_METRICS_PORT} or a free port "
                                 f"when that is taken; 0: none)")


def apply_flags(scn: Any, args: argparse.Namespace) -> Any:
    """``scn`` with the flags of :func:`add_flags` in its ``metrics`` section (SpecError names the flag)."""
    import dataclasses

    changes = {}
    for flag, attr, field in (("--metrics-port", "metrics_port", "driver_port"),
                              ("--controller-metrics-port", "controller_metrics_port", "controller_port")):
        v = getattr(args, attr, None)
        if v is not None:
            changes[field] = check_metrics_port(v, flag)
    if not changes:
        return scn
    return dataclasses.replace(scn, metrics=dataclasses.replace(scn.metrics, **changes))


def pin_controller_port(scn: Any) -> Any:
    """``scn`` with its controller's metrics port picked now (emulation.metrics.bind_port), so the URL can be
    printed before the cluster starts and the controller takes exactly that port."""
    import dataclasses

    from emulation.metrics import bind_port

    ms = scn.metrics
    port = bind_port(ms.host, ms.controller_port, DEFAULT_CONTROLLER_METRICS_PORT, "metrics.controller_port")
    return dataclasses.replace(scn, metrics=dataclasses.replace(ms, controller_port=port))


def markdown_table() -> str:
    """README's metric table: every metric of both processes."""
    from controller.metrics import CONTROLLER_METRICS

    head = ["| metric | type | served by | labels | meaning |", "|---|---|---|---|---|"]
    return "\n".join(head + markdown_rows(CONTROLLER_METRICS, "controller")
                     + markdown_rows(DRIVER_METRICS, "driver"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m testbed.runs.metrics", description="print README's metric table")
    p.parse_args(argv)
    print(markdown_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
