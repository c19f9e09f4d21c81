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


def _start(cfg: Path, tmp_path: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "agents.node", "--config", str(cfg), "--log",
                             str(tmp_path / "agent.log")], cwd=ROOT)


def test_agent_exits_when_its_owner_is_killed(tmp_path):
    owner = subprocess.Popen(["sleep", "120"])
    cfg, port = _config(tmp_path, owner)
    agent = _start(cfg, tmp_path)
    try:
        client = AgentClient(f"tcp://127.0.0.1:{port}", "agent0", timeout_s=30.0)
        assert client.call("ping")["pid"] == agent.pid  # up and serving while its owner lives
        time.sleep(1.5)
        assert agent.poll() is None
        owner.kill()
        owner.wait()
        assert agent.wait(timeout=10) == 0  # noticed within ~1 s, shut down cleanly
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
        assert client.call("ping")["pid"] == agent.pid
        time.sleep(2.0)
        assert agent.poll() is None and client.call("ping")["pid"] == agent.pid
        client.call("shutdown")
        assert agent.wait(timeout=10) == 0
        client.close()
    finally:
        if agent.poll() is None:
            agent.kill()
            agent.wait()
