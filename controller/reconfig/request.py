"""Reconfiguration requests (pure): the REST bodies of ``POST /circuits`` and ``POST /phase``, validated into a
:class:`ReconfigRequest` (SpecError naming the field on bad input).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Optional

from emulation.spec import FabricSpec, JobLayout, check_delay_ms, check_phase
from emulation.validation import BRIEF_CHARS, SpecError, brief, finite_float, from_dict, require

from ..fabric_rules import BUILTIN
from ..ocs import Matching

MAX_WINDOW_MS = 3600_000.0


def _check_window(value: float | None, name: str = "window_ms") -> None:
    """A slack window: finite, 0..MAX_WINDOW_MS ms."""
    if value is None:
        return
    v = finite_float(value, name)
    require(0 <= v <= MAX_WINDOW_MS, name, f"must be in 0..{MAX_WINDOW_MS:g} ms, got {v:g}")


def _check_gain(value: float | None, name: str = "gain_ms") -> None:
    """A predicted gain: finite, -MAX_WINDOW_MS..MAX_WINDOW_MS ms (negative: the new topology is slower)."""
    if value is None:
        return
    v = finite_float(value, name)
    require(-MAX_WINDOW_MS <= v <= MAX_WINDOW_MS, name,
            f"must be in {-MAX_WINDOW_MS:g}..{MAX_WINDOW_MS:g} ms (negative: the new topology is slower), got {v:g}")


def check_timing(delay_ms: float | None, window_ms: float | None, gain_ms: float | None) -> None:
    """The timing fields of a reconfiguration (a REST body's, or a request the controller builds itself):
    the switching delay (wall-clock ms; None: the controller's), the slack window, the predicted gain."""
    check_delay_ms(delay_ms, "delay_ms")
    _check_window(window_ms)
    _check_gain(gain_ms)


@dataclass(frozen=True, kw_only=True)
class _TimingBody:
    """The timing fields every reconfiguration body takes (validated in one place)."""

    delay_ms: Optional[float] = None
    window_ms: Optional[float] = None
    gain_ms: Optional[float] = None  # predicted gain of the new topology (decide_switch)

    def __post_init__(self) -> None:
        check_timing(self.delay_ms, self.window_ms, self.gain_ms)


@dataclass(frozen=True, kw_only=True)
class CircuitsBody(_TimingBody):
    """JSON body of ``POST /api/v1/circuits``: ``{"circuits": {"0": [[1, 3], [2, 4]]}, "delay_ms": 10}``
    (optional ``window_ms``, ``gain_ms``)."""

    circuits: dict[str, Any]


@dataclass(frozen=True, kw_only=True)
class PhaseBody(_TimingBody):
    """JSON body of ``POST /api/v1/phase``: ``{"phase": "train", "delay_ms": 10, "window_ms": null,
    "gain_ms": null}``; the train phase may name one ``part`` of its step ("mp": the EP all-to-all and PP
    stages, "dp": the gradient all-reduce; ``controller.phases.train_part_matchings``) to install that part's
    own topology (re-wiring inside the train phase, scenario ``controller.train_rewire``)."""

    phase: str
    part: Optional[str] = None


@dataclass(frozen=True)
class ReconfigRequest:
    """A validated reconfiguration: target matchings for some OCSes (the others keep theirs).

    ``phase`` names the phase the target realises (None for explicit circuits), ``part`` the part of the
    train step it was built for (None: the whole phase). ``delay_ms`` None means the spec's default switching
    delay. ``source``: who asked (``rest``, ``initial``, ``reconcile``).
    """

    target: Mapping[int, Matching]
    phase: str | None = None
    part: str | None = None
    delay_ms: float | None = None
    window_ms: float | None = None
    gain_ms: float | None = None
    source: str = "rest"

    def __post_init__(self) -> None:
        check_timing(self.delay_ms, self.window_ms, self.gain_ms)


def _ocs_index(spec: FabricSpec, key: object) -> int:
    f = f"circuits.{str(key)[:BRIEF_CHARS]}"
    # ASCII digits only: str.isdigit() also takes "\u0660" (int() reads it as 0) and "\u00b2" (int() fails)
    if not isinstance(key, str) or not (key.isascii() and key.isdigit()) or (len(key) > 1 and key.startswith("0")):
        raise SpecError(f, f"OCS must be a decimal index 0..{spec.ocs_count - 1}, got {brief(key)}")
    o = int(key)
    require(o < spec.ocs_count, f, f"unknown OCS {o} (fabric has OCSes 0..{spec.ocs_count - 1})")
    return o


def circuits_request(spec: FabricSpec, data: Any) -> ReconfigRequest:
    """Validate a ``POST /circuits`` JSON body into a request (raises SpecError naming the field)."""
    body = from_dict(CircuitsBody, data)
    require(len(body.circuits) > 0, "circuits", "must name at least one OCS")
    target = {}
    for key, pairs in body.circuits.items():
        o = _ocs_index(spec, key)
        target[o] = Matching.from_pairs(spec.ports_per_ocs, pairs, field=f"circuits.{key}")
    return ReconfigRequest(target=target, delay_ms=body.delay_ms, window_ms=body.window_ms, gain_ms=body.gain_ms)


def phase_request(spec: FabricSpec, layout: JobLayout, data: Any, traffic: Any = None,
                  rule: Any = None) -> ReconfigRequest:
    """Validate a ``POST /phase`` JSON body into a request with the phase's matchings on every OCS
    (``traffic``: ``controller.traffic.PhaseTraffic``, what the train topology is built from; ``rule``: the
    fabric's phase rule, controller.fabric_rules, None: the built-in)."""
    rule = rule or BUILTIN
    body = from_dict(PhaseBody, data)
    check_phase(body.phase)
    if body.part is None:
        target = rule.matchings(spec, layout, body.phase, traffic)
    else:
        require(body.phase == "train", "part", f"only the train phase has parts, got phase {body.phase!r}")
        require(traffic is not None, "part", "the controller was told no workload, so it has no train step to split "
                "(start it with the scenario's workload)")
        target = rule.part_matchings(spec, layout, traffic, body.part)
        require(target is not None, "part", f"the workload's train step sends nothing in part {body.part!r} "
                "(a dense model has no model-parallel part)")
    return ReconfigRequest(target=dict(target), phase=body.phase, part=body.part, delay_ms=body.delay_ms,
                           window_ms=body.window_ms, gain_ms=body.gain_ms)
