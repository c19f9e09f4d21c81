"""testbed/runs/lanes.py: the progress-informed lane search runs every plan on the engine and loses nothing."""
from __future__ import annotations

import math

import pytest

from emulation.orchestration import orchestrator_settings
from emulation.scenario import Scenario
from emulation.spec import FabricSpec, JobLayout
from emulation.workload import WorkloadSpec
from testbed.runs.lanes import LanePlan, plans, run_plan, search
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
