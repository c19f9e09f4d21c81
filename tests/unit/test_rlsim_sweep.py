"""Sweeps: planning, the serial path, outputs, and the Ray path when Ray is importable."""
import json

import pytest

from emulation.scenario import Scenario
from emulation.spec import FabricSpec, JobLayout
from emulation.validation import SpecError
from emulation.workload import WorkloadSpec
from rlsim.sweep import pareto_front, plan, ray_available, run_sweep, summarise, write_outputs

SCN = Scenario(name="tiny", seed=1,
               fabric=FabricSpec(pods=2, tors_per_pod=2, servers_per_tor=2, server_gbps=3200, uplink_gbps=400,
                                 uplinks_per_tor=16, ocs_count=4),
               layout=JobLayout((0,), (1,)),
               workload=WorkloadSpec(prompts_per_step=8, samples_per_prompt=4, max_response_tokens=4096))


def test_plan_varies_t_ocs_only_for_rewiring_fabrics():
    pts = plan(SCN, ["fat-tree", "rfabric", "mixnet"], [64, 128], [0.001, 10.0])
    assert len(pts) == 2 * (1 + 2 + 1)  # MixNet is static for the job: one T_ocs
    assert {p.t_ocs_ms for p in pts if p.fabric == "fat-tree"} == {SCN.fabric.reconfig_delay_ms}
    with pytest.raises(SpecError, match="fabrics"):
        plan(SCN, ["torus"], [64], [1.0])
    with pytest.raises(SpecError, match="gpus"):
        plan(SCN, ["rfabric"], [100], [1.0])
    with pytest.raises(SpecError, match="t_ocs_ms"):
        plan(SCN, ["rfabric"], [64], [-1.0])


def test_pareto_front():
    pts = [(1.0, 1.0), (2.0, 3.0), (2.0, 2.0), (3.0, 2.5), (0.5, 0.2)]
    assert pareto_front(pts) == [4, 0, 1]


def test_serial_sweep_writes_json_and_plots(tmp_path):
    pts = plan(SCN, ["fat-tree", "fat-tree-4to1", "rfabric"], [64], [0.001, 100.0])
    res = run_sweep(SCN, pts, use_ray=False, progress=False)
    assert len(res) == len(pts)
    files = write_outputs(res, str(tmp_path), {"test": True})
    for k in ("json", "pareto", "phases", "t_ocs"):
        assert (tmp_path / files[k].split("/")[-1]).stat().st_size > 0
    doc = json.loads((tmp_path / "sweep.json").read_text())
    rows = doc["summary"]["64"]
    ft = [r for r in rows if r["fabric"] == "fat-tree"][0]
    assert ft["perf_per_cost_vs_fat_tree"] == pytest.approx(1.0)
    rf = sorted((r for r in res if r["fabric"] == "rfabric"), key=lambda r: r["t_ocs_ms"])
    assert rf[1]["iteration_s"] >= rf[0]["iteration_s"]  # slower switching never helps
    assert summarise(res)["64"]


@pytest.mark.skipif(not ray_available(), reason="ray is not installed (optional extra 'ray')")
def test_ray_sweep_matches_serial():
    pts = plan(SCN, ["fat-tree", "rfabric"], [64], [10.0])
    serial = run_sweep(SCN, pts, use_ray=False, progress=False)
    remote = run_sweep(SCN, pts, use_ray=True, progress=False)
    assert [r["iteration_s"] for r in remote] == [r["iteration_s"] for r in serial]
