"""ToR routing over the circuit graph (pure): shortest-path next hops, make-before-break transition routes,
and the OpenFlow flow/group changes that install them.

Every ToR forwards IPv4 by destination address: a local server's address goes out of its server port; a
remote server's address goes to the *select group* of its ToR (group id ``1 + dst_tor``), whose buckets
output to the uplinks of every first hop on a shortest circuit path (one bucket per circuit, so parallel
circuits share the load). Transit ToRs forward by the same tables, so multi-hop paths need nothing more.
A destination ToR that becomes unreachable loses its flows and its group (the flows are deleted first);
packets to it then miss the table and are dropped (OpenFlow 1.3 table-miss default).

ARP is not routed here: hosts need static ARP entries (``FabricSpec.host_mac`` is deterministic).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Mapping

from emulation.spec import FabricSpec
from emulation.validation import SpecError

from .ocs import TOR_COOKIE, FlowSpec
from .phases import CircuitGraph

ETH_TYPE_IPV4 = 0x0800
LOCAL_PRIORITY = 200  # ipv4_dst of a server on this ToR -> its port
REMOTE_PRIORITY = 100  # ipv4_dst of a server on another ToR -> the group of that ToR


@dataclass(frozen=True)
class Routes:
    """``next_hops[tor][dst_tor]``: sorted uplink ports (one per circuit) of every first hop on a shortest
    path; unreachable destinations (and ``dst_tor == tor``) are absent."""

    next_hops: Mapping[int, Mapping[int, tuple[int, ...]]]

    def ports(self, tor: int, dst: int) -> tuple[int, ...]:
        return tuple(self.next_hops.get(tor, {}).get(dst, ()))

    def reachable(self, tor: int, dst: int) -> bool:
        return tor == dst or dst in self.next_hops.get(tor, {})


def _dist_to(graph: CircuitGraph, dst: int) -> list[int]:
    """Circuit hops from every ToR to ``dst`` (-1: unreachable)."""
    dist = [-1] * graph.n_tors
    dist[dst] = 0
    q = deque([dst])
    adj = graph.adj
    while q:
        x = q.popleft()
        dx = dist[x] + 1
        for _, y, _ in adj[x]:
            if dist[y] < 0:
                dist[y] = dx
                q.append(y)
    return dist


def _check_graph(spec: FabricSpec, graph: CircuitGraph) -> None:
    if graph.n_tors != spec.n_tors:
        raise SpecError("graph", f"has {graph.n_tors} ToRs, the fabric has {spec.n_tors}")


def compute_routes(spec: FabricSpec, graph: CircuitGraph) -> Routes:
    """Shortest paths (in circuit hops) from every ToR to every other ToR: one BFS per destination."""
    _check_graph(spec, graph)
    hops: dict[int, dict[int, tuple[int, ...]]] = {t: {} for t in range(spec.n_tors)}
    for dst in range(spec.n_tors):
        dist = _dist_to(graph, dst)
        for t in range(spec.n_tors):
            d = dist[t]
            if d <= 0:
                continue
            hops[t][dst] = tuple(sorted(p for p, peer, _ in graph.adj[t] if dist[peer] == d - 1))
    return Routes(hops)


def transition_routes(spec: FabricSpec, old: Routes, stable_graph: CircuitGraph) -> Routes:
    """Routes to install *before* the changing circuits go dark (make before break).

    ``stable_graph`` holds only the circuits that survive the reconfiguration. For each (tor, dst) still
    connected on it, the route is a shortest path on it (so traffic leaves the changing circuits); otherwise
    the old route is kept (it goes dark with its circuit: unavoidable).

    Loop-free: a stable-routed packet moves to a ToR strictly closer to dst on ``stable_graph``, which is then
    stable-routed as well; an old-routed packet moves strictly closer on the old graph, and may switch to
    stable routing but never back. So no packet can revisit a ToR.
    """
    _check_graph(spec, stable_graph)
    stable = compute_routes(spec, stable_graph)
    hops: dict[int, dict[int, tuple[int, ...]]] = {}
    for t in range(spec.n_tors):
        row: dict[int, tuple[int, ...]] = {}
        old_row = old.next_hops.get(t, {})
        new_row = stable.next_hops.get(t, {})
        for dst in set(old_row) | set(new_row):
            if dst in new_row:
                row[dst] = new_row[dst]
            else:
                row[dst] = tuple(old_row[dst])
        hops[t] = row
    return Routes(hops)


class RouteLoop(RuntimeError):
    """A planned route state would forward packets in a circle (a bug in the planner, never user input)."""


def port_peers(*graphs: CircuitGraph) -> Callable[[int, int], int | None]:
    """``port_peer`` for :func:`find_loop`: the ToR at the far end of ``(tor, tor_port)``'s circuit in the
    first of ``graphs`` that has one (None: dark)."""
    table: dict[tuple[int, int], int] = {}
    for g in reversed(graphs):  # earlier graphs win
        for t in range(g.n_tors):
            for p, peer, _ in g.edges(t):
                table[(t, p)] = peer
    return lambda t, p: table.get((t, p))


def check_loop_free(routes: Routes, graph: CircuitGraph, what: str) -> None:
    """Raise RouteLoop when ``routes`` loop on the circuits of ``graph``."""
    loop = find_loop(routes, port_peers(graph), graph.n_tors)
    if loop is not None:
        raise RouteLoop(f"{what} would loop through ToRs {loop}")


def find_loop(routes: Routes, port_peer: Callable[[int, int], int | None], n_tors: int) -> list[int] | None:
    """A forwarding loop (list of ToRs, first == last) following any next-hop port, or None.

    ``port_peer(tor, tor_port)`` gives the ToR at the other end of that uplink's circuit (None: dark), e.g.
    the old circuit for ports whose circuit is changing and the stable one otherwise.
    """
    for dst in range(n_tors):
        # colour DFS over the per-destination forwarding graph
        succ: dict[int, list[int]] = {}
        for t in range(n_tors):
            nxt = []
            for p in routes.ports(t, dst):
                peer = port_peer(t, p)
                if peer is not None and peer != dst:
                    nxt.append(peer)
            succ[t] = nxt
        state = [0] * n_tors  # 0 new, 1 on stack, 2 done
        for root in range(n_tors):
            if state[root]:
                continue
            stack = [(root, iter(succ[root]))]
            path = [root]
            state[root] = 1
            while stack:
                node, it = stack[-1]
                nxt = next(it, None)
                if nxt is None:
                    state[node] = 2
                    stack.pop()
                    path.pop()
                elif state[nxt] == 1:
                    return path[path.index(nxt):] + [nxt]
                elif state[nxt] == 0:
                    state[nxt] = 1
                    stack.append((nxt, iter(succ[nxt])))
                    path.append(nxt)
    return None


# ---- flows and groups ------------------------------------------------------------------------
@dataclass(frozen=True)
class GroupSpec:
    """An OpenFlow select group: one equal-weight bucket ``output:port`` per port."""

    group_id: int
    ports: tuple[int, ...]


def group_id_of(dst_tor: int) -> int:
    return 1 + dst_tor


@dataclass(frozen=True)
class TorChanges:
    """Changes on one ToR. Apply in this order: add_groups, modify_groups, add_flows, delete_flows,
    delete_groups (a flow never points to a missing group)."""

    tor: int
    add_groups: tuple[GroupSpec, ...] = ()
    modify_groups: tuple[GroupSpec, ...] = ()
    add_flows: tuple[FlowSpec, ...] = ()
    delete_flows: tuple[FlowSpec, ...] = ()
    delete_groups: tuple[int, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not (self.add_groups or self.modify_groups or self.add_flows or self.delete_flows
                    or self.delete_groups)


@dataclass(frozen=True)
class RouteChanges:
    per_tor: Mapping[int, TorChanges] = field(default_factory=dict)  # only ToRs with changes

    @property
    def is_empty(self) -> bool:
        return not self.per_tor


def _ip_flow(ip: str, priority: int, action: tuple[str, object]) -> FlowSpec:
    return FlowSpec(priority, (("eth_type", ETH_TYPE_IPV4), ("ipv4_dst", ip)), (action,), TOR_COOKIE)


def local_flows(spec: FabricSpec, tor: int) -> list[FlowSpec]:
    """ipv4_dst of each server on ``tor`` -> that server's port."""
    return [_ip_flow(spec.host_ip(s), LOCAL_PRIORITY, ("output", spec.server_port(s)))
            for s in spec.servers_on_tor(tor)]


def remote_flows(spec: FabricSpec, dst_tor: int) -> list[FlowSpec]:
    """ipv4_dst of each server on ``dst_tor`` -> the group of ``dst_tor`` (installed on other ToRs)."""
    return [_ip_flow(spec.host_ip(s), REMOTE_PRIORITY, ("group", group_id_of(dst_tor)))
            for s in spec.servers_on_tor(dst_tor)]


def route_flow_changes(spec: FabricSpec, old: Routes | None, new: Routes) -> RouteChanges:
    """The group and flow changes that turn the tables of ``old`` (None: empty switches) into ``new``.

    ``old is None`` also installs each ToR's local-server flows. Unchanged groups and flows are left alone.
    """
    per: dict[int, TorChanges] = {}
    for t in range(spec.n_tors):
        o = old.next_hops.get(t, {}) if old is not None else {}
        n = new.next_hops.get(t, {})
        add_g, mod_g, add_f, del_f, del_g = [], [], [], [], []
        if old is None:
            add_f.extend(local_flows(spec, t))
        for dst in sorted(set(o) | set(n)):
            if dst == t:
                continue
            if dst in n and dst not in o:
                add_g.append(GroupSpec(group_id_of(dst), tuple(n[dst])))
                add_f.extend(remote_flows(spec, dst))
            elif dst in o and dst not in n:
                del_f.extend(remote_flows(spec, dst))
                del_g.append(group_id_of(dst))
            elif tuple(o[dst]) != tuple(n[dst]):
                mod_g.append(GroupSpec(group_id_of(dst), tuple(n[dst])))
        ch = TorChanges(t, tuple(add_g), tuple(mod_g), tuple(add_f), tuple(del_f), tuple(del_g))
        if not ch.is_empty:
            per[t] = ch
    return RouteChanges(per)
