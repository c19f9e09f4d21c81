"""ToR table sync (pure): the OpenFlow operations that make ToRs hold a route state, given what they hold.

:func:`tor_ops` turns a :class:`controller.routing.RouteChanges` into per-ToR operations. Incremental
changes are sent as they are. A *full* route state (after a ToR reconnected, or went stale and was read
back) is diffed against the ToR's read-back tables (:class:`TorTables`): identical flows and groups are left
alone (their counters kept), differing ones replaced, extra ones deleted. The os-ken app only turns the
operations into messages (the unit tests sync an in-memory ToR, tests/unit/fakes_controller.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from .ocs import FlowSpec
from .routing import RouteChanges, TorChanges

FlowKey = tuple[int, tuple[tuple[str, object], ...]]  # (priority, match items sorted by name)
Actions = tuple[tuple[str, object], ...]


def flow_key(f: FlowSpec) -> FlowKey:
    """How a flow is identified in a read-back table (the switch reports match fields in its own order)."""
    return (f.priority, tuple(sorted(f.match)))


@dataclass(frozen=True)
class TorTables:
    """What one ToR holds: groups (id -> bucket output ports) and this app's flows (key -> actions)."""

    groups: Mapping[int, tuple[int, ...]] = field(default_factory=dict)
    flows: Mapping[FlowKey, Actions] = field(default_factory=dict)


@dataclass(frozen=True)
class TorOps:
    """Operations for one ToR: first ``delete_held`` (held flows that are not wanted, by key), then
    ``changes`` (a routing.TorChanges, in its own order: a flow never points to a missing group)."""

    tor: int
    changes: TorChanges
    delete_held: tuple[FlowKey, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.delete_held and self.changes.is_empty


def tor_ops(changes: RouteChanges, full: bool, held: Mapping[int, TorTables]) -> list[TorOps]:
    """Per-ToR operations for ``changes``, by ToR index.

    Not ``full``: ``changes`` are incremental; every ToR with changes gets exactly them (``held`` unused).
    ``full``: ``changes`` is the complete route state (``route_flow_changes(spec, None, routes)``); only the
    ToRs in ``held`` (read back since their last full sync) are synced, against what they hold, and each
    gets an entry, empty when it already holds the state (it is still confirmed with a barrier). ToRs
    without a read-back are assumed to be in step and get nothing.
    """
    if not full:
        return [TorOps(t, ch) for t, ch in sorted(changes.per_tor.items()) if not ch.is_empty]
    out = []
    for t in sorted(held):
        have = held[t]
        ch = changes.per_tor.get(t)
        want_g = {g.group_id: g for g in (ch.add_groups + ch.modify_groups if ch else ())}
        want_f = {flow_key(f): f for f in (ch.add_flows if ch else ())}
        out.append(TorOps(t, delete_held=tuple(k for k in sorted(have.flows, key=repr) if k not in want_f),
                          changes=TorChanges(
                              t,
                              add_groups=tuple(g for gid, g in sorted(want_g.items()) if gid not in have.groups),
                              modify_groups=tuple(g for gid, g in sorted(want_g.items()) if gid in have.groups
                                                  and tuple(have.groups[gid]) != tuple(g.ports)),
                              add_flows=tuple(f for k, f in want_f.items() if have.flows.get(k) != tuple(f.actions)),
                              delete_groups=tuple(sorted(gid for gid in have.groups if gid not in want_g)))))
    return out
