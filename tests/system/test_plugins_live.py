"""A plug-in planner defined in this file runs on the emulated cluster for one step of the small default
(scenarios/default-small.yaml), beside the built-in planner: same agents, same execution path (its switches
carried out by the agents), and report.json carries both with their speedups and oracle fractions
(docs/plugins.md)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from emulation.orchestration import PolicySpec
from emulation.scenario import load_scenario
from testbed.orchestrator.interfaces import LayoutPlanner
from testbed.orchestrator.planner import Decision
from testbed.runs.experiment import Experiment

pytestmark = pytest.mark.system


class TailPlanner(LayoutPlanner):
    """The throughput layout while the batch is full; the largest TP once a server holds its tail."""

    @dataclass(frozen=True)
    class Params:
        tail: int = 8  # a server holding at most this many requests is in its tail

    def __init__(self, ctx, params):
        self.ctx, self.p = ctx, params
        by_tp = sorted(ctx.layouts, key=lambda lay: lay.tp)
        self.bulk, self.latency = by_tp[0], by_tp[-1]

    def initial(self, view, charged=True):
        return Decision.to(view, self.bulk, "a full batch: the throughput layout")

    def evaluate_all(self, views, now, interval=None):
        out = {}
        for s, v in views.items():
            if v.busy_until > now or v.layout == self.latency or not 0 < v.load.n <= self.p.tail:
                out[s] = Decision.stay(v, f"{v.load.n} requests")
                continue
            out[s] = Decision.to(v, self.latency, f"a tail of {v.load.n}")
        return out


def test_a_plugin_planner_runs_beside_the_builtin_on_the_emulated_cluster(tmp_path):
    scn = load_scenario(Path(__file__).resolve().parents[2] / "scenarios" / "default-small.yaml")
    mine = PolicySpec("tail", planner=f"{__name__}:TailPlanner", params={"planner": {"tail": 16}})
    exp = Experiment(scn, "emulated", steps=1)
    with exp:
        report, files = exp.compare([exp.policy("planner"), exp.policy(mine)], 1, tmp_path)
    doc = json.loads(open(files["report"]).read())
    assert {"planner", "tail", doc["best_static"]} <= set(doc["policies"])
    for name in ("planner", "tail"):
        p = doc["policies"][name]
        assert p["lost_requests"] == 0 and p["exactly_once"] and p["speedup_vs_best_static"] > 0
        assert p["oracle_kind"] == "switch" and p["oracle_fraction"] == pytest.approx(
            p["speedup_vs_best_static"] / doc["oracle"]["kinds"]["switch"]["speedup"])
    events = json.loads((tmp_path / "tail" / "timeline.json").read_text())["events"]
    switched = [e for e in events if e["kind"] == "layout_switch" and not e.get("initial")]
    assert switched and all(e["to"] == "TP8x1" and e["reason"].startswith("a tail of") for e in switched)
    assert doc["policies"]["tail"]["layout_switches"] == len(switched) + sum(
        1 for e in events if e["kind"] == "layout_switch" and e.get("initial") and e.get("charged"))


def test_the_published_policies_run_on_the_emulated_cluster(tmp_path):
    """contrib/'s Seer (a quarter of its seats filled at the start, so its pool is dealt at the ticks by live
    submits to the agents) and RollPacker, one step of default-small: every response exactly once."""
    scn = load_scenario(Path(__file__).resolve().parents[2] / "scenarios" / "default-small.yaml")
    seer = PolicySpec("seer", dispatch="contrib.seer:SeerDispatch", params={"dispatch": {"fill": 0.25}})
    rollpacker = PolicySpec("rollpacker", planner="contrib.rollpacker:RollPackerPlanner")
    exp = Experiment(scn, "emulated", steps=1)
    with exp:
        report, files = exp.compare([exp.policy(seer), exp.policy(rollpacker)], 1, tmp_path)
    doc = json.loads(open(files["report"]).read())
    for name, kind in (("seer", "placement"), ("rollpacker", "switch")):
        p = doc["policies"][name]
        assert p["lost_requests"] == 0 and p["exactly_once"] and p["oracle_kind"] == kind
    events = json.loads((tmp_path / "seer" / "timeline.json").read_text())["events"]
    held = [e for e in events if e["kind"] == "dispatch_held"]
    released = [e for e in events if e["kind"] == "release"]
    assert held and released and sum(sum(e["released"].values()) for e in released) == held[0]["held"]
