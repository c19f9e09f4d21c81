"""RollPacker's parallelism planner, as a plug-in planner (testbed.orchestrator.interfaces.LayoutPlanner).

Source: W. Gao et al., "RollPacker: Mitigating Long-Tail Rollouts for Fast, Synchronous RL Post-Training",
arXiv 2509.21009 (2025), its rollout parallelism planner: a step-level rule on the preemptions the rollout
engines report. When a step's preemptions rise by more than ``rise`` (1.05x) over the step before, the
tensor-parallel degree doubles (more KV per replica, fewer recomputations); after ``calm_steps`` (4) steps
without a preemption it halves again (more replicas, more throughput). TP stays within a server. Every
generator takes the same layout; nothing changes inside a step.

What it reads is what every planner sees: the engines' counters (``ServerView.stats`` and, at a step's end,
the servers' states: ``num_preemptions_total``), never the response lengths. Before the first step the
previous count is 0, so preemptions in the first step already double TP for the second. Its layouts are the
ones a server may take (``ctx.layouts``: they hold the model and a longest response); it starts on the
smallest of them (``start`` names another) and the testbed charges every change at a step boundary as any
switch. Use it as ``planner: contrib.rollpacker:RollPackerPlanner`` (docs/plugins.md).
"""
from __future__ import annotations

from dataclasses import dataclass

from agents.engine import Layout
from testbed.orchestrator.interfaces import LayoutPlanner, PolicyContext
from testbed.orchestrator.planner import Decision, ServerView


class RollPackerPlanner(LayoutPlanner):
    @dataclass(frozen=True)
    class Params:
        rise: float = 1.05  # preemptions above rise x the previous step's double TP
        calm_steps: int = 4  # steps without a preemption that halve TP
        start: str | None = None  # the first step's layout (TP<t>x<r>); None: the smallest TP that fits

        def __post_init__(self) -> None:
            from emulation.validation import require

            require(isinstance(self.rise, float) and self.rise >= 1.0, "rise", f"must be >= 1, got {self.rise!r}")
            require(isinstance(self.calm_steps, int) and self.calm_steps >= 1, "calm_steps",
                    f"must be an integer >= 1, got {self.calm_steps!r}")

    def __init__(self, ctx: PolicyContext, params: Params):
        self.ctx, self.p = ctx, params
        self.tps = sorted({lay.tp for lay in ctx.layouts})  # dense layouts a server holds, by TP
        start = Layout.parse(params.start, ctx.gpus, "params.planner.start") if params.start else min(
            ctx.layouts, key=lambda lay: lay.tp)
        self.tp = start.tp if start.tp in self.tps else self.tps[0]
        self.previous = 0  # the previous step's preemptions (none before the run)
        self.calm = 0  # steps in a row without a preemption
        self.counted: dict[int, int] = {}  # server -> its preemption counter at the last step's end
        self.history: list[dict] = []  # per step: preemptions and the TP chosen for the next one

    def layout(self) -> Layout:
        return Layout(tp=self.tp)

    def initial(self, view: ServerView, charged: bool = True) -> Decision:
        want = self.layout()
        if want == view.layout:
            return Decision.stay(view, f"RollPacker: TP {self.tp}")
        return Decision.to(view, want, f"RollPacker: TP {view.layout.tp} -> {self.tp} "
                                       f"({self.history[-1]['why'] if self.history else 'the starting layout'})")

    def evaluate_all(self, views: dict, now: float, interval: float | None = None) -> dict:
        return {s: Decision.stay(v, "RollPacker plans at step boundaries") for s, v in views.items()}

    def step_end(self, step: int, states: dict) -> None:
        total = {s: int(st.stats.get("num_preemptions_total") or 0) for s, st in states.items()}
        now = sum(max(0, n - self.counted.get(s, 0)) for s, n in total.items())
        self.counted.update(total)
        before = self.tp
        if now > self.p.rise * self.previous:
            self.tp = min([t for t in self.tps if t >= 2 * self.tp] or [self.tps[-1]])
            self.calm, why = 0, f"preemptions {now} > {self.p.rise:g} x {self.previous}: TP doubles"
        elif now == 0:
            self.calm += 1
            why = f"{self.calm} step(s) without a preemption"
            if self.calm >= self.p.calm_steps:
                self.tp = max([t for t in self.tps if t <= self.tp // 2] or [self.tps[0]])
                self.calm, why = 0, why + ": TP halves"
        else:
            self.calm, why = 0, f"preemptions {now} <= {self.p.rise:g} x {self.previous}: TP stays"
        self.previous = now
        self.history.append({"step": step, "preemptions": now, "tp": before, "next_tp": self.tp, "why": why})
