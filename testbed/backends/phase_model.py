"""RLSim's model of the non-generation phases and of the fabric's phase changes, shared by both backends:
the simulated one takes its sync and train times from it; the emulated one asks it for the predicted gain and
slack window it hands the controller with every phase change (benefit-aware switching), and for the modelled
training compute.
"""
from __future__ import annotations

import math

import numpy as np

from agents.costmodel import CostModel
from controller.switching import decide_switch
from controller.traffic import phase_traffic
from emulation.spec import PHASES
from rlsim.fabrics import CircuitNetwork, Unreachable, build_network, rfabric_counts
from rlsim.sim import SimSettings, resolved, sync_phase, train_phase

from .base import PhaseDecision


class PhaseModel:
    def __init__(self, scenario, settings: SimSettings = SimSettings()):
        self.scn = scenario
        self.spec, self.layout, self.w = scenario.fabric, scenario.layout, scenario.workload
        self.cm = CostModel.for_names(self.w.model, self.w.gpu)
        self.settings = resolved(settings, scenario)
        self.delay_ms = scenario.reconfig_delay_ms  # real time: the model's clock
        self.nets = {}
        self.traffic = phase_traffic(self.spec, self.layout, self.w)  # what the controller builds them from
        self.static = self.spec.is_static
        for ph in PHASES:
            if self.static:  # a packet tree: one network, whatever the phase
                self.nets[ph] = self.nets.get("train") or build_network(self.spec.kind, self.spec, self.layout,
                                                                       opts=settings.fabric)
                continue
            counts, m = rfabric_counts(self.spec, self.layout, ph, self.traffic)
            self.nets[ph] = CircuitNetwork("rfabric", self.spec, counts, settings.fabric.max_two_hop, matchings=m)
        self.train_servers = self.layout.train_servers(self.spec)
        self.train_layout = self.traffic.train.layout  # training's placement (controller.traffic)
        self.gen_servers = self.layout.gen_servers(self.spec)

    def _net(self, topology: str | None):
        return self.nets["train" if self.static or topology is None else topology]

    def sync_s(self, topology: str | None) -> tuple[float, dict]:
        try:
            run = sync_phase(self.w, self.cm, self.spec, self.layout, self._net(topology), self.train_servers,
                             self.gen_servers, self.settings)
        except Unreachable as e:
            return math.inf, {"unreachable": str(e)}
        return run.duration, dict(run.detail)

    def train_s(self, topology: str | None, lengths: np.ndarray) -> tuple[float, dict]:
        try:
            run = train_phase(self.w, self.cm, self.spec, self._net(topology), self.train_servers,
                              np.asarray(lengths), self.settings)
        except Unreachable as e:
            return math.inf, {"unreachable": str(e)}
        return run.duration, dict(run.detail)

    def predicted_s(self, phase: str, topology: str, lengths: np.ndarray | None = None) -> float:
        if phase == "sync":
            return self.sync_s(topology)[0]
        if phase == "train":
            return self.train_s(topology, lengths if lengths is not None else np.full(64, 500))[0]
        return 0.0  # generation's traffic (tokens, KV moves) is tiny on any topology that reaches the trainers

    def gain_ms(self, phase: str, installed: str, lengths: np.ndarray | None = None) -> float:
        """What ``phase`` saves on its own topology against the installed one: negative when its own is slower
        (the rule then keeps the installed one), inf when the installed one cannot carry it."""
        if phase == installed or self.static:
            return 0.0
        here = self.predicted_s(phase, installed, lengths)
        own = self.predicted_s(phase, phase, lengths)
        if math.isinf(here):
            return math.inf
        return (here - own) * 1000.0

    def window_ms(self, phase: str, lengths: np.ndarray | None = None, first_step_s: float = 0.0) -> float:
        """Idle time on the changing circuits before ``phase``'s traffic starts (its lead-in): the training
        compute before the gradient all-reduce; the first decode step before generation's first tokens;
        nothing before a weight sync (it starts sending at once)."""
        if phase == "train":
            return self.train_s(phase, lengths if lengths is not None else np.full(64, 500))[1].get("compute_s", 0.0) * 1e3
        if phase == "gen":
            return first_step_s * 1e3
        return 0.0

    def decide(self, installed: str, phase: str, window_ms: float | None, gain_ms: float | None) -> PhaseDecision:
        if self.static:
            return PhaseDecision("static", 0.0, window_ms, gain_ms, f"a static {self.spec.kind} fabric: nothing to re-wire")
        if installed == phase:
            return PhaseDecision("unchanged", 0.0, window_ms, gain_ms, "the phase's circuits are installed")
        d = decide_switch(window_ms, self.delay_ms, gain_ms)  # +-inf: the old / the new topology cannot carry it
        return PhaseDecision(d.action, d.stall_ms, window_ms, gain_ms, d.reason, self.delay_ms)
