"""The controller's state machine (no os-ken here) and its state file.

:class:`FabricController` is what the REST API talks to and what the os-ken app feeds with switch events.
It owns the intended circuits, the current routes, the phase, the connected switches and the history, and it
serialises reconfigurations (one at a time; a second waits its turn). It reaches the switches only through a
:class:`controller.reconfig.executor.Driver`, so unit tests run it against fake datapaths. The command line lives in
controller/config.py.
"""
from __future__ import annotations

import json
import logging
import queue
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from emulation.files import write_json_atomic
from emulation.spec import FabricSpec, JobLayout
from emulation.validation import SpecError, require, to_dict

from .fabric_rules import BUILTIN, FabricRule
from .ocs import Matching
from .phases import TRAIN_PARTS, topology_name
from .reconfig.clock import Clock
from .reconfig.executor import Driver, execute_plan
from .reconfig.plan import ReconfigPlan, plan_reconfig
from .reconfig.request import ReconfigRequest, circuits_request, phase_request
from .rest import Unavailable
from .switches import SwitchSet

log = logging.getLogger(__name__)

STATE_VERSION = 1
HISTORY_LIMIT = 10000


class NotReady(Unavailable):
    """The fabric is not fully connected/initialised yet (HTTP 503)."""


class ReconfigFailed(Unavailable):
    """A switch did not confirm in time or disconnected during a reconfiguration (HTTP 503)."""


# ---- state file ------------------------------------------------------------------------------------
def save_state(path: Path, circuits: Mapping[int, Matching], phase: str | None, part: str | None = None) -> None:
    """Atomically write the intended circuits (temporary file + rename), the phase they realise and the part
    of the train step they were built for (``part``, written only when there is one).

    No fsync: the file guards against the controller dying (``kill -9``), for which the page cache is
    enough; an OS crash takes the emulated switches with it, so there is nothing to reconcile after one.
    """
    data = {"version": STATE_VERSION, "phase": phase, **({"part": part} if part is not None else {}),
            "circuits": {str(o): m.to_json() for o, m in sorted(circuits.items())}}
    write_json_atomic(path, data, fsync=False)


class _StateWriter:
    """Writes the state file beside a running reconfiguration, on one long-lived thread (starting a thread
    per write cost 0.3-1.4 ms on the overhead's path); :meth:`submit` returns a :class:`_StateWrite`.

    Even without fsync a write costs 2-8 ms on this machine's ext4 (a rename over an existing file flushes
    it), the largest stage of the control overhead when it was written first. Crash semantics stay whole:
    the controller answers only after the file holds the new intent; dying before that leaves the previous
    intent in the file, and a restart reconciles the switches back to it (the request was never answered).
    """

    def __init__(self, clock: Clock):
        self._clock = clock
        self._jobs: "queue.SimpleQueue[_StateWrite]" = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, path: Path, circuits: Mapping[int, Matching], phase: str | None,
               part: str | None = None) -> "_StateWrite":
        job = _StateWrite(path, dict(circuits), phase, part, self._clock)
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._work, name="state-file", daemon=True)
            self._thread.start()
        self._jobs.put(job)
        return job

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            try:
                save_state(job.path, job.circuits, job.phase, job.part)
            except BaseException as e:  # noqa: BLE001 - reported by the job's wait()
                job.error = e
            job.done.set()


class _StateWrite:
    """One submitted state-file write; :meth:`wait` blocks until it is on disk (or failed)."""

    def __init__(self, path: Path, circuits: Mapping[int, Matching], phase: str | None, part: str | None,
                 clock: Clock):
        self.path, self.circuits, self.phase, self.part = path, circuits, phase, part
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._clock = clock

    def wait(self, timeout_s: float = 30.0) -> dict:
        """Block until written; the record fields (persist error, how long the answer waited for it)."""
        t0 = self._clock.now()
        written = self.done.wait(timeout_s)
        out: dict = {"persist_wait_ms": round((self._clock.now() - t0) * 1000.0, 3)}
        if not written:
            out["persist_error"] = f"state file not written after {timeout_s:g} s"
        elif self.error is not None:
            out["persist_error"] = f"{type(self.error).__name__}: {self.error}"
        if "persist_error" in out:
            log.error("state file: %s (a restart would reconcile to the previous intended state)",
                      out["persist_error"])
        return out


def load_state(path: Path, spec: FabricSpec) -> tuple[dict[int, Matching], str | None, str | None] | None:
    """The intended circuits, phase and train part from ``path``; None when the file does not exist.

    Raises SpecError naming the field when the file is not a state file for this fabric.
    """
    path = Path(path)
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SpecError("state_file", f"{path}: not readable JSON: {e}") from None
    f = f"state_file({path})"
    require(isinstance(data, dict), f, "must be a JSON object")
    unknown = sorted(set(data) - {"version", "phase", "part", "circuits"})
    require(not unknown, f"{f}.{unknown[0] if unknown else ''}", "unknown key")
    require(data.get("version") == STATE_VERSION, f"{f}.version", f"must be {STATE_VERSION}, got {data.get('version')!r}")
    phase = data.get("phase")
    require(phase is None or isinstance(phase, str), f"{f}.phase", f"must be a string or null, got {phase!r}")
    part = data.get("part")
    require(part is None or (phase == "train" and part in TRAIN_PARTS), f"{f}.part",
            f"must be one of {', '.join(TRAIN_PARTS)} (with phase train) or absent, got {part!r}")
    circ = data.get("circuits")
    require(isinstance(circ, dict), f"{f}.circuits", "must be a mapping")
    out = {}
    for o in range(spec.ocs_count):
        require(str(o) in circ, f"{f}.circuits.{o}", "missing (the fabric has this OCS)")
        out[o] = Matching.from_pairs(spec.ports_per_ocs, circ[str(o)], field=f"{f}.circuits.{o}")
    extra = sorted(set(circ) - {str(o) for o in range(spec.ocs_count)})
    require(not extra, f"{f}.circuits.{extra[0] if extra else ''}", "unknown OCS for this fabric")
    return out, phase, part


# ---- the controller core -------------------------------------------------------------------------------
def initial_target(spec: FabricSpec, layout: JobLayout,
                   stored: tuple[dict[int, Matching], str | None, str | None] | None,
                   current: Mapping[int, Matching], initial_phase: str, traffic: Any = None,
                   rule: FabricRule = BUILTIN) -> tuple[dict[int, Matching], str | None, str | None, str]:
    """What the controller installs once every switch was read back: (target, phase, part, source). The
    state file's intent (``reconcile``); else the circuits the OCSes hold (``adopt``); else ``initial_phase``'s
    (by the fabric's ``rule``)."""
    if stored is not None:
        target, phase, part = stored
        return target, phase, part, "reconcile"
    if any(len(m) for m in current.values()):
        log.info("no state file: adopting the circuits the OCSes hold")
        return dict(current), None, None, "adopt"
    return dict(rule.matchings(spec, layout, initial_phase, traffic)), initial_phase, None, "initial"


class _History:
    """The reconfiguration records, numbered, the newest HISTORY_LIMIT kept. REST rejections record without
    the reconfiguration lock (they never wait behind a running reconfiguration), so it has its own lock."""

    def __init__(self) -> None:
        self._records: list[dict] = []
        self._next_id = 1
        self._lock = threading.Lock()

    def add(self, rec: dict) -> dict:
        """``rec`` numbered (a new dict), appended."""
        with self._lock:
            rec = {"id": self._next_id, **rec}
            self._next_id += 1
            self._records.append(rec)
            if len(self._records) > HISTORY_LIMIT:
                del self._records[: len(self._records) - HISTORY_LIMIT]
        return rec

    def records(self) -> list[dict]:
        with self._lock:
            return list(self._records)


def fabric_topology(spec: FabricSpec, layout: JobLayout) -> dict:
    """``GET /topology``: the spec, the layout, and every ToR, OCS and uplink by name and dpid."""
    s = spec
    return {
        "spec": to_dict(s),
        "layout": to_dict(layout),
        "tors": [{"tor": t, "name": s.tor_name(t), "dpid": s.tor_dpid(t), "pod": s.pod_of_tor(t),
                  "role": layout.role_of_pod(s.pod_of_tor(t)), "servers": list(s.servers_on_tor(t))}
                 for t in range(s.n_tors)],
        "ocses": [{"ocs": o, "name": s.ocs_name(o), "dpid": s.ocs_dpid(o), "ports": s.ports_per_ocs}
                  for o in range(s.ocs_count)],
        "uplinks": [u._asdict() for u in s.uplinks()],
    }


class FabricController:
    """Intended state + serialised reconfiguration. Thread-safety comes from the injected ``lock``.

    The os-ken app calls :meth:`switch_connected` / :meth:`switch_disconnected` and, after reading a
    switch's flows, :meth:`switch_synced`; it runs those that may reconfigure in their own thread
    (a reconfiguration waits for barrier replies that the app's event loop delivers).

    When a reconfiguration fails with the switches still connected, what they hold is unknown (some
    flow-mods may have applied, ToRs may keep transition routes). The OCSes it touched and every ToR are
    then *stale*: no longer synced (so the fabric is not ready), the routes are forgotten (the next route
    push is a full one) and ``on_stale(dpids)`` asks the app to read those switches back; each read-back
    (:meth:`switch_synced`) reconciles the switch to the intended state.
    """

    def __init__(self, spec: FabricSpec, layout: JobLayout, driver: Driver, clock: Clock, lock: Any, *,
                 delay_ms: float, initial_phase: str = "train", state_path: str | Path | None = None,
                 wall: Callable[[], float] = time.time,
                 on_stale: Callable[[list[int]], None] | None = None, traffic: Any = None,
                 metrics: Any = None, rule: FabricRule = BUILTIN):
        layout.check(spec)
        self.spec, self.layout = spec, layout
        self.rule = rule  # the fabric's phase rule: the phases' circuits and every switch decision (fabric_rules)
        self.traffic = traffic  # controller.traffic.PhaseTraffic: what the phase topologies are built from
        self.driver = driver
        self.clock = clock
        self._lock = lock
        self.initial_phase = initial_phase
        # the switching delay in wall time for requests that give none (ControllerConfig resolved and validated it)
        self.delay_ms = float(delay_ms)
        self.state_path = Path(state_path) if state_path else None
        self._wall = wall
        self.switches = SwitchSet(spec, on_stale)  # connected, read back, stale; what each OCS holds
        self.matchings: dict[int, Matching] | None = None  # what the OCSes hold (after init)
        self.routes: Any = None
        self.phase: str | None = None
        self.part: str | None = None  # the part of the train step the circuits were built for (POST /phase part)
        self.initialised = False
        self.busy = False
        self._history = _History()
        self._stored = load_state(self.state_path, spec) if self.state_path else None
        self._writer = _StateWriter(clock)
        self.metrics = metrics  # controller.metrics.ControllerMetrics (fed in _record), or None
        if metrics is not None:
            metrics.watch(self)

    # ---- read side (REST GETs) ---------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """Initialised and every switch read back since it (re)connected or went stale."""
        return self.initialised and self.switches.all_synced

    def state(self) -> dict:
        sw = self.switches
        return {**sw.state(), "ready": self.ready, "initialised": self.initialised, "phase": self.phase,
                "part": self.part, "topology": topology_name(self.phase, self.part),
                "busy": self.busy, "delay_ms": self.delay_ms,
                "mismatch": [sw.mismatch[o] for o in sorted(sw.mismatch)]}

    def circuits(self) -> dict:
        if self.matchings is None:
            return {}
        return {str(o): m.to_json() for o, m in sorted(self.matchings.items())}

    def topology(self) -> dict:
        return fabric_topology(self.spec, self.layout)

    def history(self) -> list[dict]:
        return self._history.records()

    # ---- write side (REST POSTs) -------------------------------------------------------------------
    def record_rejected(self, kind: str, error: str) -> dict:
        return self._record({"kind": kind, "source": "rest", "status": "rejected", "error": error})

    def request_circuits(self, data: Any) -> dict:
        """Validate and run a ``POST /circuits`` body. SpecError -> rejected (nothing sent)."""
        return self._request("circuits", lambda: circuits_request(self.spec, data))

    def request_phase(self, data: Any) -> dict:
        """Validate and run a ``POST /phase`` body. SpecError -> rejected (nothing sent)."""
        return self._request("phase", lambda: phase_request(self.spec, self.layout, data, self.traffic, self.rule))

    def _request(self, kind: str, parse: Callable[[], ReconfigRequest]) -> dict:
        received = self.clock.now()
        try:
            req = parse()
        except SpecError as e:
            self.record_rejected(kind, str(e))
            raise
        return self.reconfigure(req, kind, received)

    def reconfigure(self, req: ReconfigRequest, kind: str, received: float | None = None) -> dict:
        """Run one reconfiguration (waits for any running one). Returns its history record."""
        received = self.clock.now() if received is None else received
        received_at = self._wall()
        with self._lock:
            if not self.ready:
                rec = {"kind": kind, "source": req.source, "status": "rejected",
                       "error": self.switches.not_ready_reason(self.initialised)}
                self._record(rec)
                raise NotReady(rec["error"])
            return self._run(req, kind, received, received_at)

    # ---- switch events (from the os-ken app) ------------------------------------------------------
    def switch_connected(self, dpid: int) -> None:
        self.switches.connect(dpid)

    def switch_disconnected(self, dpid: int) -> None:
        self.switches.disconnect(dpid)

    def switch_synced(self, dpid: int, ocs_flows: Sequence[tuple[int, int]] | None = None,
                      ocs_ports: Sequence[int] | None = None) -> None:
        """The app read the flows of switch ``dpid`` (OCS: ``(in_port, out_port)`` pairs of its circuits, and
        ``ocs_ports``, the port numbers the switch has).

        An OCS whose ports are not exactly the spec's 1..ports_per_ocs is never synced: the fabric is not what
        the spec says, so it never gets ready (``state()["mismatch"]`` says how), and no circuit can name a
        port that does not exist.

        Before initialisation, waits for every switch, then installs the intended state. Afterwards (a
        switch reconnected, or was read back because it went stale), reconciles that switch only. Blocks
        while it reconfigures; raises ReconfigFailed when that fails (the switch is stale again).
        """
        kind = self.spec.classify_dpid(dpid)
        if kind is None:
            return
        with self._lock:
            if not self.switches.sync(dpid, kind, ocs_flows, ocs_ports):
                return  # gone again, or its ports are not the spec's
            if not self.initialised:
                if self.switches.all_synced:
                    self._initialise()
                return
            if kind[0] == "ocs":
                self._reconcile_ocs(kind[1])
                return
            try:
                self.driver.apply_route_changes(self._full_routes(), full=True)
            except Exception as e:  # the ToR did not confirm: read it back again
                log.exception("full route sync of ToR %d failed", kind[1])
                self._mark_stale([dpid])
                raise ReconfigFailed(f"route sync of ToR {kind[1]}: {type(e).__name__}: {e}") from e

    # ---- internals ----------------------------------------------------------------------------------
    def _full_routes(self) -> Any:
        """The complete route state; computed on the intended circuits when the routes are unknown."""
        from . import phases, routing

        if self.routes is None:
            assert self.matchings is not None  # only called once initialised
            self.routes = routing.compute_routes(self.spec, phases.circuit_graph(self.spec, self.matchings))
        return routing.route_flow_changes(self.spec, None, self.routes)

    def _mark_stale(self, dpids: Sequence[int]) -> None:
        """What ``dpids`` hold is unknown: not synced until read back; routes unknown (next push is full)."""
        self.routes = None
        self.switches.mark_stale(dpids)

    def _dark_delay_ms(self, plan: ReconfigPlan) -> float:
        """The switching delay of a plan the controller makes itself: none unless a circuit is removed."""
        return self.delay_ms if any(s.diff.removed for s in plan.ocs_steps) else 0.0

    def _initialise(self) -> None:
        current = {o: self.switches.ocs_readback[o].matching for o in range(self.spec.ocs_count)}
        stray = {o: self.switches.ocs_readback[o].stray for o in range(self.spec.ocs_count)}
        target, phase, part, source = initial_target(self.spec, self.layout, self._stored, current,
                                                     self.initial_phase, self.traffic, self.rule)
        plan = plan_reconfig(self.spec, current, None, target, stray=stray)
        req = ReconfigRequest(target=target, phase=phase, part=part, delay_ms=self._dark_delay_ms(plan),
                              source=source)
        self.routes = None
        try:  # not ready (and no circuits reported) until the intended state is installed
            self._run(req, "initial", self.clock.now(), self._wall(), plan=plan)
        finally:
            self.initialised = True  # also after a failure: the stale switches are read back and reconciled
        log.info("fabric initialised (%s): phase %s", source, phase)

    def _reconcile_ocs(self, ocs: int) -> None:
        rb = self.switches.ocs_readback[ocs]
        assert self.matchings is not None
        intended = self.matchings[ocs]
        current = dict(self.matchings)
        current[ocs] = rb.matching
        plan = plan_reconfig(self.spec, current, self.routes, {ocs: intended}, stray={ocs: rb.stray})
        if plan.is_noop:
            log.info("OCS %d reconnected holding the intended circuits", ocs)
            return
        req = ReconfigRequest(target={ocs: intended}, phase=self.phase, part=self.part,
                              delay_ms=self._dark_delay_ms(plan), source="reconcile")
        self._run(req, "reconcile", self.clock.now(), self._wall(), plan=plan)

    def _run(self, req: ReconfigRequest, kind: str, received: float, received_at: float,
             plan: ReconfigPlan | None = None) -> dict:
        delay = self.delay_ms if req.delay_ms is None else req.delay_ms  # a request's own over the controller's
        # received_mono: the controller's monotonic clock (CLOCK_MONOTONIC, shared by every namespace), so a
        # probe stream's send times can be lined up with the reconfiguration's t_ms offsets
        rec: dict = {"kind": kind, "source": req.source, "phase": req.phase,
                     **({"part": req.part} if req.part is not None else {}), "delay_ms": delay,
                     "window_ms": req.window_ms, "gain_ms": req.gain_ms, "received_at": received_at,
                     "received_mono": received}
        decision = self.rule.decide(req.window_ms, delay, req.gain_ms)
        rec.update(decision=decision.action, stall_ms=decision.stall_ms, reason=decision.reason)
        if decision.action == "deferred":
            rec.update(status="deferred")
            return self._record(rec)
        assert plan is not None or self.matchings is not None
        stamps = {"started": self.clock.now()}  # the stages before the executor: see reconfig.STAGES
        if plan is None:
            plan = plan_reconfig(self.spec, self.matchings, self.routes, req.target)
        stamps["planned"] = self.clock.now()
        rec["changes"] = plan.summary()
        new_phase = req.phase
        persist = self._writer.submit(self.state_path, plan.target, new_phase, req.part) if self.state_path else None
        stamps["write_started"] = self.clock.now()
        self.busy = True
        try:
            ex = execute_plan(plan, delay if not plan.is_noop else 0.0, self.driver, self.clock, received, stamps)
            if persist is not None:
                rec.update(persist.wait())
        except Exception as e:  # a switch did not confirm: the intended state is persisted; reconcile later
            if persist is not None and "persist_wait_ms" not in rec:
                rec.update(persist.wait())
            log.exception("reconfiguration failed")
            # believed state = the intended one (also in the state file); the switches it touched (the
            # OCSes changed, every ToR: transition/final routes) are read back and reconciled to it
            self.matchings = dict(plan.target)
            self.phase, self.part = new_phase, req.part
            self._mark_stale([self.spec.ocs_dpid(o) for o in plan.touched_ocses] +
                             [self.spec.tor_dpid(t) for t in range(self.spec.n_tors)])
            rec.update(status="failed", error=f"{type(e).__name__}: {e}", stale=sorted(self.switches.stale))
            self._record(rec)
            raise ReconfigFailed(rec["error"]) from e
        finally:
            self.busy = False
        self.matchings = dict(plan.target)
        self.routes = plan.final_routes
        self.phase, self.part = new_phase, req.part
        rec.update(status="done", noop=plan.is_noop,
                   t_ms=ex.relative_ms(), **ex.metrics())
        log.info("reconfiguration %s (%s): %s", kind, req.source, {k: rec.get(k) for k in
                                                                    ("overhead_ms", "dark_ms", "noop")})
        return self._record(rec)

    def _record(self, rec: dict) -> dict:
        rec = self._history.add(rec)
        if self.metrics is not None:  # the one place a record is completed: each moves its counters once
            try:
                self.metrics.record(rec, self.matchings, self.phase)
            except Exception:  # noqa: BLE001 - a metrics bug must not fail a reconfiguration that happened
                log.exception("metrics: record %s not counted", rec.get("id"))
        return rec
