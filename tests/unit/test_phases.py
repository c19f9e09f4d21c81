"""controller.phases: phase topologies are valid matchings with the promised structure."""
import pytest

from controller.ocs import Matching
from controller.phases import (PHASES, all_pairs_reachable, bfs_depth, bisection_circuits, circuit_graph,
                               inter_pod_circuits, phase_matchings, reachable, round_order, round_pairs,
                               unchanged_matchings)
from emulation.spec import FabricSpec, JobLayout
from emulation.validation import SpecError

CASES = [  # (spec kwargs, train pods)
    (dict(pods=2, tors_per_pod=2, uplinks_per_tor=2, ocs_count=1), (0,)),
    (dict(pods=2, tors_per_pod=1, uplinks_per_tor=2, ocs_count=2), (0,)),
    (dict(pods=4, tors_per_pod=4, uplinks_per_tor=4, ocs_count=2), (0, 1)),
    (dict(pods=3, tors_per_pod=3, uplinks_per_tor=2, ocs_count=2), (0,)),
    (dict(pods=5, tors_per_pod=5, uplinks_per_tor=3, ocs_count=1), (0, 1)),
    (dict(pods=4, tors_per_pod=2, uplinks_per_tor=8, ocs_count=4), (3,)),
    (dict(pods=6, tors_per_pod=4, uplinks_per_tor=4, ocs_count=4, ocs_ports=30), (0, 1, 2)),
]


def build(kw, train):
    spec = FabricSpec(**kw)
    layout = JobLayout(tuple(train), tuple(p for p in range(spec.pods) if p not in train))
    return spec, layout


def tors_of(spec, pods):
    return [t for p in pods for t in spec.tors_in_pod(p)]


def test_round_robin_is_a_1_factorisation():
    for n in range(2, 12):
        rounds = n - 1 if n % 2 == 0 else n
        seen = set()
        for r in range(rounds):
            pairs = round_pairs(n, r)
            ends = [x for p in pairs for x in p]
            assert len(ends) == len(set(ends))  # a matching
            assert len(pairs) == n // 2
            seen |= set(pairs)
        assert len(seen) == n * (n - 1) // 2  # every pair exactly once over the rounds
    assert round_order(7, 9)[:4] == [0, 1, 2, 4] and round_order(7, 9)[7:] == [0, 1]


@pytest.mark.parametrize("kw, train", CASES)
def test_every_phase_gives_valid_matchings(kw, train):
    spec, layout = build(kw, train)
    for phase in PHASES:
        ms = phase_matchings(spec, layout, phase)
        assert sorted(ms) == list(range(spec.ocs_count))
        for o, m in ms.items():
            assert isinstance(m, Matching) and m.n_ports == spec.ports_per_ocs
            # re-validate through the user-facing path: raises on any overlap or bad port
            Matching.from_pairs(spec.ports_per_ocs, m.to_json())
            for a, b in m.pairs():  # circuits join two different ToRs' uplinks
                ua, ub = spec.ocs_port_owner(o, a), spec.ocs_port_owner(o, b)
                assert ua is not None and ub is not None and ua.tor != ub.tor


@pytest.mark.parametrize("kw, train", CASES)
def test_train_mesh_reaches_every_pair_and_beats_gen_bisection(kw, train):
    spec, layout = build(kw, train)
    tm = phase_matchings(spec, layout, "train")
    gm = phase_matchings(spec, layout, "gen")
    assert all_pairs_reachable(circuit_graph(spec, tm))
    assert bisection_circuits(spec, tm) >= bisection_circuits(spec, gm)
    assert bisection_circuits(spec, tm) > 0
    # every uplink is used when the ToR count is even
    if spec.n_tors % 2 == 0:
        assert sum(len(m) for m in tm.values()) == spec.n_tors * spec.uplinks_per_tor // 2


@pytest.mark.parametrize("kw, train", CASES)
def test_gen_isolates_pods_except_a_chain(kw, train):
    spec, layout = build(kw, train)
    gm = phase_matchings(spec, layout, "gen")
    assert inter_pod_circuits(spec, gm) == spec.pods - 1
    g = circuit_graph(spec, gm)
    for p in range(spec.pods):
        tors = list(spec.tors_in_pod(p))
        # connected inside the pod: BFS restricted to the pod's own circuits
        inside = {tors[0]}
        frontier = [tors[0]]
        while frontier:
            x = frontier.pop()
            for _, y, _ in g.edges(x):
                if y in tors and y not in inside:
                    inside.add(y)
                    frontier.append(y)
        assert inside == set(tors), f"pod {p} split"
        if len(tors) == 1:
            assert all(spec.pod_of_tor(y) != p for _, y, _ in g.edges(tors[0]))
    # the chain joins consecutive pods only
    for o, m in gm.items():
        for a, b in m.pairs():
            pa = spec.ocs_port_owner(o, a).tor // spec.tors_per_pod
            pb = spec.ocs_port_owner(o, b).tor // spec.tors_per_pod
            assert abs(pa - pb) <= 1
    assert all_pairs_reachable(g)


@pytest.mark.parametrize("kw, train", CASES)
def test_sync_reaches_every_generator_from_the_trainers(kw, train):
    spec, layout = build(kw, train)
    sm = phase_matchings(spec, layout, "sync")
    g = circuit_graph(spec, sm)
    assert reachable(g, tors_of(spec, layout.train_pods), tors_of(spec, layout.gen_pods))
    # no circuits among trainer ToRs
    trainers = set(tors_of(spec, layout.train_pods))
    assert not any(y in trainers for t in trainers for _, y, _ in g.edges(t))


@pytest.mark.parametrize("kw", [
    dict(pods=9, tors_per_pod=1, uplinks_per_tor=2, ocs_count=2),  # 2 trainer uplinks, 8 gen pods
    dict(pods=10, tors_per_pod=3, uplinks_per_tor=2, ocs_count=1),  # 2 trainer uplinks... x3 ToRs, 9 gen pods
])
def test_sync_relays_when_gen_pods_outnumber_trainer_uplinks(kw):
    spec = FabricSpec(**kw)
    layout = JobLayout((0,), tuple(range(1, spec.pods)))
    g = circuit_graph(spec, phase_matchings(spec, layout, "sync"))
    gens = tors_of(spec, layout.gen_pods)
    depth = bfs_depth(g, tors_of(spec, layout.train_pods))
    assert all(t in depth for t in gens)
    assert max(depth[t] for t in gens) > 1  # some pods are reached through other generator pods


def test_unknown_phase_and_bad_layout():
    spec = FabricSpec()
    with pytest.raises(SpecError) as e:
        phase_matchings(spec, JobLayout(), "rollout")
    assert e.value.field == "phase"
    with pytest.raises(SpecError) as e:
        phase_matchings(spec, JobLayout((0,), (2,)), "train")
    assert e.value.field == "layout"


def test_circuit_graph_counts_parallel_circuits_and_metrics():
    spec = FabricSpec(pods=2, tors_per_pod=1, uplinks_per_tor=2, ocs_count=1)
    # both uplinks of ToR 0 (ports 1, 2) to both uplinks of ToR 1 (ports 3, 4)
    ms = {0: Matching.from_pairs(4, [[1, 3], [2, 4]])}
    g = circuit_graph(spec, ms)
    assert g.n_circuits_between(0, 1) == 2 and g.neighbors(0) == [1]
    assert sorted(p for p, _, _ in g.edges(0)) == [3, 4]  # ToR ports (2 servers + uplinks)
    assert inter_pod_circuits(spec, ms) == 2 and bisection_circuits(spec, ms) == 2
    assert bfs_depth(g, [0]) == {0: 0, 1: 1}
    empty = circuit_graph(spec, {0: Matching.empty(4)})
    assert not reachable(empty, [0], [1]) and reachable(empty, [0], [0])
    with pytest.raises(SpecError):
        circuit_graph(spec, {0: Matching.empty(5)})
    with pytest.raises(SpecError):
        circuit_graph(spec, {1: Matching.empty(4)})


def test_unchanged_matchings():
    old = {0: Matching.from_pairs(4, [[1, 2], [3, 4]])}
    new = {0: Matching.from_pairs(4, [[1, 2]])}
    assert unchanged_matchings(old, new)[0].circuits == {(1, 2)}
    with pytest.raises(SpecError):
        unchanged_matchings(old, {1: Matching.empty(4)})


def test_scale_2048_tors():
    spec = FabricSpec(pods=64, tors_per_pod=32, uplinks_per_tor=8, ocs_count=8)
    layout = JobLayout(tuple(range(16)), tuple(range(16, 64)))
    for phase in PHASES:
        ms = phase_matchings(spec, layout, phase)
        assert all(m.n_ports == spec.ports_per_ocs for m in ms.values())
        g = circuit_graph(spec, ms)
        if phase == "sync":
            assert reachable(g, tors_of(spec, layout.train_pods), tors_of(spec, layout.gen_pods))
        else:
            assert all_pairs_reachable(g)
