"""The emulated loop trains MoE too: on scenarios/moe-small.yaml (EP across the four trainer servers, two
ToRs) a training step runs a real Gloo all-to-all of the scaled expert activations across the fabric beside
the gradient all-reduce, the traffic RLSim models (controller.traffic)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from agents.engine import Layout
from controller.phases import train_part_matchings
from controller.traffic import train_bytes, train_traffic
from emulation.builder import port_bytes
from emulation.scenario import load_scenario
from testbed.backends.emulated import EmulatedBackend
from testbed.cluster.agent_pool import running_cluster

pytestmark = pytest.mark.system

SCN = load_scenario("scenarios/moe-small.yaml")
REWIRED = dataclasses.replace(SCN, controller=dataclasses.replace(SCN.controller, train_rewire=True))


def ocs_bytes(bridge: str) -> int:
    return sum(c["tx"] for c in port_bytes(bridge).values())


def test_moe_training_step_runs_its_all_to_all_across_the_fabric():
    """... and re-wired inside the train phase (controller.train_rewire) the controller installs the EP
    stage's own topology, whose two circuits between the trainer ToRs both carry the all-to-all."""
    spec = SCN.fabric
    with running_cluster(SCN) as (tb, pool):
        groups = dict(pool.train_groups())
        assert groups["ep_alltoall-0"].members == (0, 1, 2, 3)  # one EP group over both trainer ToRs
        gps = spec.gpus_per_server
        layouts = {s: Layout.parse(f"TP2x{gps // 2}", gps) for s in pool.generators}
        b = EmulatedBackend(SCN, layouts, cluster=(tb, pool))
        assert b.set_phase("train", None, None).decision == "switched"
        lengths = np.full(SCN.workload.prompts_per_step * SCN.workload.samples_per_prompt, 200)
        before = ocs_bytes(spec.ocs_name(0))
        tr = b.train(0, lengths)
        crossed = ocs_bytes(spec.ocs_name(0)) - before
        # the same step re-wired: the controller holds the mp part's circuits (every trainer-ToR uplink to the
        # EP partner ToR), and before the all-reduce the rule keeps them (the rings run on them: no gain)
        rw = EmulatedBackend(REWIRED, layouts, cluster=(tb, pool))
        assert rw.model.topology_for("train") == "train:mp"
        assert rw.set_phase("train:mp", 300.0, 700.0).decision == "switched"
        assert tb.client.state()["topology"] == "train:mp"
        mp = train_part_matchings(spec, SCN.layout, rw.model.traffic, "mp")
        assert tb.client.circuits() == {str(o): m.to_json() for o, m in mp.items()}
        ocs = spec.ocs_name(0)
        before = port_bytes(ocs)
        tr_mp = rw.train(1, lengths)
        after = port_bytes(ocs)
    assert tr.detail["correct"] and tr.detail["alltoall_s"] > 0 and tr.detail["allreduce_s"] > 0
    # what the all-to-all sends across ToRs: each of the four members sends a quarter of its bytes to every
    # member, so half of them to the two on the other ToR (scaled bytes)
    tl = b.model.train_layout
    tt = train_traffic(tl, train_bytes(b.cm, tl, float(lengths.sum() + len(lengths) * SCN.workload.prompt_tokens)))
    a2a = tt.stage("ep_alltoall").groups[0].nbytes * spec.scale
    cross = 4 * a2a / 2  # four servers, half of each one's all-to-all bytes to the other ToR
    assert crossed >= 0.95 * cross  # every cross-ToR byte went through the OCS (plus the all-reduce's)
    assert tr.detail["alltoall_bytes"] == pytest.approx(a2a, rel=0.01)
    stages = [u["stage"] for u in b.phase_util if u["phase"] == "train"]
    assert stages == ["ep_alltoall", "dp_allreduce"]
    a2a_rec = next(u for u in b.phase_util if u["stage"] == "ep_alltoall")
    assert a2a_rec["modelled_s"] > 0 and a2a_rec["measured_s"] > 0  # the cross-check covers it

    assert tr_mp.detail["correct"] and tr_mp.detail["topology"] == "train:mp"
    assert tr_mp.detail["rewire_decision"] == "deferred" and tr_mp.detail["topology_end"] == "train:mp"
    # modelled 1.38 s against 1.84 s on the one train topology at these lengths (the servers' links bind, not
    # the one circuit between the trainer ToRs)
    assert tr_mp.detail["modelled_alltoall_s"] < 0.8 * tr.detail["modelled_alltoall_s"]
    # both circuits between the trainer ToRs carry the all-to-all, evenly: the source ToRs pin each server
    # pair to one of the parallel uplinks (controller.routing.pinned_flows), where the select group's hash of
    # the four connections splits them unevenly in 5 of 8 hashings
    trainer_ports = {p for t in (0, 1) for p in (spec.uplink(t, u).ocs_port for u in range(spec.uplinks_per_tor))}
    per_circuit = [sum(after[str(p)]["tx"] - before[str(p)]["tx"] for p in pair) for pair in mp[0].pairs()
                   if set(pair) <= trainer_ports]
    assert len(per_circuit) == 2 and min(per_circuit) > 0.4 * sum(per_circuit)
    assert sum(per_circuit) >= 0.95 * cross  # every cross-ToR byte crossed one of the two circuits
