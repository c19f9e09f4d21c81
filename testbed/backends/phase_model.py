"""RLSim's model of the non-generation phases and of the fabric's phase changes, shared by both backends:
the simulated one takes its sync and train times from it; the emulated one asks it for the predicted gain and
slack window it hands the controller with every phase change (benefit-aware switching), and for the modelled
training compute.

Topologies are named as the controller names them (``controller.phases.topology_name``): a phase's own
("gen", "train", "sync") and, where the scenario re-wires inside the train phase (``controller.train_rewire``)
and its train step has model-parallel traffic, "train:mp" (the EP all-to-all and PP stages' own) and "train:dp"
(the DP rings'). :meth:`topology_for` says which one a phase asks for: "train:mp" for training where RLSim's
model of the iteration (``rlsim.sim.simulate_iteration``, the same code) is faster re-wired than on one train
topology; the train phase then re-wires to "train:dp" before its all-reduce when the rule says so
(:meth:`rewire_gain_ms`).
"""
from __future__ import annotations

import math

import numpy as np

from agents.costmodel import CostModel
from controller.fabric_rules import scenario_rule
from controller.phases import TRAIN_PARTS, topology_name
from controller.traffic import phase_traffic
from emulation.spec import PHASES
from rlsim.fabric_models import fabric_model
from rlsim.fabrics import Unreachable
from rlsim.sim import SimSettings, resolved, simulate_iteration, sync_phase, train_phase

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
        self.rule = scenario_rule(scenario)  # the fabric's phase rule (controller.fabric_rules), the controller's
        model = fabric_model(self.spec.kind, "fabric.kind")
        self.static = not model.reconfigures
        for ph in PHASES:
            if self.static:  # a packet tree: one network, whatever the phase
                self.nets[ph] = self.nets.get("train") or model.network(self.spec, self.layout, "train",
                                                                        settings.fabric)
                continue
            self.nets[ph] = model.topology(self.spec, self.layout, ph, settings.fabric, self.traffic, self.rule)[0]
        # re-wiring inside the train phase: the parts' topologies are modelled whenever the step has them (the
        # controller installs one on request); rewire_plan: whether RLSim's iteration takes re-wiring (its
        # detail.train_rewire; None where the scenario does not ask for it or there is nothing to re-wire)
        self.rewire_plan = None
        if not self.static and self.traffic.n_stages > 1:
            for part in TRAIN_PARTS:
                name = topology_name("train", part)
                self.nets[name] = model.topology(self.spec, self.layout, name, settings.fabric, self.traffic,
                                                 self.rule)[0]
            if self.settings.train_rewire:
                self.rewire_plan = simulate_iteration(scenario, self.spec.kind,
                                                      settings=self.settings)["detail"]["train_rewire"]
        self.train_servers = self.layout.train_servers(self.spec)
        self.train_layout = self.traffic.train.layout  # training's placement (controller.traffic)
        self.gen_servers = self.layout.gen_servers(self.spec)

    def _net(self, topology: str | None):
        return self.nets["train" if self.static or topology is None else topology]

    @property
    def rewires(self) -> bool:
        """The train phase starts on "train:mp" and may re-wire to "train:dp" inside (RLSim took it)."""
        return bool(self.rewire_plan and self.rewire_plan["taken"])

    def topology_for(self, phase: str) -> str:
        """The topology ``phase`` asks the fabric for: its own, "train:mp" for a re-wiring train phase."""
        return "train:mp" if phase == "train" and self.rewires else phase

    def sync_s(self, topology: str | None) -> tuple[float, dict]:
        try:
            run = sync_phase(self.w, self.cm, self.spec, self.layout, self._net(topology), self.train_servers,
                             self.gen_servers, self.settings)
        except Unreachable as e:
            return math.inf, {"unreachable": str(e)}
        return run.duration, dict(run.detail)

    def train_s(self, topology: str | None, lengths: np.ndarray) -> tuple[float, dict]:
        """Training on ``topology``; on "train:mp" the phase re-wires to "train:dp" before its all-reduce when
        the rule says so (its stall inside). ``detail["topology_end"]``: the topology it ends on."""
        dp_net = self.nets.get("train:dp") if topology == "train:mp" else None
        try:
            run = train_phase(self.w, self.cm, self.spec, self._net(topology), self.train_servers,
                              np.asarray(lengths), self.settings, dp_net=dp_net, delay_s=self.delay_ms / 1e3,
                              rule=self.rule)
        except Unreachable as e:
            return math.inf, {"unreachable": str(e)}
        end = run.detail.get("end_topology")
        out = {**run.detail, "topology_end": topology_name("train", end) if end else topology}
        rw = run.detail.get("train_rewire")
        if rw is not None:  # the keys the emulated backend reports for the live re-wiring
            out.update(rewire_decision=rw["decision"], rewire_s=rw["stall_s"])
        return run.duration, out

    @staticmethod
    def rewire_gain_ms(detail: dict) -> float:
        """What the all-reduce saves on "train:dp" against "train:mp" (inf: the rings cannot run on "train:mp"),
        the gain the re-wiring inside the train phase hands the controller; ``detail``: :meth:`train_s`'s on
        "train:mp"."""
        rw = detail.get("train_rewire") or {}
        return math.inf if not rw.get("old_topology_carries", True) else float(rw.get("gain_ms") or 0.0)

    def predicted_s(self, phase: str, topology: str, lengths: np.ndarray | None = None) -> float:
        if phase == "sync":
            return self.sync_s(topology)[0]
        if phase == "train":
            return self.train_s(topology, lengths if lengths is not None else np.full(64, 500))[0]
        return 0.0  # generation's traffic (tokens, KV moves) is tiny on any topology that reaches the trainers

    def gain_ms(self, phase: str, installed: str, lengths: np.ndarray | None = None) -> float:
        """What ``phase`` saves on its own topology (:meth:`topology_for`) against the installed one: negative
        when its own is slower (the rule then keeps the installed one), inf when the installed one cannot
        carry it."""
        mine = self.topology_for(phase)
        if mine == installed or self.static:
            return 0.0
        here = self.predicted_s(phase, installed, lengths)
        own = self.predicted_s(phase, mine, lengths)
        if math.isinf(here):
            return math.inf
        return (here - own) * 1000.0

    def window_ms(self, phase: str, lengths: np.ndarray | None = None, first_step_s: float = 0.0) -> float:
        """Idle time on the changing circuits before ``phase``'s traffic starts (its lead-in): the training
        compute before the gradient all-reduce; the first decode step before generation's first tokens;
        nothing before a weight sync (it starts sending at once)."""
        if phase == "train":
            return self.train_s(self.topology_for(phase), lengths if lengths is not None else np.full(64, 500)
                                )[1].get("compute_s", 0.0) * 1e3
        if phase == "gen":
            return first_step_s * 1e3
        return 0.0

    def decide(self, installed: str, topology: str, window_ms: float | None, gain_ms: float | None) -> PhaseDecision:
        """The rule's decision on a change from the ``installed`` topology to ``topology``."""
        if self.static:
            return PhaseDecision("static", 0.0, window_ms, gain_ms, f"a static {self.spec.kind} fabric: nothing to re-wire")
        if installed == topology:
            return PhaseDecision("unchanged", 0.0, window_ms, gain_ms, "the phase's circuits are installed")
        d = self.rule.decide(window_ms, self.delay_ms, gain_ms)  # +-inf: the old / the new topology cannot carry it
        return PhaseDecision(d.action, d.stall_ms, window_ms, gain_ms, d.reason, self.delay_ms)
