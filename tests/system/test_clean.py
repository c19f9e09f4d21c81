"""`orchestrrl clean` after a kill -9 of a run: no orl* bridge, interface or recorded process remains."""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from emulation import registry

pytestmark = pytest.mark.system

ORCHESTRRL = str(Path(sys.executable).with_name("orchestrrl"))

RUN = r"""
import sys, time
from emulation.builder import EmulatedFabric
from emulation.spec import FabricSpec
fab = EmulatedFabric(FabricSpec(), controller_port=16698)
fab.start()
fab.popen(0, ["sleep", "300"])          # own session: survives its parent
fab.popen(5, ["sleep", "300"])
print("UP", flush=True)
time.sleep(300)
"""


def read_line(p: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    buf = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([p.stdout], [], [], 0.1)
        if ready:
            chunk = os.read(p.stdout.fileno(), 4096)
            if not chunk:
                break
            buf += chunk
            if b"\n" in buf:
                return buf.decode().splitlines()[0]
    raise AssertionError(f"no line from the run within {timeout_s}s (got {buf!r}, rc={p.poll()})")


def test_clean_after_kill_9(orl_state_dir, no_capacity_file, orl_leftovers):
    assert orl_leftovers() == {"bridges": [], "interfaces": []}, "leftovers from an earlier run: orchestrrl clean"
    run = subprocess.Popen([sys.executable, "-c", RUN], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        _check_clean_after_kill_9(run, orl_leftovers)
    except BaseException:  # a failed check must not leave the crashed run's fabric to break later tests
        registry.clean()
        raise


def _check_clean_after_kill_9(run: subprocess.Popen, orl_leftovers) -> None:
    try:
        assert read_line(run, 60) == "UP"
        recorded = registry.list_processes()
        assert {r.role.split(":")[0] for r in recorded} == {"mnhost", "mnswitch", "hostproc"}
        os.kill(run.pid, signal.SIGKILL)
        run.wait(timeout=10)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    left = orl_leftovers()
    assert left["bridges"] and left["interfaces"]  # the crash did leave things behind
    sleepers = [r for r in recorded if r.role.startswith("hostproc")]
    assert all(registry.process_alive(r.pid, r.start_time) for r in sleepers)

    out = subprocess.run([ORCHESTRRL, "clean", "--json"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rep = json.loads(out.stdout)
    assert set(left["bridges"]) <= set(rep["bridges"])
    assert {p["pid"] for p in rep["processes"]} >= {r.pid for r in sleepers}

    assert orl_leftovers() == {"bridges": [], "interfaces": []}
    assert not any(registry.process_alive(r.pid, r.start_time) for r in recorded)
    assert registry.list_processes() == [] and registry.list_resources() == []
    again = subprocess.run([ORCHESTRRL, "clean"], capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and "nothing to clean" in again.stdout


def test_clean_leaves_another_registrys_fabric_alone(tmp_path, monkeypatch, no_capacity_file, orl_leftovers):
    """Two registries (two ORCHESTRRL_STATE_DIR): cleaning one leaves the other's running fabric alone;
    a second fabric with the same names refuses to start and touches nothing."""
    from emulation.builder import EmulatedFabric
    from emulation.spec import FabricSpec

    assert orl_leftovers() == {"bridges": [], "interfaces": []}, "leftovers from an earlier run: orchestrrl clean"
    reg_a, reg_b = tmp_path / "registry-a", tmp_path / "registry-b"
    monkeypatch.setenv("ORCHESTRRL_STATE_DIR", str(reg_b))
    other = EmulatedFabric(FabricSpec(), controller_port=16697)  # "another checkout's running fabric"
    other.start()
    try:
        theirs = orl_leftovers()
        b_records = registry.list_resources()
        assert theirs["bridges"] and b_records

        monkeypatch.setenv("ORCHESTRRL_STATE_DIR", str(reg_a))
        with pytest.raises(registry.NameInUse, match="already exist"):
            EmulatedFabric(FabricSpec(), controller_port=16696).start()
        assert orl_leftovers() == theirs and registry.list_resources() == []
        # registry A's own leftover: a veth pair it recorded
        registry.record_resource("interface", "orlxa0")
        subprocess.run(["ip", "link", "add", "orlxa0", "type", "veth", "peer", "name", "orlxa1"], check=True)
        env = dict(os.environ, ORCHESTRRL_STATE_DIR=str(reg_a))

        dry = subprocess.run([ORCHESTRRL, "clean", "--all", "--dry-run", "--json"], capture_output=True, text=True,
                             timeout=60, env=env)
        rep = json.loads(dry.stdout)
        assert set(theirs["bridges"]) <= set(rep["bridges"]) and "orlxa0" in rep["interfaces"]  # says all
        assert orl_leftovers()["bridges"] == theirs["bridges"]  # and removes nothing

        out = subprocess.run([ORCHESTRRL, "clean", "--json"], capture_output=True, text=True, timeout=60, env=env)
        assert out.returncode == 0, out.stdout + out.stderr
        rep = json.loads(out.stdout)
        assert rep["interfaces"] == ["orlxa0"] and rep["bridges"] == [] and rep["processes"] == []
        assert set(theirs["bridges"]) <= set(rep["not_recorded"]["bridges"])
        left = orl_leftovers()
        assert left["bridges"] == theirs["bridges"] and set(left["interfaces"]) == set(theirs["interfaces"])
        assert registry.list_resources() == []
        monkeypatch.setenv("ORCHESTRRL_STATE_DIR", str(reg_b))
        assert registry.list_resources() == b_records  # the other registry's records survive
        assert other.host(0).cmd("echo alive").strip() == "alive"  # its hosts too
    finally:
        monkeypatch.setenv("ORCHESTRRL_STATE_DIR", str(reg_b))
        other.stop()
        subprocess.run(["ip", "link", "del", "orlxa0"], capture_output=True)
    assert orl_leftovers() == {"bridges": [], "interfaces": []}
