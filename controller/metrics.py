"""The controller's Prometheus metrics (``--metrics-port``; README "Live metrics").

Fed at three places, one per kind of event:

* :meth:`ControllerMetrics.record` from ``FabricController._record``, the one place every history record is
  completed (done, deferred, failed, rejected): so a reconfiguration moves its counters by exactly one, and
  the counters always agree with ``GET /api/v1/history``;
* :meth:`ControllerMetrics.rest` from ``RestApp.__call__``, once per answered request;
* :meth:`ControllerMetrics.flush` from the os-ken driver, once per datapath flow-cache purge.

The switch gauges are read at scrape time from the core (:meth:`ControllerMetrics.watch`).
"""
from __future__ import annotations

import logging
from typing import Any

from emulation.metrics import MetricDef, build, new_registry
from emulation.spec import PHASES

from .reconfig.executor import STAGES
from .switching import SWITCH_ACTIONS

log = logging.getLogger(__name__)

REST_ENDPOINTS = ("topology", "circuits", "state", "history", "phase", "other")  # the label's values
PHASE_STATES = PHASES + ("none",)  # "none": circuits set directly (POST /circuits) or adopted
# around the switching delays a scenario uses (1-100 ms), and far past them
# (few buckets: a scrape runs in the controller's process and holds its interpreter while it renders them)
BLACKOUT_BUCKETS = (0.0025, 0.005, 0.0075, 0.01, 0.0125, 0.015, 0.02, 0.03, 0.05, 0.1, 0.5)
OVERHEAD_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.02, 0.05, 0.5)

CONTROLLER_METRICS = (
    MetricDef("orchestrrl_reconfigurations_total", "counter",
              "reconfigurations by the benefit-aware decision (switched, stalled, deferred) and outcome (done, "
              "deferred, failed); kind: phase, circuits, initial, reconcile. One per GET /history record "
              "with a decision", ("kind", "decision", "status")),
    MetricDef("orchestrrl_reconfigurations_rejected_total", "counter",
              "requests refused before any decision (bad input, fabric not ready); one per rejected history "
              "record", ("kind",)),
    MetricDef("orchestrrl_reconfiguration_blackout_seconds", "histogram",
              "dark time of a reconfiguration that changed circuits: deletes sent to adds sent (history "
              "dark_ms; the programmed delay plus what the controller adds)", ("kind",), BLACKOUT_BUCKETS),
    MetricDef("orchestrrl_reconfiguration_overhead_seconds", "histogram",
              "control overhead of a reconfiguration that changed something: request received to new "
              "circuits confirmed, minus the programmed delay (history overhead_ms)", ("kind",),
              OVERHEAD_BUCKETS),
    MetricDef("orchestrrl_reconfiguration_overhead_stage_seconds_total", "counter",
              "the control overhead stage by stage, summed over the reconfigurations counted in "
              "orchestrrl_reconfiguration_overhead_seconds (history overhead_stages_ms; "
              "controller/reconfig/executor.py STAGES): divide by its _count for the mean", ("stage",)),
    MetricDef("orchestrrl_reconfiguration_stall_seconds_total", "counter",
              "time phases waited for stalled reconfigurations (the switching delay beyond the slack "
              "window)", ()),
    MetricDef("orchestrrl_ocs_circuits", "gauge", "circuits an OCS holds (the controller's intended state)",
              ("ocs",)),
    MetricDef("orchestrrl_ocs_circuit_changes_total", "counter",
              "circuits added and removed on an OCS by completed reconfigurations", ("ocs", "change")),
    MetricDef("orchestrrl_fabric_phase", "gauge",
              "1 for the phase topology the fabric holds (train, gen, sync; none: circuits set directly), "
              "0 for the others", ("phase",)),
    MetricDef("orchestrrl_controller_switches_connected", "gauge", "switches connected over OpenFlow", ()),
    MetricDef("orchestrrl_controller_switches_expected", "gauge", "switches the fabric has (ToRs and OCSes)", ()),
    MetricDef("orchestrrl_controller_ready", "gauge",
              "1 when the fabric is ready (initialised, every switch read back), else 0", ()),
    MetricDef("orchestrrl_controller_rest_requests_total", "counter",
              "REST API requests answered, by method, endpoint and HTTP status", ("method", "endpoint", "code")),
    MetricDef("orchestrrl_datapath_flushes_total", "counter",
              "purges of Open vSwitch's datapath flow cache around reconfigurations (controller/datapath.py), "
              "by result (ok, failed)", ("result",)),
    MetricDef("orchestrrl_datapath_flush_seconds_total", "counter", "time the datapath flow-cache purges took, "
              "summed (divide by the ok flushes for the mean)", ()),
)


class ControllerMetrics:
    """The controller's metrics in a registry of their own (``registry``), fed by the hooks above."""

    def __init__(self) -> None:
        self.registry = new_registry()
        m = build(self.registry, CONTROLLER_METRICS)
        self.m = m
        self._reconf = m["orchestrrl_reconfigurations_total"]
        self._rejected = m["orchestrrl_reconfigurations_rejected_total"]
        self._blackout = m["orchestrrl_reconfiguration_blackout_seconds"]
        self._overhead = m["orchestrrl_reconfiguration_overhead_seconds"]
        self._stage = {name: m["orchestrrl_reconfiguration_overhead_stage_seconds_total"].labels(name)
                       for name, _, _ in STAGES}
        self._stall = m["orchestrrl_reconfiguration_stall_seconds_total"]
        self._circuits = m["orchestrrl_ocs_circuits"]
        self._changes = m["orchestrrl_ocs_circuit_changes_total"]
        self._phase = {p: m["orchestrrl_fabric_phase"].labels(p) for p in PHASE_STATES}
        self._rest = m["orchestrrl_controller_rest_requests_total"]
        self._flushes = {r: m["orchestrrl_datapath_flushes_total"].labels(r) for r in ("ok", "failed")}
        self._flush_s = m["orchestrrl_datapath_flush_seconds_total"]
        for d in SWITCH_ACTIONS:  # the decisions exist from the start (a dashboard's rate() needs a 0 first)
            self._reconf.labels("phase", d, "deferred" if d == "deferred" else "done")
        for kind in ("phase", "circuits"):
            self._rejected.labels(kind)

    def watch(self, core: Any) -> None:
        """Read the switch gauges from ``core`` (a FabricController) at every scrape."""
        self.m["orchestrrl_controller_switches_connected"].set_function(lambda: len(core.switches.connected))
        self.m["orchestrrl_controller_switches_expected"].set_function(lambda: len(core.switches.expected))
        self.m["orchestrrl_controller_ready"].set_function(lambda: 1.0 if core.ready else 0.0)

    # ---- hooks ------------------------------------------------------------------------------------------
    def record(self, rec: dict, matchings: Any, phase: str | None) -> None:
        """A history record was completed; ``matchings`` and ``phase``: what the controller believes the
        fabric holds after it."""
        kind, status = rec.get("kind", "other"), rec.get("status")
        decision = rec.get("decision")
        if decision is None:
            self._rejected.labels(kind).inc()
            return
        self._reconf.labels(kind, decision, status).inc()
        if decision == "stalled" and rec.get("stall_ms"):
            self._stall.inc(rec["stall_ms"] / 1000.0)
        if status != "done":
            if status == "failed":  # believed state = the intended one (runtime: read back later)
                self._state(matchings, phase)
            return
        if not rec.get("noop"):
            if "dark_ms" in rec:
                self._blackout.labels(kind).observe(rec["dark_ms"] / 1000.0)
            if "overhead_ms" in rec:
                self._overhead.labels(kind).observe(max(0.0, rec["overhead_ms"]) / 1000.0)
            for name, ms in (rec.get("overhead_stages_ms") or {}).items():
                child = self._stage.get(name)
                if child is not None:
                    child.inc(max(0.0, ms) / 1000.0)
            for ocs, ch in (rec.get("changes") or {}).get("ocs", {}).items():
                if ch.get("added"):
                    self._changes.labels(str(ocs), "added").inc(len(ch["added"]))
                if ch.get("removed"):
                    self._changes.labels(str(ocs), "removed").inc(len(ch["removed"]))
        self._state(matchings, phase)

    def _state(self, matchings: Any, phase: str | None) -> None:
        for ocs, m in (matchings or {}).items():
            self._circuits.labels(str(ocs)).set(len(m.circuits))
        now = phase if phase in PHASE_STATES else "none"
        for p, g in self._phase.items():
            g.set(1.0 if p == now else 0.0)

    def rest(self, method: str, endpoint: str, code: int) -> None:
        ep = endpoint if endpoint in REST_ENDPOINTS else "other"
        self._rest.labels(method if method in ("GET", "POST") else "other", ep, str(code)).inc()

    def flush(self, ok: bool, seconds: float | None = None) -> None:
        self._flushes["ok" if ok else "failed"].inc()
        if ok and seconds is not None:
            self._flush_s.inc(max(0.0, seconds))
