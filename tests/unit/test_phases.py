"""controller.phases: phase topologies are valid matchings with the promised structure."""
import pytest

from controller.ocs import Matching
from controller.phases import (all_pairs_reachable, bfs_depth, bisection_circuits, circuit_graph,
                               inter_pod_circuits, phase_matchings, reachable, round_order, round_pairs,
                               sync_chains, unchanged_matchings)
from emulation.spec import PHASES, FabricSpec, JobLayout
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


# ---- the sync phase's feeds and the server-level broadcast plan (sync_chains) ---------------------------
SPREAD = CASES + [  # (spec kwargs, train pods): more trainers than generators, and the reverse, uneven
    (dict(pods=5, tors_per_pod=1, uplinks_per_tor=3, ocs_count=1), (0, 1)),
    (dict(pods=4, tors_per_pod=3, uplinks_per_tor=32, ocs_count=4), (0, 1, 2)),
    (dict(pods=4, tors_per_pod=6, uplinks_per_tor=8, ocs_count=8), (0,)),
    (dict(pods=8, tors_per_pod=8, servers_per_tor=4, uplinks_per_tor=32, ocs_count=32), (0, 1, 2, 3)),
]


@pytest.mark.parametrize("kw, train", SPREAD)
def test_sync_feeds_spread_over_trainer_tors_and_use_every_uplink(kw, train):
    """Each generator ToR's trainer circuits come from as many trainer ToRs as possible, evenly (no feeder
    holds more than its ceiling share); totals differ by at most one; the smaller side uses every uplink."""
    spec, layout = build(kw, train)
    g = circuit_graph(spec, phase_matchings(spec, layout, "sync"))
    trainers, gens = tors_of(spec, layout.train_pods), tors_of(spec, layout.gen_pods)
    totals = []
    for j in gens:
        per = {}
        for _, peer, _ in g.edges(j):
            if peer in trainers:
                per[peer] = per.get(peer, 0) + 1
        f = sum(per.values())
        totals.append(f)
        if f:
            assert max(per.values()) <= -(-f // len(trainers)), (j, per)
            assert len(per) == min(f, len(trainers)), (j, per)
    if len(trainers) <= len(gens):
        assert all(len(g.edges(t)) == spec.uplinks_per_tor for t in trainers)
    else:
        assert all(t == spec.uplinks_per_tor for t in totals)
    if min(totals):
        assert max(totals) - min(totals) <= 1


def check_plan(spec, layout, matchings, chains, holders=None):
    """Every generator server exactly once; every hop under one ToR or on a circuit; shares sum to one;
    sources are trainer holders or generator servers reached by an earlier chain."""
    g = circuit_graph(spec, matchings)
    gen_servers = layout.gen_servers(spec)
    members = [m for c in chains for m in c.members]
    assert sorted(members) == sorted(gen_servers)
    holders = set(layout.train_servers(spec) if holders is None else holders)
    tor = spec.tor_of_server

    def on_circuit(a, b):
        return tor(a) == tor(b) or g.n_circuits_between(tor(a), tor(b)) > 0

    reached = set()
    for c in chains:
        assert sum(share for _, share in c.sources) == pytest.approx(1.0)
        for src, _ in c.sources:
            assert src in holders or src in reached, (src, c)
            assert on_circuit(src, c.members[0]), (src, c.members[0])
        for a, b in zip(c.members, c.members[1:]):
            assert on_circuit(a, b), (a, b)
        reached |= set(c.members)
    return g


@pytest.mark.parametrize("kw, train", SPREAD)
@pytest.mark.parametrize("phase", PHASES)
def test_sync_chains_reach_every_generator_server_once_on_circuits(kw, train, phase):
    spec, layout = build(kw, train)
    ms = phase_matchings(spec, layout, phase)
    try:
        chains = sync_chains(spec, layout, ms)
    except SpecError as e:  # another phase's circuits may leave a generator ToR without a path
        assert phase != "sync" and e.field == "matchings"
        return
    check_plan(spec, layout, ms, chains)
    if phase == "sync":  # the sync topology needs no relay between chains: every source is a trainer
        trainer_servers = set(layout.train_servers(spec))
        assert all(src in trainer_servers for c in chains for src, _ in c.sources)


def test_sync_chains_spread_heads_over_trainer_servers_at_the_circuit_rate():
    """2,048 GPUs of scenarios/dapo-32b.yaml: 32 circuits into each generator ToR, one from every trainer
    ToR; 8 circuits carry a server's 3.2 Tb/s, so each of the ToR's 4 servers heads its own chain, fed in 8
    stripes by 8 different trainer servers under 8 different trainer ToRs, and every trainer server feeds
    exactly 8 circuits."""
    spec, layout = build(SPREAD[-1][0] | dict(server_gbps=3200.0, uplink_gbps=400.0), SPREAD[-1][1])
    ms = phase_matchings(spec, layout, "sync")
    chains = sync_chains(spec, layout, ms)
    check_plan(spec, layout, ms, chains)
    assert len(chains) == len(layout.gen_servers(spec)) and all(len(c.members) == 1 for c in chains)
    load = {}
    for c in chains:
        assert len(c.sources) == 8 and {share for _, share in c.sources} == {1 / 8}
        assert len({spec.tor_of_server(s) for s, _ in c.sources}) == 8
        for s, _ in c.sources:
            load[s] = load.get(s, 0) + 1
    assert set(load) == set(layout.train_servers(spec)) and set(load.values()) == {8}
    # heads under one ToR are fed by different trainer servers
    for t in tors_of(spec, layout.gen_pods):
        srcs = [s for c in chains if spec.tor_of_server(c.members[0]) == t for s, _ in c.sources]
        assert len(srcs) == len(set(srcs))


def test_sync_chains_on_the_default_scenario_and_with_scarce_circuits():
    spec, layout = FabricSpec(), JobLayout()  # the emulator's fabric: 2 circuits into each generator ToR
    ms = phase_matchings(spec, layout, "sync")
    chains = sync_chains(spec, layout, ms)
    check_plan(spec, layout, ms, chains)
    assert sorted(len(c.members) for c in chains) == [1, 1, 1, 1]  # one 400G circuit per 400G server
    # 8 x 400G servers per ToR behind 2 circuits: one chain relays through the ToR, fed by both circuits
    spec = FabricSpec(servers_per_tor=4, server_gbps=3200.0)
    chains = sync_chains(spec, layout, phase_matchings(spec, layout, "sync"))
    assert sorted(len(c.members) for c in chains) == [4, 4]
    assert all(len(c.sources) == 2 for c in chains)


@pytest.mark.parametrize("kw", [dict(pods=9, tors_per_pod=1, uplinks_per_tor=2, ocs_count=2),
                                dict(pods=10, tors_per_pod=3, uplinks_per_tor=2, ocs_count=1)])
def test_sync_chains_relay_across_generator_tors_when_trainer_uplinks_run_out(kw):
    spec = FabricSpec(**kw)
    layout = JobLayout((0,), tuple(range(1, spec.pods)))
    ms = phase_matchings(spec, layout, "sync")
    chains = sync_chains(spec, layout, ms)
    check_plan(spec, layout, ms, chains)
    trainer_uplinks = len(layout.train_pods) * spec.tors_per_pod * spec.uplinks_per_tor
    assert len(chains) == trainer_uplinks  # one chain per trainer circuit, continued over relay circuits
    assert max(len({spec.tor_of_server(m) for m in c.members}) for c in chains) > 1


def test_sync_chains_holders_and_unreachable_generators():
    spec, layout = FabricSpec(), JobLayout()
    ms = phase_matchings(spec, layout, "sync")
    only = sync_chains(spec, layout, ms, holders=[0])  # one trainer server holds the weights: ToR 0 feeds all
    check_plan(spec, layout, ms, only, holders=[0])
    assert {s for c in only for s, _ in c.sources} <= {0} | set(layout.gen_servers(spec))
    for bad in ([4], [], [99]):
        with pytest.raises(SpecError) as ei:
            sync_chains(spec, layout, ms, holders=bad)
        assert ei.value.field in ("holders", "server")
    empty = {0: Matching.empty(spec.ports_per_ocs)}
    with pytest.raises(SpecError) as ei:
        sync_chains(spec, layout, empty)
    assert ei.value.field == "matchings"
