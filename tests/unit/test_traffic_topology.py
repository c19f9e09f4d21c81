"""Phase topologies built from the phase's traffic (controller.traffic + controller.phases.train_plan), the
static packet fabric's forwarding rule, and the shared weight-sync stripes plan."""
import dataclasses
import itertools

import numpy as np
import pytest

from controller.phases import (_Circuits, all_pairs_reachable, circuit_graph, phase_matchings,
                               stripe_plan, train_plan)
from controller.traffic import (Group, TrainBytes, TrainStage, TrainTraffic, phase_traffic, ring_allreduce,
                                train_layout, train_traffic)
from emulation.builder import plan_fabric, static_flows
from emulation.scenario import load_scenario
from emulation.spec import EMULATED_FABRICS, PHASES, FabricSpec, JobLayout
from emulation.validation import SpecError
from emulation.workload import WorkloadSpec


def counts(spec, matchings):
    g = circuit_graph(spec, matchings)
    c = np.zeros((spec.n_tors, spec.n_tors), dtype=int)
    for t in range(spec.n_tors):
        for _, peer, _ in g.edges(t):
            c[t, peer] += 1
    return c


def moe(spec, layout, ep=4, model="Qwen3-30B-A3B"):
    return phase_traffic(spec, layout, WorkloadSpec(model=model, train_ep=ep, prompts_per_step=32,
                                                    samples_per_prompt=4, max_response_tokens=2048))


# ---- traffic ----------------------------------------------------------------------------------------------
def test_two_way_ring_sends_the_same_bytes_each_way():
    one, two = ring_allreduce([0, 1, 2, 3], 8.0), ring_allreduce([0, 1, 2, 3], 8.0, two_way=True)
    out = lambda dem, s: sum(b for a, _, b in dem if a == s)  # noqa: E731
    assert all(out(one, s) == pytest.approx(out(two, s)) == pytest.approx(12.0) for s in range(4))
    assert {(a, b) for a, b, _ in two} == {(0, 1), (1, 2), (2, 3), (3, 0), (1, 0), (2, 1), (3, 2), (0, 3)}
    assert ring_allreduce([0, 1], 8.0, two_way=True) == ring_allreduce([0, 1], 8.0)  # two members: one pair


def test_train_traffic_stages_follow_the_layout():
    spec = FabricSpec(pods=2, tors_per_pod=2, servers_per_tor=2, uplinks_per_tor=4, ocs_count=2)
    tl = train_layout(JobLayout().train_servers(spec), 8, tp=8, pp=1, dp=0, ep=4)
    tt = train_traffic(tl, TrainBytes(dense_grad=10.0, expert_grad=40.0, a2a_per_replica=5.0, act_per_replica=1.0))
    assert [s.name for s in tt.stages] == ["ep_alltoall", "dp_allreduce"]  # pp 1: no point-to-point stage
    (ep,) = tt.stage("ep_alltoall").groups
    assert ep.kind == "all_to_all" and ep.members == (0, 1, 2, 3) and ep.nbytes == pytest.approx(5.0)
    (dense,) = tt.stage("dp_allreduce").groups  # dp == ep: one replica per shard, no expert ring
    assert dense.label == "dense" and dense.nbytes == 10.0
    assert [n for n, _ in tt.named_groups()] == ["ep_alltoall-0", "dp_allreduce-0"]
    with pytest.raises(SpecError) as ei:
        train_layout(JobLayout().train_servers(spec), 8, tp=8, pp=1, dp=0, ep=3)
    assert ei.value.field == "workload.train_ep"


# ---- the train topology from the traffic ------------------------------------------------------------------
def test_ep_group_concentrated_on_two_tors_gets_circuits_between_them():
    """An all-to-all between ToRs 1 and 3 (not neighbours in index order) beside a DP ring over every trainer
    ToR: the plan puts those two ToRs in one cell and gives them direct circuits; the uniform mesh (traffic
    unknown) gives them at most one."""
    spec = FabricSpec(pods=2, tors_per_pod=4, servers_per_tor=2, uplinks_per_tor=8, ocs_count=8,
                      server_gbps=800, uplink_gbps=400)
    layout = JobLayout((0,), (1,))
    servers = layout.train_servers(spec)  # 8 servers on ToRs 0..3
    tl = train_layout(servers, 8, 8, 1, 0, 1)
    a2a = Group("all_to_all", (2, 3, 6, 7), 4e11)  # the servers of ToRs 1 and 3
    ring = Group("ring", tuple(servers), 1e9, "dense")
    tt = TrainTraffic(tl, TrainBytes(1e9, 0.0, 0.0, 0.0),
                      (TrainStage("ep_alltoall", (a2a,)), TrainStage("dp_allreduce", (ring,))))
    plan = train_plan(spec, tt)
    assert (1, 3) in plan.cells and plan.intra_ports >= 2
    built = _Circuits(spec)
    from controller.phases import _build_train

    _build_train(spec, layout, built, tt)
    c = counts(spec, built.matchings())
    assert c[1, 3] >= plan.intra_ports - 1  # one may go to join the generation pod (the widest bundle gives)
    assert c[1, 3] > max(c[0, 1], c[0, 2], c[2, 3])  # the all-to-all pair is the widest bundle
    uniform = counts(spec, phase_matchings(spec, layout, "train"))
    assert uniform[1, 3] <= 1 < c[1, 3]


def test_moe_workload_gives_its_ep_pairs_direct_circuits_and_a_connected_graph():
    spec = FabricSpec(pods=4, tors_per_pod=2, servers_per_tor=2, uplinks_per_tor=8, ocs_count=8,
                      server_gbps=800, uplink_gbps=400)
    layout = JobLayout((0, 1), (2, 3))
    tr = moe(spec, layout, ep=4)  # EP group = 4 servers = 2 ToRs: cells (0, 1) and (2, 3)
    plan = train_plan(spec, tr.train)
    assert plan.cells == ((0, 1), (2, 3)) and plan.intra_ports > 0
    m = phase_matchings(spec, layout, "train", tr)
    c = counts(spec, m)
    assert c[0, 1] > 0 and c[2, 3] > 0 and c[0, 1] >= c[0, 2]
    assert all_pairs_reachable(circuit_graph(spec, m))  # generation's pods stay reachable (async mode)


@pytest.mark.parametrize("pods", [2, 8])
def test_dense_ring_gets_its_neighbours_circuits(pods):
    """A dense model: every trainer uplink to the ring neighbours. Joining the generation pods (isolated in
    their own circuits) to the trainers takes a circuit from different bundles, never a ToR's whole ring."""
    s = load_scenario("scenarios/dapo-32b.yaml")
    spec = dataclasses.replace(s.fabric, pods=pods, ocs_ports=0)
    layout = JobLayout(tuple(range(pods // 2)), tuple(range(pods // 2, pods)))
    tr = phase_traffic(spec, layout, s.workload)
    m = phase_matchings(spec, layout, "train", tr)
    c = counts(spec, m)
    tors = [t for p in layout.train_pods for t in spec.tors_in_pod(p)]
    for a, b in zip(tors, tors[1:] + tors[:1]):  # ring neighbours: half a ToR's uplinks each side
        assert spec.uplinks_per_tor // 2 - 1 <= c[a, b] <= spec.uplinks_per_tor // 2
    assert c[np.ix_(tors, tors)].sum() >= len(tors) * spec.uplinks_per_tor - 2 * len(layout.gen_pods)
    assert all_pairs_reachable(circuit_graph(spec, m))


@pytest.mark.parametrize("kw,train,ep", [
    (dict(pods=2, tors_per_pod=2, uplinks_per_tor=2, ocs_count=1), (0,), 1),
    (dict(pods=2, tors_per_pod=4, servers_per_tor=2, uplinks_per_tor=6, ocs_count=3), (0,), 4),
    (dict(pods=3, tors_per_pod=4, servers_per_tor=2, uplinks_per_tor=8, ocs_count=8), (0, 1), 4),
    (dict(pods=4, tors_per_pod=3, servers_per_tor=4, uplinks_per_tor=5, ocs_count=5), (0, 1), 8),
    (dict(pods=4, tors_per_pod=4, servers_per_tor=2, uplinks_per_tor=4, ocs_count=1, ocs_ports=70), (0,), 8),
])
def test_allocation_never_puts_a_port_in_two_circuits(kw, train, ep):
    spec = FabricSpec(server_gbps=800, **kw)
    layout = JobLayout(tuple(train), tuple(p for p in range(spec.pods) if p not in train))
    tr = moe(spec, layout, ep=ep)
    for phase in PHASES:
        m = phase_matchings(spec, layout, phase, tr)
        ends = [(o, p) for o, mm in m.items() for pair in mm.circuits for p in pair]
        assert len(ends) == len(set(ends))  # an OCS port in at most one circuit
        uplinks = [(u.tor, u.uplink) for o, mm in m.items() for pair in mm.circuits for p in pair
                   if (u := spec.ocs_port_owner(o, p)) is not None]
        assert len(uplinks) == len(set(uplinks))  # a ToR uplink in at most one circuit
        for o, mm in m.items():  # both ends of a circuit on one OCS: the wiring allows it
            assert all(spec.ocs_port_owner(o, p) is None or spec.ocs_port_owner(o, p).ocs == o
                       for pair in mm.circuits for p in pair)


def test_kempe_placement_fills_a_regular_bipartite_demand():
    """One port per ToR per OCS: greedy placement of a 4-regular bipartite multigraph can get stuck; the
    alternating-path swap places every circuit, each port once."""
    spec = FabricSpec(pods=1, tors_per_pod=8, servers_per_tor=1, uplinks_per_tor=4, ocs_count=4)
    circ = _Circuits(spec)
    left, right = [0, 1, 2, 3], [4, 5, 6, 7]
    demand = [(a, b) for a, b in itertools.product(left, right)]  # K4,4: 4-regular
    placed = sum(circ.place(a, b) for a, b in demand)
    assert placed == len(demand)
    assert all(circ.n_free[t] == 0 for t in range(8))
    m = circ.matchings()  # Matching validates every port once
    assert sum(len(x.circuits) for x in m.values()) == 16


# ---- static packet fabrics ---------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", [k for k in EMULATED_FABRICS if k != "rfabric"])
def test_static_fabric_plan_and_rule(kind):
    base = load_scenario("scenarios/default.yaml").fabric
    spec = dataclasses.replace(base, kind=kind)
    plan = plan_fabric(spec)
    ups = [link for link in plan.links if link.kind == "uplink"]
    assert len(ups) == spec.n_tors * spec.ocs_count  # one uplink per spine per ToR
    assert {s.kind for s in plan.switches} == {"tor", "spine"}
    up_cap = spec.servers_per_tor * spec.server_link_mbps / {"fat-tree": 1, "fat-tree-2to1": 2, "fat-tree-4to1": 4,
                                                            "fat-tree-8to1": 8, "fat-tree-16to1": 16}[kind]
    assert sum(link.rate_mbps for link in ups) == pytest.approx(spec.n_tors * up_cap)
    flows = static_flows(spec)
    # follow the rule from every server to every other: ToR -> (spine -> ToR) -> the destination's port
    for src in range(spec.n_servers):
        for dst in range(spec.n_servers):
            if src == dst:
                continue
            t = spec.tor_of_server(src)
            tor_flows = flows[spec.tor_name(t)]
            local = [f for f in tor_flows if f"nw_dst={spec.host_ip(dst)}," in f]
            if spec.tor_of_server(dst) == t:
                assert local and local[0].endswith(f"output:{spec.server_port(dst)}")
                continue
            assert not local
            (out,) = [f for f in tor_flows if f"in_port={spec.server_port(src)}," in f]
            port = int(out.rsplit(":", 1)[1])
            up = next(u for u in spec.built_uplinks() if u.tor == t and u.tor_port == port)
            (sp,) = [f for f in flows[spec.ocs_name(up.ocs)] if f"nw_dst={spec.host_ip(dst)}," in f]
            owner = spec.ocs_port_owner(up.ocs, int(sp.rsplit(":", 1)[1]))
            assert owner.tor == spec.tor_of_server(dst)


def test_rfabric_has_no_static_rule_and_bad_kinds_are_refused():
    with pytest.raises(SpecError):
        static_flows(FabricSpec())
    with pytest.raises(SpecError) as ei:
        FabricSpec(kind="torus")
    assert ei.value.field == "kind"
    with pytest.raises(SpecError) as ei:
        FabricSpec(kind="topoopt").check_emulatable()  # RLSim models it; the emulator does not build it
    assert ei.value.field == "kind"


def test_stripe_plan_deals_chains_and_stripes_round_robin():
    plan = stripe_plan([10, 11, 12, 13], [[0, 1], [2, 3]], 4, 2)
    assert [m for _, m in plan] == [[10], [11], [12], [13]]
    assert [[s for s, _ in src] for src, _ in plan] == [[0, 2], [2, 0], [1, 3], [3, 1]]
    assert all(sh == 0.5 for src, _ in plan for _, sh in src)
    assert [m for _, m in stripe_plan([10, 11, 12, 13], [[0]], 2, 1)] == [[10, 11], [12, 13]]


# ---- the same RL steps on several fabrics ---------------------------------------------------------------
def test_compare_fabrics_side_by_side_on_the_simulated_backend(tmp_path):
    from testbed.runs.fabric_compare import compare_fabrics, format_fabrics, network_times

    base = load_scenario("scenarios/short-7b.yaml")
    w = dataclasses.replace(base.workload, prompts_per_step=16, samples_per_prompt=4, max_response_tokens=512)
    scn = dataclasses.replace(base, workload=w)
    rep, files = compare_fabrics(scn, ["rfabric", "fat-tree-4to1"], "simulated", ["static-TP1x8@64"], 1, tmp_path)
    assert set(rep["fabrics"]) == {"rfabric", "fat-tree-4to1"} and (tmp_path / "fabrics.json").exists()
    rf, t4 = (rep["fabrics"][k]["policies"]["static-TP1x8@64"] for k in ("rfabric", "fat-tree-4to1"))
    # the 4:1 tree's ToR pipes carry a quarter of the servers' rate: its ring hops and weight sync are slower
    assert t4["allreduce_s"] > rf["allreduce_s"] and t4["sync_s"] > rf["sync_s"]
    assert rep["cost_usd"]["rfabric"] > 0 and "fat-tree-4to1" in format_fabrics(rep)
    step = {"train": {"allreduce_s": 1.0, "alltoall_s": 2.0}, "sync": {"broadcast_s": 3.0}, "phases": {"sync_s": 9}}
    assert network_times(step) == {"alltoall_s": 2.0, "allreduce_s": 1.0, "sync_s": 3.0}


# ---- re-wiring inside the train phase (RLSim's train_rewire) ----------------------------------------------
def test_train_parts_give_the_alltoall_every_uplink_and_the_rings_a_connected_graph():
    from controller.phases import train_part_matchings, train_part_traffic

    spec = FabricSpec(pods=4, tors_per_pod=2, servers_per_tor=2, uplinks_per_tor=8, ocs_count=8,
                      server_gbps=800, uplink_gbps=400)
    layout = JobLayout((0, 1), (2, 3))
    tr = moe(spec, layout, ep=4)  # cells (0, 1) and (2, 3)
    assert [s.name for s in train_part_traffic(tr, "mp").train.stages] == ["ep_alltoall"]
    assert [s.name for s in train_part_traffic(tr, "dp").train.stages] == ["dp_allreduce"]
    mp, dp = (train_part_matchings(spec, layout, tr, p) for p in ("mp", "dp"))
    whole = counts(spec, phase_matchings(spec, layout, "train", tr))
    c = counts(spec, mp)
    assert c[0, 1] == c[2, 3] == spec.uplinks_per_tor > whole[0, 1]  # every uplink to the EP partner ToR
    assert not all_pairs_reachable(circuit_graph(spec, mp))  # the cells alone: not joined
    assert all_pairs_reachable(circuit_graph(spec, dp))
    for m in (mp, dp):
        ends = [(o, p) for o, mm in m.items() for pair in mm.circuits for p in pair]
        assert len(ends) == len(set(ends))
    dense = phase_traffic(spec, layout, WorkloadSpec(prompts_per_step=32, samples_per_prompt=4))
    assert train_part_traffic(dense, "mp") is None and train_part_matchings(spec, layout, dense, "mp") is None
    with pytest.raises(SpecError) as ei:
        train_part_traffic(tr, "ep")
    assert ei.value.field == "part"
