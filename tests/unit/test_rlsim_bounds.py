"""The perf/cost ceilings (rlsim/bounds.py) hold every simulated fabric below them, and the bound is the
arithmetic it says it is."""
import dataclasses

import pytest

from agents.costmodel import CostModel
from emulation.scenario import Scenario
from emulation.spec import FabricSpec, JobLayout
from emulation.workload import WorkloadSpec
from rlsim.bounds import cost_floor_usd, iteration_bounds_s, perf_cost_ceiling, uplinks_cost_usd
from rlsim.cost import fabric_cost
from rlsim.fabrics import FABRICS, OVERSUB
from rlsim.sim import SimSettings, simulate_iteration
from rlsim.sweep import Point, default_ocs, point_scenario

# MoE with EP across the two ToRs of the trainer pod (8 servers, TP 8 each: one EP group of 8), 8 uplinks per
# ToR (4:1); 128 NICs need two tiers of 64-port switches
MOE = Scenario(name="moe-small", seed=3,
               fabric=FabricSpec(pods=2, tors_per_pod=2, servers_per_tor=4, server_gbps=3200, uplink_gbps=400,
                                 uplinks_per_tor=8, ocs_count=8),
               layout=JobLayout((0,), (1,)),
               workload=WorkloadSpec(model="Qwen3-30B-A3B", prompts_per_step=16, samples_per_prompt=4,
                                     max_response_tokens=2048, rollout_tp=4, train_ep=8))
SETTINGS = SimSettings(reconfig_delay_ms=10.0)
TOR_DOWN = 4 * 3200 / 400  # a non-blocking ToR's uplinks
NIC = CostModel.for_names(MOE.workload.model, MOE.workload.gpu).gpu.nic_gbps


def _at(u: int) -> Scenario:
    return point_scenario(MOE, Point("rfabric", MOE.fabric.n_gpus, 10.0, u, default_ocs(MOE, u), None))


def test_every_simulated_fabric_iterates_no_faster_than_its_bound():
    ft = simulate_iteration(MOE, "fat-tree", settings=SETTINGS)
    gen = ft["phases"]["gen_s"]
    bounds = {b["uplinks_per_tor"]: b for b in iteration_bounds_s(MOE, MOE.fabric.n_gpus, range(1, 33), gen, SETTINGS)}
    assert bounds[2]["train_stages_s"]["ep_alltoall_s"] > bounds[8]["train_stages_s"]["ep_alltoall_s"] > 0
    for u in (2, 4, 8):
        r = simulate_iteration(_at(u), "rfabric", settings=SETTINGS)
        b = bounds[u]
        assert r["iteration_s"] >= b["iteration_s"] * (1 - 1e-9)
        assert r["phases"]["train_s"] >= b["train_s"] * (1 - 1e-9)
        assert r["phases"]["sync_s"] >= b["sync_s"] * (1 - 1e-9)
    for f, o in OVERSUB.items():  # a tree tapered o:1 has 32/o uplinks per ToR (4 servers x 3,200 Gb/s down)
        r = simulate_iteration(MOE, f, settings=SETTINGS)
        u = TOR_DOWN / o
        if u.is_integer():
            assert r["iteration_s"] >= bounds[int(u)]["iteration_s"] * (1 - 1e-9), f


def test_the_alltoall_bound_is_the_busiest_tors_bytes_over_its_uplinks():
    """EP group of 8 servers, four per ToR: a server sends 7/8 of its all-to-all bytes to the others, 4/8 of
    them across its ToR, so a ToR sends 4 x 1/2 of a server's bytes up: the bound at u uplinks is that over
    u x 400 Gb/s, or the servers' 3,200 Gb/s links' 7/8 where that binds (from u = 19)."""
    from controller.traffic import train_bytes, train_traffic
    from rlsim.sim import _train_layout
    from emulation.workload import LengthSchedule
    import numpy as np

    w, spec = MOE.workload, MOE.fabric
    cm = CostModel.for_names(w.model, w.gpu)
    lengths = LengthSchedule(w).lengths_for_step(0, MOE.rng())
    tl = _train_layout(w, spec, MOE.layout.train_servers(spec))
    tokens = float(np.sum(lengths) + len(lengths) * w.prompt_tokens)
    st = train_traffic(tl, train_bytes(cm, tl, tokens)).stage("ep_alltoall")
    (g,) = st.groups
    per_server = g.nbytes  # bytes each member spreads over the group
    lat = SETTINGS.latency_us * 1e-6 * tl.ep * max(1, len(lengths) // tl.dp)
    for u in (1, 4, 16, 24):
        (b,) = iteration_bounds_s(MOE, spec.n_gpus, [u], 0.0, SETTINGS)
        want = max(per_server * 7 / 8 / (3200e9 / 8), 4 * per_server / 2 / (u * 400e9 / 8)) + lat
        assert b["train_stages_s"]["ep_alltoall_s"] == pytest.approx(want, rel=1e-9)


def test_costs_of_the_ceilings_are_below_every_fabric_of_their_taper():
    floor = cost_floor_usd(MOE.fabric, NIC)
    for f in FABRICS:
        assert fabric_cost(f, MOE.fabric, NIC)["total_usd"] > floor, f
    for u in (2, 4, 8):
        c = uplinks_cost_usd(MOE.fabric, NIC, u)
        assert floor < c < fabric_cost("rfabric", _at(u).fabric, NIC)["total_usd"]
    for f, o in OVERSUB.items():
        u = TOR_DOWN / o
        if u.is_integer():
            assert uplinks_cost_usd(MOE.fabric, NIC, int(u)) <= fabric_cost(f, MOE.fabric, NIC)["total_usd"], f


def test_no_simulated_fabric_beats_the_ceilings():
    ceil = perf_cost_ceiling(MOE, MOE.fabric.n_gpus, [2, 4, 8], settings=SETTINGS)
    free = ceil["free_network"]["perf_per_cost_ceiling_vs_fat_tree"]
    best = ceil["best_within_goal"]
    assert best is not None and best["perf_per_cost_ceiling_vs_fat_tree"] <= free
    assert all(r["perf_per_cost_ceiling_vs_fat_tree"] <= free for r in ceil["per_uplinks"])
    assert [r["uplinks_per_tor"] for r in ceil["per_uplinks"]] == list(range(1, 33))  # up to a non-blocking ToR
    ft = ceil["fat_tree"]
    for row in ceil["rfabric"]:
        assert row["perf_per_cost_vs_fat_tree"] <= row["ceiling_at_its_cost_vs_fat_tree"] * (1 + 1e-9)
        assert row["vs_bound"] >= 1 - 1e-9
        if row["slowdown_vs_fat_tree"] <= ceil["slowdown_goal"]:
            assert row["perf_per_cost_vs_fat_tree"] <= best["perf_per_cost_ceiling_vs_fat_tree"] * (1 + 1e-9)
    for f in OVERSUB:
        r = simulate_iteration(MOE, f, settings=SETTINGS)
        pc = ft["iteration_s"] * ft["cost_usd"] / (r["iteration_s"] * r["cost_usd"])
        assert pc <= free
        if r["iteration_s"] / ft["iteration_s"] - 1 <= ceil["slowdown_goal"]:
            assert pc <= best["perf_per_cost_ceiling_vs_fat_tree"] * (1 + 1e-9), f


def test_a_dense_job_has_no_alltoall_bound_and_a_sync_bound_by_the_links():
    dense = dataclasses.replace(MOE, workload=dataclasses.replace(MOE.workload, model="Qwen2.5-7B", train_ep=1))
    (b,) = iteration_bounds_s(dense, dense.fabric.n_gpus, [4], 1.0, SETTINGS)
    assert set(b["train_stages_s"]) == {"dp_allreduce_s"}
    W = CostModel.for_names("Qwen2.5-7B", dense.workload.gpu).weight_bytes()
    assert b["sync_s"] == pytest.approx(max(W / (3200e9 / 8), W / (4 * 400e9 / 8)))
    assert b["iteration_s"] == pytest.approx(1.0 + b["train_s"] + b["sync_s"])


def test_the_sweep_carries_the_ceiling_into_its_summary_and_plot(tmp_path):
    import json

    from rlsim.sweep import plan, run_sweep, write_outputs

    n = MOE.fabric.n_gpus
    pts = plan(MOE, ["fat-tree", "fat-tree-2to1", "fat-tree-4to1", "rfabric"], [n], [10.0], uplinks=[8, 16])
    res = run_sweep(MOE, pts, SETTINGS, use_ray=False, progress=False)
    ceil = perf_cost_ceiling(MOE, n, settings=SETTINGS)
    files = write_outputs(res, str(tmp_path), {}, {n: ceil})
    doc = json.load(open(files["json"]))
    summ = doc["summary"][str(n)]
    assert summ["ceiling"]["best_within_goal"] == {k: ceil["best_within_goal"][k] for k in summ["ceiling"]["best_within_goal"]}
    (entry,) = summ["vs_static"].values()
    over = entry["best_oversubscribed_fat_tree"]["perf_per_cost_vs_fat_tree"]
    assert entry["ceiling_vs_best_oversubscribed_fat_tree"] == pytest.approx(
        ceil["best_within_goal"]["perf_per_cost_ceiling_vs_fat_tree"] / over)
    assert entry["ceiling_vs_best_oversubscribed_fat_tree"] >= entry["rfabric_vs_best_oversubscribed_fat_tree"]
    assert doc["ceilings"][str(n)]["per_uplinks"] and (tmp_path / "pareto.png").stat().st_size > 0


@pytest.mark.parametrize("u", [2, 4])
def test_train_rewire_gives_the_alltoall_every_uplink_never_slows_the_iteration_and_stays_bounded(u):
    """RFabric re-wiring inside the train phase (SimSettings.train_rewire): the all-to-all runs on the EP
    partner ToRs' own circuits (every uplink), the rings then on theirs if that gains more than T_ocs. It is
    taken only when the iteration is faster so; it never beats the bound."""
    from rlsim.sim import TRAIN_REWIRE

    ft = simulate_iteration(MOE, "fat-tree", settings=SETTINGS)
    (b,) = iteration_bounds_s(MOE, MOE.fabric.n_gpus, [u], ft["phases"]["gen_s"], SETTINGS)
    for t in (10.0, 1000.0):
        st = dataclasses.replace(SETTINGS, reconfig_delay_ms=t)
        one = simulate_iteration(_at(u), "rfabric", settings=st)
        rw = simulate_iteration(_at(u), "rfabric", settings=dataclasses.replace(st, train_rewire=True))
        plan = rw["detail"]["train_rewire"]
        assert plan["one_topology_iteration_s"] == pytest.approx(one["iteration_s"])
        assert rw["iteration_s"] == pytest.approx(min(one["iteration_s"], plan["rewired_iteration_s"]))
        assert rw["phases"]["train_s"] >= b["train_s"] * (1 - 1e-9) and rw["iteration_s"] >= b["iteration_s"] * (1 - 1e-9)
        if t == 10.0:  # the all-to-all at the ToRs' whole uplink rate: faster than on the shared topology
            assert plan["taken"] and rw["iteration_s"] < one["iteration_s"]
            a2a = rw["detail"]["train"]["ep_alltoall_s"]
            assert a2a < one["detail"]["train"]["ep_alltoall_s"]
            assert a2a == pytest.approx(b["train_stages_s"]["ep_alltoall_s"], rel=0.05)
            d = rw["detail"]["reconfig"][TRAIN_REWIRE]
            assert d["action"] in ("stalled", "kept") and d["window_ms"] == 0.0
            assert (d["gain_ms"] or float("inf")) > 10.0 if d["action"] == "stalled" else d["gain_ms"] <= 10.0
    assert not simulate_iteration(MOE, "fat-tree", settings=dataclasses.replace(SETTINGS, train_rewire=True))[
        "detail"]["train_rewire"]  # only RFabric re-wires
