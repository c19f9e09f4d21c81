"""`orchestrrl demo` on the default scenario's small variant, and the cross-check of the two backends.

The demo (`compare` on the emulated backend: the tuned static baseline, static-low, static-high and every
policy, real agents on the emulated RFabric) must finish, print whether its runs were faithful first, then the
speedup table, and write report.json with the tuning grid (every max_num_seqs tried; the tuned configuration
is its best), the oracle bounds and each policy's share of its oracle. The simulated backend on the same
scenario must agree with it, per policy, as testbed/runs/crosscheck.py says: mean step makespan and mean
generation, train and sync times within 10% (train and sync let off only where the fidelity monitor flagged
them and named the fix). Nothing may be lost in any run.

The default scenario itself (the ~10-minute `make demo`) is cross-checked by `orchestrrl bench crosscheck`,
a benchmark, with the same code: its figures are in docs/orchestrator.md "Measured".
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from testbed.benchmarks.bench_crosscheck import run_demo, simulated_compare
from testbed.runs.crosscheck import crosscheck

pytestmark = pytest.mark.system
ROOT = Path(__file__).resolve().parents[2]
SMALL = ROOT / "scenarios" / "default-small.yaml"


@pytest.mark.timeout(1200)
def test_demo_of_the_small_default_agrees_with_the_simulated_backend(tmp_path, monkeypatch):
    monkeypatch.setenv("ORCHESTRRL_CACHE_DIR", str(tmp_path / "cache"))  # the grid tuned afresh, then reused
    out = tmp_path / "emulated"
    rc, stdout, stderr = run_demo(SMALL, out, timeout_s=900)
    assert rc == 0, stderr[-3000:]
    assert "best static configuration" in stdout and "speedup" in stdout  # the table is printed
    emu = json.loads((out / "report.json").read_text())
    n = len(emu["policies"])  # the first line says whether the runs were faithful, as report.json does
    assert stdout.splitlines()[0].startswith(f"fidelity: {n - emu['fidelity_flagged_runs']} of {n} runs faithful")

    grid = emu["baseline_grid"]  # the tuned baseline: the best of every layout and max_num_seqs tried
    best = min(grid, key=lambda g: (g["makespan_s"], g["max_num_seqs"]))
    assert emu["best_static"] == best["name"] and best["name"] in emu["policies"]
    assert {g["max_num_seqs"] for g in grid} == {64, 128, 256, 512, 1024}
    assert {"planner", "balancer", "orchestrrl"} <= set(emu["policies"])
    for name, kind in (("planner", "switch"), ("balancer", "placement"), ("orchestrrl", "both")):
        p = emu["policies"][name]
        assert p["oracle_kind"] == kind
        assert p["oracle_fraction"] == pytest.approx(p["speedup_vs_best_static"] /
                                                     emu["oracle"]["kinds"][kind]["speedup"])

    sim = simulated_compare(SMALL, list(emu["policies"]), tmp_path / "sim")
    figures, problems = crosscheck(emu, sim, out)
    print(json.dumps(figures, indent=1))  # emulated, simulated, ratio (for the closing note: pytest -s)
    assert figures and not problems, problems
