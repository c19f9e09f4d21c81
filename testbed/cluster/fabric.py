"""Bring up a whole emulated RFabric: the controller process, then the Mininet fabric connected to it.

Used by `orchestrrl fabric up`, the benchmarks, the demo and the system tests, so they all start and stop
the world the same way. Everything is torn down in reverse order, also when start-up fails halfway.
"""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from controller.process import ControllerProcess
from emulation.builder import EmulatedFabric
from emulation.spec import FabricSpec, JobLayout

log = logging.getLogger(__name__)


@dataclass
class Testbed:
    spec: FabricSpec
    layout: JobLayout
    controller: ControllerProcess | None  # None: a static fabric (nothing to re-wire, no controller)
    fabric: EmulatedFabric

    @property
    def client(self):
        if self.controller is None:
            raise RuntimeError(f"a static {self.spec.kind} fabric has no controller")
        return self.controller.client


@contextlib.contextmanager
def running_testbed(spec: FabricSpec, layout: JobLayout, *, initial_phase: str = "train",
                    delay_ms: float | None = None, state_file: Path | None = None,
                    connect_timeout_s: float = 30.0, datapath_flush: str = "auto",
                    workload=None, metrics_port: int = 0, metrics_host: str = "127.0.0.1",
                    rule: str = "benefit-aware", rule_params: dict | None = None) -> Iterator[Testbed]:
    """Start controller + fabric, wait until every switch is connected and the initial phase installed.
    ``delay_ms``: the OCS switching delay the controller programs, in wall time (a scenario's
    ``Scenario.wall_delay_ms``; None: the fabric's ``reconfig_delay_ms`` in wall time, which the controller resolves).
    ``workload``: what the controller's train topology is built from (None: the uniform mesh); ``metrics_port``: the controller's Prometheus endpoint (0: none;
    emulation.metrics.bind_port picks one); ``rule``/``rule_params``: the fabric's phase rule (controller.fabric_rules)."""
    spec.check_emulatable()
    layout.check(spec)
    if spec.is_static:  # spine bridges with their fixed rule (emulation.builder.static_flows): no controller
        with EmulatedFabric(spec, controller_port=None) as fab:
            log.info("testbed up: %d hosts, %d ToRs, %d spines (static %s)", spec.n_servers, spec.n_tors,
                     spec.ocs_count, spec.kind)
            yield Testbed(spec, layout, None, fab)
        return
    with ControllerProcess(spec, layout, initial_phase=initial_phase, delay_ms=delay_ms,
                           state_file=state_file, datapath_flush=datapath_flush, workload=workload,
                           metrics_port=metrics_port, metrics_host=metrics_host, rule=rule,
                           rule_params=rule_params) as ctl:
        def wait_connected(dpids: set[int], timeout_s: float) -> None:
            ctl.client.wait_switches(dpids, timeout_s)

        with EmulatedFabric(spec, controller_port=ctl.of_port, wait_connected=wait_connected,
                            connect_timeout_s=connect_timeout_s) as fab:
            ctl.client.wait_ready(connect_timeout_s)
            log.info("testbed up: %d hosts, %d ToRs, %d OCSes; REST %s", spec.n_servers, spec.n_tors,
                     spec.ocs_count, ctl.client.base_url)
            try:
                yield Testbed(spec, layout, ctl, fab)
            except (TimeoutError, socket.timeout):
                _dump_controller(ctl)
                raise


def _dump_controller(ctl: ControllerProcess) -> None:
    """The controller did not answer in time: have it log every thread's stack (SIGUSR1), say where."""
    if not ctl.running or ctl.pid is None:
        return
    ctl.keep_files = True  # the stacks go to its log: keep the log after stop
    size = ctl.log_path.stat().st_size if ctl.log_path.exists() else 0
    os.kill(ctl.pid, signal.SIGUSR1)
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline and ctl.log_path.stat().st_size == size:
        time.sleep(0.05)
    log.error("controller pid %d did not answer in time; its thread stacks are in %s", ctl.pid,
              ctl.log_path)
