"""The default scenario's small variant end to end on the emulated cluster with the tuned baseline: the tuning
grid (simulated backend) picks the static configuration, which runs on real agents beside the orchestrator;
report.json carries the grid, the oracle bounds and each policy's share of its oracle; nothing is lost, the
first line of the table says whether the runs were faithful (and agrees with report.json), and the emulated
step makespans agree with the simulated backend's within 10%."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from emulation.scenario import load_scenario
from testbed.runs.experiment import Experiment

pytestmark = pytest.mark.system
ROOT = Path(__file__).resolve().parents[2]
SMALL = ROOT / "scenarios" / "default-small.yaml"


@pytest.mark.timeout(900)
def test_the_small_default_runs_with_its_tuned_baseline(tmp_path):
    env = {**os.environ, "ORCHESTRRL_CACHE_DIR": str(tmp_path / "cache")}
    out = tmp_path / "emu"
    p = subprocess.run([sys.executable, "-m", "testbed.cli", "compare", str(SMALL), "--backend", "emulated",
                        "--policies", "orchestrrl", "--out", str(out), "-q"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=800)
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads((out / "report.json").read_text())
    grid = rep["baseline_grid"]
    best = min(grid, key=lambda g: (g["makespan_s"], g["max_num_seqs"]))
    assert rep["best_static"] == best["name"] and set(rep["policies"]) == {best["name"], "orchestrrl"}
    assert {g["max_num_seqs"] for g in grid} == {64, 128, 256, 512, 1024}
    first = p.stdout.splitlines()[0]
    n = len(rep["policies"])
    assert first.startswith(f"fidelity: {n - rep['fidelity_flagged_runs']} of {n} runs faithful"), first
    o = rep["policies"]["orchestrrl"]
    assert o["lost_requests"] == 0 and rep["policies"][best["name"]]["lost_requests"] == 0
    assert o["oracle_fraction"] == pytest.approx(o["speedup_vs_best_static"] / rep["oracle"]["kinds"]["both"]["speedup"])
    # the same comparison on the simulated backend (the tuning cache is the one the emulated run wrote)
    os.environ["ORCHESTRRL_CACHE_DIR"] = env["ORCHESTRRL_CACHE_DIR"]
    try:
        scn = load_scenario(SMALL)
        exp = Experiment(scn, "simulated")
        with exp:
            sim, _ = exp.compare([exp.policy("orchestrrl")], scn.workload.steps, tmp_path / "sim")
    finally:
        os.environ.pop("ORCHESTRRL_CACHE_DIR", None)
    for name, e in rep["policies"].items():
        a, b = float(np.mean(e["step_makespan_s"])), float(np.mean(sim["policies"][name]["step_makespan_s"]))
        assert abs(a / b - 1) <= 0.10, f"{name}: emulated {a:.2f} s vs simulated {b:.2f} s"
