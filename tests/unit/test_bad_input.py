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
