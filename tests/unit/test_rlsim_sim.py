"""One simulated RL iteration: structure, reproducibility, scaling, reconfiguration and the CLI."""
import dataclasses
import json
import os

import numpy as np
import pytest

from agents.costmodel import CostModel
from emulation.scenario import ControllerSettings, Scenario, load_scenario
from emulation.spec import FabricSpec, JobLayout
from emulation.validation import SpecError
from emulation.workload import WorkloadSpec
from rlsim.fabrics import FABRICS
from rlsim.sim import SimSettings, replica_decode_s, scale_scenario, simulate_iteration
from testbed.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT = os.path.join(ROOT, "scenarios", "default.yaml")


def small(**workload):
    fabric = FabricSpec(pods=4, tors_per_pod=2, servers_per_tor=2, server_gbps=3200, uplink_gbps=400,
                        uplinks_per_tor=16, ocs_count=4)
    w = WorkloadSpec(model="Qwen2.5-7B", prompts_per_step=16, samples_per_prompt=4, **workload)
    return Scenario(name="small", seed=3, fabric=fabric, layout=JobLayout((0, 1), (2, 3)), workload=w,
                    controller=ControllerSettings(initial_phase="gen"))


@pytest.mark.parametrize("fabric", FABRICS)
def test_result_has_the_interface_keys(fabric):
    r = simulate_iteration(small(), fabric)
    assert set(r["phases"]) == {"gen_s", "sync_s", "train_s"}
    assert r["iteration_s"] == pytest.approx(sum(r["phases"].values()))
    assert all(v > 0 for v in r["phases"].values())
    assert r["cost_usd"] > 0 and r["wall_s"] > 0 and r["gpus"] == 128
    json.dumps(r)


def test_same_seed_same_result_other_seed_differs():
    a = simulate_iteration(small(), "rfabric")
    b = simulate_iteration(small(), "rfabric")
    c = simulate_iteration(dataclasses.replace(small(), seed=4), "rfabric")
    assert a["iteration_s"] == b["iteration_s"] and a["phases"] == b["phases"]
    assert c["phases"]["gen_s"] != a["phases"]["gen_s"]


def test_generation_is_the_long_tail():
    r = simulate_iteration(small(), "fat-tree")
    g = r["detail"]["gen"]
    assert g["compute_s"] > 2 * g["replica_p50_s"]  # the slowest replica sets the phase
    # and a spike at the cap makes generation longer
    plain = simulate_iteration(small(max_response_tokens=8192), "fat-tree")
    capped = simulate_iteration(small(cap_fraction=0.3, max_response_tokens=8192), "fat-tree")
    assert capped["phases"]["gen_s"] > plain["phases"]["gen_s"]


def test_replica_decode_matches_step_sum_without_queueing():
    cm = CostModel.for_names("Qwen2.5-7B", "H800")
    lengths = np.array([3, 5])
    t = replica_decode_s(cm, lengths, prompt=10, tp=1, slots=8)
    # steps 0..2: two sequences; steps 3..4: one; contexts at segment midpoints
    expect = 3 * cm.decode_step_s(2, 2 * (10 + 1.5)) + 2 * cm.decode_step_s(1, 10 + 4)
    assert t == pytest.approx(expect)
    # one slot serialises them
    one = replica_decode_s(cm, lengths, prompt=10, tp=1, slots=1)
    assert one > t


def test_oversubscription_never_speeds_up_and_costs_less():
    base = simulate_iteration(small(), "fat-tree")
    o4 = simulate_iteration(small(), "fat-tree-4to1")
    assert o4["iteration_s"] >= base["iteration_s"]
    assert o4["cost_usd"] < base["cost_usd"]


def test_rfabric_reconfiguration_follows_slack_rule():
    fast = simulate_iteration(small(), "rfabric", settings=SimSettings(t_ocs_ms=0.0))
    slow = simulate_iteration(small(), "rfabric", settings=SimSettings(t_ocs_ms=100.0))
    rec = slow["detail"]["reconfig"]
    assert set(rec) == {"gen->train", "train->sync", "sync->gen"}
    for v in rec.values():
        assert v["hidden"] == (v["window_ms"] is None or v["window_ms"] > 100.0)
        if not v["hidden"]:
            assert v["stall_s"] == pytest.approx(0.1 - v["window_ms"] / 1e3)
    stalls = sum(v["stall_s"] for v in rec.values())
    assert slow["iteration_s"] == pytest.approx(fast["iteration_s"] + stalls)


def test_scale_scenario():
    s = small()
    assert scale_scenario(s, None) is s
    big = scale_scenario(s, 256)  # pods of 32 GPUs
    assert big.fabric.pods == 8 and big.fabric.n_gpus == 256
    assert len(big.layout.gen_pods) == 4 and set(big.layout.train_pods) | set(big.layout.gen_pods) == set(range(8))
    for bad in (0, 33, 32, -64, 48):
        with pytest.raises(SpecError, match="gpus"):
            scale_scenario(s, bad)


def test_moe_and_pipeline_traffic_appear():
    s = small()
    moe = dataclasses.replace(s, workload=dataclasses.replace(s.workload, model="Qwen3-30B-A3B", train_ep=2))
    r = simulate_iteration(moe, "fat-tree")
    assert r["detail"]["train"]["ep_alltoall_s"] > 0
    pp = dataclasses.replace(s, workload=dataclasses.replace(s.workload, train_pp=2))
    r = simulate_iteration(pp, "fat-tree")
    assert r["detail"]["train"]["pp_p2p_s"] > 0
    bad = dataclasses.replace(s, workload=dataclasses.replace(s.workload, train_ep=3))
    with pytest.raises(SpecError, match="train_ep"):
        simulate_iteration(bad, "fat-tree")


def test_cli_json_and_errors(capsys):
    assert main(["sim", DEFAULT, "--fabric", "rail", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert {"iteration_s", "phases", "cost_usd", "wall_s"} <= set(r)
    assert main(["sim", DEFAULT, "--gpus", "100"]) == 2
    assert "gpus" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["sim", DEFAULT, "--fabric", "torus"])
    assert e.value.code == 2
    assert "rfabric" in capsys.readouterr().err
    assert main(["sim", os.path.join(ROOT, "nope.yaml")]) == 2
    assert main(["sim", "sweep", DEFAULT]) == 2  # --out missing
