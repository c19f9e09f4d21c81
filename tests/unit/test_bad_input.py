"""The fault corpus on the command line: every bad scenario, flag or --info-file gets exit 2, a short message
naming the field, and nothing starts (no fabric, no controller, no simulation) and no file changes."""
from __future__ import annotations

import contextlib
import os
import re
import types

import pytest
import yaml

from testbed import cli

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
DEFAULT = os.path.join(ROOT, "scenarios", "default.yaml")


@pytest.fixture
def nothing_starts(monkeypatch):
    """Fail the test if a fabric, a controller, RLSim or the demo is started."""
    import rlsim.sim
    import testbed.cluster.agent_pool
    import testbed.cluster.fabric
    from controller import app as ctl_app

    def boom(*a, **k):
        raise AssertionError("started something on bad input")

    monkeypatch.setattr(testbed.cluster.fabric, "running_testbed", boom)
    monkeypatch.setattr(rlsim.sim, "simulate_iteration", boom)
    monkeypatch.setattr(testbed.cluster.agent_pool, "running_cluster", boom)
    monkeypatch.setattr(ctl_app, "run_controller", boom)


def scenario(tmp_path, data: dict) -> str:
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump(data) if isinstance(data, dict) else data)
    return str(p)


HUGE = "1" + "0" * 400  # a 401-digit integer
BIG_EMULATED = {"fabric": {"pods": 1500, "tors_per_pod": 4, "servers_per_tor": 2},  # 12,000 servers
                "layout": {"train_pods": list(range(750)), "gen_pods": list(range(750, 1500))}}

CASES = [
    # (scenario YAML text or dict, commands, field)
    ("fabric:\n  pods: 1000000\n", ["sim", "demo", "fabric up"], "layout"),
    (f"fabric:\n  server_gbps: {HUGE}\n", ["sim", "demo", "fabric up"], "fabric.server_gbps"),
    ("fabric:\n  scale: .inf\n", ["sim", "demo", "fabric up"], "fabric.scale"),
    ("fabric:\n  reconfig_delay_ms: .inf\n", ["sim", "demo", "fabric up"], "fabric.reconfig_delay_ms"),
    ("fabric:\n  reconfig_delay_ms: .nan\n", ["sim", "demo", "fabric up"], "fabric.reconfig_delay_ms"),
    ("fabric:\n  reconfig_delay_ms: 70000\n", ["sim", "demo", "fabric up"], "fabric.reconfig_delay_ms"),
    ("controller:\n  delay_ms: 70000\n", ["sim", "demo", "fabric up"], "controller.delay_ms"),
    ("controller:\n  reconfig_delay_ms: 70000\n", ["sim", "demo", "fabric up"], "controller.reconfig_delay_ms"),
    ("fabric:\n  reconfig_delay_ms: 1000\n  time_dilation: 100\n", ["demo", "fabric up"], "fabric.reconfig_delay_ms"),
    (f"controller:\n  delay_ms: {HUGE}\n", ["sim", "demo", "fabric up"], "controller.delay_ms"),
    ("fabric:\n  tors_per_pod: 100000\n", ["sim"], "fabric.tors_per_pod"),
    ("fabric:\n  tors_per_pod: 100000\n", ["demo", "fabric up"], "servers"),
    ("workload:\n  prompts_per_step: 1000000000\n", ["sim", "demo", "fabric up", "controller", "run", "compare"],
     "workload.prompts_per_step"),
    ("fabric:\n  1: 2\n  a: 3\n", ["sim"], "fabric.1"),  # non-string YAML keys
    ("fabric:\n  pods: [1, 2]\n", ["sim"], "fabric.pods"),
    (BIG_EMULATED, ["demo", "fabric up"], "servers"),
]


@pytest.mark.parametrize("data,commands,field", CASES)
def test_bad_scenario_exits_2_naming_the_field(tmp_path, run_cli, nothing_starts, data, commands, field):
    path = scenario(tmp_path, data)
    for command in commands:
        rc, out = run_cli(command.split() + [path])
        assert rc == 2, (command, out.err[-2000:])
        assert f"error: {field}:" in out.err, (command, out.err[-500:])
        assert len(out.err) < 1000, (command, len(out.err))  # a few items and the count, never megabytes
        assert sorted(os.listdir(tmp_path)) == ["s.yaml"]  # nothing written beside it


@pytest.mark.parametrize("argv,field", [
    (["sim", DEFAULT, "--gpus", "1000000000000"], "gpus"),
    (["sim", DEFAULT, "--gpus", "0"], "gpus"),
    (["sim", "sweep", DEFAULT, "--out", "OUT", "--scales", "1000000000000"], "gpus"),
    (["controller", DEFAULT, "--delay-ms", "70000", "--no-auth", "--state-file", "STATE"], "delay_ms"),
    (["controller", DEFAULT, "--delay-ms", "inf", "--no-auth", "--state-file", "STATE"], "delay_ms"),
    (["bench", "reconfig", "--delay-ms", "70000"], "--delay-ms"),
    (["compare", DEFAULT, "--backend", "emulated", "--fabric", "topoopt", "--out", "OUT"], "fabric"),
    (["compare", DEFAULT, "--backend", "simulated", "--fabric", "torus", "--out", "OUT"], "fabric"),
    (["run", DEFAULT, "--backend", "simulated", "--fabric", "rfabric,fat-tree", "--out", "OUT"], "--fabric"),
    (["compare", DEFAULT, "--backend", "simulated", "--time-dilation", "0.01", "--out", "OUT"], "time_dilation"),
    (["compare", DEFAULT, "--backend", "simulated", "--policies", ",", "--out", "OUT"], "--policies"),
])
def test_bad_flag_exits_2_naming_the_field(tmp_path, run_cli, nothing_starts, argv, field):
    argv = [str(tmp_path / a) if a in ("OUT", "STATE") else a for a in argv]
    rc, out = run_cli(argv)
    assert rc == 2, out.err[-2000:]
    assert field in out.err and len(out.err) < 1000
    assert os.listdir(tmp_path) == []


def test_python_m_controller_rejects_a_delay_above_the_limit(tmp_path, capsys):
    from controller.__main__ import main

    assert main(["--spec-json", "{}", "--of-port", "6653", "--rest-port", "8080", "--no-auth",
                 "--delay-ms", "70000"]) == 2
    assert "delay_ms" in capsys.readouterr().err


# ---- fabric up --info-file: checked before anything is built; never removes a file the run did not write ----
@pytest.mark.parametrize("case", ["no_folder", "directory"])
def test_bad_info_file_is_refused_before_building(tmp_path, run_cli, nothing_starts, case):
    target = tmp_path / "missing" / "info.json" if case == "no_folder" else tmp_path
    rc, out = run_cli(["fabric", "up", DEFAULT, "--info-file", str(target)])
    assert rc == 2 and "error: info_file:" in out.err
    assert os.listdir(tmp_path) == []  # no .tmp file, no folder


def _fake_testbed(on_running=None):
    """A running_testbed stand-in: yields a testbed whose controller 'exits' at once (fabric up returns 1)."""
    spec_servers = 8

    class Ctl:
        client = types.SimpleNamespace(base_url="http://127.0.0.1:1", state=lambda: {"phase": "train"})
        token_file, pid, log_path, of_port = "/nonexistent/token", 1, "/nonexistent/log", 6653
        metrics_url = None  # set from the metrics_port fabric up asks for (below)

        @property
        def running(self):
            if on_running:
                on_running()
            return False

    ctl = Ctl()
    fabric = types.SimpleNamespace(mgmt_ip=lambda s: f"10.0.1.{s + 1}",
                                   host=lambda s: types.SimpleNamespace(pid=1000 + s),
                                   bridge_names=lambda: [f"orlt{t}" for t in range(spec_servers // 2)])
    tb = types.SimpleNamespace(controller=ctl, client=ctl.client, fabric=fabric)

    @contextlib.contextmanager
    def running_testbed(*a, **k):
        port = k.get("metrics_port", 0)
        ctl.metrics_url = f"http://{k.get('metrics_host')}:{port}/metrics" if port else None
        yield tb

    return running_testbed


def test_start_failure_keeps_an_existing_info_file(tmp_path, monkeypatch, capsys):
    import testbed.cluster.fabric

    info = tmp_path / "info.json"
    info.write_text("mine\n")

    @contextlib.contextmanager
    def failing(*a, **k):
        raise RuntimeError("fabric start failed")
        yield  # pragma: no cover

    monkeypatch.setattr(testbed.cluster.fabric, "running_testbed", failing)
    with pytest.raises(RuntimeError, match="fabric start failed"):
        cli.main(["fabric", "up", DEFAULT, "--info-file", str(info)])
    assert info.read_text() == "mine\n"  # the run did not write it: it stays
    assert os.listdir(tmp_path) == ["info.json"]


def test_info_file_written_once_up_and_removed_on_teardown(tmp_path, monkeypatch, capsys):
    import json

    import testbed.cluster.fabric

    info = tmp_path / "info.json"
    seen = []
    monkeypatch.setattr(testbed.cluster.fabric, "running_testbed",
                        _fake_testbed(on_running=lambda: seen.append(json.loads(info.read_text()))))
    assert cli.main(["fabric", "up", DEFAULT, "--info-file", str(info)]) == 1  # the fake controller 'exited'
    assert seen and len(seen[0]["hosts"]) == 8 and seen[0]["phase"] == "train"
    assert os.listdir(tmp_path) == []  # removed with the fabric it described, no temporary file left
    # the controller's Prometheus endpoint: the default port (or a free one), on loopback; 0 turns it off
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/metrics", seen[0]["metrics"])
    assert f"metrics    {seen[0]['metrics']}" in capsys.readouterr().out
    assert cli.main(["fabric", "up", DEFAULT, "--info-file", str(info), "--controller-metrics-port", "0"]) == 1
    assert seen[1]["metrics"] is None


def test_info_file_replaced_by_someone_else_is_not_removed(tmp_path, monkeypatch, capsys):
    import testbed.cluster.fabric

    info = tmp_path / "info.json"

    def other_writer():
        os.unlink(info)
        info.write_text("someone else's\n")

    monkeypatch.setattr(testbed.cluster.fabric, "running_testbed", _fake_testbed(on_running=other_writer))
    assert cli.main(["fabric", "up", DEFAULT, "--info-file", str(info)]) == 1
    assert info.read_text() == "someone else's\n"


@pytest.mark.parametrize("argv", [
    ["compare", DEFAULT, "--backend", "simulated"],
    ["compare", DEFAULT, "--backend", "simulated", "--fabric", "rfabric,fat-tree"],
    ["run", DEFAULT, "--backend", "simulated", "--policy", "planner"],
    ["map", DEFAULT],
    ["sim", "sweep", DEFAULT],
    ["bench", "faults", DEFAULT],
    ["bench", "crosscheck", DEFAULT],
    ["demo", DEFAULT],
])
@pytest.mark.parametrize("where", ["file", "below a file"])
def test_an_output_folder_that_cannot_be_one_exits_2_before_anything_runs(tmp_path, run_cli, nothing_starts,
                                                                          monkeypatch, argv, where):
    """--out names a file, or a folder below one: exit 2 naming --out before the tuning grid, the map's points
    or the sweep run (each would run for minutes and fail at its first write), and nothing is written."""
    import testbed.commands.run as run_cmd
    from rlsim import sweep
    from testbed.runs import policymap

    def boom(*a, **k):
        raise AssertionError("ran before the output folder was checked")

    monkeypatch.setattr(run_cmd, "_tune", boom)
    monkeypatch.setattr(policymap, "build", boom)
    monkeypatch.setattr(sweep, "run_sweep", boom)
    (tmp_path / "f").write_text("mine")
    out = tmp_path / "f" if where == "file" else tmp_path / "f" / "sub"
    rc, res = run_cli(argv + ["--out", str(out)])
    assert rc == 2, res.err[-2000:]
    assert "--out" in res.err and ("is not a folder" in res.err), res.err[-500:]
    assert sorted(os.listdir(tmp_path)) == ["f"] and (tmp_path / "f").read_text() == "mine"


def test_an_output_folder_nothing_can_be_made_in_exits_2(tmp_path, run_cli, nothing_starts):
    rc, res = run_cli(["compare", DEFAULT, "--backend", "simulated", "--out", "/proc/orl-no-folder"])
    assert rc == 2 and "--out /proc/orl-no-folder: nothing can be created in /proc" in res.err, res.err[-500:]


def test_the_output_folder_check_leaves_nothing_behind(tmp_path):
    from testbed.commands.common import out_folder

    assert out_folder(None, str(tmp_path / "a" / "b")) == tmp_path / "a" / "b"
    assert out_folder(str(tmp_path), "unused") == tmp_path
    assert os.listdir(tmp_path) == []  # the folder made to try the nearest existing one is gone


def test_sim_of_one_iteration_refuses_an_output_folder(tmp_path, run_cli, nothing_starts):
    rc, res = run_cli(["sim", DEFAULT, "--out", str(tmp_path / "o")])
    assert rc == 2 and "--out is for 'sim sweep'" in res.err
    assert os.listdir(tmp_path) == []


# the start of a rollout_s case (its scenario, round and layout follow)
ROLLOUT = ("cases:\n- {id: a, kind: rollout_s, role: fit, model: Qwen3-8B, gpu: H100, profile: vllm-v1, "
           "measured: 1, source: x")


@pytest.mark.parametrize("text,field", [
    (None, "cases: no such file"),
    ("cases: [\n", "not valid YAML"),
    ("- 1\n", "must be a mapping"),
    ("", "must be a mapping"),
    ("cases: 5\n", "cases: must be a list"),
    ("cases:\n- {id: a, kind: step_ms, role: fit, model: NoModel, gpu: H100, profile: vllm-v1, measured: 1, source: x}\n",
     "cases[0].model: unknown model"),
    ("cases:\n- {id: a, kind: step_ms, role: fit, model: Qwen3-8B, gpu: Z900, profile: vllm-v1, measured: 1, source: x}\n",
     "cases[0].gpu: unknown GPU"),
    (ROLLOUT + "}\n", "cases[0].scenario: is required"),
    (ROLLOUT + ", scenario: scenarios/nope.yaml, round: short, layout: TP1x8}\n", "cases[0].scenario: no such file"),
    (ROLLOUT + ", scenario: scenarios/rollpacker-qwen3-8b.yaml, round: mid, layout: TP1x8}\n", "cases[0].round"),
    (ROLLOUT + ", scenario: scenarios/rollpacker-qwen3-8b.yaml, round: short, layout: TP4x2}\n", "cases[0].layout"),
])
def test_a_bad_engine_case_file_exits_2_naming_what_is_wrong(tmp_path, run_cli, text, field):
    path = tmp_path / "cases.yaml"
    if text is not None:
        path.write_text(text)
    rc, res = run_cli(["bench", "engine", "--cases", str(path), "--json"])
    assert rc == 2, res.err[-2000:]
    assert field in res.err and len(res.err) < 1000, res.err[-500:]


@pytest.mark.parametrize("script,argv,says", [
    ("bench_policies", ["--seeds", "a,b"], "--seeds takes integers"),
    ("bench_policies", ["--seeds", ","], "--seeds must name a seed"),
    ("bench_policies", ["--reinit", "x"], "--reinit numbers"),
    ("bench_policies", ["--reinit", "-1"], "switch_reinit_s"),
    ("bench_policies", ["--set", "planner.nope=1"], "orchestrator.planner.nope: unknown key"),
    ("bench_policies", ["--extra", "x[planner=nomod:C]"], "module 'nomod' does not import"),
    ("bench_policies", ["--out", "FILE"], "exists and is not a folder"),
    ("bench_engine_sweep", ["--field", "nope", "--values", "1"], "--field 'nope': not a figure"),
    ("bench_engine_sweep", ["--field", "cpu_per_seq_us", "--values", "a"], "must be a finite number >= 0"),
    ("bench_engine_sweep", ["--field", "cpu_per_seq_us", "--values", "1,-1"], "must be a finite number >= 0"),
    ("bench_engine_sweep", ["--field", "graph_max_tokens", "--values", "1.5"], "must be an integer >= 0"),
    ("bench_engine_sweep", ["--field", "overlap", "--values", "5"], "must be true or false"),
    ("bench_engine_sweep", ["--field", "cpu_per_seq_us", "--values", "1", "--profile", "nope"], "unknown engine profile"),
    ("bench_engine_sweep", ["--field", "cpu_per_seq_us", "--values", "1", "--scenario", "/nope.yaml"], "no such file"),
    ("bench_engine", ["--scenario", "/nope.yaml"], "scenario: no such file"),
    ("bench_engine", ["--out", "FILE/x"], "a file to write in an existing folder"),
    ("bench_engine", ["--baseline", "no-such-revision"], "--baseline: no agents/engine.py at git revision"),
    ("bench_rlsim", ["--sections", "nope"], "--sections: unknown ['nope']"),
    ("bench_rlsim", ["--runs", "0"], "must be >= 1"),
    ("bench_rate_change", ["--changes", "0"], "--changes must be >= 1"),
    ("bench_lanes", ["--knowledge", "progress,bogus"], "--knowledge: knowledge 'bogus'"),
    ("bench_lanes", ["--knowledge", "predictor:-1"], "log-error sd must be a number >= 0"),
    ("bench_lanes", ["--seed", "-1"], "--seed must be >= 0"),
    ("bench_lanes", ["--known-seeds", "0,4"], "--known-seeds: whole numbers >= 1"),
    ("bench_lanes", ["--from-json", "FILE"], "--from-json: cannot read"),
    ("bench_lanes", ["--from-json", "FILE", "--knowledge", "prompt"], "--from-json re-plots earlier runs: --knowledge"),
    ("bench_lanes", ["--plot", "FILE.txt"], "--plot: a .png file in an existing folder"),
    ("bench_lanes", ["--plot", "FILE/x/lanes.png"], "--plot: a .png file in an existing folder"),
])
def test_a_benchmark_script_refuses_bad_input_before_its_first_run(tmp_path, monkeypatch, capsys, script, argv, says):
    """The sweeps docs/costmodel.md and docs/orchestrator.md quote run for minutes a point: a bad seed, setting,
    figure or output folder is exit 2 naming it, before any point runs (these were tracebacks, some mid-run)."""
    import importlib

    mod = importlib.import_module(f"testbed.benchmarks.{script}")

    def boom(*a, **k):
        raise AssertionError("ran before its input was checked")

    for fn in ("run_case", "compare_point", "rollpacker_point", "one_run", "scales_section", "_measure",
               "bench_scenario"):
        if hasattr(mod, fn):
            monkeypatch.setattr(mod, fn, boom)
    (tmp_path / "f").write_text("mine")
    argv = [str(tmp_path / "f") + a[4:] if a.startswith("FILE") else a for a in argv]
    with pytest.raises(SystemExit) as e:
        mod.main(argv + (["--cases", "default", "--seeds", "1"] if script == "bench_policies" and "--seeds" not in argv
                         else []))
    assert e.value.code == 2
    assert says in capsys.readouterr().err
    assert os.listdir(tmp_path) == ["f"]
