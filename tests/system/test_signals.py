"""Every signal tears down the same way: SIGTERM to a `demo` (what `timeout -s TERM 60 orchestrrl demo` sends),
SIGHUP to a `run` mid-generation, SIGINT to a `run`'s whole process group (Ctrl-C in a terminal). Afterwards
`orchestrrl clean --all --dry-run` lists nothing and /tmp holds nothing of the run. A `fabric up` killed with
SIGKILL takes its controller with it (the controller watches its owner), and `orchestrrl clean` removes the
rest, its scratch folders included.

Each command runs with a private registry (ORCHESTRRL_STATE_DIR), so "nothing recorded" means this test's
run left nothing; `--all` also lists every orl* bridge, interface and namespace on the machine.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from agents.client import AgentClient
from emulation import registry
from emulation.spec import FabricSpec

pytestmark = pytest.mark.system
ROOT = Path(__file__).resolve().parents[2]
ORCHESTRRL = str(Path(sys.executable).with_name("orchestrrl"))

SMALL = """
name: signals-small
seed: 5
fabric: {pods: 2, tors_per_pod: 1, servers_per_tor: 2, ocs_count: 1, uplinks_per_tor: 2}
layout: {train_pods: [0], gen_pods: [1]}
workload: {model: Qwen2.5-7B, prompts_per_step: 12, samples_per_prompt: 8, response_median_tokens: 150,
           response_sigma: 0.8, prompt_sigma: 0.4, max_response_tokens: 3000, steps: 2}
orchestrator: {planning_interval_s: 0.5, engine: {max_num_seqs: 8}}
"""
SPEC = FabricSpec(pods=2, tors_per_pod=1, servers_per_tor=2, ocs_count=1, uplinks_per_tor=2)


def _ours_in_tmp() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).iterdir() if p.name.startswith(registry.TMPDIR_PREFIXES)}


def _records(state: Path, role: str) -> list[dict]:
    out = []
    for p in state.glob("proc-*.json"):
        rec = registry.read_json(p)  # None: being written, or gone (its process exited) since the glob
        if rec is not None and rec.get("role", "").startswith(role):
            out.append(rec)
    return out


def _wait(cond, timeout_s: float, what: str, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the command exited ({proc.returncode}) before {what}: {proc.stdout.read()}")
        assert time.monotonic() < deadline, f"no {what} within {timeout_s} s"
        time.sleep(0.05)


def _generating(server: int) -> bool:
    c = AgentClient(f"tcp://{SPEC.host_mgmt_ip(server)}:7000", f"agent {server}", timeout_s=1.0)
    try:
        return c.call("stats", timeout_s=1.0)["generation_tokens_total"] > 500
    except Exception:  # noqa: BLE001 - not up yet
        return False
    finally:
        c.close()


@pytest.fixture
def scenario(tmp_path):
    p = tmp_path / "small.yaml"
    p.write_text(SMALL)
    return p


@pytest.fixture
def env(orl_state_dir, no_capacity_file):
    return dict(os.environ, ORCHESTRRL_STATE_DIR=str(orl_state_dir), PYTHONPATH=str(ROOT))


def _start(argv, env, group: bool = False) -> subprocess.Popen:
    return subprocess.Popen([ORCHESTRRL] + argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=group)


def _check_torn_down(p: subprocess.Popen, code: int, env: dict, tmp_before: set[str], orl_leftovers) -> str:
    try:
        out, _ = p.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        raise AssertionError(f"no teardown within 60 s:\n{out[-3000:]}")
    assert p.returncode == code, out[-3000:]
    assert "everything it started was stopped" in out
    dry = subprocess.run([ORCHESTRRL, "clean", "--all", "--dry-run", "--json"], env=env, capture_output=True,
                         text=True, timeout=60)
    rep = json.loads(dry.stdout)
    assert dry.returncode == 0 and not (rep["processes"] or rep["bridges"] or rep["interfaces"] or rep["netns"]
                                        or rep["tmpdirs"]), rep
    assert orl_leftovers() == {"bridges": [], "interfaces": []}
    assert _ours_in_tmp() - tmp_before == set()  # /tmp holds nothing of the run
    assert "kept in" not in out  # nothing failed: nothing was kept
    return out


def _guard(p: subprocess.Popen, env: dict):
    """After a failed check: stop the command and clean by its records, so later tests start clean."""
    if p.poll() is None:
        os.killpg(p.pid, signal.SIGKILL) if os.getpgid(p.pid) == p.pid else p.kill()
        p.wait()
    subprocess.run([ORCHESTRRL, "clean"], env=env, capture_output=True, timeout=120)


def test_sigterm_to_a_demo_tears_everything_down(scenario, env, tmp_path, orl_state_dir, orl_leftovers):
    assert orl_leftovers() == {"bridges": [], "interfaces": []}
    before = _ours_in_tmp()
    p = _start(["demo", str(scenario), "--out", str(tmp_path / "demo"), "-q"], env)
    try:
        _wait(lambda: len(_records(orl_state_dir, "agent")) == SPEC.n_servers, 90, "agents started", p)
        p.send_signal(signal.SIGTERM)  # what `timeout -s TERM 60 orchestrrl demo` does at 60 s
        _check_torn_down(p, 143, env, before, orl_leftovers)
    except BaseException:
        _guard(p, env)
        raise


def _signal_a_run(scenario, env, tmp_path, orl_leftovers, policy: str, server: int, send, status: int,
                  group: bool = False) -> str:
    """Start ``orchestrrl run`` of ``policy`` on the emulated backend, ``send(p)`` once ``server`` generates, and
    check that everything is torn down with exit ``status``; the command's output."""
    before = _ours_in_tmp()
    p = _start(["run", str(scenario), "--policy", policy, "--backend", "emulated", "--out",
                str(tmp_path / "run"), "-q"], env, group=group)
    try:
        _wait(lambda: _generating(server), 120, "generation under way", p)
        send(p)
        return _check_torn_down(p, status, env, before, orl_leftovers)
    except BaseException:
        _guard(p, env)
        raise


def test_sighup_to_a_run_mid_generation_tears_everything_down(scenario, env, tmp_path, orl_state_dir,
                                                               orl_leftovers):
    _signal_a_run(scenario, env, tmp_path, orl_leftovers, "orchestrrl", 2,
                  lambda p: p.send_signal(signal.SIGHUP), 129)


def test_ctrl_c_to_the_process_group_tears_everything_down(scenario, env, tmp_path, orl_state_dir,
                                                          orl_leftovers):
    # a terminal's Ctrl-C: SIGINT to the whole foreground group
    out = _signal_a_run(scenario, env, tmp_path, orl_leftovers, "balancer", 3,
                        lambda p: os.killpg(p.pid, signal.SIGINT), 130, group=True)
    assert "controller files kept" not in out  # the controller was stopped, not killed by the Ctrl-C


def test_a_killed_fabric_up_takes_its_controller_with_it(scenario, env, tmp_path, orl_state_dir, orl_leftovers):
    before = _ours_in_tmp()
    info = tmp_path / "info.json"
    p = _start(["fabric", "up", str(scenario), "--info-file", str(info)], env)
    try:
        _wait(info.exists, 60, "the fabric up", p)
        ctl = json.loads(info.read_text())["controller_pid"]
        assert registry.process_alive(ctl)
        p.kill()  # SIGKILL: no teardown of its own at all
        p.wait()
        _wait(lambda: not registry.process_alive(ctl), 5, "the controller's exit")
        assert _ours_in_tmp() - before  # the dead run's scratch folders are still there ...
        rc = subprocess.run([ORCHESTRRL, "clean"], env=env, capture_output=True, text=True, timeout=120)
        assert rc.returncode == 0, rc.stdout + rc.stderr
        assert "scratch folder(s)" in rc.stdout
        assert _ours_in_tmp() - before == set()  # ... until clean removes them with the rest
        assert orl_leftovers() == {"bridges": [], "interfaces": []}
    except BaseException:
        _guard(p, env)
        raise
