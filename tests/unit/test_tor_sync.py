"""controller.tor_sync: the ToR operations for incremental and full route states, against a fake ToR table."""
from __future__ import annotations

import pytest

from controller import phases
from controller.routing import compute_routes, route_flow_changes
from controller.tor_sync import TorOps, TorTables, flow_key, tor_ops
from emulation.spec import FabricSpec, JobLayout
from fakes_controller import FakeTorTable

SPEC = FabricSpec(pods=2, tors_per_pod=2, servers_per_tor=2, uplinks_per_tor=2)
LAYOUT = JobLayout()


def routes(phase):
    return compute_routes(SPEC, phases.circuit_graph(SPEC, phases.phase_matchings(SPEC, LAYOUT, phase)))


def installed(phase) -> dict[int, FakeTorTable]:
    """Every ToR holding ``phase``'s routes, installed from empty tables by a full sync."""
    full = route_flow_changes(SPEC, None, routes(phase))
    tors = {t: FakeTorTable() for t in range(SPEC.n_tors)}
    for ops in tor_ops(full, True, {t: TorTables() for t in tors}):
        tors[ops.tor].apply(ops)
    return tors


def test_full_sync_from_empty_installs_every_route():
    tors = installed("train")
    r = routes("train")
    for t, tab in tors.items():
        # local + remote flow for every server, and a pinned one per (own server, remote server) where the
        # remote ToR is reached over two uplinks (two shortest paths on the train ring)
        wide = [d for d in range(SPEC.n_tors) if len(r.ports(t, d)) > 1]
        assert wide and len(tab.flows) == SPEC.n_servers + len(wide) * SPEC.servers_per_tor ** 2
        assert set(tab.groups) == {1 + d for d in range(SPEC.n_tors) if d != t}


def test_full_sync_of_a_tor_in_step_sends_nothing_but_still_lists_it():
    tors = installed("train")
    full = route_flow_changes(SPEC, None, routes("train"))
    plan = tor_ops(full, True, {1: tors[1].tables()})
    assert [o.tor for o in plan] == [1] and plan[0].is_empty


@pytest.mark.parametrize("old, new", [("train", "gen"), ("gen", "sync"), ("sync", "train")])
def test_full_sync_of_a_reconnected_tor_converges_and_leaves_identical_entries_alone(old, new):
    tors = installed(old)
    want = installed(new)
    stray = (150, (("eth_type", 0x0800), ("ipv4_dst", "10.0.0.99")))
    tors[0].flows[stray] = (("output", 1),)  # a flow the wanted state does not have
    tors[0].groups[77] = (3,)  # and a stray group
    held = {t: tab.tables() for t, tab in tors.items()}
    for tab in tors.values():
        tab.touched.clear()
    for ops in tor_ops(route_flow_changes(SPEC, None, routes(new)), True, held):
        tors[ops.tor].apply(ops)
    for t in tors:
        assert tors[t].tables() == want[t].tables()
        identical = {k for k, a in held[t].flows.items() if want[t].flows.get(k) == a}
        assert identical and not identical & {k for op, k in tors[t].touched if op in ("add_flow", "delete_flow")}
    assert ("delete_flow", stray) in tors[0].touched and ("delete_group", 77) in tors[0].touched


def test_incremental_changes_are_sent_as_they_are_and_only_to_tors_with_changes():
    tors = installed("train")
    ch = route_flow_changes(SPEC, routes("train"), routes("gen"))
    plan = tor_ops(ch, False, {t: tab.tables() for t, tab in tors.items()})  # held is ignored
    assert [o.tor for o in plan] == sorted(t for t, c in ch.per_tor.items() if not c.is_empty)
    for ops in plan:
        c = ch.per_tor[ops.tor]
        assert ops == TorOps(ops.tor, c)
        tors[ops.tor].apply(ops)
    want = installed("gen")
    assert all(tors[t].tables() == want[t].tables() for t in tors)


def test_flow_key_ignores_match_order():
    from controller.ocs import FlowSpec

    a = FlowSpec(100, (("eth_type", 0x0800), ("ipv4_dst", "10.0.0.1")), (("group", 2),), 0)
    b = FlowSpec(100, (("ipv4_dst", "10.0.0.1"), ("eth_type", 0x0800)), (("group", 2),), 0)
    assert flow_key(a) == flow_key(b)
