"""The real controller on a real fabric: a REST body shorter than its Content-Length is refused (400) and never
executed, a stalled one gets 408 within the read deadline (never 500); a circuit to a port the built OCS does
not have is refused; a scenario describing an OCS the emulator would not build is refused before anything
starts, and a controller whose spec says more OCS ports than the switch has never gets ready."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from controller.client import ControllerError
from controller.process import ControllerProcess
from controller.rest import READ_TIMEOUT_S
from emulation.builder import EmulatedFabric
from emulation.spec import FabricSpec, JobLayout
from emulation.validation import SpecError
from testbed.cluster.fabric import running_testbed
from raw_http import raw_post

pytestmark = pytest.mark.system
ROOT = Path(__file__).resolve().parents[2]
ORCHESTRRL = str(Path(sys.executable).with_name("orchestrrl"))
SPEC = FabricSpec(pods=2, tors_per_pod=1, servers_per_tor=2, ocs_count=1, uplinks_per_tor=2)  # 4 OCS ports
LAYOUT = JobLayout((0,), (1,))


def _post(ctl, body: bytes, declared: int, then: str) -> tuple[int, dict, float]:
    return raw_post(("127.0.0.1", ctl.rest_port), ctl.token, body, declared, then, timeout=READ_TIMEOUT_S + 10)


def test_truncated_and_stalled_bodies_and_a_port_that_does_not_exist(orl_leftovers):
    with running_testbed(SPEC, LAYOUT, initial_phase="train") as tb:
        ctl = tb.controller
        before = tb.client.circuits()
        st, err, _ = _post(ctl, b'{"phase": "gen"}', 50, "half-close")  # 16 bytes of a declared 50
        assert st == 400 and err["field"] == "body" and "ended after 16 of the 50" in err["error"]
        st, err, took = _post(ctl, b'{"phase": ', 50, "stall")
        assert st == 408 and err["field"] == "body" and took <= READ_TIMEOUT_S + 2.0
        assert tb.client.state()["phase"] == "train" and tb.client.circuits() == before  # nothing executed
        hist = tb.client.history()
        assert [h["status"] for h in hist[-2:]] == ["rejected", "rejected"]
        # the built OCS has ports 1..4: a circuit to port 9 is refused, nothing changes
        with pytest.raises(ControllerError) as ei:
            tb.client.request("POST", "circuits", {"circuits": {"0": [[1, 9]]}})
        assert ei.value.status == 400 and "circuits.0" in str(ei.value.field)
        assert tb.client.circuits() == before
        tail = ctl.log_tail()  # a 500 is logged as "REST handler failed" with its traceback
        assert "REST handler failed" not in tail and "Traceback" not in tail
    assert orl_leftovers() == {"bridges": [], "interfaces": []}


def test_an_ocs_the_emulator_would_not_build_is_refused_before_anything_starts(tmp_path, orl_leftovers):
    for ports, why in ((100000, "largest commercial OCS"), (16, "builds only the 8")):
        scn = tmp_path / f"ocs{ports}.yaml"
        scn.write_text(f"name: ocs{ports}\nfabric: {{ocs_ports: {ports}}}\n")
        r = subprocess.run([ORCHESTRRL, "fabric", "up", str(scn)], cwd=ROOT, capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2 and "ocs_ports" in r.stderr and why in r.stderr, r.stderr  # the field named
        assert orl_leftovers() == {"bridges": [], "interfaces": []}  # nothing was built


def test_a_controller_whose_spec_says_other_ocs_ports_than_the_switch_has_never_gets_ready(orl_leftovers):
    said = FabricSpec(**{**SPEC.__dict__, "ocs_ports": 8})  # the controller is told 8 ports; the switch has 4
    with ControllerProcess(said, LAYOUT, initial_phase="train") as ctl:
        with EmulatedFabric(SPEC, controller_port=ctl.of_port,
                            wait_connected=lambda d, t: ctl.client.wait_switches(d, t)):
            t0 = time.monotonic()
            with pytest.raises(SpecError) as ei:
                ctl.client.wait_ready(30)
            assert time.monotonic() - t0 < 15  # refused as soon as the switch was read, not at the timeout
            assert ei.value.field == "fabric.ocs_ports" and "has 4 ports" in str(ei.value)
            with pytest.raises(ControllerError) as ce:
                ctl.client.set_phase("gen")
            assert ce.value.status == 503 and "does not match its spec" in str(ce.value)
    assert orl_leftovers() == {"bridges": [], "interfaces": []}
