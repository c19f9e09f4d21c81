"""The fabric's phase rule as a plug-in (pure): which circuits each phase gets (its phase topology) and whether a
reconfiguration is made now (the switch decision). One registry, :data:`FABRIC_RULES`, read alike by the
emulated controller (controller.runtime: the circuits a ``POST /phase`` installs, the decision on every
reconfiguration), RLSim (rlsim.fabrics, rlsim.sim: RFabric's networks and transitions) and the testbed's phase
model (testbed.backends.phase_model): a scenario's ``controller.rule`` names it (``controller.rule_params``: its
parameters), so a user's rule is measured on the emulator and in RLSim alike.

Built-in: ``benefit-aware`` (alias ``builtin``): the phase topologies of controller.phases (train mesh from the
train step's traffic, pod-isolated generation, sync broadcast tree) and controller.switching.decide_switch.
A user's rule implements :class:`FabricRule` in a file of its own (docs/plugins.md).
"""
from __future__ import annotations

import abc
from typing import Any, Mapping

from emulation.plugins import Registry

from . import phases
from .switching import SwitchDecision, decide_switch


class FabricRule(abc.ABC):
    """``Params``: a frozen dataclass of the rule's parameters (None: it takes none)."""

    Params = None

    def __init__(self, params=None):
        self.params = params

    @abc.abstractmethod
    def matchings(self, spec, layout, phase: str, traffic=None) -> dict:
        """The OCS matchings (ocs -> controller.ocs.Matching) of ``phase``'s topology (``gen``, ``train``,
        ``sync``) on ``spec`` for job ``layout``; ``traffic``: controller.traffic.PhaseTraffic (None: unknown)."""

    @abc.abstractmethod
    def part_matchings(self, spec, layout, traffic, part: str) -> dict | None:
        """The matchings of one part of a train step (``mp``: the model-parallel stages, ``dp``: the gradient
        all-reduce; controller.phases.TRAIN_PARTS); None when the step sends nothing in that part."""

    @abc.abstractmethod
    def decide(self, window_ms: float | None, delay_ms: float, gain_ms: float | None) -> SwitchDecision:
        """Whether a reconfiguration taking ``delay_ms`` is made now, given the idle ``window_ms`` before the
        next phase's traffic and its predicted ``gain_ms`` (controller.switching's contract)."""


class BenefitAware(FabricRule):
    """The built-in rule: controller.phases' topologies, controller.switching.decide_switch."""

    def matchings(self, spec, layout, phase: str, traffic=None) -> dict:
        return phases.phase_matchings(spec, layout, phase, traffic)

    def part_matchings(self, spec, layout, traffic, part: str) -> dict | None:
        return phases.train_part_matchings(spec, layout, traffic, part)

    def decide(self, window_ms: float | None, delay_ms: float, gain_ms: float | None) -> SwitchDecision:
        return decide_switch(window_ms, delay_ms, gain_ms)


FABRIC_RULES = Registry("fabric rule", FabricRule, "fabric_rules", {"benefit-aware": BenefitAware,
                                                                    "builtin": BenefitAware})
BUILTIN = BenefitAware()


def fabric_rule(ref: str = "benefit-aware", params: Mapping[str, Any] | None = None,
                field: str = "controller.rule") -> FabricRule:
    """The rule ``ref`` names, made with its ``params`` (SpecError naming ``field`` otherwise)."""
    cls = FABRIC_RULES.resolve(ref, field)
    p = FABRIC_RULES.params(cls, params, f"{field}_params")
    return BUILTIN if cls is BenefitAware and p is None else cls(p)


def scenario_rule(scenario) -> FabricRule:
    """The rule a scenario names (``controller.rule``, ``controller.rule_params``)."""
    c = scenario.controller
    return fabric_rule(c.rule, c.rule_params)
