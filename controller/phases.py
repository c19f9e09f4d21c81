"""Phase topologies of RFabric (pure): which circuits every OCS holds in each phase of an RL step.

Terms: a *slot* is a ToR uplink index ``u`` (0..uplinks_per_tor-1); uplink ``u`` of every ToR lands on OCS
``u % ocs_count`` (``spec.uplink``), so a circuit between uplink ``u`` of ToR ``a`` and uplink ``u'`` of ToR
``b`` needs ``u % ocs_count == u' % ocs_count``. Building per slot (``u == u'``) always satisfies that.

The ToR-level 1-factorisation used below is the circle method: with ``n`` ToRs (plus a dummy when ``n`` is
odd: its partner idles), round ``r`` pairs ``(inf, r)`` and ``(r+i, r-i) mod (n-1)``. Rounds 0 and 1
together form a Hamiltonian cycle (even ``n``) or path (odd ``n``), so any two slots carrying them connect
every ToR. Slot ``u`` carries round ``ROUND_ORDER[u]``: 0, 1, 2, 4, 8, ... (then the remaining rounds, then
repeat): consecutive rounds give connectivity, the doubling strides a small diameter.

Phases:

* ``train``: every slot of every ToR carries one round of the factorisation of *all* ToRs: a high-bisection
  mesh within and between pods (with round ``r`` small against ``n``, most pairs cross the pod-halves cut).
  Every ToR pair is reachable when ``uplinks_per_tor >= 2`` (or there are 2 ToRs).
* ``gen``: pods isolated: each pod's slots carry the rounds of that pod's own factorisation (a one-ToR pod has
  none), plus a *chain* of ``pods - 1`` inter-pod circuits (pod p <-> pod p+1) so KV-cache migrations and
  control traffic between generator pods still have a path. A chain end takes an idle port when there is one,
  otherwise it replaces one intra-pod circuit, but only if the pod stays as connected as before; a chain link
  that cannot be placed that way (e.g. one uplink per ToR, two ToRs per pod) is left out with a warning.
* ``sync``: a broadcast tree from the trainer pool to every generator ToR. Per generator pod, first a path
  through its ToRs (relay inside the pod); then every generator pod gets one entry circuit, from a trainer
  uplink while there are any (dealt round robin over trainer ToRs), otherwise from an already reached
  generator pod (relay between generator pods, breadth first); then the remaining trainer uplinks are dealt
  round robin to generator ToRs (more direct feeds, more broadcast bandwidth). Trainer ToRs carry no
  circuits among themselves in this phase.

Metrics: :func:`inter_pod_circuits`, :func:`bisection_circuits` (cut: pods ``0 .. pods//2 - 1`` against the
rest), :func:`reachable` and :func:`bfs_depth` on the ToR-level :class:`CircuitGraph`.
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Iterable, Mapping

from emulation.spec import PHASES, FabricSpec, JobLayout, check_phase  # noqa: F401 - PHASES: phases.PHASES
from emulation.validation import SpecError

from .ocs import Matching

log = logging.getLogger(__name__)

Edge = tuple[int, int, int]  # (tor_port, peer_tor, ocs)


# ---- 1-factorisation ---------------------------------------------------------------------------
def round_order(n_rounds: int, n_slots: int) -> list[int]:
    """Which round each slot carries: 0, 1, 2, 4, 8, ... then the other rounds, repeated as needed."""
    if n_rounds <= 0:
        return []
    order: list[int] = []
    seen: set[int] = set()
    cands = [0]
    step = 1
    while step < n_rounds:
        cands.append(step)
        step *= 2
    for r in cands + list(range(n_rounds)):
        if r not in seen:
            seen.add(r)
            order.append(r)
    return [order[u % n_rounds] for u in range(n_slots)]


def round_pairs(n: int, r: int) -> list[tuple[int, int]]:
    """Round ``r`` of the circle-method 1-factorisation of ``0..n-1`` (pairs (i, j), i < j)."""
    if n < 2:
        return []
    even = n if n % 2 == 0 else n + 1
    m = even - 1
    r %= m
    out = []
    if even - 1 < n:  # n even: the fixed point is a real member
        out.append((r, even - 1))
    for i in range(1, even // 2):
        a, b = (r + i) % m, (r - i) % m
        out.append((a, b) if a < b else (b, a))
    return out


def n_rounds(n: int) -> int:
    if n < 2:
        return 0
    return n - 1 if n % 2 == 0 else n


# ---- port bookkeeping ----------------------------------------------------------------------------
class _Circuits:
    """Collects circuits as (ocs, port_a, port_b) while tracking which ToR uplinks are used."""

    def __init__(self, spec: FabricSpec):
        self.spec = spec
        self.used: set[tuple[int, int]] = set()  # (tor, uplink)
        self.circ: dict[tuple[int, int], tuple[int, int]] = {}  # (tor, u) -> (peer tor, peer u)

    def free(self, tor: int, u: int) -> bool:
        return (tor, u) not in self.used

    def add(self, a: int, ua: int, b: int, ub: int) -> None:
        c = self.spec.ocs_count
        if a == b or ua % c != ub % c or (a, ua) in self.used or (b, ub) in self.used:
            raise ValueError(f"internal: bad circuit {(a, ua, b, ub)}")  # a bug here, not user input
        self.used.add((a, ua))
        self.used.add((b, ub))
        self.circ[(a, ua)] = (b, ub)
        self.circ[(b, ub)] = (a, ua)

    def remove(self, a: int, ua: int) -> None:
        b, ub = self.circ.pop((a, ua))
        del self.circ[(b, ub)]
        self.used.discard((a, ua))
        self.used.discard((b, ub))

    def free_slots(self, tor: int, ocs: int) -> list[int]:
        c = self.spec.ocs_count
        return [u for u in range(ocs, self.spec.uplinks_per_tor, c) if (tor, u) not in self.used]

    def connect(self, a: int, b: int, offset: int = 0) -> bool:
        """Join a free uplink of ``a`` and one of ``b`` on a common OCS, the one with most spare ports (ties:
        the first from OCS ``offset`` on, so callers can spread circuits over OCSes); False if none."""
        best = None
        c = self.spec.ocs_count
        for o in [(offset + i) % c for i in range(c)]:
            fa, fb = self.free_slots(a, o), self.free_slots(b, o)
            if fa and fb:
                score = len(fa) + len(fb)
                if best is None or score > best[0]:
                    best = (score, fa[0], fb[0])
        if best is None:
            return False
        self.add(a, best[1], b, best[2])
        return True

    def n_free(self, tor: int) -> int:
        return sum(1 for u in range(self.spec.uplinks_per_tor) if (tor, u) not in self.used)

    def matchings(self) -> dict[int, Matching]:
        spec = self.spec
        per: dict[int, set[tuple[int, int]]] = {o: set() for o in range(spec.ocs_count)}
        for (a, ua), (b, ub) in self.circ.items():
            if (a, ua) < (b, ub):
                la, lb = spec.uplink(a, ua), spec.uplink(b, ub)
                p, q = la.ocs_port, lb.ocs_port
                per[la.ocs].add((p, q) if p < q else (q, p))
        return {o: Matching(spec.ports_per_ocs, frozenset(cs)) for o, cs in per.items()}


def _round_robin(circ: _Circuits, tors: list[int]) -> None:
    """Every slot of ``tors`` carries one round of their factorisation (only where both ports are free)."""
    n = len(tors)
    if n < 2:
        return
    for u, r in enumerate(round_order(n_rounds(n), circ.spec.uplinks_per_tor)):
        for i, j in round_pairs(n, r):
            a, b = tors[i], tors[j]
            if circ.free(a, u) and circ.free(b, u):
                circ.add(a, u, b, u)


# ---- phases --------------------------------------------------------------------------------------
def phase_matchings(spec: FabricSpec, layout: JobLayout, phase: str) -> dict[int, Matching]:
    """OCS index -> matching over ``spec.ports_per_ocs`` ports for ``phase`` (one of PHASES)."""
    check_phase(phase)
    layout.check(spec)
    circ = _Circuits(spec)
    if phase == "train":
        _round_robin(circ, list(range(spec.n_tors)))
    elif phase == "gen":
        _build_gen(spec, circ)
    else:
        _build_sync(spec, layout, circ)
    return circ.matchings()


def _components(circ: _Circuits, tors: Iterable[int]) -> int:
    tors = list(tors)
    parent = {t: t for t in tors}

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    comps = len(tors)
    for t in tors:
        for u in range(circ.spec.uplinks_per_tor):
            peer = circ.circ.get((t, u))
            if peer is not None and peer[0] in parent:
                ra, rb = find(t), find(peer[0])
                if ra != rb:
                    parent[ra] = rb
                    comps -= 1
    return comps


def _chain_end(spec: FabricSpec, circ: _Circuits, pod: int, ocs: int, dry: bool) -> tuple[int, int, int] | None:
    """(cost, tor, uplink) for a chain end in ``pod`` on ``ocs``: an idle port (cost 0) or a port whose
    intra-pod circuit can be dropped without splitting the pod (cost 1). ``dry``: do not drop anything."""
    tors = list(spec.tors_in_pod(pod))
    chain_slots = range(ocs, spec.uplinks_per_tor, spec.ocs_count)
    for t in tors:
        for u in chain_slots:
            if circ.free(t, u):
                return (0, t, u)
    before = _components(circ, tors)
    for t in tors:
        for u in chain_slots:
            peer = circ.circ.get((t, u))
            if peer is None or peer[0] not in tors:
                continue  # an inter-pod (chain) circuit: keep it
            circ.remove(t, u)
            ok = _components(circ, tors) <= before
            circ.add(t, u, peer[0], peer[1])
            if ok:
                if not dry:
                    circ.remove(t, u)
                return (1, t, u)
    return None


def _build_gen(spec: FabricSpec, circ: _Circuits) -> None:
    for p in range(spec.pods):
        _round_robin(circ, list(spec.tors_in_pod(p)))
    for p in range(spec.pods - 1):
        best = None
        for o in range(spec.ocs_count):
            ea = _chain_end(spec, circ, p, o, dry=True)
            eb = _chain_end(spec, circ, p + 1, o, dry=True)
            if ea and eb and (best is None or ea[0] + eb[0] < best[0]):
                best = (ea[0] + eb[0], o)
        if best is None:
            log.warning("gen phase: no port for the chain circuit between pods %d and %d "
                        "(uplinks_per_tor=%d); the pods stay disconnected", p, p + 1, spec.uplinks_per_tor)
            continue
        ea = _chain_end(spec, circ, p, best[1], dry=False)
        eb = _chain_end(spec, circ, p + 1, best[1], dry=False)
        circ.add(ea[1], ea[2], eb[1], eb[2])


def _build_sync(spec: FabricSpec, layout: JobLayout, circ: _Circuits) -> None:
    trainers = [t for p in sorted(layout.train_pods) for t in spec.tors_in_pod(p)]
    gen_pods = sorted(layout.gen_pods)
    # 1. relay path inside every generator pod
    for j, p in enumerate(gen_pods):
        tors = list(spec.tors_in_pod(p))
        for i, (a, b) in enumerate(zip(tors, tors[1:])):
            if not circ.connect(a, b, offset=j * 2 + i):
                log.warning("sync phase: no port for the relay circuit %d-%d in pod %d", a, b, p)
    # 2. one entry circuit per generator pod: trainers first (round robin), then reached generator pods
    senders: deque[int] = deque(trainers)
    relays: deque[int] = deque()
    for p in gen_pods:
        tors = list(spec.tors_in_pod(p))
        placed = _place_entry(circ, senders, tors) or _place_entry(circ, relays, tors)
        if placed:
            relays.extend(tors)
        else:
            log.warning("sync phase: generator pod %d cannot be reached (no free ports)", p)
    # 3. the remaining trainer uplinks feed generator ToRs directly, round robin over pods
    targets = [t for i in range(spec.tors_per_pod) for p in gen_pods for t in [spec.tors_in_pod(p)[i]]]
    if not targets:
        return
    start = 0  # each OCS continues the round robin where the previous one stopped
    for o in range(spec.ocs_count):
        queue = deque(t for t in targets[start:] + targets[:start] if circ.free_slots(t, o))
        start = (start + sum(len(circ.free_slots(s, o)) for s in trainers)) % len(targets)
        for s in trainers:
            for u in circ.free_slots(s, o):
                while queue and not circ.free_slots(queue[0], o):
                    queue.popleft()
                if not queue:
                    break
                t = queue.popleft()
                circ.add(s, u, t, circ.free_slots(t, o)[0])
                queue.append(t)  # round robin: back of the queue (dropped later when full)


def _place_entry(circ: _Circuits, senders: deque[int], tors: list[int]) -> bool:
    """Connect the first sender (round robin) that has a port on an OCS shared with one of ``tors``."""
    for _ in range(len(senders)):
        s = senders[0]
        if circ.n_free(s) == 0:
            senders.popleft()
            continue
        senders.rotate(-1)
        if any(circ.connect(s, t) for t in tors):
            return True
    return False


# ---- ToR-level graph ---------------------------------------------------------------------------
@dataclass(frozen=True)
class CircuitGraph:
    """ToR-level multigraph: ``adj[tor]`` lists ``(tor_port, peer_tor, ocs)``, one per circuit end."""

    n_tors: int
    adj: tuple[tuple[Edge, ...], ...]

    def edges(self, tor: int) -> tuple[Edge, ...]:
        return self.adj[tor]

    def neighbors(self, tor: int) -> list[int]:
        return sorted({peer for _, peer, _ in self.adj[tor]})

    def n_circuits_between(self, a: int, b: int) -> int:
        return sum(1 for _, peer, _ in self.adj[a] if peer == b)

    def n_circuits(self) -> int:
        return sum(len(e) for e in self.adj) // 2


def circuit_graph(spec: FabricSpec, matchings: Mapping[int, Matching]) -> CircuitGraph:
    """The ToR-level multigraph of ``matchings`` (OCS index -> Matching). Circuits to spare OCS ports and
    circuits joining two uplinks of the same ToR carry no ToR-to-ToR traffic and are left out."""
    adj: list[list[Edge]] = [[] for _ in range(spec.n_tors)]
    for o in sorted(matchings):
        m = matchings[o]
        if not (isinstance(o, int) and 0 <= o < spec.ocs_count):
            raise SpecError("matchings", f"OCS {o!r} does not exist (0..{spec.ocs_count - 1})")
        if m.n_ports != spec.ports_per_ocs:
            raise SpecError(f"matchings.{o}", f"has {m.n_ports} ports, OCS {o} has {spec.ports_per_ocs}")
        for a, b in m.pairs():
            ua, ub = spec.ocs_port_owner(o, a), spec.ocs_port_owner(o, b)
            if ua is None or ub is None or ua.tor == ub.tor:
                continue
            adj[ua.tor].append((ua.tor_port, ub.tor, o))
            adj[ub.tor].append((ub.tor_port, ua.tor, o))
    return CircuitGraph(spec.n_tors, tuple(tuple(sorted(es)) for es in adj))


def unchanged_matchings(old: Mapping[int, Matching], new: Mapping[int, Matching]) -> dict[int, Matching]:
    """Per OCS, the circuits present in both ``old`` and ``new`` (they keep carrying traffic)."""
    if set(old) != set(new):
        raise SpecError("matchings", f"OCS sets differ: {sorted(old)} vs {sorted(new)}")
    out = {}
    for o in old:
        if old[o].n_ports != new[o].n_ports:
            raise SpecError(f"matchings.{o}", f"port counts differ: {old[o].n_ports} vs {new[o].n_ports}")
        out[o] = Matching(old[o].n_ports, old[o].circuits & new[o].circuits)
    return out


# ---- metrics -----------------------------------------------------------------------------------
def _tor_circuits(spec: FabricSpec, matchings: Mapping[int, Matching]) -> Iterable[tuple[int, int]]:
    for o, m in matchings.items():
        for a, b in m.circuits:
            ua, ub = spec.ocs_port_owner(o, a), spec.ocs_port_owner(o, b)
            if ua is not None and ub is not None:
                yield ua.tor, ub.tor


def inter_pod_circuits(spec: FabricSpec, matchings: Mapping[int, Matching]) -> int:
    return sum(1 for a, b in _tor_circuits(spec, matchings) if spec.pod_of_tor(a) != spec.pod_of_tor(b))


def bisection_circuits(spec: FabricSpec, matchings: Mapping[int, Matching]) -> int:
    """Circuits across the cut between pods ``0 .. pods//2 - 1`` and the other pods."""
    half = spec.pods // 2
    return sum(1 for a, b in _tor_circuits(spec, matchings)
               if (spec.pod_of_tor(a) < half) != (spec.pod_of_tor(b) < half))


def bfs_depth(graph: CircuitGraph, src_tors: Iterable[int]) -> dict[int, int]:
    """Hops from the nearest of ``src_tors`` to every reachable ToR (sources at depth 0)."""
    depth = {}
    q: deque[int] = deque()
    for s in src_tors:
        if s not in depth:
            depth[s] = 0
            q.append(s)
    while q:
        x = q.popleft()
        for _, y, _ in graph.adj[x]:
            if y not in depth:
                depth[y] = depth[x] + 1
                q.append(y)
    return depth


def reachable(graph: CircuitGraph, src_tors: Iterable[int], dst_tors: Iterable[int]) -> bool:
    """True when every ToR of ``dst_tors`` is reachable from some ToR of ``src_tors``."""
    depth = bfs_depth(graph, src_tors)
    return all(d in depth for d in dst_tors)


def all_pairs_reachable(graph: CircuitGraph) -> bool:
    return graph.n_tors == 0 or len(bfs_depth(graph, [0])) == graph.n_tors
