"""OCS reconfiguration (pure): the slack and switching rules, validated requests, ordered plans and a timed executor.

A reconfiguration goes from the current circuits to a target, OCS by OCS, in four ordered steps:

1. move ToR routes off the circuits that will change, wherever another path exists (transition routes);
2. delete the flows of the changed OCS ports: they go dark;
3. ``delay_ms`` after the deletes were *sent*, send the new circuits' flows and wait for a barrier reply from
   every OCS touched;
4. install the final routes computed on the new circuit graph.

Unchanged circuits are never touched. Flow-mods take effect about one install latency after they are sent,
and deletes and adds see the same latency, so the adds are scheduled at ``delete sent + delay`` (not at the
delete's barrier reply + delay), with a precise wait (coarse sleep, then a spin on the clock).

Everything here is datapath-neutral: the executor talks to a :class:`Driver` (the os-ken app in production,
a fake flow table in unit tests) and reads time from an injected :class:`Clock`.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence

from emulation.spec import FabricSpec, JobLayout, check_delay_ms, check_phase
from emulation.validation import BRIEF_CHARS, SpecError, brief, finite_float, from_dict, require

from .ocs import OCS_COOKIE, OCS_PRIORITY, FlowSpec, Matching, MatchingDiff, circuit_flow_changes, diff

log = logging.getLogger(__name__)

MAX_WINDOW_MS = 3600_000.0
SPIN_MARGIN_S = 0.001  # sleep until this long before a deadline, then spin on the clock


# ---- the slack and switching rules--------------------------------------------------------------------
def fits_slack(window_ms: float | None, delay_ms: float) -> bool:
    """True when a reconfiguration taking ``delay_ms`` fits an idle window of ``window_ms``.

    No window (None) means the caller does not constrain it: it fits. Otherwise the window must be strictly
    longer than the switching delay (a window exactly as long as the delay leaves no margin).
    """
    if window_ms is None:
        return True
    return window_ms > delay_ms


SWITCH_ACTIONS = ("switched", "stalled", "deferred")  # what decide_switch answers
#: a predicted gain this far below zero (ms) means the new topology makes the next phase slower: never switch.
#: Within it a gain counts as "no loss" (RLSim's own gains of equal topologies differ by microseconds of latency).
LOSS_TOLERANCE_MS = 1.0


@dataclass(frozen=True)
class SwitchDecision:
    """The benefit-aware rule's answer: ``action`` (one of SWITCH_ACTIONS), the stall the next phase waits
    (ms; 0 unless ``stalled``) and a sentence saying why."""

    action: str
    stall_ms: float
    reason: str


def decide_switch(window_ms: float | None, delay_ms: float, gain_ms: float | None) -> SwitchDecision:
    """Benefit-aware switching, for the controller and RLSim alike (pure). The gain is weighed in every case.

    ``gain_ms`` is what the next phase is predicted to save on the new topology against staying on the old
    one (negative: the new one is slower; ``inf``: the old one cannot carry that phase; None: not predicted).

    * ``deferred`` when ``gain_ms < -LOSS_TOLERANCE_MS``: the switch would make the next phase slower, so it
      is never made, however long the window;
    * ``switched`` when the reconfiguration fits the idle window (:func:`fits_slack`: no window given, or
      one longer than ``delay_ms``) or takes no time (``delay_ms == 0``): nothing waits. A gain within
      +-LOSS_TOLERANCE_MS (no loss) still switches here: the slack makes it free, and the phase's own
      topology is what the phases beside it were planned for (in the async mode the next generation streams
      its tokens and migrates its KV over the circuits training or sync hand back; the next transition's
      window and gain are predicted from the phase's own circuits). No gain given (None) trusts the caller;
    * ``stalled``: the window is too short, but the gain exceeds the stall ``delay_ms - max(window_ms, 0)``:
      switch anyway and the next phase waits that long;
    * ``deferred`` otherwise (no gain given, or one not larger than the stall): keep the old topology.
    """
    if gain_ms is not None and gain_ms < -LOSS_TOLERANCE_MS:
        return SwitchDecision("deferred", 0.0, f"gain_ms {gain_ms:g}: the new topology is predicted to make "
                                               f"the next phase slower (by more than {LOSS_TOLERANCE_MS:g} ms), "
                                               "so it is never switched to: the current circuits stay")
    if fits_slack(window_ms, delay_ms) or delay_ms == 0:
        why = ("no window_ms given" if window_ms is None else
               f"window_ms {window_ms:g} is longer than the switching delay {delay_ms:g} ms" if delay_ms
               else "a switch that takes no time needs no window")
        if gain_ms is None:
            gain = "no gain_ms given"
        elif gain_ms > LOSS_TOLERANCE_MS:
            gain = f"gain_ms {gain_ms:g}"
        else:
            gain = (f"gain_ms {gain_ms:g} is no loss (within {LOSS_TOLERANCE_MS:g} ms): the phase gets its own "
                    "topology, which the phases beside it were planned for, at no cost")
        return SwitchDecision("switched", 0.0, f"{why}, {gain}: switching in the slack")
    stall = delay_ms - max(window_ms, 0.0)
    short = f"window_ms {window_ms:g} is not longer than the switching delay {delay_ms:g} ms"
    if gain_ms is not None and gain_ms > stall:
        return SwitchDecision("stalled", stall, f"{short}, but gain_ms {gain_ms:g} exceeds the stall: "
                                                f"switching, the next phase waits {stall:g} ms")
    if gain_ms is None:
        return SwitchDecision("deferred", 0.0, f"{short} and no gain_ms was given: the current circuits stay")
    return SwitchDecision("deferred", 0.0, f"{short} and gain_ms {gain_ms:g} does not exceed the stall "
                                           f"{stall:g} ms: the current circuits stay")


# ---- requests ------------------------------------------------------------------------------------
def _check_window(value: float | None, name: str = "window_ms") -> None:
    """A slack window: finite, 0..MAX_WINDOW_MS ms."""
    if value is None:
        return
    v = finite_float(value, name)
    require(0 <= v <= MAX_WINDOW_MS, name, f"must be in 0..{MAX_WINDOW_MS:g} ms, got {v:g}")


def _check_gain(value: float | None, name: str = "gain_ms") -> None:
    """A predicted gain: finite, -MAX_WINDOW_MS..MAX_WINDOW_MS ms (negative: the new topology is slower)."""
    if value is None:
        return
    v = finite_float(value, name)
    require(-MAX_WINDOW_MS <= v <= MAX_WINDOW_MS, name,
            f"must be in {-MAX_WINDOW_MS:g}..{MAX_WINDOW_MS:g} ms (negative: the new topology is slower), got {v:g}")


@dataclass(frozen=True, kw_only=True)
class _TimingBody:
    """The timing fields every reconfiguration body takes (validated in one place)."""

    delay_ms: Optional[float] = None
    window_ms: Optional[float] = None
    gain_ms: Optional[float] = None  # predicted gain of the new topology (decide_switch)

    def __post_init__(self) -> None:
        check_delay_ms(self.delay_ms, "delay_ms")
        _check_window(self.window_ms)
        _check_gain(self.gain_ms)


@dataclass(frozen=True, kw_only=True)
class CircuitsBody(_TimingBody):
    """JSON body of ``POST /api/v1/circuits``: ``{"circuits": {"0": [[1, 3], [2, 4]]}, "delay_ms": 10}``
    (optional ``window_ms``, ``gain_ms``)."""

    circuits: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class PhaseBody(_TimingBody):
    """JSON body of ``POST /api/v1/phase``: ``{"phase": "train", "delay_ms": 10, "window_ms": null,
    "gain_ms": null}``."""

    phase: str


@dataclass(frozen=True)
class ReconfigRequest:
    """A validated reconfiguration: target matchings for some OCSes (the others keep theirs).

    ``phase`` names the phase the target realises (None for explicit circuits). ``delay_ms`` None means the
    spec's default switching delay. ``source``: who asked (``rest``, ``initial``, ``reconcile``).
    """

    target: Mapping[int, Matching]
    phase: str | None = None
    delay_ms: float | None = None
    window_ms: float | None = None
    gain_ms: float | None = None
    source: str = "rest"

    def __post_init__(self) -> None:
        check_delay_ms(self.delay_ms, "delay_ms")
        _check_window(self.window_ms)
        _check_gain(self.gain_ms)


def _ocs_index(spec: FabricSpec, key: object) -> int:
    f = f"circuits.{str(key)[:BRIEF_CHARS]}"
    # ASCII digits only: str.isdigit() also takes "\u0660" (int() reads it as 0) and "\u00b2" (int() fails)
    if not isinstance(key, str) or not (key.isascii() and key.isdigit()) or (len(key) > 1 and key.startswith("0")):
        raise SpecError(f, f"OCS must be a decimal index 0..{spec.ocs_count - 1}, got {brief(key)}")
    o = int(key)
    require(o < spec.ocs_count, f, f"unknown OCS {o} (fabric has OCSes 0..{spec.ocs_count - 1})")
    return o


def circuits_request(spec: FabricSpec, data: Any) -> ReconfigRequest:
    """Validate a ``POST /circuits`` JSON body into a request (raises SpecError naming the field)."""
    body = from_dict(CircuitsBody, data)
    require(len(body.circuits) > 0, "circuits", "must name at least one OCS")
    target = {}
    for key, pairs in body.circuits.items():
        o = _ocs_index(spec, key)
        target[o] = Matching.from_pairs(spec.ports_per_ocs, pairs, field=f"circuits.{key}")
    return ReconfigRequest(target=target, delay_ms=body.delay_ms, window_ms=body.window_ms, gain_ms=body.gain_ms)


def phase_request(spec: FabricSpec, layout: JobLayout, data: Any, traffic: Any = None) -> ReconfigRequest:
    """Validate a ``POST /phase`` JSON body into a request with the phase's matchings on every OCS
    (``traffic``: ``controller.traffic.PhaseTraffic``, what the train topology is built from)."""
    from . import phases

    body = from_dict(PhaseBody, data)
    check_phase(body.phase)
    target = phases.phase_matchings(spec, layout, body.phase, traffic)
    return ReconfigRequest(target=dict(target), phase=body.phase, delay_ms=body.delay_ms,
                           window_ms=body.window_ms, gain_ms=body.gain_ms)


# ---- plans ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class OcsStep:
    """The flow changes of one OCS whose matching changes."""

    ocs: int
    diff: MatchingDiff
    deletes: tuple[FlowSpec, ...]
    adds: tuple[FlowSpec, ...]


@dataclass(frozen=True)
class ReconfigPlan:
    """What a reconfiguration sends, in order: ``move_steps`` (route changes before anything goes dark), the
    deletes of ``ocs_steps``, ``dark_steps`` (while the changed circuits are dark), the adds, ``final_steps``.

    Each step is a ``routing.RouteChanges`` confirmed (ToR barrier) before the next; the planner checked
    that no mixed state of a step loops on the circuits lit meanwhile. ``dark_wait``: the dark steps from
    that index on wait until the deletes are confirmed (only when they would loop on the old circuits).
    """

    current: Mapping[int, Matching]
    target: Mapping[int, Matching]  # complete: every OCS
    ocs_steps: tuple[OcsStep, ...]  # only OCSes whose matching changes, by OCS index
    transition_routes: Any = None  # routing.Routes before the changed circuits go dark
    final_routes: Any = None  # routing.Routes on the new circuit graph
    move_steps: tuple = ()  # routing.RouteChanges: current -> transition
    final_steps: tuple = ()  # routing.RouteChanges: dark routes -> final (or the full state when unknown)
    routes_full: bool = False  # final_steps is the complete route state (routes were unknown)
    dark_routes: Any = None  # routing.Routes while dark: final where no stable path exists (see routing)
    dark_steps: tuple = ()  # routing.RouteChanges: transition -> dark routes, sent after the deletes
    dark_wait: int | None = None  # dark_steps[i:] wait until the deletes are confirmed (None: none waits)

    @property
    def is_noop(self) -> bool:
        return not self.ocs_steps

    @property
    def touched_ocses(self) -> list[int]:
        return [s.ocs for s in self.ocs_steps]

    def summary(self) -> dict:
        return {
            "ocs": {str(s.ocs): {"removed": [list(c) for c in sorted(s.diff.removed)],
                                  "added": [list(c) for c in sorted(s.diff.added)],
                                  "unchanged": len(s.diff.unchanged),
                                  "dark_ports": sorted(s.diff.changed_ports)}
                    for s in self.ocs_steps},
        }


def complete_target(current: Mapping[int, Matching], target: Mapping[int, Matching]) -> dict[int, Matching]:
    """``current`` with the OCSes listed in ``target`` replaced."""
    out = dict(current)
    for o, m in target.items():
        if o not in current:
            raise SpecError(f"circuits.{o}", f"unknown OCS {o}")
        out[o] = m
    return out


def stray_flow(in_port: int, out_port: int) -> FlowSpec:
    """The circuit-flow shape of a stray ``in_port -> out_port`` flow read back from an OCS (to delete it)."""
    return FlowSpec(OCS_PRIORITY, (("in_port", int(in_port)),), (("output", int(out_port)),), OCS_COOKIE)


def plan_reconfig(spec: FabricSpec, current: Mapping[int, Matching], current_routes: Any,
                  target: Mapping[int, Matching], with_routes: bool = True,
                  stray: Mapping[int, Sequence[tuple[int, int]]] | None = None) -> ReconfigPlan:
    """The ordered steps from ``current`` to ``target`` (OCSes not in ``target`` keep their circuits).

    ``current_routes`` None means the ToRs' routes are unknown (first install): the transition step then
    moves nothing. ``with_routes=False`` plans circuits only (used by tests of the OCS side). ``stray``:
    flows read back from an OCS that form no circuit (after a restart); they are deleted with the changes.
    """
    full = complete_target(current, target)
    stray = stray or {}
    steps = []
    for o in sorted(full):
        d = diff(current[o], full[o])
        extra = tuple(stray_flow(a, b) for a, b in sorted(stray.get(o, ())))
        if d.is_empty and not extra:
            continue
        dels, adds = circuit_flow_changes(current[o], full[o])
        steps.append(OcsStep(o, d, tuple(dels) + extra, tuple(adds)))
    if not with_routes:
        return ReconfigPlan(dict(current), full, tuple(steps))
    from . import phases, routing

    g_new = phases.circuit_graph(spec, full)
    final_routes = routing.compute_routes(spec, g_new)
    if not steps and current_routes is not None:
        return ReconfigPlan(dict(current), full, (), current_routes, current_routes)
    if current_routes is None:  # first install: the complete state once the circuits are in place
        return ReconfigPlan(dict(current), full, tuple(steps), None, final_routes,
                            final_steps=(routing.route_flow_changes(spec, None, final_routes),), routes_full=True)
    g_cur = phases.circuit_graph(spec, current)
    g_stable = phases.circuit_graph(spec, {o: Matching(m.n_ports, diff(m, full[o]).unchanged)
                                           for o, m in current.items()})
    transition = routing.transition_routes(spec, current_routes, g_stable)
    # installed while every current circuit is lit, then while the changed ones are dark (a subset)
    routing.check_loop_free(transition, g_cur, "the transition routes")
    dark = routing.dark_routes(transition, final_routes, g_stable)
    # held while the new circuits light up (the lit circuits grow from the stable ones to the new graph)
    routing.check_loop_free(dark, g_new, "the routes held while the new circuits light up")
    move = routing.safe_steps(current_routes, transition, g_cur, g_stable, "moving routes off changing circuits")
    # The dark routes go out right after the deletes, which may still be in flight (old circuits lit). One
    # step when no mixed state loops on the old circuits; otherwise break before make (these entries' traffic
    # is dark anyway): empty them at once (a subset of the transition routes: loop-free), then fill them in,
    # after the deletes' barrier if the dark routes would loop on the old circuits.
    darks, dark_wait = [], None
    changed = routing.changed_entries(transition, dark)
    if changed:
        on_old, dsts = routing.port_peers(g_cur), {d for _, d in changed}
        if routing.find_loop(routing.merge(transition, dark), on_old, spec.n_tors, dsts) is None:
            darks = [dark]
        else:
            darks = [routing.blanked(transition, changed), dark]
            if routing.find_loop(dark, on_old, spec.n_tors) is not None:
                routing.check_loop_free(dark, g_stable, "the routes toward the new circuits")
                dark_wait = 1
    final = routing.safe_steps(dark, final_routes, g_new, g_new, "final routes")

    def changes(states: list, start: Any) -> tuple:
        out, prev = [], start
        for st in states:
            out.append(routing.route_flow_changes(spec, prev, st))
            prev = st
        return tuple(out)

    return ReconfigPlan(dict(current), full, tuple(steps), transition, final_routes,
                        move_steps=changes(move, current_routes), final_steps=changes(final, dark),
                        dark_routes=dark, dark_steps=changes(darks, transition), dark_wait=dark_wait)


# ---- execution -----------------------------------------------------------------------------------
class Driver(Protocol):
    """What the executor needs from the datapaths (the os-ken app; a fake in unit tests)."""

    #: the datapaths forward from a flow cache that lags the flow tables (Open vSwitch's userspace
    #: datapath: controller/datapath.py); the executor then calls :meth:`flush_flow_cache` when the
    #: deletes and when the adds are confirmed
    flushes_flow_cache: bool

    def flush_flow_cache(self) -> None:
        """Make the datapaths drop their cached flows now, so that they forward by the tables at once."""

    def apply_route_changes(self, changes: Any, full: bool = False) -> None:
        """Send route changes to the ToRs and return once every touched ToR confirmed (barrier).

        ``full``: ``changes`` is the complete route state (from ``route_flow_changes(spec, None, routes)``);
        the driver makes each ToR hold exactly that (it knows what the ToR held when it connected).
        """

    def send_ocs_flows(self, ocs: int, deletes: Sequence[FlowSpec], adds: Sequence[FlowSpec]) -> None:
        """Queue flow deletes then adds to an OCS; do not wait."""

    def send_barrier(self, ocses: Sequence[int]) -> "PendingBarrier":
        """Send a barrier to every OCS in ``ocses`` now; the answer is collected with ``wait()``.

        A barrier also orders the switch's processing: flow-mods sent after it apply after those before it.
        """


class PendingBarrier(Protocol):
    def wait(self) -> float:
        """Block until every reply arrived (raise on timeout); return the clock time of the last reply."""


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds."""

    def sleep_until(self, deadline: float) -> None:
        """Return at ``deadline`` (not before)."""


class PreciseClock:
    """perf_counter time; waits by a coarse sleep until ``margin`` before the deadline, then spins.

    ``coarse_sleep`` is ``time.sleep`` inside the controller (os-ken's hub runs native threads, which run
    meanwhile); the spin holds this thread for at most ``margin`` so nothing else delays the deadline.
    """

    def __init__(self, coarse_sleep: Callable[[float], None] = time.sleep, margin: float = SPIN_MARGIN_S):
        self._sleep = coarse_sleep
        self._margin = margin

    def now(self) -> float:
        return time.perf_counter()

    def sleep_until(self, deadline: float) -> None:
        remaining = deadline - time.perf_counter()
        if remaining > self._margin:
            self._sleep(remaining - self._margin)
        while time.perf_counter() < deadline:
            pass


TIMESTAMPS = ("received", "started", "planned", "write_started", "routes_moved", "dark_sent", "dark_confirmed",
              "dark_flushed", "dark_routes", "new_sent", "adds_confirmed", "confirmed", "final_routes")
# the control overhead (received -> confirmed, minus D), stage by stage: (name, from, to). The state file is
# written beside them (runtime._StateWrite; the record's persist_wait_ms says if the answer waited for it).
STAGES = (("queue", "received", "started"), ("plan", "started", "planned"),
          ("start_state_write", "planned", "write_started"), ("move_routes", "write_started", "routes_moved"),
          ("send_deletes", "routes_moved", "dark_sent"),
          ("dark_minus_delay", "dark_sent", "new_sent"), ("confirm_adds", "new_sent", "adds_confirmed"),
          ("flush_cache", "adds_confirmed", "confirmed"))


@dataclass
class Execution:
    """Timestamps (clock seconds) of one executed plan."""

    delay_ms: float
    t: dict[str, float] = field(default_factory=dict)

    def relative_ms(self) -> dict[str, float]:
        t0 = self.t["received"]
        return {k: round((self.t[k] - t0) * 1000.0, 3) for k in TIMESTAMPS if k in self.t}

    def metrics(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        t = self.t
        if "confirmed" in t:
            out["total_ms"] = round((t["confirmed"] - t["received"]) * 1000.0, 3)
            out["overhead_ms"] = round(out["total_ms"] - self.delay_ms, 3)
        if "dark_sent" in t and "new_sent" in t:
            out["dark_ms"] = round((t["new_sent"] - t["dark_sent"]) * 1000.0, 3)
        stages = {}
        for name, a, b in STAGES:
            if a in t and b in t:
                ms = (t[b] - t[a]) * 1000.0 - (self.delay_ms if name == "dark_minus_delay" else 0.0)
                stages[name] = round(ms, 3)
        if stages:
            out["overhead_stages_ms"] = stages  # they add up to overhead_ms
        return out


def execute_plan(plan: ReconfigPlan, delay_ms: float, driver: Driver, clock: Clock,
                 received: float | None = None, t: Mapping[str, float] | None = None) -> Execution:
    """Run ``plan`` on ``driver``: move routes; deletes; dark routes; adds at (deletes sent + delay), once the
    dark routes are confirmed; final routes. ``t``: timestamps taken before (started, planned, write_started).

    A driver whose datapaths cache flows (``flushes_flow_cache``) has the cache flushed once the deletes are
    confirmed (before the dark routes and the adds; for a delay > 0: the wait for the deletes' barrier then
    precedes the dark routes) and once the adds are: the path is dark from the deletes to the adds, not from
    when the cache next catches up with either.

    A no-op plan sends nothing (but still reports its timestamps).
    """
    ex = Execution(delay_ms=float(delay_ms))
    ex.t["received"] = clock.now() if received is None else received
    ex.t.update(t or {})
    for ch in plan.move_steps:
        driver.apply_route_changes(ch)
    ex.t["routes_moved"] = clock.now()
    if plan.ocs_steps:
        touched = plan.touched_ocses
        for s in plan.ocs_steps:
            driver.send_ocs_flows(s.ocs, s.deletes, ())
        dark_sent = clock.now()
        ex.t["dark_sent"] = dark_sent
        # the barrier orders the deletes before the adds on the switch; its reply is collected later, so a
        # delay shorter than the switch's round trip still puts the adds at (deletes sent + delay)
        dark_barrier = driver.send_barrier(touched) if any(s.deletes for s in plan.ocs_steps) else None

        def deletes_confirmed() -> None:
            nonlocal dark_barrier
            if dark_barrier is not None:
                ex.t["dark_confirmed"] = dark_barrier.wait()
                dark_barrier = None

        try:
            if driver.flushes_flow_cache and delay_ms > 0 and any(s.deletes for s in plan.ocs_steps):
                # the cache forgets the old circuits as soon as the tables have, before the dark routes
                deletes_confirmed()
                driver.flush_flow_cache()
                ex.t["dark_flushed"] = clock.now()
            # routes toward the new circuits, in place (confirmed) before they light up
            for i, ch in enumerate(plan.dark_steps):
                if plan.dark_wait is not None and i >= plan.dark_wait:
                    deletes_confirmed()
                driver.apply_route_changes(ch)
            ex.t["dark_routes"] = clock.now()
            if len(touched) > 1:  # no OCS may light a new circuit while another still holds an old one
                deletes_confirmed()
            clock.sleep_until(dark_sent + delay_ms / 1000.0)
            for s in plan.ocs_steps:
                driver.send_ocs_flows(s.ocs, (), s.adds)
            ex.t["new_sent"] = clock.now()
            new_barrier = driver.send_barrier(touched)
            try:
                deletes_confirmed()
            finally:
                new_barrier.wait()
        except BaseException:
            if dark_barrier is not None:  # collect its reply (and its waiter) without masking the failure
                try:
                    dark_barrier.wait()
                except Exception:  # noqa: BLE001 - the first failure is the one reported
                    pass
            raise
        ex.t.setdefault("dark_confirmed", dark_sent)
    ex.t["adds_confirmed"] = clock.now()
    if plan.ocs_steps and driver.flushes_flow_cache:
        driver.flush_flow_cache()
    ex.t["confirmed"] = clock.now()
    for i, ch in enumerate(plan.final_steps):
        driver.apply_route_changes(ch, full=plan.routes_full and i == 0)
    ex.t["final_routes"] = clock.now()
    return ex


# ---- test utilities (like ocs.FakeFlowTable: used by unit tests, never by the controller) ---------------
class FakeClock:
    """A manual clock: ``sleep_until`` jumps; events scheduled with :meth:`at` run when time passes them."""

    def __init__(self, start: float = 100.0):
        self.t = start
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = 0

    def now(self) -> float:
        return self.t

    def at(self, when: float, fn: Callable[[], None]) -> None:
        self._seq += 1
        self._events.append((when, self._seq, fn))
        self._events.sort(key=lambda e: (e[0], e[1]))

    def advance_to(self, when: float) -> None:
        while self._events and self._events[0][0] <= when:
            t, _, fn = self._events.pop(0)
            self.t = max(self.t, t)
            fn()
        self.t = max(self.t, when)

    def sleep_until(self, deadline: float) -> None:
        self.advance_to(deadline)

    def pending_until(self) -> float:
        return self._events[-1][0] if self._events else self.t


class FakeDriver:
    """A :class:`Driver` over one :class:`controller.ocs.FakeFlowTable` per OCS.

    A flow-mod takes effect ``install_s`` after it is sent (like a real switch); a barrier returns once every
    queued flow-mod took effect, plus ``rtt_s``. ``log`` records every call in order (``("routes", changes,
    full)``, ``("ocs", ocs, deletes, adds)``, ``("barrier", ocses)``) so tests can check the order and that
    nothing at all was sent. ``flush_s``: with it, the datapaths cache flows (``flushes_flow_cache``) and a
    flush (``("flush",)`` in the log) takes that long.
    """

    def __init__(self, clock: FakeClock, n_ocs: int, install_s: float = 0.0035, rtt_s: float = 0.0005,
                 flush_s: float | None = None):
        from .ocs import FakeFlowTable

        self.clock = clock
        self.install_s = install_s
        self.rtt_s = rtt_s
        self.tables = {o: FakeFlowTable(clock.now) for o in range(n_ocs)}
        self.log: list[tuple] = []
        self.flushes_flow_cache = flush_s is not None
        self.flush_s = flush_s or 0.0

    def flush_flow_cache(self) -> None:
        self.log.append(("flush",))
        self.clock.advance_to(self.clock.now() + self.flush_s)

    def apply_route_changes(self, changes: Any, full: bool = False) -> None:
        self.log.append(("routes", changes, full))
        self.clock.advance_to(self.clock.now() + self.install_s + self.rtt_s)

    def send_ocs_flows(self, ocs: int, deletes: Sequence[FlowSpec], adds: Sequence[FlowSpec]) -> None:
        self.log.append(("ocs", ocs, tuple(deletes), tuple(adds)))
        table = self.tables[ocs]
        dels, ads = list(deletes), list(adds)
        self.clock.at(self.clock.now() + self.install_s, lambda: table.apply(dels, ads))

    def send_barrier(self, ocses: Sequence[int]) -> "_FakeBarrier":
        self.log.append(("barrier", tuple(ocses)))
        return _FakeBarrier(self.clock, max(self.clock.pending_until(), self.clock.now()) + self.rtt_s)

    def sent(self) -> list[tuple]:
        """Calls that changed something on a switch (route changes and flow-mods; not barriers, not flushes)."""
        return [e for e in self.log if e[0] not in ("barrier", "flush")]


class _FakeBarrier:
    def __init__(self, clock: FakeClock, arrival: float):
        self.clock = clock
        self.arrival = arrival

    def wait(self) -> float:
        self.clock.advance_to(self.arrival)
        return self.arrival
