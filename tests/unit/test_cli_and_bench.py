"""CLI input checks (exit 2, nothing started) and the benchmark's pure blackout attribution."""
from __future__ import annotations

import pytest

from testbed.benchmarks.bench_fabric import CASES, CHANGED, RECONFIG_SPEC, UNCHANGED, blackout_in_window
from controller.ocs import Matching, diff


@pytest.mark.parametrize("argv, needle", [
    (["bench", "reconfig", "--delay-ms", "-1"], "--delay-ms must be >= 0"),
    (["bench", "reconfig", "--samples", "0"], "--samples must be >= 1"),
    (["bench", "reconfig", "--pps", "0"], "--pps must be > 0"),
    (["bench", "fabric", "--rate-mbps", "0"], "--rate-mbps must be > 0"),
    (["demo", "no/such/scenario.yaml"], "no/such/scenario.yaml"),
    (["fabric", "up", "no/such/scenario.yaml"], "no/such/scenario.yaml"),
    (["bench", "nope"], "invalid choice"),
    (["bench", "reconfig", "--delay-ms", "nan"], "--delay-ms must be a finite number"),
    (["bench", "reconfig", "--pps", "inf"], "--pps must be a finite number"),
    (["bench", "fabric", "--seconds", "nan"], "--seconds must be a finite number"),
    (["bench", "alltoall", "no/such/scenario.yaml"], "no/such/scenario.yaml"),
    (["bench", "alltoall", "--repeats", "0"], "--repeats must be in 1..100"),
    (["bench", "alltoall", "--topologies", "gen"], "--topologies: unknown ['gen']"),
    (["bench", "alltoall", "scenarios/default-small.yaml"], "trains without expert parallelism"),
    (["bench", "collectives", "--host-tcp-cc", "vegas"], "--host-tcp-cc: invalid choice: 'vegas'"),
    (["bench", "alltoall", "--host-tcp-cc", "BBR"], "--host-tcp-cc: invalid choice: 'BBR'"),
    (["bench", "planner", "--set", "confirm_draws"], "--set takes KEY=VALUE"),
    (["bench", "planner", "--set", "planner.nosuch=2"], "orchestrator.planner.nosuch: unknown key"),
    (["bench", "planner", "--set", "planner.confirm_draws=0"], "orchestrator.planner.confirm_draws: must be in 1..16"),
    (["bench", "planner", "--set", "planner.lengths=truth"], "the bench has no true lengths"),
    (["bench", "planner", "--set", "planner.lengths=oracle"], "orchestrator.planner.lengths: must be one of forecast, truth"),
])
def test_bad_input_exits_2_naming_the_problem(argv, needle, run_cli):
    rc, out = run_cli(argv)
    assert rc == 2
    assert needle in out.err


def test_demo_rejects_a_bad_scenario_field(tmp_path, run_cli):
    bad = tmp_path / "bad.yaml"
    bad.write_text("fabric:\n  pods: 0\n")
    rc, out = run_cli(["demo", str(bad)])
    assert rc == 2 and "fabric.pods" in out.err


def _routes(matching_pairs):
    from controller import phases, routing

    m = {0: Matching.from_pairs(RECONFIG_SPEC.ports_per_ocs, matching_pairs)}
    return routing.compute_routes(RECONFIG_SPEC, phases.circuit_graph(RECONFIG_SPEC, m))


@pytest.mark.parametrize("case", sorted(CASES))
def test_reconfig_bench_cases_change_only_tor0_tor1_and_leave_no_other_path(case):
    from controller import phases, routing

    spec, (a, b) = RECONFIG_SPEC, CASES[case]
    n = spec.ports_per_ocs
    d = diff(Matching.from_pairs(n, a), Matching.from_pairs(n, b))
    assert {(5, 7)} <= {tuple(p) for p in d.unchanged}  # ToR 2 <-> ToR 3: the unchanged probe's circuit
    src, dst = (spec.tor_of_server(s) for s in CHANGED)
    assert (src, dst) == (0, 1) and [spec.tor_of_server(s) for s in UNCHANGED] == [2, 3]
    stable = {0: Matching(n, d.unchanged)}
    assert not routing.compute_routes(spec, phases.circuit_graph(spec, stable)).reachable(src, dst)
    ra, rb = _routes(a), _routes(b)
    assert ra.ports(2, 3) == rb.ports(2, 3)  # the unchanged path keeps its route
    if case == "repaired":  # same uplinks re-paired: no ToR route changes at all
        assert ra == rb
    else:  # the egress uplinks toward each other change
        assert ra.ports(src, dst) != rb.ports(src, dst) and ra.ports(dst, src) != rb.ports(dst, src)


def test_blackout_attribution_uses_the_window_and_subtracts_one_interval():
    records = [[i, 10.0 + i * 0.001] for i in range(100)]  # 1 kHz stream
    gaps = [{"first_lost": 20, "last_lost": 29, "lost": 10, "duration_s": 0.011, "truncated": False},
            {"first_lost": 70, "last_lost": 71, "lost": 2, "duration_s": 0.003, "truncated": False},
            {"first_lost": 95, "last_lost": 99, "lost": 5, "duration_s": 0.005, "truncated": True}]
    # window around the first gap only
    assert blackout_in_window(gaps, records, 10.015, 10.030, 0.001) == pytest.approx(10.0)
    # a window with no gap: no blackout
    assert blackout_in_window(gaps, records, 10.040, 10.060, 0.001) == 0.0
    # truncated runs (stream edge) are never counted
    assert blackout_in_window(gaps, records, 10.090, 10.1, 0.001) == 0.0


def test_no_command_imports_the_cli_back():
    """testbed.cli only dispatches: the commands take UsageError and the shared checks from
    testbed.commands.common, so the CLI and its commands form no import loop (static or lazy)."""
    import ast
    from pathlib import Path

    import testbed.commands

    back = []
    for path in sorted(Path(testbed.commands.__file__).parent.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
                     if isinstance(node, ast.ImportFrom) else [])
            if any(n == "testbed.cli" or n.startswith("testbed.cli.") for n in names):
                back.append(f"{path.name}:{node.lineno}")
    assert back == [], f"commands importing testbed.cli: {back}"


def test_bench_planner_times_the_settings_it_is_given(run_cli, monkeypatch):
    """``--set`` changes the orchestrator settings the bench's planner runs with, and the JSON says what changed."""
    import json

    from testbed.benchmarks import bench_orchestrator

    seen = []
    real = bench_orchestrator.bench_planner

    def spy(scn, *a, **k):
        seen.append(scn.orchestrator.planner)
        return real(scn, *a, **k)

    monkeypatch.setattr(bench_orchestrator, "bench_planner", spy)
    rc, out = run_cli(["bench", "planner", "--requests", "64", "--ticks", "2", "--json", "-q",
                       "--set", "planner.confirm_draws=2", "--set", "planner.lookahead=false"])
    assert rc == 0, out.err
    doc = json.loads(out.out)
    assert doc["settings_changed"] == ["planner.confirm_draws=2", "planner.lookahead=false"]
    assert doc["policy"] == "orchestrrl"
    assert (seen[0].confirm_draws, seen[0].lookahead) == (2, False)
    assert all(t["held_by_lookahead"] == 0 for t in doc["slowest_ticks"])  # no lookahead: none held back by it
    rc, out = run_cli(["bench", "planner", "--requests", "64", "--ticks", "2", "--json", "-q"])
    doc = json.loads(out.out)
    assert rc == 0 and doc["settings_changed"] == []
    # what the planner did in the slowest ticks: a tempted server is held back by the lookahead or judged, and
    # only a judged one switches (orchestrrl judges every switch the lookahead does not hold back)
    assert len(doc["slowest_ticks"]) == 2 and doc["median_tick"] is not None
    for t in doc["slowest_ticks"]:
        assert t["held_by_lookahead"] + t["judged"] == t["tempted"] <= doc["servers"]
        assert t["switched"] <= t["judged"]
    # the tick takes the prompt groups' shifts as the driver's does (the workload's share before a step measured one)
    assert doc["prompt_share"] == pytest.approx((0.6 / 0.9) ** 2, abs=1e-4) and doc["prompt_shifts_ms_p50"] > 0
    rc, out = run_cli(["bench", "planner", "--requests", "64", "--ticks", "2", "--json", "-q",
                       "--set", "forecast.prompt_groups=false"])
    assert rc == 0 and json.loads(out.out)["prompt_share"] == 0.0
    from emulation.scenario import load_scenario

    assert seen[1] == load_scenario("scenarios/default.yaml").orchestrator.planner  # the scenario's own


def test_bench_planner_on_a_trace_scenario_says_why_not(run_cli):
    """A trace workload has no configured distribution to draw the bench's requests and forecast from: exit 2
    naming the trace, not a traceback."""
    rc, out = run_cli(["bench", "planner", "scenarios/synthetic-trace.yaml", "--requests", "8", "--ticks", "1", "-q"])
    assert rc == 2 and "workload.trace" in out.err and "Traceback" not in out.err


def test_bench_estimator_runs_both_sides_on_the_profile_it_is_given(capsys, monkeypatch):
    """``bench_estimator.py --profile``: the engine and the estimator run on the profile's cost model (the
    kernels-only one without it); an unknown profile exits 2 naming the known ones."""
    import json

    from agents.costmodel import CostModel
    from testbed.benchmarks import bench_estimator

    assert bench_estimator.main(["--profile", "vllm-v9"]) == 2
    assert "vllm-v0" in capsys.readouterr().err
    made = []
    real = CostModel.for_engine.__func__

    def spy(cls, model, gpu, settings):
        made.append(settings.profile)
        return real(cls, model, gpu, settings)

    monkeypatch.setattr(CostModel, "for_engine", classmethod(spy))
    monkeypatch.setattr(bench_estimator, "CASES", [("Qwen2.5-7B", 32, 300, 0.5, 4096, 0.0, 64, 0)])
    assert bench_estimator.main(["--profile", "vllm-v0"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["profile"] == "vllm-v0" and made == ["vllm-v0"]
    assert set(doc["cases"][0]["layouts"]) <= {"TP1x8", "TP2x4", "TP4x2", "TP8x1"} and doc["cases"][0]["layouts"]
    assert bench_estimator.main([]) == 0 and json.loads(capsys.readouterr().out)["profile"] == "kernels-only"
    assert made == ["vllm-v0"]  # the default stays on the kernels-only model


def test_bench_estimator_midstep_compares_switches_from_inside_a_step(capsys, monkeypatch):
    """``bench_estimator.py --midstep``: from a state inside a step, every layout's estimate (switch cost
    included) against the engine run on from a copy of that state; the kept layout's gain is 0 on both sides,
    the pick's regret is its engine time over the best's, and bad ``--at`` exits 2."""
    import json

    from testbed.benchmarks import bench_estimator

    monkeypatch.setattr(bench_estimator, "CASES", [("Qwen2.5-7B", 48, 400, 0.5, 4096, 0.0, 64, 0)])
    assert bench_estimator.main(["--midstep", "--at", "0"]) == 2
    assert bench_estimator.main(["--at", "0.5"]) == 2
    assert "--at" in capsys.readouterr().err
    assert bench_estimator.main(["--midstep", "--at", "0.5", "--profile", "vllm-v0"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["midstep"] and doc["at"] == [0.5] and doc["profile"] == "vllm-v0"
    states = doc["cases"][0]["states"]
    assert len(states) == len(states[0]["layouts"]) >= 2  # one state per layout started from, every layout from each
    for s in states:
        rows = s["layouts"]
        assert rows[s["from"]]["gain_engine_s"] == 0 and rows[s["from"]]["gain_estimate_s"] == 0
        best = min(r["engine_s"] for r in rows.values())
        assert s["regret"] == round(rows[s["estimator_pick"]]["engine_s"] / best, 4) >= 1.0
        # the state is the kept layout's own run at half its makespan: what is left of it takes as long again
        assert abs(s["t0_s"] - rows[s["from"]]["engine_s"]) < 0.01
        for r in rows.values():
            assert abs(r["ratio"] - r["estimate_s"] / r["engine_s"]) < 1e-3
        assert all(isinstance(r["preemptions"], int) and r["preemptions"] >= 0 for r in rows.values())
    assert doc["states"] == len(states) and doc["stay"]["n"] == len(states)
    kinds = [doc[k] for k in ("stay", "to_smaller_tp", "to_larger_tp") if k in doc]
    assert sum(k["engine_preempting"]["n"] + k["engine_not_preempting"]["n"] for k in kinds) == \
        sum(len(s["layouts"]) for s in states)
    assert doc["worst_regret"] == max(s["regret"] for s in states)


def test_a_commands_default_scenario_is_found_from_any_folder(run_cli, tmp_path, monkeypatch):
    """The default scenarios are the checkout's: `orchestrrl bench planner` (or demo, bench crosscheck, ...) run
    from another folder found no 'scenarios/default.yaml' there (exit 2). From the checkout they read as written."""
    import json
    import os

    from testbed.commands.common import shipped_scenario

    assert shipped_scenario("default.yaml") == "scenarios/default.yaml"  # the suite runs from the checkout
    monkeypatch.chdir(tmp_path)
    assert shipped_scenario("default.yaml").endswith("/scenarios/default.yaml")
    rc, out = run_cli(["bench", "planner", "--requests", "64", "--ticks", "1", "--json", "-q"])
    assert rc == 0, out.err[-500:]
    assert json.loads(out.out)["scenario"] == "default" and os.listdir(tmp_path) == []


def test_bench_crosscheck_hands_its_child_absolute_paths(run_cli, tmp_path, monkeypatch):
    """The demo runs in a child process whose folder is the checkout: a relative scenario or --out given from
    another folder named other files there (the demo wrote one folder, the cross-check read another)."""
    import shutil

    from testbed.benchmarks import bench_crosscheck

    got = {}

    def fake(scenario, out, timeout_s):
        got.update(scenario=scenario, out=out)
        return {"demo_exit": 0}

    monkeypatch.setattr(bench_crosscheck, "bench_crosscheck", fake)
    shutil.copy("scenarios/default.yaml", tmp_path / "mine.yaml")
    monkeypatch.chdir(tmp_path)
    rc, out = run_cli(["bench", "crosscheck", "mine.yaml", "--out", "res", "-q"])
    assert rc == 0, out.err[-500:]
    assert got["scenario"] == tmp_path / "mine.yaml" and got["out"] == tmp_path / "res"
