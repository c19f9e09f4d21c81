"""End to end on a real emulated RFabric: controller process + Mininet hosts + userspace OVS, real packets.

* a phase change moves traffic onto the new circuits: the OCS flow table holds the phase's circuits and the
  OCS flows of the new first-hop circuits count the probe's packets, which keep arriving;
* a reconfiguration with delay D leaves a loss gap of about D on changed circuits, also where the path's ToR
  routes move to other uplinks, and none on unchanged ones (the same measurement as ``orchestrrl bench
  reconfig``, fewer samples, loose bounds: a check, not a benchmark).
"""
from __future__ import annotations

import re
import subprocess
import time

import pytest

from controller import phases, routing
from emulation.spec import FabricSpec, JobLayout
from testbed.benchmarks.bench_fabric import bench_reconfig
from testbed.cluster.fabric import running_testbed
from testbed.cluster.probes import ProbeStream

pytestmark = pytest.mark.system

SPEC = FabricSpec()  # the default scenario's shape: 2 pods x 2 ToRs x 2 servers, 1 OCS, 2 uplinks per ToR
LAYOUT = JobLayout()


def ocs_counters(bridge: str) -> dict[int, tuple[int, int]]:
    """in_port -> (out_port, n_packets) of an OCS's flows."""
    out = subprocess.run(["ovs-ofctl", "-O", "OpenFlow13", "--no-names", "dump-flows", bridge],
                         capture_output=True, text=True, check=True, timeout=10).stdout
    res = {}
    for line in out.splitlines():
        m = re.search(r"n_packets=(\d+),.*in_port=(\d+) actions=output:(\d+)", line)
        if m:
            res[int(m.group(2))] = (int(m.group(3)), int(m.group(1)))
    return res


def first_hop_ocs_ports(phase: str, src_tor: int, dst_tor: int) -> set[int]:
    """OCS ports where traffic src_tor -> dst_tor enters the OCS layer in ``phase`` (shortest paths)."""
    graph = phases.circuit_graph(SPEC, phases.phase_matchings(SPEC, LAYOUT, phase))
    ports = routing.compute_routes(SPEC, graph).ports(src_tor, dst_tor)
    uplinks = {u.tor_port: u for u in SPEC.uplinks() if u.tor == src_tor}
    return {uplinks[p].ocs_port for p in ports}


def poll(cond, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_phase_change_moves_traffic_onto_new_circuits():
    src, dst = 0, SPEC.n_servers - 1  # pod 0 -> pod 1
    src_tor, dst_tor = SPEC.tor_of_server(src), SPEC.tor_of_server(dst)
    with running_testbed(SPEC, LAYOUT, initial_phase="train", delay_ms=10) as tb:
        stream = ProbeStream(tb.fabric, src, dst, pps=500, duration_s=6.0, port=47100).start()
        ocs = SPEC.ocs_name(0)
        seen = {}
        for phase in ("gen", "sync", "train"):
            rep = tb.client.set_phase(phase, delay_ms=10)
            assert rep["status"] == "done" and tb.client.state()["phase"] == phase
            want = phases.phase_matchings(SPEC, LAYOUT, phase)[0]
            flows = ocs_counters(ocs)
            assert {p: o for p, (o, _) in flows.items()} == {**{a: b for a, b in want.pairs()},
                                                               **{b: a for a, b in want.pairs()}}
            entry = first_hop_ocs_ports(phase, src_tor, dst_tor)
            assert entry, f"{phase}: no path from ToR {src_tor} to ToR {dst_tor}"
            before = sum(flows[p][1] for p in entry)
            # the probe's packets now enter the OCS on this phase's first-hop circuits
            assert poll(lambda: sum(ocs_counters(ocs)[p][1] for p in entry) >= before + 50), phase
            seen[phase] = entry
        res = stream.summary()
    # packets arrived in every phase: the stream lost only what the three blackouts (about 10 ms each) cost
    assert res["received"] >= 0.8 * res["sent"], res["lost"]
    assert seen["gen"] != seen["train"] or seen["sync"] != seen["train"]  # traffic really moved


@pytest.mark.parametrize("delay_ms", [0.0, 10.0, 50.0])
def test_loss_gap_tracks_the_programmed_delay(delay_ms):
    res = bench_reconfig(delay_ms, samples=8, pps=2000.0)
    assert res["unchanged_loss"] == 0 and res["unchanged_loss_rerouted"] == 0, res
    if delay_ms > 0:
        assert res["changed_lost"] > 0, res
    # about D where the same uplinks stay paired: a few ms of slack for a shared 2-core CI machine (the
    # benchmark reports the real spread). Below D: the controller sends the adds D after it sent the deletes,
    # counting on both taking effect one install latency later; on a loaded machine a delete lands later than
    # the adds that follow it and the dark time comes out short: 8.4 ms for D = 10 beside two CPU-bound jobs
    # (2026-12-06), and a median of 6.75 ms over 4 samples in a fresh-clone CI run with nothing else on the
    # machine (2026-12-07; quiet, 6 runs of 4 gave medians 9.5-11.0, single samples 8.0-12.5). So 8 samples and
    # 5 ms of slack: still far from D = 0's blackout, and a delay not applied (or applied twice) still fails
    low = max(delay_ms - 5.0, 0.5 * delay_ms)
    assert low <= res["blackout_ms_p50"] <= delay_ms + 6.0, res
    # where the path's ToR routes move to other uplinks, the routes toward the new circuits may only go in
    # once the deletes are confirmed (before, they would send into the old circuit), so the dark interval is
    # the larger of D and that confirmation plus the ToRs' route update (~10 ms on this userspace datapath,
    # quiet: a D of 0 cannot be met): the probe's blackout is held to the dark interval the controller reports
    dark_ms = delay_ms + max(0.0, res["overhead_stages_ms_p50_rerouted"]["dark_minus_delay"])
    assert low <= res["blackout_ms_p50_rerouted"] <= dark_ms + 6.0, res
