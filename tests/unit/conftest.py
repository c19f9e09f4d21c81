"""Shared unit-test fixtures: the CLI run in-process, and a controller core on fake switches."""
from __future__ import annotations

import threading

import pytest


@pytest.fixture
def run_cli(capsys):
    """``run_cli(argv) -> (exit code, captured output)``: ``orchestrrl`` run in this process."""
    from testbed import cli as cli_mod

    def run(argv):
        try:
            rc = cli_mod.main(argv)
        except SystemExit as e:  # argparse's own errors
            rc = e.code
        return rc, capsys.readouterr()

    return run


@pytest.fixture
def connected_core():
    """``connected_core(spec, layout, **kw) -> (core, driver, clock)``: a FabricController on fake switches,
    every switch connected and read back (empty OCSes), the initial phase installed, the driver's log
    cleared."""
    from fakes_controller import FakeClock, FakeDriver
    from controller.runtime import FabricController

    def make(spec, layout, **kw):
        clock = FakeClock()
        drv = FakeDriver(clock, spec.ocs_count)
        kw.setdefault("delay_ms", spec.reconfig_delay_ms)
        core = FabricController(spec, layout, drv, clock, threading.Lock(), **kw)
        for d in core.switches.expected:
            core.switch_connected(d)
        for d in core.switches.expected:
            core.switch_synced(d, [] if spec.classify_dpid(d)[0] == "ocs" else None)
        assert core.ready
        drv.log.clear()
        return core, drv, clock

    return make
