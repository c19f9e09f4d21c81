"""testbed/runs/lanes.py: the progress-informed lane search runs every plan on the engine and loses nothing; with a
score known at time 0 the lanes start with the top-scored requests."""
from __future__ import annotations

import math

import numpy as np
import pytest

from emulation.orchestration import orchestrator_settings
from emulation.scenario import Scenario
from emulation.spec import FabricSpec, JobLayout
from emulation.workload import WorkloadSpec
from testbed.runs.lanes import KNOWN_GRID, LanePlan, plans, run_plan, scores, search, start_deal
from testbed.runs.oracle import Oracle

GRID = {"min_generated": (50, 10_000), "per_tick": (8,), "deal": ("all", "bulk")}


def _oracle() -> Oracle:
    w = WorkloadSpec(model="Qwen2.5-7B", prompts_per_step=8, samples_per_prompt=4, response_median_tokens=100,
                     max_response_tokens=512, steps=1, prompt_sigma=0.3)
    scn = Scenario(name="tiny", seed=1, fabric=FabricSpec(pods=2, tors_per_pod=1, servers_per_tor=4),
                   layout=JobLayout(train_pods=(0,), gen_pods=(1,)), workload=w,
                   orchestrator=orchestrator_settings({"step_mode": "sync"}))
    return Oracle(scn, ("TP1x8", 64), grid=(64, 256), steps=1)


def test_every_plan_finishes_every_request_no_faster_than_the_floor():
    orc = _oracle()
    (_, lengths, placed), = orc.step_cases()
    runs = search(orc, lengths, placed, GRID)
    assert len(runs) == len(plans(orc, len(placed), GRID)) > 0
    assert {r.plan.lanes for r in runs} == {1, 2, 3}  # 4 generator servers: 1..3 of them lanes
    floor = orc.floor(lengths)
    for r in runs:
        assert r.finished == len(lengths) and math.isfinite(r.makespan_s) and r.makespan_s >= floor - 1e-9
        if r.plan.min_generated > lengths.max():  # no request ever qualifies: nothing moves
            assert r.moved == 0
    moving = [r for r in runs if r.plan.min_generated <= lengths.max() and r.plan.deal == "bulk"]
    assert moving and all(r.moved > 0 for r in moving)  # the lanes start empty: they get only what is moved
    assert [r.makespan_s for r in runs] == sorted(r.makespan_s for r in runs)


def test_a_plan_out_of_range_is_refused():
    orc = _oracle()
    (_, lengths, placed), = orc.step_cases()
    lay = [x.name(orc.gpus) for x in orc.layouts]
    with pytest.raises(ValueError, match="deal"):
        run_plan(orc, LanePlan(1, lay[-1], lay[0], 50, 8, "some"), lengths, placed)
    with pytest.raises(ValueError, match="lanes"):
        run_plan(orc, LanePlan(len(placed), lay[-1], lay[0], 50, 8, "all"), lengths, placed)


def test_a_seeded_plan_starts_the_lanes_with_the_top_scored_requests():
    placed = {4: np.arange(0, 5), 5: np.arange(5, 10), 6: np.arange(10, 15), 7: np.arange(15, 20)}
    score = np.zeros(20)
    score[[3, 17, 8, 11]] = [4.0, 3.0, 2.0, 1.0]  # the four highest, in this order
    parts = start_deal(LanePlan(2, "TP8x1", "TP1x8", 10**9, 1, "bulk", seed=2), placed, score, lane_replicas=1)
    assert parts[6].tolist() == [3, 8] and parts[7].tolist() == [17, 11]  # 2 lanes x 1 replica x 2, round robin
    rest = sorted(set(range(20)) - {3, 17, 8, 11})
    assert np.concatenate([parts[4], parts[5]]).tolist() == rest  # the rest over the bulk, in index order
    every = start_deal(LanePlan(2, "TP8x1", "TP1x8", 10**9, 1, "all", seed=1), placed, score, lane_replicas=1)
    assert every[6][0] == 3 and every[7][0] == 17 and sum(map(len, every.values())) == 20
    assert [len(every[s]) for s in placed] == [5, 5, 1 + 4, 1 + 4]  # "all": the 18 others in chunks over all four
    unseeded = start_deal(LanePlan(1, "TP8x1", "TP1x8", 50, 8, "bulk"), placed, None, lane_replicas=1)
    assert len(unseeded[7]) == 0 and np.concatenate([unseeded[s] for s in (4, 5, 6)]).tolist() == list(range(20))


def test_scores_say_what_each_knowledge_knows():
    lengths = np.array([100, 400, 10, 1000])
    pid = np.array([0, 0, 1, 1])
    rng = lambda: np.random.default_rng(3)  # noqa: E731
    assert scores("progress", lengths, pid, rng()) is None
    prompt = scores("prompt", lengths, pid, rng())
    assert prompt[0] == prompt[1] == pytest.approx(np.log(200.0)) and prompt[2] == pytest.approx(np.log(100.0))
    assert np.array_equal(scores("predictor:0", lengths, pid, rng()), np.log(lengths.astype(float)))
    a, b = scores("predictor:0.1", lengths, pid, rng()), scores("predictor:0.4", lengths, pid, rng())
    assert np.allclose((b - np.log(lengths)) / 0.4, (a - np.log(lengths)) / 0.1)  # one draw, scaled by the sd
    many = scores("predictor:0.5", np.full(20000, 300), np.zeros(20000), rng()) - np.log(300.0)
    assert abs(float(np.std(many)) - 0.5) < 0.02
    for bad in ("oracle", "predictor:", "predictor:-0.1", "predictor:nan", ""):
        with pytest.raises(ValueError, match="knowledge"):
            scores(bad, lengths, pid, rng())


def test_a_seeded_search_finishes_every_request_and_refuses_a_seed_without_scores():
    orc = _oracle()
    (_, lengths, placed), = orc.step_cases()
    grid = dict(KNOWN_GRID, seed=(1, 4))
    runs = search(orc, lengths, placed, grid, score=np.log(lengths.astype(float)))
    assert len(runs) == len(plans(orc, len(placed), grid)) and {r.plan.seed for r in runs} == {1, 4}
    floor = orc.floor(lengths)
    for r in runs:
        assert r.finished == len(lengths) and r.makespan_s >= floor - 1e-9
        if r.plan.min_generated > lengths.max():
            assert r.moved == 0
    lay = [x.name(orc.gpus) for x in orc.layouts]
    with pytest.raises(ValueError, match="seed: 2 requests per lane replica need a score"):
        run_plan(orc, LanePlan(1, lay[-1], lay[0], 50, 8, "bulk", seed=2), lengths, placed)
    with pytest.raises(ValueError, match="seed: must be >= 0"):
        run_plan(orc, LanePlan(1, lay[-1], lay[0], 50, 8, "bulk", seed=-1), lengths, placed,
                 score=np.zeros(len(lengths)))


def _result(knowledge: dict, oracle_s: float = 80.0) -> dict:
    """A bench_lanes result of one scenario and step: static 100 s, the given oracle, each knowledge's best plan."""
    return {"scenario": "s", "steps": 1, "seed": 1, "tuned_static": "TP8x1@1024", "static_gen_s": 100.0,
            "oracle_gen_s": oracle_s, "floor_s": 70.0, "speedup": {"oracle": 100.0 / oracle_s, "floor": 100 / 70},
            "knowledge": {k: {"lanes_gen_s": t, "speedup": 100.0 / t} for k, t in knowledge.items()},
            "per_step": [{"step": 0, "static_gen_s": 100.0, "oracle_gen_s": oracle_s, "floor_s": 70.0,
                          "top": {k: [] for k in knowledge}}]}


def test_runs_split_by_knowledge_merge_into_one_and_disagreeing_runs_are_refused():
    from testbed.benchmarks.bench_lanes import MergeError, merge

    a = {"s": _result({"progress": 100.5, "predictor:0.5": 88.0})}
    b = {"s": _result({"predictor:0.25": 83.0, "predictor:0.5": 88.0}), "t": _result({"prompt": 97.0})}
    out = merge([a, b])
    assert set(out) == {"s", "t"}
    assert set(out["s"]["knowledge"]) == {"progress", "predictor:0.5", "predictor:0.25"}
    assert set(out["s"]["per_step"][0]["top"]) == {"progress", "predictor:0.5", "predictor:0.25"}
    assert a["s"]["knowledge"].keys() == {"progress", "predictor:0.5"}  # the inputs are left as they were
    with pytest.raises(MergeError, match="oracle_gen_s"):  # another scenario, seed or model under the same name
        merge([a, {"s": _result({"prompt": 97.0}, oracle_s=79.0)}])
    with pytest.raises(MergeError, match="'predictor:0.5' is 87.0 s in run 2"):
        merge([a, {"s": _result({"predictor:0.5": 87.0})}])
    with pytest.raises(MergeError, match="missing knowledge"):
        merge([{"s": {"steps": 1}}])


def test_the_plot_draws_every_scenario(tmp_path):
    from testbed.benchmarks.bench_lanes import plot

    res = {"s": _result({"progress": 100.5, "prompt": 97.0, "predictor:0": 80.2, "predictor:0.5": 88.0}),
           "t": _result({"progress": 99.0})}  # no predictor searched: the lines alone
    path = plot(res, tmp_path / "lanes.png")
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
