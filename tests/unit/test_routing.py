"""controller.routing: shortest-path routes, transition routes, flow/group changes."""
import pytest

from controller.ocs import TOR_COOKIE, Matching
from controller.phases import circuit_graph, phase_matchings, unchanged_matchings
from controller.routing import (PINNED_PRIORITY, GroupSpec, RouteLoop, Routes, compute_routes, find_loop, group_id_of,
                                port_peers, route_flow_changes, transition_routes)
from emulation.spec import FabricSpec, JobLayout
from emulation.validation import SpecError


def line_spec(n_tors=4, uplinks=2):
    return FabricSpec(pods=n_tors, tors_per_pod=1, servers_per_tor=2, uplinks_per_tor=uplinks, ocs_count=1)


def port(spec, tor, u):
    return spec.uplink(tor, u).ocs_port


def matching(spec, links):
    """links: [(tor_a, uplink_a, tor_b, uplink_b)] on OCS 0."""
    return {0: Matching.from_pairs(spec.ports_per_ocs,
                                   [[port(spec, a, ua), port(spec, b, ub)] for a, ua, b, ub in links])}


def tor_port(spec, tor, u):
    return spec.uplink(tor, u).tor_port


def test_shortest_paths_on_a_line_and_unreachable_absent():
    spec = line_spec(4)
    g = circuit_graph(spec, matching(spec, [(0, 0, 1, 0), (1, 1, 2, 0)]))  # 0 - 1 - 2, ToR 3 alone
    r = compute_routes(spec, g)
    assert r.ports(0, 2) == (tor_port(spec, 0, 0),)
    assert r.ports(1, 0) == (tor_port(spec, 1, 0),) and r.ports(1, 2) == (tor_port(spec, 1, 1),)
    assert 3 not in r.next_hops[0] and r.next_hops[3] == {}
    assert 0 not in r.next_hops[0]
    assert not r.reachable(0, 3) and r.reachable(0, 2)


def test_parallel_circuits_and_equal_cost_paths_spread():
    spec = line_spec(4, uplinks=2)
    # two parallel circuits 0-1: both uplinks carry traffic to ToR 1
    g = circuit_graph(spec, matching(spec, [(0, 0, 1, 0), (0, 1, 1, 1)]))
    r = compute_routes(spec, g)
    assert r.ports(0, 1) == (tor_port(spec, 0, 0), tor_port(spec, 0, 1))
    # a 4-cycle 0-1-2-3-0: two equal-cost first hops from 0 to 2
    g = circuit_graph(spec, matching(spec, [(0, 0, 1, 0), (1, 1, 2, 0), (2, 1, 3, 0), (3, 1, 0, 1)]))
    r = compute_routes(spec, g)
    assert r.ports(0, 2) == (tor_port(spec, 0, 0), tor_port(spec, 0, 1))
    assert r.ports(0, 1) == (tor_port(spec, 0, 0),)


def test_graph_size_must_match():
    spec = line_spec(4)
    with pytest.raises(SpecError):
        compute_routes(line_spec(3), circuit_graph(spec, matching(spec, [])))


peer_lookup = port_peers


def test_transition_routes_avoid_changing_circuits_and_are_loop_free():
    spec = line_spec(4)
    # old: ring 0-1-2-3-0. new: 0-2, 1-3 plus keep 0-1 and 2-3.
    old_m = matching(spec, [(0, 0, 1, 0), (1, 1, 2, 0), (2, 1, 3, 0), (3, 1, 0, 1)])
    new_m = matching(spec, [(0, 0, 1, 0), (2, 1, 3, 0), (0, 1, 2, 0), (1, 1, 3, 1)])
    old_g, new_g = circuit_graph(spec, old_m), circuit_graph(spec, new_m)
    stable_g = circuit_graph(spec, unchanged_matchings(old_m, new_m))  # 0-1 and 2-3 only
    old_r = compute_routes(spec, old_g)
    tr = transition_routes(spec, old_r, stable_g)
    # still connected on stable circuits: moves onto them
    assert tr.ports(1, 0) == (tor_port(spec, 1, 0),)
    assert tr.ports(0, 1) == (tor_port(spec, 0, 0),)
    # 0 -> 3 was via the changing circuit 3-0 and has no stable path: old route kept
    assert tr.ports(0, 3) == old_r.ports(0, 3) == (tor_port(spec, 0, 1),)
    assert find_loop(tr, peer_lookup(old_g), spec.n_tors) is None
    assert find_loop(compute_routes(spec, new_g), peer_lookup(new_g), spec.n_tors) is None


def test_find_loop_detects_a_loop():
    spec = line_spec(2)
    g = circuit_graph(spec, matching(spec, [(0, 0, 1, 0)]))
    assert find_loop(compute_routes(spec, g), peer_lookup(g), 2) is None
    # forged tables: ToRs 0 and 1 send traffic for ToR 2 to each other
    spec3 = line_spec(3)
    g3 = circuit_graph(spec3, matching(spec3, [(0, 0, 1, 0)]))
    looping = Routes({0: {2: (tor_port(spec3, 0, 0),)}, 1: {2: (tor_port(spec3, 1, 0),)}, 2: {}})
    assert find_loop(looping, peer_lookup(g3), 3) in ([0, 1, 0], [1, 0, 1])


@pytest.mark.parametrize("a, b", [("train", "gen"), ("gen", "sync"), ("sync", "train"), ("train", "sync")])
def test_phase_transitions_are_loop_free(a, b):
    spec = FabricSpec(pods=4, tors_per_pod=3, uplinks_per_tor=4, ocs_count=2)
    layout = JobLayout((0, 1), (2, 3))
    ma, mb = phase_matchings(spec, layout, a), phase_matchings(spec, layout, b)
    ga = circuit_graph(spec, ma)
    stable = circuit_graph(spec, unchanged_matchings(ma, mb))
    old_r = compute_routes(spec, ga)
    tr = transition_routes(spec, old_r, stable)
    assert find_loop(tr, peer_lookup(ga), spec.n_tors) is None
    # every transition route either runs on stable circuits or is the old route
    stable_ports = {(t, p) for t in range(spec.n_tors) for p, _, _ in stable.edges(t)}
    for t, row in tr.next_hops.items():
        for dst, ports in row.items():
            assert all((t, p) in stable_ports for p in ports) or ports == old_r.ports(t, dst)


def test_route_flow_changes_initial_install():
    spec = line_spec(3)
    g = circuit_graph(spec, matching(spec, [(0, 0, 1, 0), (1, 1, 2, 0)]))
    r = compute_routes(spec, g)
    ch = route_flow_changes(spec, None, r)
    c0 = ch.per_tor[0]
    assert {gs.group_id for gs in c0.add_groups} == {group_id_of(1), group_id_of(2)}
    assert GroupSpec(group_id_of(2), (tor_port(spec, 0, 0),)) in c0.add_groups
    flows = {f.match: f.actions for f in c0.add_flows}
    assert flows[(("eth_type", 0x0800), ("ipv4_dst", spec.host_ip(0)))] == (("output", 1),)
    assert flows[(("eth_type", 0x0800), ("ipv4_dst", spec.host_ip(5)))] == (("group", group_id_of(2)),)
    assert len(c0.add_flows) == spec.n_servers  # 2 local + 4 remote
    assert all(f.cookie == TOR_COOKIE for f in c0.add_flows)
    assert route_flow_changes(spec, r, r).is_empty


def test_route_flow_changes_only_changed_groups():
    spec = line_spec(3)
    r1 = compute_routes(spec, circuit_graph(spec, matching(spec, [(0, 0, 1, 0), (1, 1, 2, 0)])))
    # 0-1 moves to a different uplink pair; 1-2 gone
    r2 = compute_routes(spec, circuit_graph(spec, matching(spec, [(0, 1, 1, 1), (1, 0, 2, 1)])))
    ch = route_flow_changes(spec, r1, r2)
    c0 = ch.per_tor[0]
    assert {g.group_id for g in c0.modify_groups} == {group_id_of(1), group_id_of(2)}
    assert not c0.add_flows and not c0.delete_flows and not c0.add_groups
    # a destination becoming unreachable: flows then group deleted
    r3 = compute_routes(spec, circuit_graph(spec, matching(spec, [(0, 0, 1, 0)])))
    c = route_flow_changes(spec, r1, r3).per_tor[0]
    assert c.delete_groups == (group_id_of(2),)
    assert {f.match[1][1] for f in c.delete_flows} == {spec.host_ip(4), spec.host_ip(5)}
    assert 2 in route_flow_changes(spec, r1, r3).per_tor


def _pins(changes, tor, field="add_flows"):
    return {f.match: f.actions[0][1] for f in getattr(changes.per_tor[tor], field) if f.priority == PINNED_PRIORITY}


def test_parallel_uplinks_pin_each_server_pair_to_one_of_them_evenly_and_follow_the_routes():
    """A select group hashes a handful of TCP connections onto its buckets, unevenly in most hashings (four
    connections on two buckets: 3:1 or 4:0 in 5 of 8): the source ToR pins each (own server, remote server)
    pair to one uplink instead, every uplink the same number of pairs."""
    spec = line_spec(3, uplinks=2)
    two = compute_routes(spec, circuit_graph(spec, matching(spec, [(0, 0, 1, 0), (0, 1, 1, 1)])))
    pins = _pins(route_flow_changes(spec, None, two), 0)
    ups = (tor_port(spec, 0, 0), tor_port(spec, 0, 1))
    assert len(pins) == spec.servers_per_tor ** 2 and sorted(pins.values()) == sorted(ups * 2)
    for s in spec.servers_on_tor(0):  # each server's two remote peers go out of different uplinks
        assert {p for m, p in pins.items() if ("in_port", spec.server_port(s)) in m} == set(ups)
    assert all(("ipv4_dst", spec.host_ip(d)) in m for m in pins for d in spec.servers_on_tor(1)
               if m[2][1] == spec.host_ip(d))
    # a single uplink needs no pin (the group has one bucket); going to it deletes the pins, back adds them
    one = compute_routes(spec, circuit_graph(spec, matching(spec, [(0, 0, 1, 0)])))
    assert not _pins(route_flow_changes(spec, None, one), 0)
    down = route_flow_changes(spec, two, one)
    assert set(_pins(down, 0, "delete_flows")) == set(pins) and not _pins(down, 0)
    assert _pins(route_flow_changes(spec, one, two), 0) == pins
    assert route_flow_changes(spec, two, two).is_empty
    # the pair of uplinks changes: the pins move with the group, none deleted (an add replaces, and deletes run
    # after the adds, so deleting a re-added pin would drop it)
    spec = line_spec(3, uplinks=3)
    a_ = compute_routes(spec, circuit_graph(spec, matching(spec, [(0, 0, 1, 0), (0, 1, 1, 1)])))
    b_ = compute_routes(spec, circuit_graph(spec, matching(spec, [(0, 1, 1, 1), (0, 2, 1, 2)])))
    ch = route_flow_changes(spec, a_, b_)
    moved = _pins(ch, 0)
    assert not _pins(ch, 0, "delete_flows") and set(moved.values()) == {tor_port(spec, 0, 1), tor_port(spec, 0, 2)}


def test_planner_refuses_transition_routes_that_loop(monkeypatch, connected_core):
    """The runtime checks what it installs: a looping transition state fails the plan before anything is sent."""
    from controller import routing

    spec = FabricSpec()
    core, drv, _ = connected_core(spec, JobLayout())
    # ToR 0 and the ToR at the far end of its uplink 0 send traffic for a third ToR to each other
    far = spec.ocs_port_owner(0, core.matchings[0].peer(spec.uplink(0, 0).ocs_port))
    dst = min({1, 2, 3} - {far.tor})
    forged = Routes({t: {} for t in range(spec.n_tors)} | {0: {dst: (spec.uplink(0, 0).tor_port,)},
                                                          far.tor: {dst: (far.tor_port,)}})
    monkeypatch.setattr(routing, "transition_routes", lambda *a: forged)
    with pytest.raises(RouteLoop, match="transition routes"):
        core.request_phase({"phase": "gen", "delay_ms": 0})
    assert drv.log == [] and core.phase == "train"
