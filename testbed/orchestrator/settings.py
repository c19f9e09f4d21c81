"""The orchestrator's settings (``orchestrator:`` in a scenario) and the policies (pure).

A scenario keeps its ``orchestrator`` section as a plain mapping (emulation/ is below this floor and cannot
name these types); :func:`orchestrator_settings` validates it, and an unknown key, a wrong type or an
impossible value is a SpecError naming the path (``orchestrator.planner.min_gain_s: must be ...``).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

from agents.engine import EngineSettings, Layout, dense_layouts
from emulation.validation import SpecError, from_dict, require

from .balancer import BalancerSettings
from .forecast import ForecastSettings
from .planner import PlannerSettings

STEP_MODES = ("sync", "async")
DISPATCH = ("contiguous", "random")  # how a step's batch is dealt to the servers (backends.base.deal)
POLICIES = ("static-low", "static-high", "planner", "balancer", "orchestrrl")


@dataclass(frozen=True)
class OrchestratorSettings:
    """planning_interval_s: how often the planner and the balancer look (backend seconds).
    step_mode: ``sync`` (generate -> train -> sync weights, one after the other: on-policy) or ``async``
      (one step off policy: generation of step k+1 overlaps training of step k; the weights of step k go
      out when its training ends, and step k+2's generation waits for them).
    engine: the generation engines' vLLM-style knobs (max_num_seqs, max_num_batched_tokens, ...).
    dispatch: ``contiguous`` (veRL: equal consecutive chunks of the batch, whole prompt groups per server)
      or ``random``.
    """

    planning_interval_s: float = 1.0
    step_mode: Literal[STEP_MODES] = "sync"
    engine: EngineSettings = field(default_factory=EngineSettings)
    planner: PlannerSettings = field(default_factory=PlannerSettings)
    balancer: BalancerSettings = field(default_factory=BalancerSettings)
    forecast: ForecastSettings = field(default_factory=ForecastSettings)
    sync_bucket_mb: float = 512.0  # veRL's update_weights_bucket_megabytes (real MB; scaled on the fabric)
    dispatch: Literal[DISPATCH] = "contiguous"  # how a step's batch is dealt to the servers

    def __post_init__(self) -> None:
        require(math.isfinite(self.planning_interval_s) and 0.01 <= self.planning_interval_s <= 600,
                "planning_interval_s", f"must be in [0.01, 600], got {self.planning_interval_s}")
        require(math.isfinite(self.sync_bucket_mb) and 0 < self.sync_bucket_mb <= 65536, "sync_bucket_mb",
                f"must be in (0, 65536], got {self.sync_bucket_mb}")


def orchestrator_settings(data: Mapping[str, Any] | None) -> OrchestratorSettings:
    return from_dict(OrchestratorSettings, dict(data or {}), "orchestrator")


@dataclass(frozen=True)
class Policy:
    """``name``; ``layout``: a fixed starting layout (None: the planner picks it); whether the planner and the
    balancer run; ``max_num_seqs``: the engines' max_num_seqs for this policy (a static configuration of the
    tuning grid, ``static-TP8x1@1024``; None: the scenario's ``orchestrator.engine.max_num_seqs``)."""

    name: str
    layout: Layout | None
    planner: bool
    balancer: bool
    max_num_seqs: int | None = None

    def engine(self, base: EngineSettings) -> EngineSettings:
        """The engine settings this policy runs with."""
        if self.max_num_seqs is None or self.max_num_seqs == base.max_num_seqs:
            return base
        return dataclasses.replace(base, max_num_seqs=self.max_num_seqs,
                                   max_num_batched_tokens=max(base.max_num_batched_tokens, self.max_num_seqs))

    @property
    def static(self) -> bool:
        return not (self.planner or self.balancer)


def feasible_layouts(cm, gpus: int, engine: EngineSettings, prompt: int, cap: int) -> list[Layout]:
    """Dense layouts whose replicas hold the weights and at least one request of the longest length."""
    out = []
    for lay in dense_layouts(gpus):
        kv = cm.kv_capacity_tokens(lay.tp, reserve=1.0 - engine.gpu_memory_utilization)
        if kv >= prompt + cap + engine.block_size:
            out.append(lay)
    return out


MAX_NUM_SEQS_LIMIT = 65536  # a static configuration's max_num_seqs (engines allocate slots for it)


def make_policy(name: str, layouts: list[Layout], gpus: int, tuned: Policy | None = None) -> Policy:
    """``static-low`` (the smallest TP that fits: many replicas, veRL's throughput set-up), ``static-high``
    (the largest TP: the latency set-up), ``static-TP<t>x<r>`` (any layout) and ``static-TP<t>x<r>@<n>`` (with
    ``max_num_seqs`` n), ``static-tuned`` (``tuned``: the best of the tuning grid, testbed.runs.tuning),
    ``planner``, ``balancer`` (migrations on the tuned static configuration, or static-low's layout when
    there is none), ``orchestrrl`` (both)."""
    if not layouts:
        raise SpecError("workload", "no layout of a server holds the model and one longest response")
    low, high = layouts[0], layouts[-1]
    if name == "static-low":
        return Policy(name, low, False, False)
    if name == "static-high":
        return Policy(name, high, False, False)
    if name == "static-tuned":
        if tuned is None:
            raise SpecError("policy", "static-tuned needs the tuning grid (orchestrrl compare computes it)")
        return dataclasses.replace(tuned, name=name)
    if name.startswith("static-"):
        text, _, mns = name[len("static-"):].partition("@")
        lay = Layout.parse(text, gpus, "policy")
        if lay not in layouts:
            raise SpecError("policy", f"{name}: that layout does not hold the model and the longest response")
        n = None
        if mns:
            if not (mns.isascii() and mns.isdigit()) or not 1 <= int(mns) <= MAX_NUM_SEQS_LIMIT:
                raise SpecError("policy", f"{name}: max_num_seqs after '@' must be an integer in "
                                          f"1..{MAX_NUM_SEQS_LIMIT}, got {mns!r}")
            n = int(mns)
        return Policy(name, lay, False, False, n)
    if name == "planner":
        return Policy(name, None, True, False)
    if name == "balancer":
        if tuned is not None:
            return Policy(name, tuned.layout, False, True, tuned.max_num_seqs)
        return Policy(name, low, False, True)
    if name == "orchestrrl":
        return Policy(name, None, True, True)
    raise SpecError("policy", f"unknown policy {name!r} (known: {', '.join(POLICIES)}, static-tuned, "
                              f"static-TP<t>x<r> or static-TP<t>x<r>@<max_num_seqs>)")
