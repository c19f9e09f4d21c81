"""A static packet fabric (fabric.kind a Fat-Tree) in the live loop: spine bridges with the builder's fixed
rule, no controller; a real Gloo all-reduce crosses the spine at the tree's shaped (oversubscribed) rate, and
the emulated backend answers phase changes with "static"."""
from __future__ import annotations

import dataclasses
import re
import subprocess

import numpy as np
import pytest

from emulation import sendbuf, shaping
from emulation.builder import port_bytes
from emulation.scenario import load_scenario
from testbed.cluster.agent_pool import running_cluster

pytestmark = pytest.mark.system

BASE = load_scenario("scenarios/default.yaml")
SCN = dataclasses.replace(BASE, fabric=dataclasses.replace(BASE.fabric, kind="fat-tree-4to1"))
OVS_LOG = "/var/log/openvswitch/ovs-vswitchd.log"


def _send_errors() -> int:
    """ovs-vswitchd's "error sending Ethernet packet" warnings so far (a packet it dropped on a full send socket)."""
    try:
        with open(OVS_LOG, errors="replace") as f:
            return sum("error sending Ethernet packet" in line for line in f)
    except OSError:
        return 0


def port_tx_bytes(bridge: str) -> dict[str, int]:
    return {port: c["tx"] for port, c in port_bytes(bridge).items()}


@pytest.fixture(scope="module")
def cluster():
    with running_cluster(SCN) as (tb, pool):
        yield tb, pool


def test_static_tree_comes_up_without_a_controller(cluster):
    tb, pool = cluster
    spec = SCN.fabric
    assert tb.controller is None
    # the spine holds the builder's rule: one flow per server address, nothing else
    flows = subprocess.run(["ovs-ofctl", "-O", "OpenFlow13", "dump-flows", spec.ocs_name(0)], capture_output=True,
                           text=True, check=True).stdout
    assert sum("nw_dst=" in line for line in flows.splitlines()) == spec.n_servers
    rate = subprocess.run(["tc", "class", "show", "dev", f"{spec.ocs_name(0)}-eth1"], capture_output=True, text=True,
                          check=True).stdout
    # 2 servers x 400 Mb/s / 4: the ToR's whole up capacity on its one uplink, as a frame rate (tc shows what htb
    # counts: frames, shaping.WIRE_PER_PAYLOAD above the payload rate)
    kbit = re.search(r"class htb 1:1 root rate (\d+)Kbit", rate)
    assert kbit, rate
    assert int(kbit.group(1)) == pytest.approx(200_000 * shaping.WIRE_PER_PAYLOAD, abs=1)


def test_gloo_all_reduce_crosses_the_spine_at_the_shaped_rate(cluster):
    tb, pool = cluster
    spec = SCN.fabric
    trainers = pool.trainers  # servers 0, 1 (ToR 0) and 2, 3 (ToR 1): the ring crosses the spine twice
    nbytes = 4 * 2**20
    before = port_tx_bytes(spec.ocs_name(0))
    res = pool.call_all(trainers, "all_reduce", lambda s: {"group": pool.group("trainers"), "nbytes": nbytes,
                                                           "iters": 1, "warmup": 0, "timeout_s": 120}, 180)
    after = port_tx_bytes(spec.ocs_name(0))
    assert all(r["correct"] for r in res.values())
    crossed = sum(after[p] - before.get(p, 0) for p in after)
    ring_bytes = 2 * (len(trainers) - 1) / len(trainers) * nbytes  # what each ring hop carries
    assert crossed >= 2 * ring_bytes  # two of the four hops leave their ToR: both went through the spine
    t = max(r["times_s"][0] for r in res.values())
    # a hop out of a ToR is one flow through its 200 Mb/s uplink: the all-reduce cannot beat that, and the
    # 400 Mb/s server links alone would allow twice the speed (a timing bound only the shaping makes true)
    floor = ring_bytes * 8 / (spec.static_uplink_mbps * 1e6)
    assert t >= 0.95 * floor
    assert t < 20 * floor  # and it does finish (no stuck flow)


def test_emulated_backend_on_a_static_tree(cluster):
    from agents.engine import Layout
    from testbed.backends.emulated import EmulatedBackend

    tb, pool = cluster
    gps = SCN.fabric.gpus_per_server
    layouts = {s: Layout.parse(f"TP1x{gps}", gps) for s in pool.generators}
    b = EmulatedBackend(SCN, layouts, cluster=(tb, pool))
    d = b.set_phase("train", 100.0, 5.0)
    assert d.decision == "static" and "static" in d.reason
    dropped = _send_errors()
    sy = b.sync_weights(1)
    assert sy.detail["consistent"] and sy.detail["chains"] == min(len(pool.trainers), len(pool.generators))
    # the striped sync's flows converge on the 4:1 ToR uplinks: queued there, they must fit Open vSwitch's one
    # send socket (emulation/sendbuf.py), or it drops them with nothing but this log line to say so
    ok, why = sendbuf.check()
    assert ok, why
    assert _send_errors() == dropped
    tr = b.train(0, np.full(64, 300))
    assert tr.detail["correct"] and tr.detail["allreduce_s"] > 0
    assert [u["stage"] for u in b.phase_util if u["phase"] == "train"] == ["dp_allreduce"]
