"""Fabric models and their cost."""
import numpy as np
import pytest

from controller.phases import circuit_graph, phase_matchings
from emulation.spec import FabricSpec, JobLayout
from emulation.validation import SpecError
from rlsim.cost import fabric_cost, load_prices, port_counts, radix_tiers
from rlsim.fabric_models import build_network
from rlsim.fabrics import FABRICS, CircuitNetwork, FabricOptions, rfabric_counts, ring_counts, topoopt_counts

SPEC = FabricSpec(pods=4, tors_per_pod=4, servers_per_tor=4, server_gbps=3200, uplink_gbps=400,
                  uplinks_per_tor=32, ocs_count=32)
LAYOUT = JobLayout(train_pods=(0, 1), gen_pods=(2, 3))


@pytest.mark.parametrize("fabric", FABRICS)
def test_every_fabric_connects_every_server_pair_it_needs(fabric):
    for phase in ("train", "gen", "sync"):
        net = build_network(fabric, SPEC, LAYOUT, phase)
        assert (net.capacity > 0).all()
        paths = net.paths(0, SPEC.n_servers - 1) if phase != "train" or fabric != "rfabric" else net.paths(0, 20)
        assert paths and all(p[0] == net.server_up(0) for p in paths)


def test_paths_same_server_and_same_tor():
    net = build_network("fat-tree", SPEC, LAYOUT)
    assert net.paths(3, 3) == []
    assert net.paths(0, 1) == [[net.server_up(0), net.server_down(1)]]


def test_rfabric_uses_the_controller_phase_topologies():
    for phase in ("train", "gen", "sync"):
        counts, m = rfabric_counts(SPEC, LAYOUT, phase)
        g = circuit_graph(SPEC, phase_matchings(SPEC, LAYOUT, phase))
        assert counts.sum() == 2 * g.n_circuits()
        for t in range(SPEC.n_tors):
            for peer in g.neighbors(t):
                assert counts[t, peer] == g.n_circuits_between(t, peer)
    # sync phase: trainer ToRs have no circuits among themselves
    c, _ = rfabric_counts(SPEC, LAYOUT, "sync")
    assert c[np.ix_(range(8), range(8))].sum() == 0


def test_circuit_fabrics_respect_port_budget():
    for c in (topoopt_counts(SPEC, LAYOUT), rfabric_counts(SPEC, LAYOUT, "train")[0]):
        assert (c.sum(axis=1) <= SPEC.uplinks_per_tor).all()
        assert (c == c.T).all() and (np.diag(c) == 0).all()


def test_ring_counts():
    c = ring_counts(5, [0, 1, 2, 3, 4], [(1, 2)])
    assert (c.sum(axis=1) == 4).all() and c[0, 1] == 2 and c[0, 4] == 2
    two = ring_counts(2, [0, 1], [(1, 3)])
    assert two[0, 1] == 3


def test_two_hop_paths_in_circuit_network():
    c = np.zeros((SPEC.n_tors, SPEC.n_tors), dtype=np.int64)
    c[0, 1] = c[1, 0] = 1
    c[1, 2] = c[2, 1] = 2
    for t in range(3, SPEC.n_tors):  # keep the rest connected in a chain
        c[t - 1, t] = c[t, t - 1] = 1
    net = CircuitNetwork("x", SPEC, c, max_two_hop=4)
    p = net.paths(0, 8)  # ToR 0 -> ToR 2: only the two-hop path via ToR 1
    assert len(p) == 1 and len(p[0]) == 4
    far = net.paths(0, SPEC.n_servers - 1)  # shortest path fallback
    assert len(far) == 1 and len(far[0]) == 2 + SPEC.n_tors - 1


def test_unknown_fabric():
    with pytest.raises(SpecError, match="fabric"):
        build_network("torus", SPEC, LAYOUT)
    with pytest.raises(SpecError, match="fabric"):
        port_counts("torus", SPEC, 400)


def test_fat_tree_counts_five_ports_per_nic_and_rfabric_two_plus_ocs():
    n_nic = SPEC.n_servers * 8
    mixnet_method = FabricOptions(fat_tree_tiers="3")
    ft = port_counts("fat-tree", SPEC, 400, mixnet_method)
    assert sum(ft["eps_ports"].values()) == 5 * n_nic and ft["ocs_ports"] == 0 and ft["fibres"] == 3 * n_nic
    assert "MixNet calculator" in ft["tier_method"]
    ft2 = port_counts("fat-tree-2to1", SPEC, 400, mixnet_method)
    assert sum(ft2["eps_ports"].values()) == 3 * n_nic
    # the default counts the tiers a 64-port switch needs: 512 NICs fit two tiers (3 ports per NIC)
    auto = port_counts("fat-tree", SPEC, 400)
    assert auto["packet_tiers"] == 2 and sum(auto["eps_ports"].values()) == 3 * n_nic
    assert auto["tier_method"].startswith("radix") and auto["switch_radix"] == 64
    rf = port_counts("rfabric", SPEC, 400)
    assert sum(rf["eps_ports"].values()) == 2 * n_nic and rf["ocs_ports"] == n_nic
    rail = port_counts("rail", SPEC, 400)
    assert sum(rail["eps_ports"].values()) == 3 * n_nic


def test_cost_uses_the_price_table():
    p = load_prices()
    c = fabric_cost("rfabric", SPEC, 400)
    n_nic = SPEC.n_servers * 8
    expect = (n_nic * (p.nic[400] + p.transceiver[400]) + 2 * n_nic * (p.eps_port[400] + p.transceiver[400])
              + n_nic * p.ocs_port + 2 * n_nic * p.fibre_m * p.fibre_per_m)
    assert c["total_usd"] == pytest.approx(expect)
    assert fabric_cost("fat-tree", SPEC, 400)["total_usd"] > c["total_usd"]
    with pytest.raises(SpecError, match="prices.nic"):
        fabric_cost("fat-tree", SPEC, 300)


def test_fat_tree_tier_count_option():
    n_nic = SPEC.n_servers * 8  # 512 NICs
    three = port_counts("fat-tree", SPEC, 400, FabricOptions(fat_tree_tiers="3"))
    two = port_counts("fat-tree", SPEC, 400, FabricOptions(fat_tree_tiers="2"))
    auto = port_counts("fat-tree", SPEC, 400, FabricOptions(fat_tree_tiers="auto"))
    assert three["packet_tiers"] == 3 and sum(three["eps_ports"].values()) == 5 * n_nic
    assert two["packet_tiers"] == 2 and sum(two["eps_ports"].values()) == 3 * n_nic and two["fibres"] == 2 * n_nic
    assert {k: v for k, v in auto.items() if k != "tier_method"} == {k: v for k, v in two.items()
                                                                    if k != "tier_method"}  # 512 NICs: 2 tiers
    # radix arithmetic: 1 tier covers the radix, 2 tiers radix x radix/2 (non-blocking), then x radix/2
    assert radix_tiers(64, 64) == 1 and radix_tiers(2048, 64) == 2 and radix_tiers(2049, 64) == 3
    assert radix_tiers(65536, 64) == 3 and radix_tiers(65537, 64) == 4
    assert radix_tiers(3264, 64, oversub=4.0) == 2  # 4:1 leaves: 51 down, 13 up
    assert load_prices().switch_radix == 64
    with pytest.raises(SpecError, match="fat_tree_tiers"):
        FabricOptions(fat_tree_tiers="4")
    assert FabricOptions().fat_tree_tiers == "auto"  # the radix-derived count is the default


@pytest.mark.parametrize("pods, radix, tiers", [(32, 64, 2), (33, 64, 3), (1024, 64, 3), (1025, 64, 4),
                                                (8, 16, 3), (32, 32, 3), (128, 128, 2)])
def test_radix_tier_count_prices_every_tier(pods, radix, tiers):
    """A non-blocking Fat-Tree of ``tiers`` packet tiers has 2 (tiers - 1) ports per NIC above the ToR's down
    ports (each inner tier: down + up; the top: down only), whatever the count (64 NICs per pod here)."""
    spec = FabricSpec(pods=pods, tors_per_pod=8, servers_per_tor=1, server_gbps=3200, uplink_gbps=400,
                      uplinks_per_tor=8, ocs_count=1)
    n_nic = spec.n_servers * 8
    c = port_counts("fat-tree", spec, 400, FabricOptions(switch_radix=radix))
    assert c["packet_tiers"] == tiers == radix_tiers(n_nic, radix) and c["switch_radix"] == radix
    assert sum(c["eps_ports"].values()) == (1 + 2 * (tiers - 1)) * n_nic
    assert c["fibres"] == tiers * n_nic


def test_switch_radix_option_is_validated():
    for bad in (1, 3, 5000, True, 64.0):
        with pytest.raises(SpecError, match="switch_radix"):
            FabricOptions(switch_radix=bad)
