"""The emulated loop trains MoE too: on scenarios/moe-small.yaml (EP across the four trainer servers, two
ToRs) a training step runs a real Gloo all-to-all of the scaled expert activations across the fabric beside
the gradient all-reduce, the traffic RLSim models (controller.traffic)."""
from __future__ import annotations


import numpy as np
import pytest

from agents.engine import Layout
from controller.traffic import train_bytes, train_traffic
from emulation.builder import port_bytes
from emulation.scenario import load_scenario
from testbed.backends.emulated import EmulatedBackend
from testbed.cluster.agent_pool import running_cluster

pytestmark = pytest.mark.system

SCN = load_scenario("scenarios/moe-small.yaml")


def ocs_bytes(bridge: str) -> int:
    return sum(c["tx"] for c in port_bytes(bridge).values())


def test_moe_training_step_runs_its_all_to_all_across_the_fabric():
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
