"""Build a real 2-pod emulated fabric: bridges, OpenFlow ports, shaping, mgmt network, forwarding, teardown.

Flows are programmed with ovs-ofctl here (a test tool standing in for the controller).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from emulation import registry, shaping
from emulation.builder import EmulatedFabric
from emulation.netlink import NoSuchLink
from emulation.spec import FabricSpec

pytestmark = pytest.mark.system

SPEC = FabricSpec(pods=2, tors_per_pod=2, servers_per_tor=2, ocs_count=1, uplinks_per_tor=2,
                  server_gbps=400, uplink_gbps=2500, scale=0.001, host_tcp_cc="reno")
# servers 400 Mb/s; uplinks 2500 Mb/s, above Mininet's own 1000 Mb/s limit for bw=, so the builder's htb shaping
# is what sets it. reno: no machine's default, so the hosts have it only if the builder set it
UNUSED_CONTROLLER_PORT = 16699  # nothing listens: fail-mode secure bridges forward only what we program


def vsctl(*args: str) -> str:
    return subprocess.run(["ovs-vsctl", "--timeout=5", *args], capture_output=True, text=True,
                          check=True).stdout.strip()


def wait_for(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


def add_flows(bridge: str, flows: list[str]) -> None:
    for f in flows:
        subprocess.run(["ovs-ofctl", "-O", "OpenFlow13", "add-flow", bridge, f], check=True)


def tor_flows(spec: FabricSpec) -> None:
    for t in range(spec.n_tors):
        flows = [f"priority=10,ip,nw_dst={spec.host_ip(s)},actions=output:{spec.server_port(s)}"
                 for s in spec.servers_on_tor(t)]
        flows.append(f"priority=1,ip,actions=output:{spec.uplink(t, 0).tor_port}")
        add_flows(spec.tor_name(t), flows)


def probe(fab: EmulatedFabric, tmp_path, src: int, dst: int, tag: str) -> dict:
    recv_out, send_out, ready = (str(tmp_path / f"{tag}-{n}") for n in ("recv.json", "send.json", "ready"))
    r = fab.popen(dst, [sys.executable, "-m", "emulation.probe", "recv", "--port", "47000", "--duration", "1.5",
                        "--out", recv_out, "--ready-file", ready])
    wait_for(lambda: os.path.exists(ready), 10, "probe receiver bound")
    s = fab.popen(src, [sys.executable, "-m", "emulation.probe", "send", "--dst", fab.spec.host_ip(dst),
                        "--port", "47000", "--pps", "1000", "--duration", "0.3", "--out", send_out])
    assert s.wait(timeout=20) == 0 and r.wait(timeout=20) == 0
    from emulation.probe import summarize
    with open(send_out) as f1, open(recv_out) as f2:
        return summarize(json.load(f1), json.load(f2))


# tc prints a rate in whole units of the largest unit that fits (2613Mbit for 2,613.95 Mb/s): 1 Mb/s is its
# precision above 1 Gb/s, still far finer than the wire factor it checks (x1.046)
TC_PRINT_MBPS = 1.0


def tc_rate_mbps(intf: str, netns_pid: int | None = None) -> float | None:
    """The htb class 1:1 rate as `tc class show` prints it (an independent reader of what netlink set)."""
    argv = (["nsenter", "-t", str(netns_pid), "-n"] if netns_pid else []) + ["tc", "class", "show", "dev", intf]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=10).stdout
    units = {"bit": 1e-6, "kbit": 1e-3, "mbit": 1.0, "gbit": 1e3}
    for line in out.splitlines():
        w = line.split()
        if w[:3] == ["class", "htb", "1:1"] and "rate" in w:
            r = w[w.index("rate") + 1].lower()
            unit = next(u for u in sorted(units, key=len, reverse=True) if r.endswith(u))
            return float(r[: -len(unit)]) * units[unit]
    return None


def tc_class_packets(intf: str, netns_pid: int | None = None) -> dict[str, int]:
    """Packets sent through every htb class of ``intf``, as `tc -s class show` prints them."""
    argv = (["nsenter", "-t", str(netns_pid), "-n"] if netns_pid else []) + ["tc", "-s", "class", "show", "dev", intf]
    out = subprocess.run(argv, capture_output=True, text=True, check=True, timeout=10).stdout
    got, cls = {}, None
    for line in out.splitlines():
        w = line.split()
        if w[:2] == ["class", "htb"]:
            cls = w[2]
        elif w[:1] == ["Sent"] and cls is not None:
            got[cls] = int(w[3])
    return got


def test_build_check_forward_and_stop(orl_state_dir, no_capacity_file, orl_leftovers, tmp_path):
    assert orl_leftovers() == {"bridges": [], "interfaces": []}, "leftovers from an earlier run: orchestrrl clean"
    fab = EmulatedFabric(SPEC, controller_port=UNUSED_CONTROLLER_PORT)
    with fab:
        # bridges: names, dpids, userspace datapath, OpenFlow13, fail-mode secure, controller target
        assert sorted(orl_leftovers()["bridges"]) == sorted(fab.bridge_names())
        for sw in fab.plan.switches:
            assert vsctl("get", "bridge", sw.name, "datapath_id").strip('"') == "%016x" % sw.dpid
            assert vsctl("get", "bridge", sw.name, "fail_mode") == "secure"
            assert vsctl("get", "bridge", sw.name, "datapath_type") == "netdev"
            assert "OpenFlow13" in vsctl("get", "bridge", sw.name, "protocols")
            ctrl = vsctl("get", "bridge", sw.name, "controller").strip("[]")
            assert vsctl("get", "controller", ctrl, "target").strip('"') == f"tcp:127.0.0.1:{UNUSED_CONTROLLER_PORT}"
        assert sorted(fab.dpids()) == sorted([0x1000, 0x1001, 0x1002, 0x1003, 0x2000])
        # every host's namespace has the spec's TCP congestion control, whatever the machine's default
        for s in range(SPEC.n_servers):
            cc = subprocess.run(["nsenter", "-t", str(fab.host(s).pid), "-n", "sysctl", "-n",
                                 "net.ipv4.tcp_congestion_control"], capture_output=True, text=True, check=True)
            assert cc.stdout.strip() == "reno", (s, cc.stdout)
        # OpenFlow port numbers as spec.py documents
        for s in range(SPEC.n_servers):
            tor = SPEC.tor_name(SPEC.tor_of_server(s))
            assert vsctl("get", "interface", f"{tor}-eth{SPEC.server_port(s)}", "ofport") == str(SPEC.server_port(s))
        for up in SPEC.uplinks():
            assert vsctl("get", "interface", f"{SPEC.tor_name(up.tor)}-eth{up.tor_port}", "ofport") == str(up.tor_port)
            assert vsctl("get", "interface", f"{SPEC.ocs_name(up.ocs)}-eth{up.ocs_port}", "ofport") == str(up.ocs_port)
        # htb on both ends of every link, at the link's payload rate (read through netlink, and by tc
        # independently: tc shows the frame rate, shaping.WIRE_PER_PAYLOAD above it)
        wire = shaping.WIRE_PER_PAYLOAD
        for link in fab.plan.links:
            assert shaping.read_rate_mbps(link.intf2) == pytest.approx(link.rate_mbps, rel=1e-4)
            assert tc_rate_mbps(link.intf2) == pytest.approx(link.rate_mbps * wire, abs=TC_PRINT_MBPS)
            if link.kind == "uplink":
                assert shaping.read_rate_mbps(link.intf1) == pytest.approx(2500.0, rel=1e-4)
            else:
                pid = fab.host(int(link.node1[len("orlh"):])).pid
                assert shaping.read_rate_mbps(link.intf1, netns_pid=pid) == pytest.approx(400.0, rel=1e-4)
                assert tc_rate_mbps(link.intf1, pid) == pytest.approx(400.0 * wire, abs=TC_PRINT_MBPS)
        # live rate change, in the root namespace and in a host's
        shaping.change_rate("orlt0-eth3", 1500.0)
        assert shaping.read_rate_mbps("orlt0-eth3") == pytest.approx(1500.0, rel=1e-4)
        assert tc_rate_mbps("orlt0-eth3") == pytest.approx(1500.0 * wire, abs=TC_PRINT_MBPS)
        with shaping.Shaper(fab.host(0).pid) as sh:
            sh.change_rate(fab.intf_of(0), 123.0)
        assert tc_rate_mbps(fab.intf_of(0), fab.host(0).pid) == pytest.approx(123.0 * wire, abs=TC_PRINT_MBPS)
        with pytest.raises(NoSuchLink):
            shaping.change_rate("orlt0-eth99", 100.0)
        # management network: root namespace reaches every host's mgmt IP; never on OVS
        all_ports = " ".join(vsctl("list-ports", b) for b in fab.bridge_names())
        assert "orlm" not in all_ports and "-m" not in all_ports
        listener = ("import socket,sys; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1);"
                    "s.bind((sys.argv[1], 7000)); s.listen(); print('ok', flush=True);"
                    "c,_=s.accept(); c.sendall(sys.argv[1].encode()); c.close()")
        for s in range(SPEC.n_servers):
            p = fab.popen(s, [sys.executable, "-c", listener, SPEC.host_mgmt_ip(s)], stdout=subprocess.PIPE,
                          text=True)
            assert p.stdout.readline().strip() == "ok"
            with socket.create_connection((SPEC.host_mgmt_ip(s), 7000), timeout=5) as c:
                assert c.recv(64).decode() == SPEC.host_mgmt_ip(s)
            p.wait(timeout=5)
        # forwarding through ToR -> OCS -> ToR: nothing crosses the OCS until its circuit exists
        tor_flows(SPEC)
        before = probe(fab, tmp_path, 0, 4, "nocircuit")
        assert before["sent"] > 0 and before["received"] == 0
        a, b = SPEC.uplink(0, 0).ocs_port, SPEC.uplink(2, 0).ocs_port
        add_flows(SPEC.ocs_name(0), [f"in_port={a},actions=output:{b}", f"in_port={b},actions=output:{a}"])
        before_cls = tc_class_packets(fab.intf_of(0), fab.host(0).pid)
        after = probe(fab, tmp_path, 0, 4, "circuit")
        assert after["received"] >= 0.95 * after["sent"]
        # the probe's small datagrams (92-byte IP packets) took the link's small-packet class, first in line
        cls = tc_class_packets(fab.intf_of(0), fab.host(0).pid)
        assert set(cls) == {"1:1", "1:10", "1:20"}
        assert cls["1:10"] - before_cls["1:10"] >= after["sent"]
        assert cls["1:1"] - before_cls["1:1"] >= cls["1:10"] - before_cls["1:10"]  # the link class counts all
        # ...but a small TCP segment that carries data stays behind its connection's queued data (PSH: bulk
        # class), so it cannot overtake it; the receiver's pure ACKs still go first
        n_msgs = 40
        rx = ("import socket,sys; s=socket.socket(); s.bind((sys.argv[1], 7001)); s.listen(); print('ok', flush=True);"
              "c,_=s.accept(); n=0\nwhile (b := c.recv(4096)): n += len(b)\nprint(n, flush=True)")
        tx = ("import socket,sys,time; c=socket.create_connection((sys.argv[1], 7001));"
              "c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n"
              f"for _ in range({n_msgs}): c.sendall(b'x' * 16); time.sleep(0.005)\nc.close()")
        srv = fab.popen(4, [sys.executable, "-c", rx, SPEC.host_ip(4)], stdout=subprocess.PIPE, text=True)
        assert srv.stdout.readline().strip() == "ok"
        def classes(h: int) -> dict[str, int]:
            return tc_class_packets(fab.intf_of(h), fab.host(h).pid)

        tx0, rx0 = classes(0), classes(4)
        assert fab.popen(0, [sys.executable, "-c", tx, SPEC.host_ip(4)]).wait(timeout=20) == 0
        assert srv.stdout.readline().strip() == str(16 * n_msgs)
        srv.wait(timeout=5)
        tx1, rx1 = classes(0), classes(4)
        assert tx1["1:20"] - tx0["1:20"] >= n_msgs  # 68-byte data segments, each with PSH: the bulk class
        assert tx1["1:10"] - tx0["1:10"] <= 6  # the SYN, the FIN and the pure ACKs of opening and closing
        assert rx1["1:10"] - rx0["1:10"] >= n_msgs // 2  # the receiver's (delayed) pure ACKs: first in line
        # a long-running host process, stopped by stop()
        sleeper = fab.popen(3, ["sleep", "60"])
        shells = [r.pid for r in registry.list_processes() if r.role in ("mnhost", "mnswitch")]
        assert len(shells) == SPEC.n_servers + SPEC.n_tors + SPEC.ocs_count
        times = dict(fab.timings)
    fab.stop()  # idempotent
    assert sleeper.poll() is not None
    assert orl_leftovers() == {"bridges": [], "interfaces": []}
    assert not any(registry.process_alive(p) for p in shells)
    assert registry.list_processes() == [] and registry.list_resources() == []
    print(json.dumps({"bench": "fabric_2pod", "build_s": times["build_s"], "start_s": times["start_s"],
                      "stop_s": fab.timings["stop_s"]}))


def test_failed_start_cleans_up_and_wait_connected_gets_all_dpids(orl_state_dir, no_capacity_file, orl_leftovers):
    seen = {}

    def wait_connected(dpids: set[int], timeout_s: float) -> None:
        seen["dpids"], seen["timeout"] = set(dpids), timeout_s
        seen["bridges_up"] = orl_leftovers()["bridges"]
        raise TimeoutError("controller never saw the switches")

    fab = EmulatedFabric(SPEC, controller_port=UNUSED_CONTROLLER_PORT, wait_connected=wait_connected,
                         connect_timeout_s=7.0)
    with pytest.raises(TimeoutError):
        fab.start()
    assert seen["dpids"] == set(fab.dpids()) and seen["timeout"] == 7.0
    assert sorted(seen["bridges_up"]) == sorted(fab.bridge_names())
    assert orl_leftovers() == {"bridges": [], "interfaces": []}
    assert registry.list_processes() == [] and registry.list_resources() == []
    fab.stop()


def test_capacity_check_warns(tmp_path, monkeypatch, caplog):
    from emulation import capacity
    monkeypatch.setenv("ORCHESTRRL_CAPACITY_FILE", str(tmp_path / "cap.json"))
    fab = EmulatedFabric(SPEC, controller_port=UNUSED_CONTROLLER_PORT)
    assert fab.capacity_check()["measured"] is False
    capacity.save_capacity(2.0, 0.95, "orchestrrl bench fabric")
    fab2 = EmulatedFabric(SPEC, controller_port=UNUSED_CONTROLLER_PORT)
    chk = fab2.capacity_check()
    assert chk["ok"] is False and chk["aggregate_emulated_gbps"] == pytest.approx(3.2)


def test_hosts_get_their_congestion_control_on_a_fresh_root_namespace(orl_state_dir, no_capacity_file, orl_leftovers,
                                                                       caplog):
    """A freshly booted machine allows only 'reno bbr' in namespaces other than the root one: the builder adds
    the scenario's algorithm to the root namespace's allowed list before it configures the hosts, instead of
    failing every host (`sysctl: ... Operation not permitted`). The machine's list is restored afterwards."""
    from emulation import machine

    allowed = machine.by_key("net.ipv4.tcp_allowed_congestion_control")
    if "cubic" not in machine.available_tcp_ccs():
        pytest.skip("this kernel offers no cubic")
    before = machine.read(allowed)
    spec = FabricSpec(pods=1, tors_per_pod=1, servers_per_tor=2, ocs_count=1, uplinks_per_tor=1,
                      server_gbps=400, uplink_gbps=400, scale=0.001, host_tcp_cc="cubic")
    fresh = " ".join(w for w in before.split() if w != "cubic") or "reno"
    try:
        machine.write(allowed, fresh)
        assert "cubic" not in machine.read(allowed).split()
        with EmulatedFabric(spec, controller_port=UNUSED_CONTROLLER_PORT) as fab:
            assert machine.read(allowed).split() == fresh.split() + ["cubic"]
            for s in range(spec.n_servers):
                cc = subprocess.run(["nsenter", "-t", str(fab.host(s).pid), "-n", "sysctl", "-n",
                                     "net.ipv4.tcp_congestion_control"], capture_output=True, text=True, check=True)
                assert cc.stdout.strip() == "cubic", (s, cc.stdout)
        assert "tcp_allowed_congestion_control" in caplog.text and "added cubic" in caplog.text
    finally:
        machine.write(allowed, before)
    assert machine.read(allowed) == before
    assert orl_leftovers() == {"bridges": [], "interfaces": []}
