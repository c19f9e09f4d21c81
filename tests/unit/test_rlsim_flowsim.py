"""Flow simulator against analytic results (ring all-reduce, broadcast trees, hand-built max-min)."""
import numpy as np
import pytest

from emulation.spec import FabricSpec, JobLayout
from controller import traffic
from rlsim.fabric_models import build_network
from rlsim.fabrics import GBPS
from rlsim.flowsim import Transfer, max_min_rates, simulate
from rlsim.sim import run_demands


def test_max_min_textbook_example():
    # link 0 (cap 1): A, B; link 1 (cap 2): B, C  ->  A = B = 0.5, C = 1.5
    r = max_min_rates(np.array([1.0, 2.0]), np.array([0, 1, 1, 2]), np.array([0, 0, 1, 1]), 3)
    assert r == pytest.approx([0.5, 0.5, 1.5])


def test_max_min_three_links_parking_lot():
    # long flow over links 0,1,2 (cap 1 each); one short flow per link; link 2 has two short flows
    inc_sf = np.array([0, 0, 0, 1, 2, 3, 4])
    inc_link = np.array([0, 1, 2, 0, 1, 2, 2])
    r = max_min_rates(np.ones(3), inc_sf, inc_link, 5)
    assert r == pytest.approx([1 / 3, 2 / 3, 2 / 3, 1 / 3, 1 / 3])
    assert r.sum() > 0 and all(np.bincount(inc_link, weights=r[inc_sf]) <= 1 + 1e-12)


def test_max_min_inactive_and_linkless():
    r = max_min_rates(np.array([4.0]), np.array([0, 1]), np.array([0, 0]), 3, active=np.array([True, False, True]))
    assert r[0] == 4.0 and r[1] == 0.0 and r[2] == np.inf


def test_event_driven_rates_change_when_flows_finish():
    # two flows share a link of 1 B/s: the small one (1 B) ends at 2 s, the big one (3 B) then runs alone
    res = simulate(np.array([1.0]), [Transfer(1.0, [[0]]), Transfer(3.0, [[0]])])
    assert res.finish == pytest.approx([2.0, 4.0])
    assert res.link_bytes[0] == pytest.approx(4.0)
    assert res.link_last_busy[0] == pytest.approx(4.0)


def test_arrivals():
    res = simulate(np.array([2.0]), [Transfer(2.0, [[0]]), Transfer(2.0, [[0]], arrival=0.5)])
    # 0..0.5: A alone at 2 (1 B left); then both at 1: A ends at 1.5, B has 1 B left at 1.5 -> 2.0
    assert res.finish == pytest.approx([1.5, 2.0])


def test_multipath_transfer_sums_subflows():
    res = simulate(np.array([1.0, 3.0]), [Transfer(8.0, [[0], [1]])])
    assert res.makespan == pytest.approx(2.0)


def test_bad_inputs():
    with pytest.raises(ValueError):
        simulate(np.array([0.0]), [Transfer(1.0, [[0]])])
    with pytest.raises(ValueError):
        simulate(np.array([1.0]), [Transfer(1.0, [[3]])])
    assert simulate(np.array([1.0]), []).makespan == 0.0


def _fat_tree(pods=4):
    spec = FabricSpec(pods=pods, tors_per_pod=2, servers_per_tor=2, server_gbps=400, uplink_gbps=400,
                      uplinks_per_tor=2)
    layout = JobLayout(train_pods=tuple(range(pods - 1)), gen_pods=(pods - 1,))
    return spec, build_network("fat-tree", spec, layout)


@pytest.mark.parametrize("n", [2, 5, 16])
def test_ring_allreduce_matches_2_n_minus_1_over_n(n):
    spec, net = _fat_tree()
    S = 1e9
    res = run_demands(net, traffic.ring_allreduce(list(range(n)), S))
    B = spec.server_gbps * GBPS
    assert res.makespan == pytest.approx(2 * (n - 1) / n * S / B, rel=1e-9)


@pytest.mark.parametrize("fanout", [1, 2, 3])
def test_pipelined_broadcast_tree_takes_fanout_times_S_over_B(fanout):
    spec, net = _fat_tree()
    S = 5e8
    res = run_demands(net, traffic.broadcast_tree(0, list(range(1, 16)), S, fanout))
    assert res.makespan == pytest.approx(fanout * S / (spec.server_gbps * GBPS), rel=1e-9)


def test_oversubscription_slows_cross_pod_traffic():
    spec = FabricSpec(pods=2, tors_per_pod=1, servers_per_tor=4, server_gbps=400, uplink_gbps=400,
                      uplinks_per_tor=4)
    lay = JobLayout()
    # all four servers of pod 0 send to pod 1: 4 x 400 G through the ToR uplink
    dem = [(s, 4 + s, 1e9) for s in range(4)]
    t1 = run_demands(build_network("fat-tree", spec, lay), dem).makespan
    t4 = run_demands(build_network("fat-tree-4to1", spec, lay), dem).makespan
    assert t4 == pytest.approx(4 * t1)


def test_all_to_all_demands():
    d = traffic.all_to_all([0, 1, 2, 3], 4.0)
    assert len(d) == 12 and all(b == 1.0 for _, _, b in d)
    assert traffic.merge([(0, 1, 1.0), (0, 1, 2.0), (2, 2, 5.0)]) == [(0, 1, 3.0)]
    with pytest.raises(ValueError):
        traffic.broadcast_tree(0, [1], 1.0, fanout=0)
