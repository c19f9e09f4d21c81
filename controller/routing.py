"""ToR routing over the circuit graph (pure): shortest-path next hops, make-before-break transition routes,
and the OpenFlow flow/group changes that install them.

Every ToR forwards IPv4 by destination address: a local server's address goes out of its server port; a
remote server's address goes to the *select group* of its ToR (group id ``1 + dst_tor``), whose buckets
output to the uplinks of every first hop on a shortest circuit path (one bucket per circuit, so parallel
circuits share the load). Transit ToRs forward by the same tables, so multi-hop paths need nothing more.
Where a ToR has more than one first-hop uplink toward a destination ToR, the packets its own servers send
there are *pinned*: each (local server, remote server) pair to one of those uplinks, round robin over the
pairs (:func:`pinned_flows`), so a collective's few long TCP connections spread evenly over the parallel
circuits as a fluid model of them (RLSim's) assumes, in every run. The select group hashes each connection
(ports included) onto a bucket: four connections on two buckets all land on one in 1 of 8 hashings, and
split 3:1 in 1 of 2. Transit packets keep the group.
A destination ToR that becomes unreachable loses its flows and its group (the flows are deleted first);
packets to it then miss the table and are dropped (OpenFlow 1.3 table-miss default).

ARP is not routed here: hosts need static ARP entries (``FabricSpec.host_mac`` is deterministic).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from emulation.spec import FabricSpec
from emulation.validation import SpecError

from .ocs import TOR_COOKIE, FlowSpec
from .phases import CircuitGraph

ETH_TYPE_IPV4 = 0x0800
LOCAL_PRIORITY = 200  # ipv4_dst of a server on this ToR -> its port
PINNED_PRIORITY = 150  # from a server on this ToR (in_port) to a server on another: one of parallel uplinks
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


# ---- route states during a reconfiguration --------------------------------------------------------
Entry = tuple[int, int]  # (tor, dst_tor)


def entries(routes: Routes) -> set[Entry]:
    return {(t, d) for t, row in routes.next_hops.items() for d in row}


def changed_entries(a: Routes, b: Routes) -> set[Entry]:
    """The (tor, dst) whose next hops differ between ``a`` and ``b`` (present in one only included)."""
    return {e for e in entries(a) | entries(b) if a.ports(*e) != b.ports(*e)}


def merge(a: Routes, b: Routes) -> Routes:
    """Every next hop of ``a`` or ``b`` per (tor, dst): the worst case while ToRs go from ``a`` to ``b``
    (each ToR, and each select-group bucket, may hold either). Loop-free here means loop-free in every
    mixed state."""
    hops: dict[int, dict[int, tuple[int, ...]]] = {}
    for t in set(a.next_hops) | set(b.next_hops):
        ra, rb = a.next_hops.get(t, {}), b.next_hops.get(t, {})
        row = dict(ra)
        for d, pb in rb.items():
            pa = ra.get(d)
            if pa is None:
                row[d] = tuple(pb)
            elif tuple(pa) != tuple(pb):
                row[d] = tuple(sorted(set(pa) | set(pb)))
        hops[t] = row
    return Routes(hops)


def with_entries(base: Routes, other: Routes, which: set[Entry]) -> Routes:
    """``base`` with the entries in ``which`` taken from ``other`` (removed where ``other`` lacks them)."""
    hops = {t: dict(row) for t, row in base.next_hops.items()}
    for t, d in which:
        row = hops.setdefault(t, {})
        if d in other.next_hops.get(t, {}):
            row[d] = other.ports(t, d)
        else:
            row.pop(d, None)
    return Routes(hops)


def dark_routes(transition: Routes, final: Routes, stable_graph: CircuitGraph) -> Routes:
    """The routes to install while the changed circuits are dark: ``transition`` where a stable path exists
    (traffic keeps flowing on it), ``final`` where none does.

    A (tor, dst) with no path on the stable circuits is dark until the new circuits light up, whatever its
    route: pointing it at the new circuits' (dark) uplinks early loses nothing more, and its traffic flows
    the moment they light. Loop-free on the new circuits: a stable-routed packet stays on ToRs that reach
    dst on stable circuits (each hop strictly closer on them), a final-routed one moves strictly closer on
    the new graph, and may switch to stable routing but never back.
    """
    reach: dict[int, list[int]] = {d: _dist_to(stable_graph, d) for d in range(stable_graph.n_tors)}
    no_stable_path = {(t, d) for t, d in entries(transition) | entries(final) if reach[d][t] < 0}
    return with_entries(transition, final, no_stable_path)


def _levels(routes: Routes, port_peer: Callable[[int, int], int | None], which: set[Entry]) -> dict[Entry, int]:
    """For each entry: 1 + the deepest level among its next hops' entries (0 at dst), along ``routes``."""
    memo: dict[Entry, int] = {}

    def level(t: int, d: int, depth: int) -> int:
        if t == d:
            return 0
        if (t, d) in memo:
            return memo[(t, d)]
        if depth > 4 * (len(routes.next_hops) + 1):
            raise RouteLoop(f"routes to ToR {d} loop through ToR {t}")
        peers = [port_peer(t, p) for p in routes.ports(t, d)]
        memo[(t, d)] = 1 + max((level(q, d, depth + 1) for q in peers if q is not None), default=0)
        return memo[(t, d)]

    return {e: level(e[0], e[1], 0) for e in which}


def blanked(routes: Routes, which: set[Entry]) -> Routes:
    """``routes`` with the entries in ``which`` emptied (their select groups keep no bucket: packets drop).

    Going ``a -> blanked(a, changed) -> b`` never mixes ``a``'s and ``b``'s next hops for one entry, so it
    is loop-free whenever ``a`` and ``b`` are (break before make: only for traffic that is dark anyway)."""
    hops = {t: dict(row) for t, row in routes.next_hops.items()}
    for t, d in which:
        if d in hops.get(t, {}):
            hops[t][d] = ()
    return Routes(hops)


def safe_steps(before: Routes, after: Routes, lit: CircuitGraph, order_graph: CircuitGraph,
               what: str) -> list[Routes]:
    """Route states from ``before`` to ``after`` (the last one is ``after``; none when equal), such that no
    mixed state of two consecutive ones loops on the circuits of ``lit``, and no traffic stops (make
    before break).

    One step when the worst-case mixed state of ``before`` and ``after`` is loop-free (the common case);
    otherwise the changed entries go in rounds, nearest the destination first along ``after`` on
    ``order_graph`` (a ToR switches only once the ToRs it forwards to have: a packet at a switched ToR then
    follows ``after`` to the end). Every step is checked; RouteLoop when one would still loop.
    """
    changed = changed_entries(before, after)
    if not changed:
        return []
    peer = port_peers(lit)
    dsts = {d for _, d in changed}  # a mixed loop of two loop-free states runs through a changed entry
    if find_loop(merge(before, after), peer, lit.n_tors, dsts) is None:
        return [after]
    in_after = entries(after)
    present = {e for e in changed if e in in_after}
    lv = _levels(after, port_peers(order_graph), present)
    rounds = sorted(set(lv.values()))
    states, done, prev = [], set(), before
    for k in rounds + [None]:  # removed entries last: their packets drop instead of moving
        done |= {e for e, v in lv.items() if v == k} if k is not None else changed - present
        nxt = with_entries(before, after, done)
        if nxt == prev:
            continue
        loop = find_loop(merge(prev, nxt), peer, lit.n_tors, dsts)
        if loop is not None:
            raise RouteLoop(f"{what}: switching the ToRs over would loop through ToRs {loop}")
        states.append(nxt)
        prev = nxt
    return states


def find_loop(routes: Routes, port_peer: Callable[[int, int], int | None], n_tors: int,
              dsts: Iterable[int] | None = None) -> list[int] | None:
    """A forwarding loop (list of ToRs, first == last) following any next-hop port, or None.

    ``port_peer(tor, tor_port)`` gives the ToR at the other end of that uplink's circuit (None: dark), e.g.
    the old circuit for ports whose circuit is changing and the stable one otherwise. ``dsts``: only the
    routes toward these ToRs (default all).
    """
    for dst in (range(n_tors) if dsts is None else sorted(dsts)):
        # colour DFS over the per-destination forwarding graph
        succ: dict[int, list[int]] = {}
        hops = routes.next_hops
        for t in range(n_tors):
            nxt = []
            for p in hops.get(t, {}).get(dst, ()):
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


def pinned_flows(spec: FabricSpec, tor: int, dst_tor: int, ports: tuple[int, ...]) -> list[FlowSpec]:
    """Where ``tor`` reaches ``dst_tor`` over more than one first-hop uplink (``ports``): each pair of a server
    on ``tor`` (matched by its port) and a server on ``dst_tor`` goes out of one of them, pair ``(i, j)`` (the
    servers' indices on their ToRs) out of ``ports[(i + j) % len(ports)]``, so every uplink carries the
    same number of pairs (within one). None for a single uplink: the group has one bucket."""
    if len(ports) < 2:
        return []
    out = []
    for i, s in enumerate(spec.servers_on_tor(tor)):
        for j, d in enumerate(spec.servers_on_tor(dst_tor)):
            out.append(FlowSpec(PINNED_PRIORITY, (("eth_type", ETH_TYPE_IPV4), ("in_port", spec.server_port(s)),
                                                  ("ipv4_dst", spec.host_ip(d))),
                                (("output", int(ports[(i + j) % len(ports)])),), TOR_COOKIE))
    return out


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
                add_f.extend(pinned_flows(spec, t, dst, tuple(n[dst])))
            elif dst in o and dst not in n:
                del_f.extend(pinned_flows(spec, t, dst, tuple(o[dst])))
                del_f.extend(remote_flows(spec, dst))
                del_g.append(group_id_of(dst))
            elif tuple(o[dst]) != tuple(n[dst]):
                mod_g.append(GroupSpec(group_id_of(dst), tuple(n[dst])))
                # re-pinned after the group changed (add replaces a flow of the same match); pins the new
                # state has none of are deleted, never one it re-adds (deletes run after the adds)
                was, now = pinned_flows(spec, t, dst, tuple(o[dst])), pinned_flows(spec, t, dst, tuple(n[dst]))
                keep = {f.key for f in now}
                add_f.extend(f for f in now if f not in was)
                del_f.extend(f for f in was if f.key not in keep)
        ch = TorChanges(t, tuple(add_g), tuple(mod_g), tuple(add_f), tuple(del_f), tuple(del_g))
        if not ch.is_empty:
            per[t] = ch
    return RouteChanges(per)
