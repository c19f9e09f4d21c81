"""Fakes of the controller's datapaths for unit tests (never used by the controller itself).

* :class:`FakeFlowTable`: an in-memory OpenFlow table of one OCS, with an injected clock;
* :class:`FakeTorTable`: an in-memory ToR that applies ``controller.tor_sync.TorOps``;
* :class:`FakeClock`: a manual clock for the executor (``controller.reconfig.clock.Clock``);
* :class:`FakeDriver`: the executor's ``Driver`` over one FakeFlowTable per OCS.

Imported by basename (pytest puts tests/unit on the path): ``from fakes_controller import FakeClock``.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Sequence

from controller.ocs import FlowSpec
from controller.tor_sync import Actions, FlowKey, TorOps, TorTables, flow_key

log = logging.getLogger(__name__)


class FakeFlowTable:
    """An in-memory OpenFlow table for unit tests, with an injected clock.

    ``apply(deletes, adds)`` removes then installs flows (keyed by priority and match, like a strict
    flow-mod) at ``now()``; ``lookup(in_port)`` follows the highest-priority in_port-only flow.
    ``history[port]`` records ``(time, out_port | None)`` each time the forwarding of ``port`` changes,
    so a test can compute each port's dark interval with :meth:`dark_intervals`.
    """

    def __init__(self, now: Callable[[], float]):
        self._now = now
        self.flows: dict[tuple, FlowSpec] = {}
        self.history: dict[int, list[tuple[float, int | None]]] = {}
        self.ops: list[tuple[float, str, FlowSpec]] = []  # (time, "del" | "add", flow)

    def _in_port_entries(self, port: int) -> list[FlowSpec]:
        return [f for f in self.flows.values() if f.match == (("in_port", port),)]

    def lookup(self, in_port: int) -> int | None:
        cands = self._in_port_entries(in_port)
        if not cands:
            return None
        best = max(cands, key=lambda f: f.priority)
        for kind, arg in best.actions:
            if kind == "output":
                return int(arg)
        return None

    def _record(self, ports: Iterable[int]) -> None:
        t = self._now()
        for p in sorted(set(ports)):
            cur = self.lookup(p)
            h = self.history.setdefault(p, [])
            if not h or h[-1][1] != cur:
                h.append((t, cur))

    @staticmethod
    def _in_ports(flows: Iterable[FlowSpec]) -> list[int]:
        return [int(v) for f in flows for k, v in f.match if k == "in_port"]

    def delete(self, flows: Iterable[FlowSpec]) -> None:
        flows = list(flows)
        t = self._now()
        for f in flows:
            if self.flows.pop(f.key, None) is None:
                log.debug("fake table: delete of absent flow %s", f)
            self.ops.append((t, "del", f))
        self._record(self._in_ports(flows))

    def add(self, flows: Iterable[FlowSpec]) -> None:
        flows = list(flows)
        t = self._now()
        for f in flows:
            self.flows[f.key] = f
            self.ops.append((t, "add", f))
        self._record(self._in_ports(flows))

    def apply(self, deletes: Iterable[FlowSpec], adds: Iterable[FlowSpec]) -> None:
        self.delete(deletes)
        self.add(adds)

    def port_flows(self) -> list[tuple[int, int]]:
        """(in_port, out_port) of every in_port flow, as read back from a switch."""
        out = []
        for f in self.flows.values():
            ports = self._in_ports([f])
            outs = [int(a) for k, a in f.actions if k == "output"]
            if ports and outs:
                out.append((ports[0], outs[0]))
        return sorted(out)

    def dark_intervals(self, port: int) -> list[tuple[float, float | None]]:
        """[(start, end)] while ``port`` forwarded nowhere after having forwarded somewhere.

        ``end`` is None when the port is still dark. A port that never had a flow has no intervals.
        """
        out: list[tuple[float, float | None]] = []
        start: float | None = None
        seen = False
        for t, dst in self.history.get(port, []):
            if dst is None:
                if seen and start is None:
                    start = t
            else:
                if start is not None:
                    out.append((start, t))
                    start = None
                seen = True
        if start is not None:
            out.append((start, None))
        return out


class FakeTorTable:
    """An in-memory ToR: applies :class:`TorOps` like a switch (groups by id, flows by key) and counts
    what each operation touched, so a test can check that identical entries were left alone."""

    def __init__(self, tables: TorTables | None = None):
        self.groups: dict[int, tuple[int, ...]] = dict(tables.groups) if tables else {}
        self.flows: dict[FlowKey, Actions] = dict(tables.flows) if tables else {}
        self.touched: list[tuple[str, object]] = []

    def tables(self) -> TorTables:
        return TorTables(dict(self.groups), dict(self.flows))

    def apply(self, ops: TorOps) -> None:
        for k in ops.delete_held:
            self.flows.pop(k, None)
            self.touched.append(("delete_flow", k))
        ch = ops.changes
        for g in ch.add_groups:
            if g.group_id in self.groups:
                raise ValueError(f"group {g.group_id} exists (OFPGMFC_GROUP_EXISTS)")
            self.groups[g.group_id] = tuple(g.ports)
            self.touched.append(("add_group", g.group_id))
        for g in ch.modify_groups:
            if g.group_id not in self.groups:
                raise ValueError(f"group {g.group_id} unknown (OFPGMFC_UNKNOWN_GROUP)")
            self.groups[g.group_id] = tuple(g.ports)
            self.touched.append(("modify_group", g.group_id))
        for f in ch.add_flows:
            for kind, arg in f.actions:
                if kind == "group" and arg not in self.groups:
                    raise ValueError(f"flow {f} points to missing group {arg}")
            self.flows[flow_key(f)] = tuple(f.actions)
            self.touched.append(("add_flow", flow_key(f)))
        for f in ch.delete_flows:
            self.flows.pop(flow_key(f), None)
            self.touched.append(("delete_flow", flow_key(f)))
        for gid in ch.delete_groups:
            if any(a == ("group", gid) for acts in self.flows.values() for a in acts):
                raise ValueError(f"group {gid} deleted while a flow points to it")
            self.groups.pop(gid, None)
            self.touched.append(("delete_group", gid))


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
    """A :class:`controller.reconfig.executor.Driver` over one :class:`FakeFlowTable` per OCS.

    A flow-mod takes effect ``install_s`` after it is sent (like a real switch); a barrier returns once every
    queued flow-mod took effect, plus ``rtt_s``. ``log`` records every call in order (``("routes", changes,
    full)``, ``("ocs", ocs, deletes, adds)``, ``("barrier", ocses)``) so tests can check the order and that
    nothing at all was sent. ``flush_s``: with it, the datapaths cache flows (``flushes_flow_cache``) and a
    flush (``("flush",)`` in the log) takes that long.
    """

    def __init__(self, clock: FakeClock, n_ocs: int, install_s: float = 0.0035, rtt_s: float = 0.0005,
                 flush_s: float | None = None):
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
