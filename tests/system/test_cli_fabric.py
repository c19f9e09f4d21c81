"""The user-facing `orchestrrl fabric up` on a real fabric (held, then Ctrl-C). The demo (`orchestrrl demo`,
a comparison of every policy on the emulated cluster) is tests/system/test_crosscheck.py."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest


pytestmark = pytest.mark.system
ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ROOT / "scenarios" / "default.yaml"


def _orl_bridges() -> list[str]:
    out = subprocess.run(["ovs-vsctl", "list-br"], capture_output=True, text=True, check=True).stdout.split()
    return [b for b in out if b.startswith("orl")]


def test_fabric_up_serves_rest_and_tears_down_on_ctrl_c(tmp_path):
    info_file = tmp_path / "info.json"
    p = subprocess.Popen([sys.executable, "-m", "testbed.cli", "fabric", "up", str(DEFAULT), "--info-file",
                          str(info_file)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not info_file.exists():
            assert p.poll() is None, p.stdout.read()
            assert time.monotonic() < deadline, "fabric up did not come up within 60 s"
            time.sleep(0.1)
        info = json.loads(info_file.read_text())
        assert len(info["hosts"]) == 8 and info["phase"] == "train"
        assert set(info["bridges"]) <= set(_orl_bridges())
        token = Path(info["token_file"]).read_text().strip()
        req = urllib.request.Request(info["rest"] + "circuits", headers={"Authorization": f"Bearer {token}"})
        circuits = json.loads(urllib.request.urlopen(req, timeout=10).read())
        assert circuits["0"]  # the train mesh is installed
        # no token: refused
        with pytest.raises(urllib.error.HTTPError) as ei:
            urllib.request.urlopen(info["rest"] + "circuits", timeout=10)
        assert ei.value.code == 401
        # the controller's Prometheus endpoint, named in the info file: on loopback, the initial phase counted
        assert info["metrics"].startswith("http://127.0.0.1:") and info["metrics"].endswith("/metrics")
        body = urllib.request.urlopen(info["metrics"], timeout=10).read().decode()
        assert 'orchestrrl_reconfigurations_total{decision="switched",kind="initial",status="done"} 1.0' in body
        assert 'orchestrrl_fabric_phase{phase="train"} 1.0' in body
        assert "orchestrrl_controller_rest_requests_total" in body
        p.send_signal(signal.SIGINT)
        out, _ = p.communicate(timeout=60)
        assert p.returncode == 0, out
        assert "fabric down" in out
        assert not (set(info["bridges"]) & set(_orl_bridges()))
        assert not info_file.exists()  # it described a fabric that is gone
        assert not Path(info["token_file"]).parent.exists()  # the controller's /tmp/orlctl-* folder too
    finally:
        if p.poll() is None:  # the test failed with the fabric up: take it down by its records
            p.kill()
            p.wait()
            from emulation import registry

            registry.clean()
