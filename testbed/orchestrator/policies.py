"""The policies a run compares (pure): static layouts, the planner, the balancer and both, and the layouts
a server may take. Their settings are the scenario's ``orchestrator:`` section, typed and validated when the
scenario loads (emulation.orchestration).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from agents.engine import Layout, dense_layouts
from emulation.orchestration import EngineSettings
from emulation.validation import SpecError

POLICIES = ("static-low", "static-high", "planner", "balancer", "orchestrrl")


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
