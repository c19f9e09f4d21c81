"""The reconfiguration executor (datapath-neutral): runs a :class:`~controller.reconfig.plan.ReconfigPlan` on a
:class:`Driver` (the os-ken app in production, a fake flow table in unit tests) against an injected
:class:`~controller.reconfig.clock.Clock`, and records the timestamps of every step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Protocol, Sequence

from ..ocs import FlowSpec
from .clock import Clock
from .plan import ReconfigPlan


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
