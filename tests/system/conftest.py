"""Shared fixtures for system tests (root + Open vSwitch).

Every test marked ``@pytest.mark.system`` is skipped, with the reason, unless it runs as root and Open vSwitch
answers. `make test` and CI run them alone; when something else on the machine also uses Open vSwitch (another
checkout's tests, a benchmark), serialise the runs with a lock, since every test starts with no orl* bridges:

    flock /tmp/orchestrrl-ovs.lock .venv/bin/pytest -m system tests/system
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess

import pytest


@functools.lru_cache(maxsize=None)
def system_skip_reason() -> str | None:
    """Why system tests cannot run here, or None when they can."""
    if os.geteuid() != 0:
        return "system test needs root (builds OVS bridges and network namespaces)"
    if not shutil.which("ovs-vsctl"):
        return "system test needs Open vSwitch (ovs-vsctl not found; run scripts/provision.sh)"
    try:
        r = subprocess.run(["ovs-vsctl", "--timeout=5", "show"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError) as e:
        return f"system test needs Open vSwitch answering ({e})"
    if r.returncode != 0:
        return f"system test needs Open vSwitch answering: {r.stderr.strip()[:200]}"
    return None


def pytest_runtest_setup(item):
    if item.get_closest_marker("system") is not None:
        reason = system_skip_reason()
        if reason:
            pytest.skip(reason)


@pytest.fixture
def orl_state_dir(tmp_path, monkeypatch):
    """A private registry state dir (ORCHESTRRL_STATE_DIR) for this test and its subprocesses."""
    d = tmp_path / "orl-state"
    monkeypatch.setenv("ORCHESTRRL_STATE_DIR", str(d))
    return d


@pytest.fixture
def no_capacity_file(tmp_path, monkeypatch):
    """Point ORCHESTRRL_CAPACITY_FILE at a file that does not exist (no machine measurement)."""
    p = tmp_path / "capacity.json"
    monkeypatch.setenv("ORCHESTRRL_CAPACITY_FILE", str(p))
    return p


def orl_bridges() -> list[str]:
    out = subprocess.run(["ovs-vsctl", "--timeout=5", "list-br"], capture_output=True, text=True, check=True).stdout
    return [b for b in out.split() if b.startswith("orl")]


def orl_interfaces() -> list[str]:
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True, check=True).stdout
    names = [line.split(":", 2)[1].strip().split("@", 1)[0] for line in out.splitlines() if ":" in line]
    return [n for n in names if n.startswith("orl")]


@pytest.fixture
def orl_leftovers():
    """Callable returning the orl* bridges and root-namespace interfaces that exist right now."""
    return lambda: {"bridges": orl_bridges(), "interfaces": orl_interfaces()}
