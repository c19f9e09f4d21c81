"""Scenario: one YAML file that says what to run (fabric, job layout, workload, controller settings).

``load_scenario(path)`` reads and validates a scenario file. Every error is a :class:`SpecError` whose field
is the dotted path in the file (``fabric.pods: must be >= 1, got 0``); a missing or unreadable file is a
SpecError naming the path. The layout is checked against the fabric (every pod has exactly one role). A
workload trace (``workload.trace``) is resolved against the scenario file's folder and checked against the
workload when the scenario loads (``workload.trace: line 17: response_length must be ...``).
"""
from __future__ import annotations

import dataclasses
import ipaddress
import os
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import yaml

from .orchestration import OrchestratorSettings
from .plugins import check_ref
from .spec import MAX_DELAY_MS, PHASES, FabricSpec, JobLayout, check_delay_ms
from .validation import SpecError, from_dict, require
from .workload import WorkloadSpec, resolve_trace

Phase = Literal[PHASES]  # type: ignore[valid-type]  # one of spec.PHASES


@dataclass(frozen=True)
class ControllerSettings:
    # OCS switching time in ms, real (scenario) time; None: the fabric's reconfig_delay_ms. Read it resolved
    # as Scenario.reconfig_delay_ms, or in wall time as Scenario.wall_delay_ms. (Old spelling: delay_ms.)
    reconfig_delay_ms: float | None = None
    # Phase topology installed when the fabric comes up.
    initial_phase: Phase = "train"
    # RFabric: a train phase may get two topologies, the model-parallel stages' own (EP all-to-all, PP) and,
    # before the gradient all-reduce, the DP rings' own (controller.phases.train_part_matchings; the rule
    # weighs that switch with no idle window). Taken when RLSim's model of the iteration is faster so than on
    # one train topology; off: one train topology for every stage. RLSim reads it too (SimSettings.train_rewire).
    train_rewire: bool = False
    # The fabric's phase rule (its phase topologies and switch decision; controller.fabric_rules), read alike by
    # the emulated controller and RLSim: a registered name (benefit-aware, the built-in) or a plug-in path
    # package.module:Class; rule_params: its parameters (validated by the rule when the testbed starts).
    rule: str = "benefit-aware"
    rule_params: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_delay_ms(self.reconfig_delay_ms, "reconfig_delay_ms")
        check_ref(self.rule, "rule")
        require(isinstance(self.train_rewire, bool), "train_rewire", f"must be true or false, got {self.train_rewire!r}")


DEFAULT_CONTROLLER_METRICS_PORT = 9480  # the controller's Prometheus endpoint (README "Live metrics")
DEFAULT_DRIVER_METRICS_PORT = 9481  # the driver's (orchestrrl run / compare): the orchestrator and the engines


def check_metrics_port(value: int | None, field: str) -> int | None:
    """A Prometheus endpoint's port: None (the default port), 0 (off) or a TCP port; SpecError otherwise."""
    require(value is None or (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 65535),
            field, f"must be a TCP port 1..65535, 0 (off) or null (the default port), got {value!r}")
    return value


def check_metrics_host(value: str, field: str) -> str:
    """The address a Prometheus endpoint listens on: an IP address literal (no name to resolve)."""
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise SpecError(field, f"must be an IP address (127.0.0.1 keeps the endpoint on loopback), got {value!r}") \
            from None
    return value


@dataclass(frozen=True)
class MetricsSettings:
    """Where the run's Prometheus endpoints listen (README "Live metrics").

    A port of 0 turns that endpoint off; null (the default) takes the default port (controller 9480, driver
    9481), or a free one when another process holds it (the run prints the one it took). A port given
    explicitly must be free. ``host`` is loopback by default: /metrics is read-only and has no token.
    """

    host: str = "127.0.0.1"
    controller_port: int | None = None  # the SDN controller's /metrics (emulated backend, fabric up)
    driver_port: int | None = None  # the driver's /metrics: orchestrator, engines (run, compare)

    def __post_init__(self) -> None:
        check_metrics_host(self.host, "host")
        check_metrics_port(self.controller_port, "controller_port")
        check_metrics_port(self.driver_port, "driver_port")


@dataclass(frozen=True)
class Scenario:
    name: str = "scenario"
    seed: int = 0
    fabric: FabricSpec = field(default_factory=FabricSpec)
    layout: JobLayout = field(default_factory=JobLayout)
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    controller: ControllerSettings = field(default_factory=ControllerSettings)
    orchestrator: OrchestratorSettings = field(default_factory=OrchestratorSettings)  # emulation.orchestration
    metrics: MetricsSettings = field(default_factory=MetricsSettings)

    def __post_init__(self) -> None:
        require(bool(self.name.strip()), "name", "must not be empty")
        require(self.seed >= 0, "seed", f"must be >= 0, got {self.seed}")
        self.layout.check(self.fabric)
        where = ("fabric" if self.controller.reconfig_delay_ms is None else "controller") + ".reconfig_delay_ms"
        require(self.wall_delay_ms <= MAX_DELAY_MS, where,
                f"{self.reconfig_delay_ms:g} ms x fabric.time_dilation {self.fabric.time_dilation:g} lasts "
                f"{self.wall_delay_ms:g} ms in wall time, over the controller's limit of {MAX_DELAY_MS:g} ms")

    # The OCS switching delay, resolved here once. Two meanings, two names:
    @property
    def reconfig_delay_ms(self) -> float:
        """The switching delay in real (scenario) time, ms: ``controller.reconfig_delay_ms`` when given, else
        the fabric's. What the simulated backend and RLSim switch in."""
        d = self.controller.reconfig_delay_ms
        return float(self.fabric.reconfig_delay_ms if d is None else d)

    @property
    def wall_delay_ms(self) -> float:
        """The switching delay in wall time, ms (:attr:`reconfig_delay_ms` x the time dilation): what the
        emulated fabric's controller programs."""
        return self.fabric.wall_ms(self.reconfig_delay_ms)

    def rng(self) -> np.random.Generator:
        """A fresh generator seeded with ``seed`` (same scenario, same draws)."""
        return np.random.default_rng(self.seed)


# keys a scenario file may still spell the old way: (section, old key) -> the key's name now
RENAMED_KEYS = {("controller", "delay_ms"): "reconfig_delay_ms"}


def _renamed(data: Any) -> tuple[Any, dict[str, str]]:
    """``data`` with the old spellings of RENAMED_KEYS read as the new ones (SpecError when both are given),
    and {new path: old path} of those it renamed (an error then names the key as the file spells it)."""
    used: dict[str, str] = {}
    if not isinstance(data, dict):
        return data, used  # from_dict names what is wrong with it
    for (section, old), new in RENAMED_KEYS.items():
        sec = data.get(section)
        if isinstance(sec, dict) and old in sec:
            require(new not in sec, f"{section}.{old}", f"is the old spelling of {section}.{new}: give one of them")
            data = {**data, section: {new if k == old else k: v for k, v in sec.items()}}
            used[f"{section}.{new}"] = f"{section}.{old}"
    return data, used


def load_scenario(path: str | os.PathLike) -> Scenario:
    """Read and validate the scenario YAML file at ``path``."""
    p = os.fspath(path)
    try:
        with open(p, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise SpecError("scenario", f"no such file: {p}") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as e:
        raise SpecError("scenario", f"cannot read {p}: {e}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise SpecError("scenario", f"{p} is not valid YAML: {e}") from None
    if data is None:
        raise SpecError("scenario", f"{p} is empty")
    data, renamed = _renamed(data)
    try:
        scn = from_dict(Scenario, data, "")
    except SpecError as e:
        if e.field in renamed:
            raise SpecError(renamed[e.field], e.message) from None
        raise
    # A trace path is relative to the scenario's folder; resolved (and the file checked) here, once.
    workload = resolve_trace(scn.workload, os.path.dirname(os.path.abspath(p)))
    return scn if workload is scn.workload else dataclasses.replace(scn, workload=workload)
