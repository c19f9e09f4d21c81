"""Scenario: one YAML file that says what to run (fabric, job layout, workload, controller settings).

``load_scenario(path)`` reads and validates a scenario file. Every error is a :class:`SpecError` whose field
is the dotted path in the file (``fabric.pods: must be >= 1, got 0``); a missing or unreadable file is a
SpecError naming the path. The layout is checked against the fabric (every pod has exactly one role). A
workload trace (``workload.trace``) is resolved against the scenario file's folder and checked against the
workload when the scenario loads (``workload.trace: line 17: response_length must be ...``).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import yaml

from .spec import PHASES, FabricSpec, JobLayout, check_delay_ms, pick_delay_ms
from .validation import SpecError, from_dict, require
from .workload import WorkloadSpec, resolve_trace

Phase = Literal[PHASES]  # type: ignore[valid-type]  # one of spec.PHASES


@dataclass(frozen=True)
class ControllerSettings:
    # OCS switching time in ms; None: the fabric's reconfig_delay_ms.
    delay_ms: float | None = None
    # Phase topology installed when the fabric comes up.
    initial_phase: Phase = "train"

    def __post_init__(self) -> None:
        check_delay_ms(self.delay_ms, "delay_ms")

    def effective_delay_ms(self, fabric: FabricSpec) -> float:
        return pick_delay_ms(self.delay_ms, fabric.reconfig_delay_ms)


@dataclass(frozen=True)
class Scenario:
    name: str = "scenario"
    seed: int = 0
    fabric: FabricSpec = field(default_factory=FabricSpec)
    layout: JobLayout = field(default_factory=JobLayout)
    workload: WorkloadSpec = field(default_factory=WorkloadSpec)
    controller: ControllerSettings = field(default_factory=ControllerSettings)
    # the orchestrator's settings: validated by testbed.orchestrator.settings (a floor above this one), which
    # names the field path (orchestrator.planner.min_gain_s) of anything wrong before a run starts
    orchestrator: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        require(bool(self.name.strip()), "name", "must not be empty")
        require(self.seed >= 0, "seed", f"must be >= 0, got {self.seed}")
        self.layout.check(self.fabric)

    def rng(self) -> np.random.Generator:
        """A fresh generator seeded with ``seed`` (same scenario, same draws)."""
        return np.random.default_rng(self.seed)


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
    scn = from_dict(Scenario, data, "")
    # A trace path is relative to the scenario's folder; resolved (and the file checked) here, once.
    workload = resolve_trace(scn.workload, os.path.dirname(os.path.abspath(p)))
    return scn if workload is scn.workload else dataclasses.replace(scn, workload=workload)
