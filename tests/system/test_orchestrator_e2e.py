"""The orchestrator end to end on the emulated cluster: two policies on a small scenario (every response
completes exactly once at the collectors, report.json holds the figures), and a generator agent killed in the
middle of a run, whose requests are re-queued on the others so that nothing is lost."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import pytest

from emulation.scenario import Scenario
from emulation.workload import WorkloadSpec
from testbed.runs.experiment import Experiment
from small_scenario import small_scenario

pytestmark = pytest.mark.system

SCN = small_scenario("e2e-small", steps=2)  # tests/small_scenario.py: seconds a step


def test_two_policies_end_to_end_every_response_exactly_once(tmp_path):
    exp = Experiment(SCN, "emulated")
    with exp:
        pool = exp.cluster[1]
        pids = dict(pool.pids)
        asked = [exp.policy("static-TP1x8"), exp.policy("orchestrrl")]
        report, files = exp.compare(asked, 2, tmp_path)
        assert {s: pool.call(s, "ping")["pid"] for s in pids} == pids  # one set of agents served every policy
    doc = json.loads(open(files["report"]).read())
    # compare adds the tuned static configuration (the best of the simulated grid) to what was asked for
    grid = doc["baseline_grid"]
    top = min(grid, key=lambda g: (g["makespan_s"], g["max_num_seqs"]))
    best = doc["best_static"]
    assert best == top["name"] and len(grid) > 1
    assert set(doc["policies"]) == {p.name for p in asked} | {best}
    for name, p in doc["policies"].items():
        assert p["lost_requests"] == 0
        assert len(p["step_makespan_s"]) == 2 and all(x > 0 for x in p["step_makespan_s"])
        assert p["throughput_tokens_per_s"] > 0
        # the speedup is the baseline's mean step makespan over this policy's, both measured in this run
        base = sum(doc["policies"][best]["step_makespan_s"]) / 2
        assert p["speedup_vs_best_static"] == pytest.approx(base / (sum(p["step_makespan_s"]) / 2), rel=1e-9)
        assert "verdict" in p["fidelity"] and p["fidelity"]["agents"]
    assert doc["policies"][best]["speedup_vs_best_static"] == 1.0  # the baseline against itself
    run = json.loads(open(tmp_path / "orchestrrl" / "run.json").read())
    for step in run["steps"]:
        assert step["lost_requests"] == 0 and step["requests"] == 96
        assert step["sync"]["consistent"] and step["train"]["correct"]  # the same weights everywhere; sums right
    assert (tmp_path / "orchestrrl" / "trace-orchestrrl.json").exists() and (tmp_path / "makespan.png").exists()


def test_an_agent_killed_mid_run_loses_nothing(tmp_path):
    scn = Scenario(**{**SCN.__dict__, "workload": WorkloadSpec(**{**SCN.workload.__dict__, "steps": 2,
                                                                   "max_response_tokens": 1500})})
    exp = Experiment(scn, "emulated")
    with exp:
        pool = exp.cluster[1]
        victim = 3

        def kill_when_busy():
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                try:
                    if pool.clients[victim].call("stats", timeout_s=2)["generation_tokens_total"] > 3000:
                        break
                except Exception:  # noqa: BLE001
                    pass
                time.sleep(0.1)
            os.killpg(pool.procs[victim].pid, signal.SIGKILL)

        t = threading.Thread(target=kill_when_busy, daemon=True)
        t.start()
        res, files = exp.run(exp.policy("static-TP1x8"), 2, tmp_path)
        t.join(timeout=5)
    assert res["lost_requests"] == 0
    assert str(victim) in {str(k) for k in res["failures"]}
    events = json.loads(open(files["timeline"]).read())["events"]
    failed = [e for e in events if e["kind"] == "agent_failed"]
    requeued = [e for e in events if e["kind"] == "requeued"]
    assert failed and failed[0]["server"] == victim and failed[0]["requests"] > 0
    assert requeued and requeued[0]["requests"] > 0 and victim not in requeued[0]["to"]
    # the step after the failure ran on the survivor alone, and completed too
    assert res["steps"][1]["lost_requests"] == 0
