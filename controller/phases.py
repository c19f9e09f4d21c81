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
* ``sync``: the weight broadcast. Every slot is a matching between trainer and generator ToRs, rotated from
  slot to slot, so each generator ToR's circuits come from as many trainer ToRs as possible, evenly, and
  every trainer uplink feeds a generator ToR (when trainers outnumber generators, every generator uplink is
  fed). Generator ToRs that trainer uplinks cannot reach (they ran out) hang on relay paths from the fed
  ones, and spare ports widen those relay hops. Trainer ToRs carry no circuits among themselves.
  :func:`sync_chains` turns any phase's circuits into the server-level broadcast plan (RLSim's sync phase
  uses it).

Metrics: :func:`inter_pod_circuits`, :func:`bisection_circuits` (cut: pods ``0 .. pods//2 - 1`` against the
rest), :func:`reachable` and :func:`bfs_depth` on the ToR-level :class:`CircuitGraph`.
"""
from __future__ import annotations

import functools
import logging
import math
from collections import deque
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Iterable, Mapping

from emulation.spec import FabricSpec, JobLayout, check_phase
from emulation.validation import SpecError

from .ocs import Matching
from .traffic import Demand, TrainTraffic, stage_server_bound_s

if TYPE_CHECKING:
    from .traffic import PhaseTraffic

log = logging.getLogger(__name__)
GBPS = 1e9 / 8  # bytes/s per Gb/s
PLAN_TIE = 0.005  # train_plan: estimates within 0.5% of the best count as equal

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
        self.n_free = [spec.uplinks_per_tor] * spec.n_tors  # free uplinks per ToR
        k = spec.ports_per_tor_per_ocs
        self.free_on = [[k] * spec.ocs_count for _ in range(spec.n_tors)]  # free uplinks per ToR per OCS

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
        self.n_free[a] -= 1
        self.n_free[b] -= 1
        self.free_on[a][ua % c] -= 1
        self.free_on[b][ub % c] -= 1

    def remove(self, a: int, ua: int) -> None:
        b, ub = self.circ.pop((a, ua))
        del self.circ[(b, ub)]
        self.used.discard((a, ua))
        self.used.discard((b, ub))
        self.n_free[a] += 1
        self.n_free[b] += 1
        c = self.spec.ocs_count
        self.free_on[a][ua % c] += 1
        self.free_on[b][ub % c] += 1

    def free_slots(self, tor: int, ocs: int) -> list[int]:
        c = self.spec.ocs_count
        return [u for u in range(ocs, self.spec.uplinks_per_tor, c) if (tor, u) not in self.used]

    def connect(self, a: int, b: int) -> bool:
        """Join a free uplink of ``a`` and one of ``b`` on a common OCS, the one with most spare ports (ties:
        the lowest OCS); False if none."""
        if not (self.n_free[a] and self.n_free[b]):
            return False
        fa, fb = self.free_on[a], self.free_on[b]
        best, best_o = 0, None
        for o in range(self.spec.ocs_count):
            if fa[o] and fb[o] and fa[o] + fb[o] > best:
                best, best_o = fa[o] + fb[o], o
        if best_o is None:
            return False
        self.add(a, self.free_slots(a, best_o)[0], b, self.free_slots(b, best_o)[0])
        return True

    def place(self, a: int, b: int) -> bool:
        """A circuit between ``a`` and ``b``: :meth:`connect`, and when no OCS has a free port on both but the
        wiring gives every ToR one port per OCS, free one by swapping two OCSes along an alternating path of
        circuits (a Kempe chain: every ToR on the path keeps its peers, on other ports). False if neither works."""
        if self.connect(a, b):
            return True
        spec = self.spec
        if spec.ports_per_tor_per_ocs != 1 or a == b:
            return False
        up = spec.uplinks_per_tor  # one port per OCS: uplink u is on OCS u
        free_a = [u for u in range(up) if self.free(a, u)]
        free_b = [u for u in range(up) if self.free(b, u)]
        for al in free_a:
            for be in free_b:
                path, x, col, other = [], b, al, be
                while (x, col) in self.circ and len(path) <= spec.n_tors:
                    y, _ = self.circ[(x, col)]
                    path.append((x, y, col))
                    x, col, other = y, other, col
                if x == a or (x, col) in self.circ:  # the chain ends at ``a`` (or never ends): no use
                    continue
                for x0, y0, c0 in path:
                    self.remove(x0, c0)
                for x0, y0, c0 in path:
                    c1 = be if c0 == al else al
                    self.add(x0, c1, y0, c1)
                self.add(a, al, b, al)
                return True
        return False

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
def phase_matchings(spec: FabricSpec, layout: JobLayout, phase: str,
                    traffic: "PhaseTraffic | None" = None) -> dict[int, Matching]:
    """OCS index -> matching over ``spec.ports_per_ocs`` ports for ``phase`` (one of PHASES).

    ``traffic`` (``controller.traffic.phase_traffic`` of the scenario's workload): the train topology is
    built from what training sends (:func:`train_plan`). Without it (a controller told no workload) the
    train phase is the uniform mesh over every ToR, the right topology only for unknown or uniform traffic.
    """
    check_phase(phase)
    layout.check(spec)
    return dict(_phase_matchings(spec, layout, phase, traffic))


@functools.lru_cache(maxsize=256)
def _phase_matchings(spec: FabricSpec, layout: JobLayout, phase: str, traffic, join: bool = True) -> dict[int, Matching]:
    circ = _Circuits(spec)
    if phase == "train":
        if traffic is None:
            _round_robin(circ, list(range(spec.n_tors)))
        else:
            _build_train(spec, layout, circ, traffic.train, join)
    elif phase == "gen":
        _build_gen(spec, circ)
    else:
        _build_sync(spec, layout, circ)
    return circ.matchings()


class _DisjointSets:
    """Union-find over ToRs (path halving); a union keeps the smaller root, so a set's root is its least ToR."""

    def __init__(self, items: Iterable[int]):
        self.parent = {x: x for x in items}

    def __contains__(self, x: int) -> bool:
        return x in self.parent

    def find(self, x: int) -> int:
        parent = self.parent
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(self, a: int, b: int) -> bool:
        """Join the sets of ``a`` and ``b``; False if they were one already."""
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return False
        self.parent[max(ra, rb)] = min(ra, rb)
        return True

    def sets(self) -> list[tuple[int, ...]]:
        """The sets, each in the items' order, ordered by their roots."""
        out: dict[int, list[int]] = {}
        for x in self.parent:
            out.setdefault(self.find(x), []).append(x)
        return [tuple(v) for _, v in sorted(out.items())]


def _components(circ: _Circuits, tors: Iterable[int]) -> int:
    tors = list(tors)
    ds = _DisjointSets(tors)
    comps = len(tors)
    for t in tors:
        for u in range(circ.spec.uplinks_per_tor):
            peer = circ.circ.get((t, u))
            if peer is not None and peer[0] in ds and ds.union(t, peer[0]):
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
    gens = [t for p in sorted(layout.gen_pods) for t in spec.tors_in_pod(p)]
    nt, ng = len(trainers), len(gens)
    # 1. direct feeds: every slot is a matching between the smaller side and as many ToRs of the larger one
    #    (both ends on slot u, so on one OCS), shifted from slot to slot: by the smaller side's size, so the
    #    first slots reach every ToR of the larger side, plus one after each full turn, so the first
    #    ``n_large`` slots use every shift once (every pair gets its share of circuits, evenly)
    small, large = (trainers, gens) if nt <= ng else (gens, trainers)
    ns, nl = len(small), len(large)
    turn = nl // math.gcd(ns, nl)  # slots until the shifts by ``ns`` come back to 0
    for u in range(spec.uplinks_per_tor):
        off = u * ns + u // turn
        for i, a in enumerate(small):
            circ.add(a, u, large[(i + off) % nl], u)
    # 2. generator ToRs that no trainer uplink reaches (trainer uplinks ran out): relay paths from the fed
    #    ones, grown round robin so they stay short; then spare ports widen the relay hops
    tset = set(trainers)
    fed = [g for g in gens if any(circ.circ.get((g, u), (None,))[0] in tset for u in range(spec.uplinks_per_tor))]
    tails: deque[int] = deque(fed)
    hops: list[tuple[int, int]] = []
    for g in gens:
        if g in fed:
            continue
        for _ in range(len(tails)):
            t = tails.popleft()
            if circ.connect(t, g):
                tails.append(g)
                hops.append((t, g))
                break
            tails.append(t)
        else:
            log.warning("sync phase: generator ToR %d cannot be reached (no free ports)", g)
    while hops:
        hops = [h for h in hops if circ.connect(*h)]


# ---- the train topology, from training's traffic ------------------------------------------------------------
@dataclass(frozen=True)
class TrainPlan:
    """How the train topology allots the trainer ToRs' uplinks (:func:`train_plan`).

    ``cells``: trainer ToRs joined by model-parallel traffic (an EP group's all-to-all or a pipeline's
    point-to-point); ``circuits``: ``(a, b, n)`` circuits between trainer ToRs ``a < b``; ``intra_ports``
    (``C``): uplinks per ToR of a multi-ToR cell inside its cell; ``base``: circuits from a ToR to every ToR
    of an adjacent cell before the rest follows the rings' bytes; ``estimate_s``: each stage's estimated
    time at that choice; ``by_choice``: the estimated train network time of every (C, base) tried."""

    cells: tuple[tuple[int, ...], ...]
    circuits: tuple[tuple[int, int, int], ...]
    intra_ports: int
    base: int
    estimate_s: tuple[tuple[str, float], ...]
    by_choice: tuple[tuple[int, int, float], ...]

    def summary(self) -> dict:
        return {"cells": len(self.cells), "tors_per_cell": sorted({len(c) for c in self.cells}),
                "intra_cell_ports": self.intra_ports, "base_per_tor_pair": self.base,
                "trainer_circuits": sum(n for _, _, n in self.circuits),
                "estimate_s": {k: round(float(v), 6) for k, v in self.estimate_s}}


def _tor_demand(spt: int, demands: Iterable[Demand]) -> dict[tuple[int, int], float]:
    acc: dict[tuple[int, int], float] = {}
    for s_, d, b in demands:
        a, c = s_ // spt, d // spt
        if a != c:
            acc[(a, c)] = acc.get((a, c), 0.0) + b
    return acc


def _cells(spt: int, tors: list[int], tt: TrainTraffic) -> list[tuple[int, ...]]:
    """Trainer ToRs joined (union-find) by all-to-all and point-to-point groups: model-parallel traffic
    stays inside a cell; only the DP rings (AllReduce, whose ring order the library chooses) cross cells."""
    ds = _DisjointSets(tors)
    for st in tt.stages:
        for g in st.groups:
            if g.kind == "ring":
                continue
            ts = sorted({m // spt for m in g.members})
            for t in ts[1:]:
                ds.union(ts[0], t)
    return ds.sets()


def _split(total: int, weights: list[float]) -> list[int]:
    """``total`` ports dealt in proportion to ``weights`` (largest remainders; ties: first)."""
    wsum = sum(weights)
    if total <= 0 or wsum <= 0:
        return [0] * len(weights)
    raw = [total * w / wsum for w in weights]
    out = [int(math.floor(x)) for x in raw]
    for i in sorted(range(len(raw)), key=lambda i: (-(raw[i] - out[i]), i))[:total - sum(out)]:
        out[i] += 1
    return out


def _width(c: dict[int, dict[int, int]], a: int, b: int, share: dict[tuple[int, int], float]) -> float:
    """The circuits' worth a ToR pair's bytes can use: the direct bundle, plus half of every two-hop path
    (the narrower of its bundles, each at ``share`` of its circuits when other detours cross it too: a
    two-hop byte takes two circuit hops and the bundles it borrows carry their own traffic)."""
    ca, cb = c.get(a, {}), c.get(b, {})
    w = float(ca.get(b, 0))
    for m, n in ca.items():
        if m != b and m in cb:
            w += 0.5 * min(n * share.get((a, m), 1.0), cb[m] * share.get((m, b), 1.0))
    return w


def _ring_weights(cells: list, cell_of: dict[int, int], stage_dem: list
                  ) -> tuple[dict[tuple[int, int], float], dict[int, dict[int, float]]]:
    """train_plan's ring traffic between cells: bytes per ToR pair of different cells (both directions, keyed
    (low, high)) and per pair of adjacent cells (``adj_w[g][h]``), summed over the stages."""
    ring_bytes: dict[tuple[int, int], float] = {}  # between ToRs of different cells, both directions
    adj_w: dict[int, dict[int, float]] = {i: {} for i in range(len(cells))}
    for _, _, td in stage_dem:
        for (a, b), v in td.items():
            g, h = cell_of.get(a), cell_of.get(b)
            if g is None or h is None or g == h:
                continue
            key = (min(a, b), max(a, b))
            ring_bytes[key] = ring_bytes.get(key, 0.0) + v
            adj_w[g][h] = adj_w[g].get(h, 0.0) + v
            adj_w[h][g] = adj_w[h].get(g, 0.0) + v
    return ring_bytes, adj_w


def _cell_counts(tors: list[int], cells: list, adj_w: dict[int, dict[int, float]],
                 ring_bytes: dict[tuple[int, int], float], U: int, C: int,
                 base: int) -> dict[int, dict[int, int]] | None:
    """train_plan's circuits per ToR pair for ``(C, base)`` (its docstring's step 2); None when ``base``
    circuits to every ToR of an adjacent cell do not fit the uplinks given to that cell."""
    alloc: dict[int, dict[int, int]] = {t: {} for t in tors}
    for g, cell in enumerate(cells):
        own = C if len(cell) > 1 else 0
        for a in cell:
            peers = [b for b in cell if b != a]
            # the rotation puts a remainder on different peers from ToR to ToR
            k = cell.index(a)
            for b, n in zip(peers[k:] + peers[:k], _split(own, [1.0] * len(peers))):
                alloc[a][b] = n
            nb = sorted(adj_w[g])
            for h, p in zip(nb, _split(U - own, [adj_w[g][h] for h in nb])):
                q = cells[h]
                if base * len(q) > p:
                    return None
                rest = _split(p - base * len(q), [ring_bytes.get((min(a, b), max(a, b)), 0.0) for b in q])
                if p - base * len(q) > 0 and not any(rest):  # no ring bytes to this cell's ToRs: evenly
                    rest = _split(p - base * len(q), [1.0] * len(q))
                for b, n in zip(q, rest):
                    alloc[a][b] = base + n
    c: dict[int, dict[int, int]] = {t: {} for t in tors}
    for a in tors:
        for b, n in alloc[a].items():
            m = min(n, alloc[b].get(a, 0))
            if m > 0:
                c[a][b] = m
    return c


def _stage_estimates(stage_dem: list, cell_of: dict[int, int], R: float, c: dict[int, dict[int, int]],
                     sh: dict) -> list[tuple[str, float]]:
    """train_plan's estimated time of each stage on circuits ``c`` (its docstring's step 3)."""
    out = []
    for name, t_srv, td in stage_dem:
        t = t_srv
        for (a, b), v in td.items():
            if a not in cell_of or b not in cell_of:
                continue
            w = _width(c, a, b, sh if cell_of[a] != cell_of[b] else {})
            t = max(t, v / (w * R) if w > 0 else math.inf)
        out.append((name, t))
    return out


@functools.lru_cache(maxsize=64)
def train_plan(spec: FabricSpec, tt: TrainTraffic) -> TrainPlan:
    """Allot the trainer ToRs' uplinks from training's traffic (pure). TopoOpt splits a server's degree
    between model-parallel traffic and the AllReduce rings in proportion to their traffic; MixNet gives the
    bottleneck pairs of the all-to-all direct circuits. Here, at ToR granularity and for stages that run one
    after the other (each may borrow the others' circuits over two hops):

    1. Cells: trainer ToRs joined by EP all-to-all or PP point-to-point traffic (:func:`_cells`).
    2. A ToR of a multi-ToR cell puts ``C`` uplinks into circuits inside its cell (spread over its cell
       peers); the other ``U - C`` go to the cells its DP rings hop to, in proportion to the ring bytes
       toward each. Toward an adjacent cell a ToR first gives ``base`` circuits to every one of its ToRs
       (the all-to-all's two-hop paths through that cell, and the rings' detours), then the rest in
       proportion to its ring bytes to each (the direct ring hops). A one-ToR cell has no ``C``.
    3. ``(C, base)`` minimises the sum of the stages' estimated times: each the larger of its non-blocking
       time (the busiest server link) and its slowest ToR pair, bytes over :func:`_width` (a cell's own
       circuits shared by the detours of every adjacent cell while the rings run). Within PLAN_TIE of the
       best, the most direct circuits (largest ``C``, then ``base``) win: the estimate's two-hop paths are
       the idealised part.
    """
    spt = spec.servers_per_tor
    U = spec.uplinks_per_tor
    R = spec.uplink_gbps * GBPS
    tors = sorted({s // spt for s in tt.layout.servers})
    cells = _cells(spt, tors, tt)
    cell_of = {t: i for i, c in enumerate(cells) for t in c}
    stage_dem = []  # (name, non-blocking time, ToR-level demand with two-way rings)
    for st in tt.stages:
        dem = st.demands(two_way=True)
        stage_dem.append((st.name, stage_server_bound_s(spec, dem), _tor_demand(spt, dem)))
    ring_bytes, adj_w = _ring_weights(cells, cell_of, stage_dem)
    multi = any(len(c) > 1 for c in cells)

    def counts(C: int, base: int) -> dict[int, dict[int, int]] | None:
        return _cell_counts(tors, cells, adj_w, ring_bytes, U, C, base)

    # while the rings run, a cell's own circuits carry the detours of every adjacent cell
    share: dict[tuple[int, int], float] = {(a, b): 1.0 / len(adj_w[g]) for g, cell in enumerate(cells)
                                           if len(cell) > 1 and len(adj_w[g]) > 1 for a in cell for b in cell}

    def estimate(c: dict[int, dict[int, int]], sh: dict) -> list[tuple[str, float]]:
        return _stage_estimates(stage_dem, cell_of, R, c, sh)

    scored: list[tuple[int, int, float]] = []
    seen: set[int] = set()

    def score(Cs) -> None:
        for C in Cs:
            if C in seen or not 0 <= C <= U:
                continue
            seen.add(C)
            for base in range(U + 1):
                c = counts(C, base)
                if c is None:
                    break
                scored.append((C, base, sum(t for _, t in estimate(c, share))))

    # every other C, then the neighbours of the best ones (the estimate is smooth in C)
    score(range(0, U + 1, 2) if multi else [0])
    if multi:
        low = min(t for _, _, t in scored)
        score([C + d for C, _, t in scored if t <= low * (1 + 4 * PLAN_TIE) for d in (-1, 1)])
    low = min(t for _, _, t in scored)
    C, base, _ = max((k for k in scored if k[2] <= low * (1 + PLAN_TIE)), key=lambda k: (k[0], k[1]))
    best_c = counts(C, base)
    circuits = tuple((a, b, n) for a in tors for b, n in sorted(best_c[a].items()) if a < b)
    return TrainPlan(tuple(cells), circuits, C if multi else 0, base, tuple(estimate(best_c, share)),
                     tuple(scored))


#: the parts of a train step that may each get their own topology (:func:`train_part_matchings`): "mp", the
#: model-parallel stages (EP all-to-all, PP point-to-point), which run inside every micro-batch's forward and
#: backward passes; "dp", the gradient all-reduce, which runs once after the last backward pass.
TRAIN_PARTS = ("mp", "dp")


def topology_name(phase: str | None, part: str | None = None) -> str | None:
    """The name of the topology a phase (and part of the train step) is installed with: the phase's own
    name, or ``train:mp`` / ``train:dp`` (the names RLSim's reconfiguration keys and the phase model use)."""
    return phase if part is None or phase is None else f"{phase}:{part}"


def split_topology(name: str) -> tuple[str, str | None]:
    """``topology_name``'s inverse: ``"train:dp"`` -> ``("train", "dp")``, ``"gen"`` -> ``("gen", None)``."""
    phase, _, part = name.partition(":")
    return phase, part or None


def train_part_traffic(traffic: "PhaseTraffic", part: str) -> "PhaseTraffic | None":
    """``traffic`` with training's stages cut to one part of the step (TRAIN_PARTS); None when that part
    sends nothing (a dense model has no model-parallel part)."""
    if part not in TRAIN_PARTS:
        raise SpecError("part", f"must be one of {', '.join(TRAIN_PARTS)}, got {part!r}")
    stages = tuple(st for st in traffic.train.stages if (st.name == "dp_allreduce") == (part == "dp"))
    if not stages:
        return None
    return replace(traffic, train=replace(traffic.train, stages=stages))


def train_part_matchings(spec: FabricSpec, layout: JobLayout, traffic: "PhaseTraffic",
                         part: str) -> dict[int, Matching] | None:
    """The train topology built from one part of training's traffic alone (pure; None: that part sends
    nothing). Re-wiring between the parts gives each all of a ToR's uplinks instead of a split between them
    (the all-to-all's circuits to the EP partner ToRs, then the rings'), for one switching time per step;
    RLSim's ``train_rewire`` weighs it with :func:`controller.switching.decide_switch`. The model-parallel
    part's topology is not one connected graph: its cells take every uplink they can use, so it suits a
    synchronous iteration only (nothing crosses cells while the forward and backward passes run; in the
    async mode generation streams to the trainers beside them). The rings' part is joined. The controller
    installs a part on ``POST /phase {"phase": "train", "part": ...}`` (scenario ``controller.train_rewire``:
    the live loop re-wires inside the train phase as RLSim does); otherwise the one train topology
    (:func:`phase_matchings`)."""
    one = train_part_traffic(traffic, part)
    if one is None:
        return None
    layout.check(spec)
    if part == "dp":
        # the rings' own plan where it is estimated faster for them than the whole step's, whose cells lend
        # the rings their circuits for detours (with few uplinks a ToR alone may not reach every ring hop)
        own = dict(train_plan(spec, one.train).estimate_s)["dp_allreduce"]
        whole = dict(train_plan(spec, traffic.train).estimate_s)["dp_allreduce"]
        return dict(_phase_matchings(spec, layout, "train", one if own < whole else traffic))
    # the model-parallel part: its traffic stays inside the cells, which may take every uplink; the ToR graph
    # is not joined (nothing else crosses cells while it runs in a synchronous iteration)
    return dict(_phase_matchings(spec, layout, "train", one, False))


def _build_train(spec: FabricSpec, layout: JobLayout, circ: _Circuits, tt: TrainTraffic, join: bool = True) -> None:
    """The train topology: :func:`train_plan`'s circuits among the trainer ToRs (those inside cells
    first), the generation pods isolated as in the gen phase (generation runs beside training in the async
    mode), then every ToR joined into one connected graph (:func:`_connect_all`)."""
    plan = train_plan(spec, tt)
    cell_of = {t: i for i, c in enumerate(plan.cells) for t in c}
    lost = 0
    # one circuit per bundle at a time, so a bundle that cannot be placed in full loses its last circuits
    todo = sorted(plan.circuits, key=lambda abn: (cell_of[abn[0]] != cell_of[abn[1]], abn[0], abn[1]))
    left = {(a, b): n for a, b, n in todo}
    while left:
        for a, b, _ in todo:
            if left.get((a, b)):
                lost += not circ.place(a, b)
                left[(a, b)] -= 1
                if not left[(a, b)]:
                    del left[(a, b)]
    if lost:
        log.debug("train phase: %d planned circuits found no common free OCS port", lost)
    for p in layout.gen_pods:
        _round_robin(circ, list(spec.tors_in_pod(p)))
    if join:
        _connect_all(spec, circ)


def _connect_all(spec: FabricSpec, circ: _Circuits) -> None:
    """Join the ToR graph into one component: over free ports on a common OCS where there are some, else by
    re-pairing two parallel circuits of different components on one OCS (a-b, c-d -> a-c, b-d: no ToR
    loses a port, each bundle keeps a circuit; the widest bundles give theirs). Logs a warning when
    neither is possible."""
    oc = spec.ocs_count
    while True:
        parent = list(range(spec.n_tors))

        def find(x: int) -> int:
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        for (a, _), (b, _) in circ.circ.items():
            ra, rb = find(a), find(b)
            if ra != rb:
                parent[ra] = rb
        comp = [find(t) for t in range(spec.n_tors)]
        roots = sorted(set(comp), key=lambda r: min(t for t in range(spec.n_tors) if comp[t] == r))
        if len(roots) <= 1:
            return
        free: dict[int, dict[int, tuple[int, int]]] = {r: {} for r in roots}  # comp -> OCS -> (tor, u)
        for t in range(spec.n_tors):
            if circ.n_free[t]:
                for u in range(spec.uplinks_per_tor):
                    if circ.free(t, u):
                        free[comp[t]].setdefault(u % oc, (t, u))
        mult: dict[tuple[int, int], int] = {}
        for (a, _), (b, _) in circ.circ.items():
            if a < b:
                mult[(a, b)] = mult.get((a, b), 0) + 1
        par: dict[int, dict[int, list[tuple[int, int, int, int]]]] = {r: {} for r in roots}  # comp -> OCS -> circuits
        for (a, ua), (b, ub) in sorted(circ.circ.items()):
            if a < b and mult[(a, b)] > 1:
                par[comp[a]].setdefault(ua % oc, []).append((a, ua, b, ub))
        given: dict[int, int] = {}  # circuits a ToR gave up for a join: spread them over the ToRs

        def pick(cands: list[tuple[int, int, int, int]]) -> tuple[int, int, int, int] | None:
            live = [c for c in cands if mult[(c[0], c[2])] > 1 and circ.circ.get((c[0], c[1])) == (c[2], c[3])]
            if not live:
                return None
            return max(live, key=lambda c: (mult[(c[0], c[2])] - given.get(c[0], 0) - given.get(c[2], 0), -c[0], -c[2]))

        A, joined = roots[0], 0
        for B in roots[1:]:  # join every other component to A in one pass (A's tables absorb B's)
            common = sorted(set(free[A]) & set(free[B]))
            if common:
                o = common[0]
                (a, ua), (b, ub) = free[A].pop(o), free[B].pop(o)
                circ.add(a, ua, b, ub)
            else:
                best = None
                for o in sorted(set(par[A]) & set(par[B])):
                    ca, cb = pick(par[A][o]), pick(par[B][o])
                    if ca and cb:
                        score = mult[(ca[0], ca[2])] + mult[(cb[0], cb[2])] - sum(given.get(t, 0) for t in (*ca[::2], *cb[::2]))
                        if best is None or score > best[0]:
                            best = (score, ca, cb)
                if best is None:
                    continue
                (a, ua, b, ub), (c, uc, d, ud) = best[1], best[2]
                circ.remove(a, ua)
                circ.remove(c, uc)
                circ.add(a, ua, c, uc)
                circ.add(b, ub, d, ud)
                for x, y in ((a, b), (c, d)):
                    mult[(x, y)] -= 1
                    given[x] = given.get(x, 0) + 1
                    given[y] = given.get(y, 0) + 1
            joined += 1
            for o, v in free[B].items():
                free[A].setdefault(o, v)
            for o, v in par[B].items():
                par[A].setdefault(o, []).extend(v)
        if not joined:
            log.warning("phase topology: %d ToR components cannot be joined (no free or parallel ports on a "
                        "common OCS)", len(roots))
            return


@dataclass(frozen=True)
class SyncChain:
    """One pipelined chain of the weight broadcast, at server level.

    ``sources``: (server, share of the weights it sends the head); a trainer server, or, where a relay tree
    branches (never on the sync phase's own topology), a generator server of an earlier chain (share 1).
    ``members``: generator servers in relay order (``members[0]`` is the head); each relays the whole
    weights to the next. Every hop (source -> head, member -> next) rides a circuit or stays under one ToR.
    """

    sources: tuple[tuple[int, float], ...]
    members: tuple[int, ...]


def stripe_plan(gen_servers: list[int], groups: list[list[int]], n_chains: int,
                k_stripes: int) -> list[tuple[list[tuple[int, float]], list[int]]]:
    """The weight-sync plan of a fabric without phase circuits (a packet tree): ``(sources, members)``
    per chain. The generator servers split into ``n_chains`` contiguous chains; chain ``d``'s head pulls
    ``1/k_stripes`` of the weights from ``k_stripes`` holders, one from each of the groups (trainer ToRs)
    ``d .. d+k-1`` (round robin), the holder within a group round robin over the chains; each member relays
    the whole weights to the next. ``groups``: the holders (opaque ids: replicas or servers) per trainer
    ToR."""
    G = len(groups)
    out = []
    for d in range(n_chains):
        members = gen_servers[d * len(gen_servers) // n_chains:(d + 1) * len(gen_servers) // n_chains]
        sources = []
        for k in range(k_stripes):
            grp = groups[(d + k) % G]
            sources.append((grp[(d // G) % len(grp)], 1.0 / k_stripes))
        out.append((sources, list(members)))
    return out


def _holders_by_tor(spec: FabricSpec, trainers: list[int], holders: Iterable[int] | None) -> dict[int, list[int]]:
    """sync_chains' holders per trainer ToR (default: every server of the trainer ToRs); SpecError (field
    ``holders``) for a server that is no trainer's, or when none holds the weights."""
    train_set = set(trainers)
    if holders is None:
        holders = [s for t in trainers for s in spec.servers_on_tor(t)]
    by_tor: dict[int, list[int]] = {}
    for h in sorted(set(holders)):
        t = spec.tor_of_server(h)
        if t not in train_set:
            raise SpecError("holders", f"server {h} is not a trainer server")
        by_tor.setdefault(t, []).append(h)
    if not by_tor:
        raise SpecError("holders", "no trainer server holds the weights")
    return by_tor


def _feed_order(fed: list[int], circuits_to: Callable[[int], dict[int, int]]) -> tuple[list[int], dict[int, int]]:
    """Breadth first from the ToRs fed by trainer circuits (depth 0) over generator circuits: the ToRs in the
    order reached, and each later one's parent (the reached ToR with most circuits to it, then the lowest)."""
    order = list(fed)
    parent: dict[int, int] = {}
    seen = set(order)
    q = deque(order)
    while q:
        x = q.popleft()
        for y, c in sorted(circuits_to(x).items(), key=lambda kv: (-kv[1], kv[0])):
            if y not in seen:
                seen.add(y)
                parent[y] = x
                order.append(y)
                q.append(y)
    return order, parent


def _interleave(counts: Mapping[int, int]) -> list[int]:
    """Each key as many times as its count, interleaved in key order (``{1: 2, 3: 1}`` -> ``[1, 3, 1]``)."""
    dealt: list[int] = []
    left = dict(counts)
    while left:
        for i in sorted(left):
            dealt.append(i)
            left[i] -= 1
            if not left[i]:
                del left[i]
    return dealt


def sync_chains(spec: FabricSpec, layout: JobLayout, matchings: Mapping[int, Matching],
                holders: Iterable[int] | None = None) -> tuple[SyncChain, ...]:
    """The weight-sync plan on ``matchings`` (normally the ``sync`` phase's): every generator server is in
    exactly one chain. ``holders``: the trainer servers that hold a full copy (default: every server of the
    trainer pods); a trainer ToR without one feeds nothing.

    A generator ToR fed by ``f`` circuits from trainer ToRs runs ``m = clamp(f * uplink_gbps / server_gbps,
    1, servers_per_tor)`` chains over its servers (as many as its circuits can feed at the server rate; with
    fewer circuits one chain relays through the ToR's servers). Its circuits are dealt to those chains round
    robin over the feeding trainer ToRs, and each trainer ToR's circuits round robin over its holders, so
    the feeds spread over trainer ToRs and servers; a chain head's share from a source is that source's
    share of the chain's circuits. A generator ToR without a trainer circuit is reached over generator
    circuits (breadth first from the fed ones): its servers extend a chain ending in its parent ToR, or,
    when none is left to extend, start one fed by a server of the parent. Raises SpecError (field
    ``matchings``) when some generator ToR has no such path."""
    layout.check(spec)
    graph = circuit_graph(spec, matchings)
    spt = spec.servers_per_tor
    trainers = [t for p in sorted(layout.train_pods) for t in spec.tors_in_pod(p)]
    gens = [t for p in sorted(layout.gen_pods) for t in spec.tors_in_pod(p)]
    gen_set = set(gens)
    by_tor = _holders_by_tor(spec, trainers, holders)

    def circuits_from(j: int, pool: set[int]) -> dict[int, int]:
        out: dict[int, int] = {}
        for _, peer, _ in graph.edges(j):
            if peer in pool:
                out[peer] = out.get(peer, 0) + 1
        return out

    def n_chains(f: int) -> int:
        return max(1, min(spt, int(f * spec.uplink_gbps // spec.server_gbps)))

    def groups(tor: int, m: int) -> list[list[int]]:
        srv = list(spec.servers_on_tor(tor))
        return [srv[k * len(srv) // m:(k + 1) * len(srv) // m] for k in range(m)]

    feeds = {j: circuits_from(j, set(by_tor)) for j in gens}
    order, parent = _feed_order([j for j in gens if feeds[j]], lambda x: circuits_from(x, gen_set))
    seen = set(order)
    missing = [j for j in gens if j not in seen]
    if missing:
        raise SpecError("matchings", f"generator ToRs {missing[:8]}{' ...' if len(missing) > 8 else ''} have "
                                     "no circuit path from a trainer ToR holding the weights")

    chains: list[tuple[list[tuple[int, float]], list[int]]] = []
    open_tails: dict[int, list[int]] = {}  # generator ToR -> chains ending there, not extended yet
    relay_use: dict[int, int] = {}  # generator server -> chains it feeds
    ptr = {t: 0 for t in by_tor}  # round robin over each trainer ToR's holders
    for j in order:
        if j not in parent:  # fed by trainer circuits
            fj = feeds[j]
            m = n_chains(sum(fj.values()))
            dealt = _interleave(fj)
            for k, members in enumerate(groups(j, m)):
                mine = dealt[k::m]
                count: dict[int, int] = {}
                for i in mine:
                    h = by_tor[i][ptr[i] % len(by_tor[i])]
                    ptr[i] += 1
                    count[h] = count.get(h, 0) + 1
                chains.append(([(h, c / len(mine)) for h, c in sorted(count.items())], members))
                open_tails.setdefault(j, []).append(len(chains) - 1)
            continue
        p = parent[j]
        for members in groups(j, n_chains(circuits_from(j, {p})[p])):
            if open_tails.get(p):
                idx = open_tails[p].pop()
                chains[idx][1].extend(members)
            else:
                src = min(spec.servers_on_tor(p), key=lambda s: (relay_use.get(s, 0), -s))
                relay_use[src] = relay_use.get(src, 0) + 1
                chains.append(([(src, 1.0)], list(members)))
                idx = len(chains) - 1
            open_tails.setdefault(j, []).append(idx)
    return tuple(SyncChain(tuple(src), tuple(mem)) for src, mem in chains)


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
