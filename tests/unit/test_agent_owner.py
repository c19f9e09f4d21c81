"""An agent whose starter dies (even by SIGKILL, with no chance to stop it) shuts itself down: an agent
process on loopback (no fabric needed), owned by a stand-in process that the test kills."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

from agents.client import AgentClient
from emulation.registry import proc_start_time

ROOT = Path(__file__).resolve().parents[2]
START_S = 120.0  # an agent's start-up deadline (AgentPool.start_timeout_s)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(tmp_path: Path, owner: subprocess.Popen | None) -> tuple[Path, int]:
    port = _free_port()
    cfg = {"index": 0, "server": 0, "role": "gen", "gpus": 8, "model": "Qwen2.5-7B", "gpu": "H800",
           "rpc": {"host": "127.0.0.1", "port": port}, "fabric_ip": "127.0.0.1", "fabric_intf": "lo",
           "layout": "TP1x8"}
    if owner is not None:
        cfg.update(owner_pid=owner.pid, owner_start=proc_start_time(owner.pid))
    p = tmp_path / "agent.json"
    p.write_text(json.dumps(cfg))
    return p, port


def _wait_for(cond, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.05)


def _start(cfg: Path, tmp_path: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "agents.node", "--config", str(cfg), "--log",
                             str(tmp_path / "agent.log")], cwd=ROOT)


def test_agent_exits_when_its_owner_is_killed(tmp_path):
    owner = subprocess.Popen(["sleep", "120"])
    cfg, port = _config(tmp_path, owner)
    agent = _start(cfg, tmp_path)
    try:
        client = AgentClient(f"tcp://127.0.0.1:{port}", "agent0", timeout_s=30.0)
        # up and serving while its owner lives (the first answer waits for torch's import: seconds on a busy machine)
        assert client.call("ping", timeout_s=START_S)["pid"] == agent.pid
        _wait_for(lambda: client.call("ping")["owner_checks"] >= 1, 10, "a check of the live owner")
        assert agent.poll() is None
        owner.kill()
        owner.wait()
        assert agent.wait(timeout=10) == 0  # noticed at its next check (every second), shut down cleanly
        assert "is gone: shutting down" in (tmp_path / "agent.log").read_text()
        client.close()
    finally:
        for p in (owner, agent):
            if p.poll() is None:
                p.kill()
                p.wait()


def test_agent_without_an_owner_keeps_serving(tmp_path):
    cfg, port = _config(tmp_path, None)
    agent = _start(cfg, tmp_path)
    try:
        client = AgentClient(f"tcp://127.0.0.1:{port}", "agent0", timeout_s=30.0)
        assert client.call("ping", timeout_s=START_S)["pid"] == agent.pid
        _wait_for(lambda: client.call("ping")["owner_checks"] >= 2, 10, "two periodic checks with no owner")
        assert agent.poll() is None and client.call("ping")["pid"] == agent.pid
        client.call("shutdown")
        assert agent.wait(timeout=10) == 0
        client.close()
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
