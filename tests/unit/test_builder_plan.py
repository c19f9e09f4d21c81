"""The builder's plan (links, OpenFlow ports, rates, names) without root or Mininet."""
import subprocess
import sys

import pytest

from emulation.builder import host_batch, mgmt_root_batch, plan_fabric, parse_port_bytes
from emulation.spec import FabricSpec
from emulation.validation import SpecError


def test_plan_does_not_import_mininet():
    code = ("import sys; from emulation.builder import plan_fabric; from emulation.spec import FabricSpec; "
            "plan_fabric(FabricSpec()); print('mininet.net' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_default_two_pod_plan():
    spec = FabricSpec()  # 2 pods x 2 ToRs x 2 servers, 1 OCS, 2 uplinks per ToR
    plan = plan_fabric(spec)
    assert [h.name for h in plan.hosts] == [f"orlh{i}" for i in range(8)]
    assert [(s.name, s.dpid) for s in plan.switches] == [
        ("orlt0", 0x1000), ("orlt1", 0x1001), ("orlt2", 0x1002), ("orlt3", 0x1003), ("orlo0", 0x2000)]
    server = [l for l in plan.links if l.kind == "server"]
    uplink = [l for l in plan.links if l.kind == "uplink"]
    assert len(server) == 8 and len(uplink) == 8
    # server 3 sits on ToR 1 at port 2
    l3 = server[3]
    assert (l3.node1, l3.port1, l3.intf1, l3.node2, l3.port2, l3.intf2) == (
        "orlh3", 0, "orlh3-eth0", "orlt1", 2, "orlt1-eth2")
    assert all(l.rate_mbps == pytest.approx(spec.server_link_mbps) for l in server)
    # ToR 2 uplink 1 -> ToR port 4, OCS 0 port 1 + 2*2 + 1 = 6
    u = [l for l in uplink if l.node1 == "orlt2" and l.port1 == 4][0]
    assert (u.node2, u.port2, u.intf2) == ("orlo0", 6, "orlo0-eth6")
    assert all(l.rate_mbps == pytest.approx(spec.uplink_mbps) for l in uplink)


def test_every_port_used_once_and_matches_spec():
    spec = FabricSpec(pods=3, tors_per_pod=2, servers_per_tor=3, ocs_count=2, uplinks_per_tor=4,
                      server_gbps=200, uplink_gbps=400, scale=0.005)
    plan = plan_fabric(spec)
    ends = [(l.node1, l.port1) for l in plan.links] + [(l.node2, l.port2) for l in plan.links]
    assert len(ends) == len(set(ends))
    for up in spec.uplinks():
        link = [l for l in plan.links if l.node1 == spec.tor_name(up.tor) and l.port1 == up.tor_port]
        assert len(link) == 1
        assert (link[0].node2, link[0].port2) == (spec.ocs_name(up.ocs), up.ocs_port)
        assert link[0].rate_mbps == pytest.approx(2000.0)
    assert [l.rate_mbps for l in plan.links if l.kind == "server"] == [pytest.approx(1000.0)] * spec.n_servers
    # every OCS port 1..ports_per_ocs has one uplink
    for o in range(spec.ocs_count):
        ports = sorted(l.port2 for l in plan.links if l.node2 == spec.ocs_name(o))
        assert ports == list(range(1, spec.ports_per_ocs + 1))


def test_interface_names_fit_and_carry_prefix():
    plan = plan_fabric(FabricSpec(pods=5, tors_per_pod=10, servers_per_tor=5))
    names = plan.interfaces()
    assert len(names) == len(set(names))
    assert all(n.startswith("orl") and len(n) <= 15 for n in names)


def test_host_batch_static_arp_and_mgmt():
    spec = FabricSpec()
    plan = plan_fabric(spec)
    lines = host_batch(plan, 2)
    neigh = [l for l in lines if l.startswith("neigh")]
    assert len(neigh) == spec.n_servers - 1
    assert f"neigh replace {spec.host_ip(5)} lladdr {spec.host_mac(5)} dev orlh2-eth0 nud permanent" in neigh
    assert not any(spec.host_ip(2) + " " in l for l in neigh)
    assert f"addr add {spec.host_mgmt_ip(2)}/24 dev orlh2-m" in lines
    root = mgmt_root_batch(plan, {s: 1000 + s for s in range(spec.n_servers)})
    assert root[0] == "link add orlmgmt type bridge"
    assert f"addr add {spec.mgmt_gateway_ip}/24 dev orlmgmt" in root
    assert "link add orlm7 type veth peer name orlh7-m netns 1007" in root
    assert not any("ovs" in l for l in root)


def test_bad_spec_rejected_before_anything_is_built():
    from emulation.builder import EmulatedFabric
    with pytest.raises(SpecError, match="controller_port"):
        EmulatedFabric(FabricSpec(), controller_port=70000)
    with pytest.raises(SpecError, match="controller_host"):
        EmulatedFabric(FabricSpec(), controller_port=6653, controller_host="localhost:1")


def test_port_counters_are_read_per_port_and_direction():
    dump = """OFPST_PORT reply (OF1.3) (xid=0x2): 2 ports
  port LOCAL: rx pkts=0, bytes=0, drop=0, errs=0, frame=0, over=0, crc=0
           tx pkts=3, bytes=210, drop=0, errs=0, coll=0
           duration=12.5s
  port  1: rx pkts=10, bytes=15140, drop=0, errs=0, frame=0, over=0, crc=0
           tx pkts=7, bytes=518, drop=0, errs=0, coll=0
           duration=12.5s
"""
    assert parse_port_bytes(dump) == {"LOCAL": {"rx": 0, "tx": 210}, "1": {"rx": 15140, "tx": 518}}
