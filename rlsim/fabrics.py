"""Fabric models at server granularity: links with capacities and the paths a server-to-server demand takes.

Every fabric has one up and one down link per server (``server_gbps``: all of a server's NICs, used evenly
by rank-aligned collectives). Above the servers:

* ``fat-tree`` (and ``fat-tree-2to1`` .. ``fat-tree-16to1``): three tiers (ToR, pod aggregation, core) as
  aggregated pipes with ideal ECMP: ToR up/down of ``servers_per_tor * server_gbps / oversub`` and pod up/down
  of ``tors_per_pod`` times that (non-blocking above the ToR).
* ``rail``: rail-optimised: the same-rank NICs of a whole pod hang off one rail switch per rank, so a pod is
  one hop (rank-aligned traffic never crosses a ToR tier); pods meet at a non-blocking spine.
* ``topoopt``: one static direct-connect ToR topology for the whole job (set once by an OCS, and priced as
  OCS ports; a patch panel would be cheaper: docs/rlsim.md gives that sensitivity), built
  for the training ring: ring neighbours among the trainer ToRs get the circuits one server's ring traffic
  needs, the rest of the uplinks form power-of-two strides over all ToRs (TopoOpt's TotientPerms idea).
* ``mixnet``: a packet fabric on part of each ToR's uplinks (``1 - ocs_fraction``) beside a regional OCS per
  pod on the rest, whose circuits form a ring over the pod's ToRs. Modelled static for the job: the same
  ring serves every phase, so there is nothing to re-wire (and T_ocs does not matter).
* ``rfabric``: the ToR uplinks go to the OCSes of the FabricSpec, wired per phase by the controller's own
  phase topologies (``controller.phases``: train mesh, pod-isolated generation, sync broadcast tree).

Direct-connect fabrics (topoopt, mixnet's OCS part, rfabric) forward through ToRs: a demand between ToRs
``a`` and ``b`` uses the direct circuit bundle (if any) plus up to ``max_two_hop`` two-hop paths through
common neighbours, or the shortest path when there is neither. A bundle of ``c`` circuits is one link of
``c * uplink_gbps`` (ideal spraying over its circuits).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from controller.fabric_rules import BUILTIN
from controller.phases import circuit_graph, split_topology
from emulation.spec import FABRICS, OVERSUB, FabricSpec, JobLayout  # noqa: F401 - FABRICS, OVERSUB: re-exported
from emulation.validation import SpecError


GBPS = 1e9 / 8  # bytes/s per Gb/s
FAT_TREE_TIERS = ("auto", "2", "3")
# what each tier count means (rlsim.cost counts the ports; docs/rlsim.md)
TIER_METHODS = {"auto": "radix: the fewest tiers of switch_radix-port switches that cover the NICs",
                "2": "two tiers (ToR + spine)",
                "3": "the MixNet calculator's method: ToR, aggregation and core tiers from the uplink ratio"}


class Unreachable(SpecError):
    """A demand has no path on a network (e.g. a phase topology that does not carry another phase)."""


@dataclass(frozen=True)
class FabricOptions:
    max_two_hop: int = 8  # two-hop paths per ToR pair on direct-connect fabrics
    mixnet_ocs_fraction: float = 0.5  # MixNet: share of ToR uplinks on the regional OCS
    # Tiers of the packet fabrics (Fat-Tree, MixNet's packet part) for the cost model (TIER_METHODS): "auto"
    # (default: the fewest tiers that cover the NICs with switch_radix-port switches), "2" (ToR + spine), "3"
    # (the MixNet calculator's method, REFERENCE.md: ToR, pod aggregation and core with several pods).
    fat_tree_tiers: str = "auto"
    switch_radix: int | None = None  # ports per packet switch for "auto"; None: prices.yaml's switch_radix

    def __post_init__(self) -> None:
        if self.fat_tree_tiers not in FAT_TREE_TIERS:
            raise SpecError("fat_tree_tiers", f"must be one of {', '.join(FAT_TREE_TIERS)}, got {self.fat_tree_tiers!r}")
        if self.switch_radix is not None and not (isinstance(self.switch_radix, int)
                                                  and not isinstance(self.switch_radix, bool)
                                                  and 4 <= self.switch_radix <= 4096):
            raise SpecError("switch_radix", f"must be an integer in 4..4096, got {self.switch_radix!r}")
        if not (isinstance(self.max_two_hop, int) and self.max_two_hop >= 0):
            raise SpecError("max_two_hop", f"must be an integer >= 0, got {self.max_two_hop!r}")
        if not 0 < self.mixnet_ocs_fraction < 1:
            raise SpecError("mixnet_ocs_fraction", f"must be in (0, 1), got {self.mixnet_ocs_fraction}")


class Network:
    """Links (capacity in bytes/s) and paths between servers."""

    def __init__(self, name: str, spec: FabricSpec):
        self.name = name
        self.spec = spec
        ns = spec.n_servers
        self._cap: list[float] = [spec.server_gbps * GBPS] * (2 * ns)
        self.labels: list[str] = [f"srv{s}-up" for s in range(ns)] + [f"srv{s}-down" for s in range(ns)]
        self._cache: dict[tuple[int, int], list[list[int]]] = {}

    def add_link(self, gbps: float, label: str) -> int:
        self._cap.append(gbps * GBPS)
        self.labels.append(label)
        return len(self._cap) - 1

    @property
    def capacity(self) -> np.ndarray:
        return np.asarray(self._cap, dtype=float)

    def server_up(self, s: int) -> int:
        return s

    def server_down(self, s: int) -> int:
        return self.spec.n_servers + s

    def paths(self, src: int, dst: int) -> list[list[int]]:
        """Subflow paths (link ids) for a demand from server ``src`` to server ``dst`` (cached per ToR pair)."""
        if src == dst:
            return []
        ta, tb = src // self.spec.servers_per_tor, dst // self.spec.servers_per_tor
        mid = [] if ta == tb else self._tor_paths(ta, tb)
        if ta != tb and not mid:
            raise Unreachable("fabric", f"{self.name}: no path from ToR {ta} to ToR {tb}")
        ends = (self.server_up(src), self.server_down(dst))
        if ta == tb:
            return [[ends[0], ends[1]]]
        return [[ends[0], *p, ends[1]] for p in mid]

    def reachable(self, src: int, dst: int) -> bool:
        try:
            self.paths(src, dst)
        except Unreachable:
            return False
        return True

    def _tor_paths(self, a: int, b: int) -> list[list[int]]:
        raise NotImplementedError


class TreeNetwork(Network):
    """Fat-tree / rail: aggregated up/down pipes per group and per pod."""

    def __init__(self, name: str, spec: FabricSpec, oversub: float, group_is_pod: bool):
        super().__init__(name, spec)
        self.group_is_pod = group_is_pod
        tor_gbps = spec.servers_per_tor * spec.server_gbps / oversub
        pod_gbps = spec.tors_per_pod * tor_gbps
        self.tor_up = self.tor_down = None
        if not group_is_pod:
            self.tor_up = [self.add_link(tor_gbps, f"tor{t}-up") for t in range(spec.n_tors)]
            self.tor_down = [self.add_link(tor_gbps, f"tor{t}-down") for t in range(spec.n_tors)]
        self.pod_up = [self.add_link(pod_gbps, f"pod{p}-up") for p in range(spec.pods)]
        self.pod_down = [self.add_link(pod_gbps, f"pod{p}-down") for p in range(spec.pods)]

    def _tor_paths(self, a: int, b: int) -> list[list[int]]:
        key = (a, b)
        if key not in self._cache:
            pa, pb = a // self.spec.tors_per_pod, b // self.spec.tors_per_pod
            path: list[int] = []
            if not self.group_is_pod:
                path.append(self.tor_up[a])
            if pa != pb:
                path += [self.pod_up[pa], self.pod_down[pb]]
            if not self.group_is_pod:
                path.append(self.tor_down[b])
            self._cache[key] = [path]
        return self._cache[key]


class CircuitNetwork(Network):
    """Direct-connect ToR graph (circuit counts per ToR pair), optionally beside a packet fabric (MixNet)."""

    def __init__(self, name: str, spec: FabricSpec, counts: np.ndarray, max_two_hop: int,
                 eps_uplink_gbps: float = 0.0, matchings: dict | None = None):
        super().__init__(name, spec)
        self.matchings = matchings  # RFabric: the OCS matchings behind ``counts`` (the sync plan reads them)
        n = spec.n_tors
        if counts.shape != (n, n) or (counts != counts.T).any() or (np.diag(counts) != 0).any():
            raise ValueError("circuit counts must be a symmetric n_tors x n_tors matrix with a zero diagonal")
        self.counts = counts
        self.max_two_hop = max_two_hop
        self.bundle: dict[tuple[int, int], int] = {}
        for a, b in zip(*np.nonzero(counts)):
            self.bundle[(int(a), int(b))] = self.add_link(float(counts[a, b]) * spec.uplink_gbps, f"tor{a}->tor{b}")
        self.eps = eps_uplink_gbps > 0
        if self.eps:
            tor_gbps = eps_uplink_gbps
            pod_gbps = spec.tors_per_pod * tor_gbps
            self.eps_tor_up = [self.add_link(tor_gbps, f"eps-tor{t}-up") for t in range(n)]
            self.eps_tor_down = [self.add_link(tor_gbps, f"eps-tor{t}-down") for t in range(n)]
            self.eps_pod_up = [self.add_link(pod_gbps, f"eps-pod{p}-up") for p in range(spec.pods)]
            self.eps_pod_down = [self.add_link(pod_gbps, f"eps-pod{p}-down") for p in range(spec.pods)]
        self._nbrs = [np.nonzero(counts[t])[0] for t in range(n)]

    def _tor_paths(self, a: int, b: int) -> list[list[int]]:
        key = (a, b)
        if key in self._cache:
            return self._cache[key]
        paths: list[list[int]] = []
        if (a, b) in self.bundle:
            paths.append([self.bundle[(a, b)]])
        common = np.intersect1d(self._nbrs[a], self._nbrs[b], assume_unique=True)
        if len(common):
            width = np.minimum(self.counts[a, common], self.counts[common, b])
            order = np.lexsort((common, -width))[: self.max_two_hop]
            paths += [[self.bundle[(a, int(m))], self.bundle[(int(m), b)]] for m in common[order]]
        if not paths:
            hop = self._shortest(a, b)
            if hop:
                paths.append([self.bundle[(x, y)] for x, y in zip(hop, hop[1:])])
        if self.eps:
            pa, pb = a // self.spec.tors_per_pod, b // self.spec.tors_per_pod
            p = [self.eps_tor_up[a]]
            if pa != pb:
                p += [self.eps_pod_up[pa], self.eps_pod_down[pb]]
            p.append(self.eps_tor_down[b])
            paths.append(p)
        self._cache[key] = paths
        return paths

    def direct_paths(self, src: int, dst: int) -> list[list[int]]:
        """The one path of a planned hop (a weight-sync chain's): under one ToR, or over the direct circuit
        bundle between the two ToRs (no detour). Unreachable when the ToRs share no circuit."""
        if src == dst:
            return []
        ta, tb = src // self.spec.servers_per_tor, dst // self.spec.servers_per_tor
        ends = (self.server_up(src), self.server_down(dst))
        if ta == tb:
            return [[ends[0], ends[1]]]
        if (ta, tb) not in self.bundle:
            raise Unreachable("fabric", f"{self.name}: no circuit from ToR {ta} to ToR {tb}")
        return [[ends[0], self.bundle[(ta, tb)], ends[1]]]

    def _shortest(self, a: int, b: int) -> list[int] | None:
        prev = {a: -1}
        q = deque([a])
        while q:
            x = q.popleft()
            if x == b:
                break
            for y in self._nbrs[x]:
                y = int(y)
                if y not in prev:
                    prev[y] = x
                    q.append(y)
        if b not in prev:
            return None
        path = [b]
        while prev[path[-1]] != -1:
            path.append(prev[path[-1]])
        return path[::-1]


# ---- circuit topologies ------------------------------------------------------------------------
def ring_counts(n_total: int, members: Sequence[int], strides: Sequence[tuple[int, int]]) -> np.ndarray:
    """Circuit counts for rings over ``members`` (in order): ``strides`` lists (stride, multiplicity); each
    (stride, m) uses ``2 m`` ports per member (m circuits to the member ``stride`` ahead, m behind)."""
    c = np.zeros((n_total, n_total), dtype=np.int64)
    n = len(members)
    if n < 2:
        return c
    for s, m in strides:
        if m <= 0 or s % n == 0:
            continue
        for i in range(n):
            a, b = members[i], members[(i + s) % n]
            c[a, b] += m
            c[b, a] += m
    if n == 2:  # the pair is both "ahead" and "behind": the loop counted it twice
        c //= 2
    return c


def _ring_plan(n: int, ports: int, ring_mult: int) -> list[tuple[int, int]]:
    """Stride 1 with ``ring_mult`` circuits each way, then strides 2, 4, 8, ... with the ports left."""
    if n < 2 or ports < 2:
        return []
    m1 = max(1, min(ring_mult, ports // 2))
    plan = [(1, m1)]
    left = ports - 2 * m1
    s = 2
    while left >= 2 and s < (n + 1) // 2 + 1 and s < n:
        plan.append((s, 1))
        left -= 2
        s *= 2
    if left >= 2:
        plan[0] = (1, m1 + left // 2)
    return plan


def topoopt_counts(spec: FabricSpec, layout: JobLayout) -> np.ndarray:
    """TopoOpt-like static topology: trainer ring (stride 1, as wide as one server's ring traffic), a
    generator ring, and power-of-two strides over all ToRs with the remaining uplinks."""
    d = spec.uplinks_per_tor
    train = [t for p in sorted(layout.train_pods) for t in spec.tors_in_pod(p)]
    gen = [t for p in sorted(layout.gen_pods) for t in spec.tors_in_pod(p)]
    need = int(np.ceil(spec.server_gbps / spec.uplink_gbps))  # circuits one server's ring flow needs
    if d < 4:  # too few ports for separate rings: one ring plan over every ToR
        return ring_counts(spec.n_tors, train + gen, _ring_plan(spec.n_tors, d, need))
    own = max(1, min(need, (d // 2) // 2))  # half the ports (at most) for the role rings
    c = ring_counts(spec.n_tors, train, [(1, own)]) + ring_counts(spec.n_tors, gen, [(1, own)])
    rest = d - 2 * own
    strides: list[tuple[int, int]] = []
    s, n = 1, spec.n_tors
    while rest >= 2 and s < n:
        strides.append((s, 1))
        rest -= 2
        s *= 2
    if rest >= 2 and strides:
        strides[0] = (1, strides[0][1] + rest // 2)
    return c + ring_counts(spec.n_tors, train + gen, strides)


def mixnet_counts(spec: FabricSpec, ocs_uplinks: int) -> np.ndarray:
    """MixNet regional OCS: per pod, a ring over its ToRs using ``ocs_uplinks`` ports per ToR."""
    c = np.zeros((spec.n_tors, spec.n_tors), dtype=np.int64)
    for p in range(spec.pods):
        tors = list(spec.tors_in_pod(p))
        c += ring_counts(spec.n_tors, tors, _ring_plan(len(tors), ocs_uplinks, ocs_uplinks // 2))
    return c


def rfabric_counts(spec: FabricSpec, layout: JobLayout, phase: str, traffic=None, rule=None) -> tuple[np.ndarray, dict]:
    """Circuit counts of RFabric in ``phase``, from the fabric rule's phase topologies (``traffic``:
    ``controller.traffic.phase_traffic`` of the workload, what the train topology is built from; ``rule``:
    controller.fabric_rules, None: the built-in), and the matchings."""
    matchings = (rule or BUILTIN).matchings(spec, layout, phase, traffic)
    return circuit_counts(spec, matchings), matchings


def rfabric_network(spec: FabricSpec, layout: JobLayout, topology: str, traffic, max_two_hop: int,
                    rule=None) -> tuple[CircuitNetwork, dict]:
    """RFabric on the topology named ``topology`` (``controller.phases.topology_name``: a phase's, or
    ``train:mp`` / ``train:dp``, one part of a train step with model-parallel traffic) by the fabric's phase
    ``rule`` (controller.fabric_rules; None: the built-in), and its matchings."""
    phase, part = split_topology(topology)
    if part is None:
        counts, m = rfabric_counts(spec, layout, phase, traffic, rule)
    else:
        m = (rule or BUILTIN).part_matchings(spec, layout, traffic, part)
        counts = circuit_counts(spec, m)
    return CircuitNetwork("rfabric", spec, counts, max_two_hop, matchings=m), m


def circuit_counts(spec: FabricSpec, matchings) -> np.ndarray:
    """Circuits between every ToR pair (``c[a, b]``) that OCS ``matchings`` make."""
    graph = circuit_graph(spec, matchings)
    c = np.zeros((spec.n_tors, spec.n_tors), dtype=np.int64)
    for t in range(spec.n_tors):
        for _, peer, _ in graph.edges(t):
            c[t, peer] += 1
    return c


def mixnet_split(spec: FabricSpec, opts: FabricOptions) -> tuple[int, int]:
    """(OCS uplinks, packet uplinks) per ToR for MixNet."""
    ocs = int(round(spec.uplinks_per_tor * opts.mixnet_ocs_fraction))
    ocs = min(max(ocs, 1), spec.uplinks_per_tor - 1) if spec.uplinks_per_tor > 1 else 0
    return ocs, spec.uplinks_per_tor - ocs


def _structural_tiers_above_tor(spec: FabricSpec) -> int:
    if spec.n_tors == 1:
        return 0
    if spec.pods == 1 or spec.tors_per_pod == 1:
        return 1
    return 2


def radix_tiers(n_endpoints: int, radix: int, oversub: float = 1.0) -> int:
    """Fewest switch tiers of a folded Clos of ``radix``-port switches that cover ``n_endpoints`` NIC ports:
    a leaf has ``d = radix * o / (1 + o)`` ports down; 1 tier covers ``radix``, 2 tiers ``radix * d`` (a spine
    of radix ports reaches radix leaves), each further tier multiplies by ``radix / 2``."""
    if radix < 2:
        raise SpecError("prices.switch_radix", f"must be >= 2, got {radix}")
    if n_endpoints <= radix:
        return 1
    d = max(1, int(radix * oversub / (1 + oversub)))
    cover, tiers = radix * d, 2
    while cover < n_endpoints:
        cover *= radix // 2
        tiers += 1
    return tiers


def fat_tree_tiers_above_tor(spec: FabricSpec, n_nic: int, oversub: float, opts: FabricOptions,
                             prices) -> int:
    """Packet tiers above the ToR (``prices``: rlsim.cost.Prices, its switch radix): "auto" (from the radix, the
    default), "2" (one spine tier), "3" (the MixNet calculator's method: ToR, pod aggregation and core whenever there are several pods of several ToRs)."""
    if opts.fat_tree_tiers == "3":
        return _structural_tiers_above_tor(spec)
    if opts.fat_tree_tiers == "2":
        return min(1, _structural_tiers_above_tor(spec))
    radix = opts.switch_radix or prices.switch_radix
    return radix_tiers(n_nic, radix, oversub) - 1 if spec.n_tors > 1 else 0
